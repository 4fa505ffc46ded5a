"""``python -m allreduce_kit.compare RUN_A.json RUN_B.json [...] [--plot PATH.png]``: runs side by side.

Reads the ``summary`` that ``python -m allreduce_kit.train --json`` writes in both modes (the
same keys for ``--mode sync`` and ``--mode async-ps``, see ``allreduce_kit/train/summary.py``),
prints one row per field and one column per run (with the method: plain sync, ``--backup-workers``,
``--local-sgd`` or ``--mode async-ps``; the median step; the allreduce traffic per sample; the
training time to ``--target-accuracy``), and with ``--plot`` draws the loss per epoch
against training time and against samples seen, every run on the same axes. It reads files only:
it neither needs nor starts MPI, so it runs as one plain process.
"""
import argparse
import json
import os
import re
import statistics
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .cli import output_problem
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
    if field in ("wall_seconds", "train_seconds", "staleness_mean"):
        return f"{value:.2f}"
    if field == "samples_per_second":
        return f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def losses(run: Dict[str, Any]) -> Dict[int, float]:
    """A run's training loss by epoch number (1-based): from its summary's ``epoch_numbers``, or its
    per-epoch records, so that a run whose report starts after epoch 1 lines up by epoch."""
    summary = run["summary"]
    numbers = summary.get("epoch_numbers")
    if numbers is None:
        records = run.get("epochs")
        numbers = ([int(e["epoch"]) for e in records] if isinstance(records, list)
                   and len(records) == len(summary["loss_per_epoch"]) and all("epoch" in e for e in records)
                   else range(1, len(summary["loss_per_epoch"]) + 1))
    return dict(zip(numbers, summary["loss_per_epoch"]))


def time_to_accuracy(run: Dict[str, Any], target: float) -> Optional[float]:
    """Training seconds until the first epoch whose test accuracy reaches ``target`` (None: never)."""
    seconds = 0.0
    for epoch in run.get("epochs") or []:
        seconds += float(epoch.get("seconds", 0.0))
        if epoch.get("test_accuracy") is not None and epoch["test_accuracy"] >= target:
            return seconds
    return None


def method(run: Dict[str, Any]) -> str:
    """How the run trained: ``sync``, ``backup-workers B``, ``local-sgd H`` or ``async-ps`` (from its config)."""
    config = run.get("config") or {}
    if run["summary"]["mode"] != "sync":
        return run["summary"]["mode"]
    if (config.get("backup_workers") or 0) > 0:
        return f"backup-workers {config['backup_workers']}"
    if (config.get("local_sgd") or 1) > 1:
        return f"local-sgd {config['local_sgd']}"
    return "sync"


def _number(value: Any, digits: int) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def table(runs: Sequence[Dict[str, Any]], names: Sequence[str], target: float = 0.95) -> str:
    """Fields as rows, runs as columns; then the loss of every epoch, one row per epoch number.

    After the shared fields: the method (plain sync, backup workers, local SGD or the parameter
    server), the median step, the model's allreduce traffic per sample, the backup workers'
    effective batch and largest dropped share, and the training time to ``target`` test accuracy."""
    rows: List[List[str]] = [["", *names]]
    for field in FIELDS:
        if field == "loss_per_epoch":
            continue
        rows.append([field.replace("_", " "), *(_cell(field, r["summary"].get(field)) for r in runs)])
    straggler = [r.get("config", {}).get("straggler") for r in runs]
    rows.append(["straggler", *("-" if not s else f"rank {s[0]} +{s[1]:g} ms" for s in straggler)])
    jitter = [(r.get("config") or {}).get("jitter_ms") for r in runs]
    if any(jitter):
        rows.append(["jitter", *(f"+{j:g} ms mean" if j else "-" for j in jitter)])
    straggler = [r.get("straggler") or {} for r in runs]
    traffic = [r.get("communication") or {} for r in runs]
    backup = [s.get("backup_workers") for s in straggler]
    rows.append(["method", *map(method, runs)])
    rows.append(["step ms p50", *(_number(s.get("step_ms_p50"), 2) for s in straggler)])
    rows.append(["allreduce calls per sample", *(_number(c.get("calls_per_sample"), 5) for c in traffic)])
    rows.append(["allreduce bytes per sample", *(_number(c.get("bytes_per_sample"), 1) for c in traffic)])
    if any(backup):
        rows.append(["effective global batch", *(_number(b and b["effective_global_batch_mean"], 1) for b in backup)])
        rows.append(["dropped share max", *("-" if not b else f"{100 * max(r['dropped_share'] for r in b['ranks']):.0f}%"
                                            for b in backup)])
    rows.append([f"time to {100 * target:g}% test (s)", *(_number(time_to_accuracy(r, target), 2) for r in runs)])
    by_epoch = [losses(r) for r in runs]
    for e in sorted(set().union(*by_epoch)):
        rows.append([f"loss epoch {e}", *(f"{loss[e]:.4f}" if e in loss else "-" for loss in by_epoch)])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    fmt = lambda row: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
    return "\n".join([fmt(rows[0]), fmt(["-" * w for w in widths]), *map(fmt, rows[1:])])


def repeats(names: Sequence[str]) -> List[Tuple[str, List[int]]]:
    """Group runs whose names differ only in a trailing ``-N`` (repeats: ``sync_p8-0``,
    ``sync_p8-1``): ``[(group name, [indices])]`` in first-seen order."""
    groups: Dict[str, List[int]] = {}
    for i, name in enumerate(names):
        groups.setdefault(re.sub(r"-\d+$", "", name), []).append(i)
    return list(groups.items())


def _label(run: Dict[str, Any], name: str, count: int = 1) -> str:
    summary = run["summary"]
    label = f"{name} ({method(run)}, {summary['ranks']} rank{'' if summary['ranks'] == 1 else 's'}"
    label += f", median of {count} runs)" if count > 1 else ")"
    if (run.get("config") or {}).get("straggler"):
        label += f", straggler {run['config']['straggler'][0]}:{run['config']['straggler'][1]:g}"
    return label


def _spread(values: Sequence[float]) -> Tuple[float, float, float]:
    """median, and its distance down to the smallest and up to the largest."""
    mid = statistics.median(values)
    return mid, mid - min(values), max(values) - mid


def plot(path: str, runs: Sequence[Dict[str, Any]], names: Sequence[str], median: bool = False) -> None:
    """Write ``figure(runs, names, median)`` as a PNG to exactly ``path``."""
    from .plots import save

    save(figure(runs, names, median), path)


def figure(runs: Sequence[Dict[str, Any]], names: Sequence[str], median: bool = False):
    """Loss per epoch against cumulative training time (left) and samples seen (right), one line per
    run; with ``median``, one line per group of repeats (``repeats``): at each epoch the median
    time and loss, with bars from the smallest to the largest of the repeats."""
    from .plots import pyplot, value_axis

    plt = pyplot()
    groups = repeats(names) if median else [(name, [i]) for i, name in enumerate(names)]
    fig, (by_time, by_samples) = plt.subplots(1, 2, figsize=(12, 4.5 + 0.3 * len(groups)))
    every_loss = []
    for name, members in groups:
        group = [runs[i] for i in members]
        epochs = min(len(r["summary"]["curve"]["loss"]) for r in group)
        if epochs == 0:
            continue
        columns = {key: [[r["summary"]["curve"][key][e] for r in group] for e in range(epochs)]
                   for key in ("seconds", "samples", "loss")}
        seconds, loss = map(lambda key: [_spread(v) for v in columns[key]], ("seconds", "loss"))
        samples = [statistics.median(v) for v in columns["samples"]]
        every_loss += [v for values in columns["loss"] for v in values]
        label = _label(group[0], name, len(group))
        y = [m for m, _, _ in loss]
        yerr = [[d for _, d, _ in loss], [u for _, _, u in loss]] if len(group) > 1 else None
        xerr = [[d for _, d, _ in seconds], [u for _, _, u in seconds]] if len(group) > 1 else None
        drawn = by_time.errorbar([m for m, _, _ in seconds], y, xerr=xerr, yerr=yerr, marker=".", capsize=2,
                                 elinewidth=0.8, label=label)
        by_samples.errorbar(samples, y, yerr=yerr, marker=".", capsize=2, elinewidth=0.8, label=label,
                            color=drawn[0].get_color())
    for ax, xlabel in ((by_time, "training time (s, epochs' cumulative)"), (by_samples, "samples seen")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("training loss (epoch mean)")
        value_axis(ax, every_loss)
        ax.grid(alpha=0.3)
    by_time.set_title("loss against training time" + (" (median and range of the repeats)" if median else ""))
    by_samples.set_title("loss against samples seen")
    handles, labels = by_time.get_legend_handles_labels()
    rows = -(-len(labels) // 2)
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06 * rows, 1, 1))
    return fig


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m allreduce_kit.compare",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                     description="Print two or more runs of python -m allreduce_kit.train --json "
                                                 "side by side (any mode), and optionally plot their loss curves.")
    from . import __version__

    parser.add_argument("--version", action="version", version=f"allreduce_kit {__version__}")
    parser.add_argument("runs", nargs="+", metavar="RUN.json", help="files written by allreduce_kit.train --json")
    parser.add_argument("--plot", metavar="PATH.png", default=None,
                        help="draw loss against training time and against samples seen as a PNG, written to exactly "
                             "PATH.png (a path not ending in .png is refused; needs matplotlib)")
    parser.add_argument("--median", action="store_true",
                        help="with --plot: draw runs whose file names differ only in a trailing -N (repeats of "
                             "one configuration) as one line, the median per epoch with bars over their range")
    parser.add_argument("--target-accuracy", type=float, default=0.95, metavar="A",
                        help="the row 'time to A test': training seconds until an epoch's test accuracy reaches A "
                             "(a fraction, 0 < A <= 1)")
    args = parser.parse_args(argv)
    if not 0 < args.target_accuracy <= 1:
        parser.error(f"argument --target-accuracy: expected a fraction in (0, 1], got {args.target_accuracy:g}")
    runs = []
    for path in args.runs:
        try:
            runs.append(load(path))
        except (OSError, ValueError) as error:       # json.JSONDecodeError is a ValueError
            parser.error(f"argument RUN.json: cannot read {path}: {error}")
    if args.plot:
        problem = output_problem("--plot", args.plot, ".png")
        if problem:
            parser.error(problem)
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            from .plots import NO_MATPLOTLIB
            parser.error(f"argument --plot: {NO_MATPLOTLIB}")
    names = [os.path.splitext(os.path.basename(p))[0] for p in args.runs]
    print(table(runs, names, args.target_accuracy), flush=True)
    if args.plot:
        plot(args.plot, runs, names, median=args.median)
        print(f"wrote {args.plot}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
