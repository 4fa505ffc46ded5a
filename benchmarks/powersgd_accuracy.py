"""Horovod's MNIST-style example trained with and without ``Compression.powersgd``, same seeds.

Runs ``examples/horovod_pytorch_mnist.py`` (Horovod's own script, left unchanged) in these processes,
once per seed and compression, with the compression it hands to ``DistributedOptimizer`` switched:
``none`` (what the script sends by default) and ``powersgd``
(``Compression.powersgd(rank=--rank, start_iter=--start)``, a fresh state per run). Everything
else is the script's: its model, data split, seed (``--seed`` of the script: each seed of
``--seeds``), learning rate times the rank count, and test accuracy (the last epoch's, as rank 0
prints it). Prints a table of the test accuracy per seed and the median over seeds; ``--json``
keeps it. Run (one node):

    mpirun -n 4 python benchmarks/powersgd_accuracy.py --epochs 5 --lr 0.025 --batch-size 16 --json acc.json

(the settings of the suite's run of the example at 4 ranks: the global batch and step size of one
process at batch 64 and learning rate 0.1).
"""
import contextlib
import importlib.util
import io
import json
import re
import sys
import types
import warnings
from pathlib import Path
from typing import Dict, List

import numpy as np

import allreduce_kit.torch as hvd   # does not start MPI: hvd.init() does
from allreduce_kit.cli import RankZeroParser

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "horovod_pytorch_mnist.py"
COMPRESSIONS = ("none", "powersgd")


def load_example() -> types.ModuleType:
    """The example as a module: its parser, model and ``main(args)`` (its ``__main__`` block does not run)."""
    spec = importlib.util.spec_from_file_location("horovod_pytorch_mnist", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Switched:
    """``allreduce_kit.torch`` as the example sees it, but for ``Compression.none`` (and ``fp16``),
    which are ``compression``: the example passes it to ``DistributedOptimizer`` unchanged."""

    def __init__(self, compression) -> None:
        self.Compression = types.SimpleNamespace(none=compression, fp16=compression)

    def __getattr__(self, name: str):
        return getattr(hvd, name)


def final_accuracy(output: str) -> float:
    """The last test accuracy (%) the example printed."""
    found = re.findall(r"Accuracy: ([0-9.]+)%", output)
    if not found:
        raise RuntimeError(f"the example printed no test accuracy:\n{output[-2000:]}")
    return float(found[-1])


def train(example: types.ModuleType, arguments: List[str], compression) -> float:
    """One run of the example's ``main`` with ``compression``: its final test accuracy on rank 0
    (on the other ranks, NaN: only rank 0 prints it)."""
    args = example.parser.parse_args(arguments)
    args.cuda = False
    example.hvd = Switched(compression)
    output = io.StringIO()
    with contextlib.redirect_stdout(output), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)   # the example's deprecated calls, once per run
        example.main(args)
    return final_accuracy(output.getvalue()) if hvd.rank() == 0 else float("nan")


def summary(accuracy: Dict[str, List[float]]) -> Dict[str, Dict]:
    """Per compression: its accuracies, their median, and (powersgd) the median's difference to none's."""
    rows = {c: {"test_accuracy": a, "median": float(np.median(a))} for c, a in accuracy.items()}
    for c, row in rows.items():
        row["median_minus_none"] = row["median"] - rows["none"]["median"]
    return rows


def lines(result: Dict) -> List[str]:
    out = [f"{EXAMPLE.name}, {result['ranks']} ranks, {result['epochs']} epochs, batch {result['batch_size']} per rank, "
           f"--lr {result['lr']}; powersgd: rank {result['rank']}, start_iter {result['start']}; "
           f"test accuracy (%) per seed {result['seeds']}:"]
    for c, row in result["rows"].items():
        out.append(f"  {c:<9} {', '.join(f'{a:6.2f}' for a in row['test_accuracy'])}   median {row['median']:6.2f}"
                   + (f"  ({row['median_minus_none']:+.2f} against none)" if c != "none" else ""))
    return out


def main() -> int:
    parser = RankZeroParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="42,43,44", help="the example's --seed for each run (default: 42,43,44)")
    parser.add_argument("--epochs", type=int, default=5, help="the example's --epochs (default: 5)")
    parser.add_argument("--lr", type=float, default=0.025, help="the example's --lr, before it multiplies it by the "
                                                                 "rank count (default: 0.025)")
    parser.add_argument("--batch-size", type=int, default=16, help="the example's --batch-size per rank (default: 16)")
    parser.add_argument("--rank", type=int, default=4, help="Compression.powersgd's rank (default: 4)")
    parser.add_argument("--start", type=int, default=10,
                        help="Compression.powersgd's start_iter: plain averages for the first steps (default: 10)")
    parser.add_argument("--json", metavar="PATH", help="also write the accuracies as JSON to PATH")
    args = parser.parse_args()
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        parser.error(f"--seeds must be integers separated by commas, got {args.seeds!r}")
    bad = [f"--{name} must be >= {least}" for name, value, least in
           (("epochs", args.epochs, 1), ("batch-size", args.batch_size, 1), ("rank", args.rank, 1),
            ("start", args.start, 0)) if value < least]
    if bad:
        parser.error("; ".join(bad))   # rank 0 says it, every rank exits with status 2
    hvd.init()
    example = load_example()
    common = ["--epochs", str(args.epochs), "--lr", str(args.lr), "--batch-size", str(args.batch_size),
              "--log-interval", "1000000"]
    accuracy: Dict[str, List[float]] = {c: [] for c in COMPRESSIONS}
    for seed in seeds:
        for c in COMPRESSIONS:
            compression = hvd.Compression.none if c == "none" else hvd.Compression.powersgd(args.rank, args.start)
            accuracy[c].append(train(example, [*common, "--seed", str(seed)], compression))
    if hvd.rank() == 0:
        result = {"ranks": hvd.size(), "epochs": args.epochs, "lr": args.lr, "batch_size": args.batch_size,
                  "rank": args.rank, "start": args.start, "seeds": seeds, "rows": summary(accuracy)}
        print("\n".join(lines(result)))
        if args.json:
            with open(args.json, "w", encoding="utf-8") as out:
                json.dump(result, out, indent=2)
            print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
