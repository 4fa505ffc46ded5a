"""``python -m allreduce_kit.checkpoint consolidate DIR OUT.npz``: a sharded or pipeline run's checkpoint as one file.

A run with ``--zero 1|2|3`` writes each checkpoint as one file per rank (its blocks of the
parameters and of the optimizer state) and a manifest naming the stage, the ranks and the block
rule; a run with ``--pipeline S`` one file per stage (its layers' parameters and optimizer state)
and a manifest naming each file's layers (``allreduce_kit/train/checkpoint.py``). ``consolidate``
reads the newest such checkpoint in DIR (or the manifest given) one file at a time and writes
every array whole to OUT.npz, atomically, in the trainer's checkpoint format: the full float32
state (the role of DeepSpeed's ``zero_to_fp32.py``). ``--resume`` needs no consolidation (it reads
the parts itself); the consolidated file is for use elsewhere, e.g. ``numpy.load(OUT)["params"]``.
"""
import os
import sys
from typing import List, Optional

__all__ = ["main"]


def main(argv: Optional[List[str]] = None) -> int:
    import argparse

    from .train import checkpoint

    p = argparse.ArgumentParser(prog="python -m allreduce_kit.checkpoint",
                                description="Tools for the trainer's checkpoints.")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("consolidate", help="write a sharded (--zero) or pipeline (--pipeline) checkpoint as one whole "
                                                ".npz file")
    c.add_argument("source", metavar="DIR", help="a checkpoint directory (its newest checkpoint) or a manifest "
                                                 "checkpoint-STEP.npz")
    c.add_argument("out", metavar="OUT.npz", help="the file to write (atomically)")
    args = p.parse_args(argv)
    if not args.out.endswith(".npz"):
        p.error(f"argument OUT.npz: expected a path ending in .npz, got {args.out!r}")
    parent = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(parent):
        p.error(f"argument OUT.npz: {parent} is not a directory")
    if not os.path.exists(args.source):
        p.error(f"argument DIR: {args.source} does not exist")
    try:
        path = checkpoint.consolidate(args.source, args.out)
    except (checkpoint.CheckpointError, FileNotFoundError, OSError) as bad:
        p.error(f"argument DIR: {bad}")
    print(f"wrote {args.out} from {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
