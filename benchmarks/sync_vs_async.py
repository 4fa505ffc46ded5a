"""Measure sync allreduce against the async parameter server, interleaving runs.

    python benchmarks/sync_vs_async.py [--repeat 3] [--epochs 10] [--out DIR]

Every configuration below runs ``--repeat`` times, in turn with the others (a burst of load
from elsewhere hits all of them alike). The script prints a markdown table of medians and
[min - max] and keeps each run's ``--json`` in DIR; it plots the first repeat of each p = 8
configuration with ``python -m allreduce_kit.compare --plot``. The default model and data
(digits, MLP 64-128-64-10, batch 32, lr 0.05, momentum 0.9) unless a row says otherwise.
"""
import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

BIN = Path(sys.executable).parent
MPIEXEC = str(BIN / "mpiexec") if (BIN / "mpiexec").exists() else "mpiexec"
TRAIN = [sys.executable, "-m", "allreduce_kit.train", "--progress", "lines"]

# (label, ranks, extra args)
CONFIGS = [(f"{mode} p={p}{' straggler 2:20' if slow else ''}{extra_label}", p,
            ["--mode", mode] + (["--straggler", "2:20"] if slow else []) + extra)
           for p in (4, 8) for slow in (False, True)
           for mode, extra, extra_label in (("sync", [], ""), ("async-ps", [], ""),
                                            ("async-ps", ["--max-staleness", "1"], " max-staleness 1"))]
CONFIGS += [(f"{mode} p=8 momentum 0", 8, ["--mode", mode, "--momentum", "0"]) for mode in ("sync", "async-ps")]


def slug(label: str) -> str:
    return label.replace(" ", "_").replace(":", "-").replace("=", "")


def spread(values, digits: int = 0) -> str:
    """median [min - max]"""
    f = lambda v: f"{v:,.{digits}f}"
    return f"{f(statistics.median(values))} [{f(min(values))} - {f(max(values))}]"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--out", default="sync-vs-async-runs")
    parser.add_argument("--table-only", action="store_true", help="tabulate and plot the runs already in --out")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(exist_ok=True)
    results = {label: [json.loads(path.read_text())["summary"] for path in sorted(out.glob(f"{slug(label)}-*.json"))]
               if args.table_only else [] for label, _, _ in CONFIGS}
    for r in range(0 if args.table_only else args.repeat):
        for i, (label, p, extra) in enumerate(CONFIGS):
            path = out / f"{slug(label)}-{r}.json"
            cmd = [MPIEXEC, "-n", str(p), *TRAIN, "--epochs", str(args.epochs), *extra, "--json", str(path)]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            if done.returncode != 0:
                print(f"FAILED: {' '.join(cmd)}\n{done.stderr[-2000:]}", file=sys.stderr)
                continue
            results[label].append(json.loads(path.read_text())["summary"])
            print(f"# {label} repeat {r + 1}: {results[label][-1]['samples_per_second']:,.0f} samples/s", file=sys.stderr)
    print(f"| run ({args.epochs} epochs; runs) | samples/s | wall s | test accuracy | final loss "
          f"| updates | rejected | staleness mean / max |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for label, _, _ in CONFIGS:
        runs = results[label]
        if not runs:
            print(f"| {label} | no run | | | | | | |")
            continue
        pick = lambda key: [s[key] for s in runs]
        print(f"| {label} ({len(runs)}) | {spread(pick('samples_per_second'))} | {spread(pick('wall_seconds'), 2)} | "
              f"{spread([100 * a for a in pick('test_accuracy')], 1)}% | "
              f"{spread([s['loss_per_epoch'][-1] for s in runs], 3)} | {statistics.median(pick('updates_applied')):,.0f} | "
              f"{statistics.median(pick('gradients_rejected')):,.0f} | "
              f"{statistics.median(pick('staleness_mean')):.2f} / {max(pick('staleness_max'))} |")
    for p in (4, 8):
        firsts = [str(out / f"{slug(label)}-0.json") for label, ranks, _ in CONFIGS
                  if ranks == p and "momentum" not in label and (out / f"{slug(label)}-0.json").exists()]
        subprocess.run([sys.executable, "-m", "allreduce_kit.compare", *firsts, "--plot", str(out / f"p{p}.png")],
                       check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
