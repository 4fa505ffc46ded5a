"""Horovod's MNIST-style example trained with and without ``Compression.powersgd``, same seeds
(``powersgd_torch.py --accuracy``).

Runs ``examples/horovod_pytorch_mnist.py`` (Horovod's own script, left unchanged) in these processes,
once per seed and compression, with the compression it hands to ``DistributedOptimizer`` switched:
``none`` (what the script sends by default) and ``powersgd``
(``Compression.powersgd(rank=--rank, start_iter=--start)``, a fresh state per run). Everything
else is the script's: its model, data split, seed (its ``--seed``: each of ``--seeds``), learning
rate times the rank count, and test accuracy (the last epoch's, as rank 0 prints it).
"""
import contextlib
import importlib.util
import io
import re
import types
import warnings
from pathlib import Path
from typing import Dict, List

import numpy as np

import allreduce_kit.torch as hvd   # does not start MPI: hvd.init() does

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "horovod_pytorch_mnist.py"
COMPRESSIONS = ("none", "powersgd")


def load_example() -> types.ModuleType:
    """The example as a module: its parser, model and ``main(args)`` (loaded, not run as a script)."""
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


def run(args) -> Dict:
    """Every seed of ``args.seeds`` with each compression, in turn (collective; after ``hvd.init()``):
    the table's figures (on ranks but 0 the accuracies are NaN)."""
    example = load_example()
    common = ["--epochs", str(args.epochs), "--lr", str(args.lr), "--batch-size", str(args.batch_size),
              "--log-interval", "1000000"]
    accuracy: Dict[str, List[float]] = {c: [] for c in COMPRESSIONS}
    for seed in args.seeds:
        for c in COMPRESSIONS:
            compression = hvd.Compression.none if c == "none" else hvd.Compression.powersgd(args.rank, args.start)
            accuracy[c].append(train(example, [*common, "--seed", str(seed)], compression))
    return {"ranks": hvd.size(), "epochs": args.epochs, "lr": args.lr, "batch_size": args.batch_size,
            "rank": args.rank, "start": args.start, "seeds": list(args.seeds), "rows": summary(accuracy)}
