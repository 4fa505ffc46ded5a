"""``python -m allreduce_kit.compare RUN_A.json RUN_B.json [...] [--plot PATH.png]``: runs side by side.

Reads the ``summary`` that ``python -m allreduce_kit.train --json`` writes in both modes (the
same keys for ``--mode sync`` and ``--mode async-ps``, see ``allreduce_kit/train/summary.py``),
prints one row per field and one column per run, and with ``--plot`` draws the loss per epoch
against wall time and against samples seen, every run on the same axes. It reads files only:
it neither needs nor starts MPI, so it runs as one plain process.
"""
import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

from .train.summary import FIELDS


def load(path: str) -> Dict[str, Any]:
    """A run's JSON; raises ``ValueError`` naming the file if it has no summary."""
    with open(path, encoding="utf-8") as f:
        run = json.load(f)
    if not isinstance(run, dict) or not isinstance(run.get("summary"), dict):
        raise ValueError(f"{path} has no \"summary\": write it with python -m allreduce_kit.train --json")
    return run


def _cell(field: str, value: Any) -> str:
    if value is None:
        return "-"
    if field.endswith("accuracy"):
        return f"{100 * value:.2f}%"
    if field in ("wall_seconds", "staleness_mean"):
        return f"{value:.2f}"
    if field == "samples_per_second":
        return f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def table(runs: Sequence[Dict[str, Any]], names: Sequence[str]) -> str:
    """Fields as rows, runs as columns; then the loss of every epoch, one row per epoch."""
    rows: List[List[str]] = [["", *names]]
    for field in FIELDS:
        if field == "loss_per_epoch":
            continue
        rows.append([field.replace("_", " "), *(_cell(field, r["summary"].get(field)) for r in runs)])
    straggler = [r.get("config", {}).get("straggler") for r in runs]
    rows.append(["straggler", *("-" if not s else f"rank {s[0]} +{s[1]:g} ms" for s in straggler)])
    for e in range(max(len(r["summary"]["loss_per_epoch"]) for r in runs)):
        rows.append([f"loss epoch {e + 1}",
                     *(f"{r['summary']['loss_per_epoch'][e]:.4f}" if e < len(r["summary"]["loss_per_epoch"]) else "-"
                       for r in runs)])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    fmt = lambda row: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
    return "\n".join([fmt(rows[0]), fmt(["-" * w for w in widths]), *map(fmt, rows[1:])])


def plot(path: str, runs: Sequence[Dict[str, Any]], names: Sequence[str]) -> None:
    """Loss per epoch against cumulative wall time (left) and samples seen (right), one line per run."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_time, by_samples) = plt.subplots(1, 2, figsize=(12, 4.5 + 0.3 * len(runs)))
    for run, name in zip(runs, names):
        curve = run["summary"]["curve"]
        label = f"{name} ({run['summary']['mode']}, {run['summary']['ranks']} ranks)"
        if (run.get("config") or {}).get("straggler"):
            label += f", straggler {run['config']['straggler'][0]}:{run['config']['straggler'][1]:g}"
        by_time.plot(curve["seconds"], curve["loss"], marker=".", label=label)
        by_samples.plot(curve["samples"], curve["loss"], marker=".", label=label)
    for ax, xlabel in ((by_time, "wall time (s)"), (by_samples, "samples seen")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("training loss (epoch mean)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    by_time.set_title("loss against wall time")
    by_samples.set_title("loss against samples seen")
    handles, labels = by_time.get_legend_handles_labels()
    rows = -(-len(labels) // 2)
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06 * rows, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m allreduce_kit.compare",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                     description="Print two or more runs of python -m allreduce_kit.train --json "
                                                 "side by side (any mode), and optionally plot their loss curves.")
    from . import __version__

    parser.add_argument("--version", action="version", version=f"allreduce_kit {__version__}")
    parser.add_argument("runs", nargs="+", metavar="RUN.json", help="files written by allreduce_kit.train --json")
    parser.add_argument("--plot", metavar="PATH.png", default=None,
                        help="draw loss against wall time and against samples seen (needs matplotlib)")
    args = parser.parse_args(argv)
    runs = []
    for path in args.runs:
        try:
            runs.append(load(path))
        except (OSError, ValueError) as error:       # json.JSONDecodeError is a ValueError
            parser.error(f"argument RUN.json: cannot read {path}: {error}")
    if args.plot:
        folder = os.path.dirname(os.path.abspath(args.plot))
        if not os.path.isdir(folder):
            parser.error(f"argument --plot: directory {folder} does not exist")
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("argument --plot: matplotlib is not installed; pip install 'allreduce_kit[plot]'")
    names = [os.path.splitext(os.path.basename(p))[0] for p in args.runs]
    print(table(runs, names), flush=True)
    if args.plot:
        plot(args.plot, runs, names)
        print(f"wrote {args.plot}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
