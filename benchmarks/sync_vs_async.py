"""Measure sync allreduce against the async parameter server, interleaving runs.

    python benchmarks/sync_vs_async.py [--repeat 3] [--epochs 10] [--out DIR]

Every configuration below runs ``--repeat`` times, in turn with the others (a burst of load
from elsewhere hits all of them alike). The script prints a markdown table of medians and
[min - max] and keeps each run's ``--json`` in DIR; it plots every repeat of each p = 4 and
p = 8 configuration as its median per epoch with the range of the repeats
(``python -m allreduce_kit.compare --plot DIR/pP.png --median``). The default model and data
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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs of each configuration, interleaved with the other configurations' runs")
    parser.add_argument("--epochs", type=int, default=10, help="--epochs of every training run")
    parser.add_argument("--out", default="sync-vs-async-runs", metavar="DIR",
                        help="folder for each run's --json (NAME-R.json) and the plots p4.png and p8.png")
    parser.add_argument("--table-only", action="store_true", help="tabulate and plot the runs already in --out")
    args = parser.parse_args()
    if args.repeat < 1 or args.epochs < 1:
        parser.error(f"argument {'--repeat' if args.repeat < 1 else '--epochs'}: must be >= 1")
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
    print(f"| run ({args.epochs} epochs; runs) | samples/s | training s | test accuracy | final loss "
          f"| updates | rejected | staleness mean / max |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for label, _, _ in CONFIGS:
        runs = results[label]
        if not runs:
            print(f"| {label} | no run | | | | | | |")
            continue
        pick = lambda key: [s[key] for s in runs]
        print(f"| {label} ({len(runs)}) | {spread(pick('samples_per_second'))} | {spread([s.get('train_seconds', s['wall_seconds']) for s in runs], 2)} | "
              f"{spread([100 * a for a in pick('test_accuracy')], 1)}% | "
              f"{spread([s['loss_per_epoch'][-1] for s in runs], 3)} | {statistics.median(pick('updates_applied')):,.0f} | "
              f"{statistics.median(pick('gradients_rejected')):,.0f} | "
              f"{statistics.median(pick('staleness_mean')):.2f} / {max(pick('staleness_max'))} |")
    for p in (4, 8):
        # Every repeat, drawn as the median per epoch with the range of the repeats: one repeat
        # alone (the first, or the slowest) would show the machine's noise as the method's speed.
        every = [str(path) for label, ranks, _ in CONFIGS if ranks == p and "momentum" not in label
                 for path in sorted(out.glob(f"{slug(label)}-*.json"))]
        subprocess.run([sys.executable, "-m", "allreduce_kit.compare", *every, "--plot", str(out / f"p{p}.png"),
                        "--median"], check=False, stdout=subprocess.DEVNULL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
