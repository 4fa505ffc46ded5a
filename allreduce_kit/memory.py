"""How much memory a data-parallel run's model state takes per rank at each ZeRO stage, before running.

``python -m allreduce_kit.memory --params 250M --ranks 8 --optimizer adam`` prints the bytes of
model state (parameters, gradients, optimizer state, and the buffers a stage gathers and reduces
through) each rank holds at ``--zero`` 0, 1, 2 and 3, and what the ranks of one node hold
together beside the node's memory. With Ψ parameters of ``s`` bytes, ``k`` elements of optimizer
state per parameter (SGD 1, Adam 2) and a rank's shard of S ≈ Ψ/N elements (the one block rule,
``allreduce_kit.blocks``, per unit):

- stage 0: ``s Ψ (2 + k)``: 16Ψ for float32 Adam;
- stage 1: ``2 s Ψ + k s S``: 8Ψ + 8Ψ/N;
- stage 2: ``s Ψ + (1 + k) s S`` plus one bucket and one layer's gradient: 4Ψ + 12Ψ/N + buffers;
- stage 3: ``(2 + k) s S`` plus two gathered layers and two layers' gradients: 16Ψ/N + buffers.

With ``--params``, the model is taken as ``--layers`` layers of equal size. Given the trainer's MLP (``--hidden`` and the data's sizes) instead of ``--params``, the counts
are exact for it (its layers, its buckets) and the activations of one batch are added.
``python -m allreduce_kit.train`` prints this estimate for its own run and refuses, before it
starts, a run whose ranks on one node would not fit in the node's available memory.
"""
import argparse
import os
import re
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .blocks import block

__all__ = ["model_state", "activation_bytes", "available_bytes", "parse_count", "mlp_sizes", "main"]

#: Elements of optimizer state per parameter.
STATE_PER_PARAMETER = {"sgd": 1, "adam": 2}


def parse_count(text: str) -> int:
    """``250M``, ``1.5G``, ``10k`` or ``123456`` as a number of parameters."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGbB]?)\s*", text)
    if not match:
        raise ValueError(f"expected a count such as 250M, 1.5G, 10k or 123456, got {text!r}")
    scale = {"": 1, "k": 10 ** 3, "m": 10 ** 6, "g": 10 ** 9, "b": 10 ** 9}[match.group(2).lower()]
    value = int(round(float(match.group(1)) * scale))
    if value < 1:
        raise ValueError(f"expected at least one parameter, got {text!r}")
    return value


def mlp_sizes(widths: Sequence[int]) -> List[int]:
    """The length of each layer's ``W`` and ``b`` together in the trainer's MLP of these widths."""
    return [int(fan_in) * int(fan_out) + int(fan_out) for fan_in, fan_out in zip(widths[:-1], widths[1:])]


def _shard(units: Sequence[Tuple[int, int]], ranks: int) -> int:
    """The longest shard any rank has of these units (each cut by the one block rule)."""
    best = 0
    for r in range(ranks):
        best = max(best, sum(block(b - a, ranks, r)[1] - block(b - a, ranks, r)[0] for a, b in units))
    return best


def _units(sizes: Sequence[int]) -> List[Tuple[int, int]]:
    out, at = [], 0
    for n in sizes:
        out.append((at, at + n))
        at += n
    return out


def model_state(params: int, ranks: int, stage: int, optimizer: str = "adam", itemsize: int = 4,
                layers: Optional[Sequence[int]] = None, bucket: Optional[int] = None) -> Dict[str, int]:
    """The bytes of model state one rank holds at ZeRO ``stage`` (the rank with the longest shard).

    ``layers``: each layer's length in elements (default: one layer of all ``params``); ``bucket``:
    the longest bucket in elements (default: all ``params``, one bucket). Keys: ``parameters``,
    ``gradients``, ``optimizer_state``, ``buffers``, ``total``."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    if optimizer not in STATE_PER_PARAMETER:
        raise ValueError(f"optimizer must be one of {', '.join(STATE_PER_PARAMETER)}, got {optimizer!r}")
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    k, s = STATE_PER_PARAMETER[optimizer], int(itemsize)
    layers = list(layers) if layers else [params]
    bucket = min(bucket or params, params)
    buckets = _units([bucket] * (params // bucket) + ([params % bucket] if params % bucket else []))
    if stage == 0:
        parts = (params, params, k * params, 0)
    elif stage == 1:
        shard = _shard(buckets, ranks)
        parts = (params, params, k * shard, 0)
    elif stage == 2:
        shard = _shard(buckets, ranks)
        parts = (params, shard, k * shard, bucket + max(layers))
    else:
        shard = _shard(_units(layers), ranks)
        parts = (shard, shard, k * shard, 4 * max(layers))
    out = dict(zip(("parameters", "gradients", "optimizer_state", "buffers"), (s * n for n in parts)))
    out["total"] = sum(out.values())
    return out


def activation_bytes(widths: Sequence[int], batch: int, itemsize: int = 4) -> int:
    """The trainer's MLP's activations of one batch (every layer's output, kept for the backward
    pass, and the backward pass's running delta and one layer's ReLU mask)."""
    return int(batch) * (sum(int(w) for w in widths) + 2 * max(int(w) for w in widths)) * int(itemsize)


def available_bytes() -> Optional[int]:
    """The memory this node can still give (``MemAvailable`` of /proc/meminfo), or None if unknown."""
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _gb(n: float) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def main(argv: Optional[List[str]] = None) -> int:
    from .cli import RankZeroParser

    p = RankZeroParser(prog="python -m allreduce_kit.memory",
                       description="Model-state bytes per rank of a data-parallel run at ZeRO stages 0-3 "
                                   "(python -m allreduce_kit.train --zero), and whether the ranks of a node fit.")
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument("--params", help="number of parameters, such as 250M, 1.5G or 123456")
    size.add_argument("--hidden", help="the trainer's MLP: hidden layer widths such as 4096,4096 (with "
                                       "--features and --classes)")
    p.add_argument("--layers", type=int, default=24,
                   help="with --params: the model as this many layers of equal size (stage 3 gathers one at a "
                        "time; stage 2 holds one layer's gradient)")
    p.add_argument("--features", type=int, default=64, help="with --hidden: input features (digits: 64)")
    p.add_argument("--classes", type=int, default=10, help="with --hidden: classes (digits: 10)")
    p.add_argument("--batch-size", type=int, default=32, help="with --hidden: samples per rank per step")
    p.add_argument("--ranks", type=int, required=True, help="data-parallel ranks in all")
    p.add_argument("--nodes", type=int, default=1, help="nodes the ranks are spread over, evenly")
    p.add_argument("--optimizer", choices=tuple(STATE_PER_PARAMETER), default="adam")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--bucket-mb", type=float, default=25.0,
                   help="the trainer's --bucket-mb: stage 2 reduces through one bucket of this size")
    args = p.parse_args(argv)
    if args.ranks < 1:
        p.error(f"argument --ranks: must be >= 1, got {args.ranks}")
    if args.nodes < 1 or args.nodes > args.ranks:
        p.error(f"argument --nodes: must be between 1 and --ranks ({args.ranks}), got {args.nodes}")
    if args.bucket_mb < 0:
        p.error(f"argument --bucket-mb: must be >= 0, got {args.bucket_mb}")
    itemsize = 4 if args.dtype == "float32" else 8
    widths, activations = None, 0
    if args.hidden is not None:
        try:
            hidden = [int(w) for w in args.hidden.split(",") if w.strip()]
        except ValueError:
            p.error(f"argument --hidden: expected comma-separated widths such as 4096,4096, got {args.hidden!r}")
        if any(w < 1 for w in hidden) or args.features < 1 or args.classes < 2 or args.batch_size < 1:
            p.error("argument --hidden: widths and --features must be >= 1, --classes >= 2, --batch-size >= 1")
        widths = [args.features, *hidden, args.classes]
        layers = mlp_sizes(widths)
        params = sum(layers)
        activations = activation_bytes(widths, args.batch_size, itemsize)
    else:
        try:
            params = parse_count(args.params)
        except ValueError as bad:
            p.error(f"argument --params: {bad}")
        if args.layers < 1 or args.layers > params:
            p.error(f"argument --layers: must be between 1 and the parameter count, got {args.layers}")
        layers = [params // args.layers + (1 if i < params % args.layers else 0) for i in range(args.layers)]
    bucket = params if args.bucket_mb <= 0 else max(1, int(args.bucket_mb * 1e6) // itemsize)
    per_node = -(-args.ranks // args.nodes)
    free = available_bytes()
    print(f"{params:,} parameters ({args.dtype}), {args.optimizer}, {args.ranks} ranks on {args.nodes} node(s) "
          f"(up to {per_node} per node)" + (f" in {args.layers} layers" if widths is None else "") + (f"; MLP {'-'.join(map(str, widths))}, activations of a batch of "
                                            f"{args.batch_size}: {_gb(activations)} per rank" if widths else ""))
    head = ("stage", "parameters", "gradients", "optimizer", "buffers", "per rank", "per node")
    rows = []
    for stage in range(4):
        m = model_state(params, args.ranks, stage, args.optimizer, itemsize, layers, bucket)
        rows.append((str(stage), *(_gb(m[k]) for k in ("parameters", "gradients", "optimizer_state", "buffers")),
                     _gb(m["total"] + activations), _gb(per_node * (m["total"] + activations))))
    widths_ = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    print("  ".join(h.rjust(w) for h, w in zip(head, widths_)))
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths_)))
    if free is not None and args.nodes == 1:
        fits = [str(i) for i in range(4)
                if per_node * (model_state(params, args.ranks, i, args.optimizer, itemsize, layers, bucket)["total"]
                               + activations) <= free]
        print(f"this node has {_gb(free)} available: "
              + (f"--zero {', '.join(fits)} fit{'s' if len(fits) == 1 else ''}" if fits else "no stage fits"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
