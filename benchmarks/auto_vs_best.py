"""``auto`` against the fastest of our algorithms, size by size, over repeated bench runs.

    python benchmarks/auto_vs_best.py                                  # 2, 4, 8 ranks, 3 runs each
    python benchmarks/auto_vs_best.py --ranks 2 --repeats 3 --with-table
    python benchmarks/auto_vs_best.py --summarize --out results/auto-vs-best   # only the table again

Runs ``python -m allreduce_kit.bench -b 4 -e 64M -f 4`` (every algorithm, ``auto`` and MPI's
``Allreduce`` in each run) ``--repeats`` times at each rank count, rank counts taking turns,
with ``ALLREDUCE_KIT_TUNING=builtin`` so that no tuning file of the user's takes part. Then per
rank count and size: ``auto``'s median time over the runs against the fastest of ours (each
algorithm's median over the runs, the least of them), the worst single run's ratio (``auto``
against the fastest of ours in that same run), and what ``auto`` ran in each run. The target,
for one node: median ratio at most ``--median-target`` (1.1) and no single run above
``--single-target`` (1.25) at any size; exit status 1 if a size misses it.

``--with-table`` adds to each run the same bench with online tuning off
(``ALLREDUCE_KIT_ONLINE_TUNING=0``: ``auto`` runs the built-in table's choice), summarized the
same way and shown beside it as ``table/best`` (median) and ``table worst``. It is a whole bench,
every algorithm, not ``-a auto`` alone: on a loaded machine a bench of one algorithm alone timed
it many times slower than the same algorithm among others.
"""
import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional

BENCH_ARGS = "-b 4 -e 64M -f 4"
BENCH_ENV = {"ALLREDUCE_KIT_TUNING": "builtin"}
NOT_OURS = ("auto", "mpi")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8], help="rank counts (default: 2 4 8)")
    p.add_argument("--repeats", type=int, default=3, help="bench runs per rank count (default: 3)")
    p.add_argument("--bench-args", default=BENCH_ARGS, help=f"the bench's arguments (default: {BENCH_ARGS!r})")
    p.add_argument("--with-table", action="store_true",
                   help="also run the same bench with online tuning off (auto on its table), beside each run")
    p.add_argument("--median-target", type=float, default=1.1, help="most auto's median may be over the best (1.1)")
    p.add_argument("--single-target", type=float, default=1.25, help="most one run's auto may be over its best (1.25)")
    p.add_argument("--out", type=Path, default=Path("results/auto-vs-best"), help="folder for the runs' JSON and tables")
    p.add_argument("--summarize", action="store_true", help="only summarize the runs already in --out")
    p.add_argument("--python", default=sys.executable, help="the interpreter to run the bench with")
    return p


def command(python: str, ranks: int, bench_args: List[str], json_path: Path) -> List[str]:
    mpiexec = str(Path(python).parent / "mpiexec")
    return [mpiexec, "-n", str(ranks), python, "-m", "allreduce_kit.bench", *bench_args, "--json", str(json_path)]


def run(cmd: List[str], added: Dict[str, str], table: Path) -> None:
    with open(table, "w", encoding="utf-8") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.PIPE, text=True, timeout=7200,
                              env=dict(os.environ, **added), stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        words = " ".join(f"{k}={v}" for k, v in added.items()) + " " + shlex.join(cmd)
        raise SystemExit(f"{words} failed ({done.returncode}):\n{done.stderr[-3000:]}")


def measure(args) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    bench_args = shlex.split(args.bench_args)
    record = {}
    for repeat in range(1, args.repeats + 1):
        for ranks in args.ranks:
            path = args.out / f"p{ranks}-r{repeat}.json"
            cmd = command(args.python, ranks, bench_args, path)
            record["online"] = " ".join(f"{k}={v}" for k, v in BENCH_ENV.items()) + " " + shlex.join(cmd)
            print(f"p = {ranks}, run {repeat}", flush=True)
            run(cmd, BENCH_ENV, path.with_suffix(".txt"))
            if args.with_table:
                path = args.out / f"table-p{ranks}-r{repeat}.json"
                cmd = command(args.python, ranks, bench_args, path)
                added = dict(BENCH_ENV, ALLREDUCE_KIT_ONLINE_TUNING="0")
                record["table"] = " ".join(f"{k}={v}" for k, v in added.items()) + " " + shlex.join(cmd)
                print(f"p = {ranks}, run {repeat}: online tuning off", flush=True)
                run(cmd, added, path.with_suffix(".txt"))
    (args.out / "commands.json").write_text(json.dumps(record, indent=1) + "\n")


def load(out: Path, prefix: str, ranks: int) -> List[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob(f"{prefix}p{ranks}-r*.json"))]


def by_size(run: dict) -> Dict[int, Dict[str, dict]]:
    table: Dict[int, Dict[str, dict]] = defaultdict(dict)
    for row in run["rows"]:
        table[row["size"]][row["algorithm"]] = row
    return table


def summarize(runs: List[dict], tables: List[dict]) -> List[dict]:
    """Per size: auto's median and the best of ours, the ratios, what auto ran; from ``tables``
    (runs with online tuning off), the same ratios as ``table_vs_best`` and ``table_worst_run``."""
    per_run = [by_size(r) for r in runs]
    off = {line["size"]: line for line in summarize(tables, [])} if tables else {}
    lines = []
    for size in sorted(per_run[0]):
        rows = [r[size] for r in per_run if size in r and "auto" in r[size]]
        ours = sorted({n for r in rows for n in r if n not in NOT_OURS})
        if not rows or not ours:
            continue
        medians = {n: statistics.median(r[n]["time_us"] for r in rows if n in r) for n in ours}
        best = min(medians, key=medians.get)
        auto = statistics.median(r["auto"]["time_us"] for r in rows)
        singles = [r["auto"]["time_us"] / min(r[n]["time_us"] for n in ours if n in r) for r in rows]
        line = {"size": size, "runs": len(rows), "auto_us": auto, "best": best, "best_us": medians[best],
                "auto_vs_best": auto / medians[best], "worst_run": max(singles),
                "auto_ran": [r["auto"]["chosen"] for r in rows],
                "explored": [r["auto"].get("explored", 0) for r in rows]}
        if size in off:
            line.update(table_vs_best=off[size]["auto_vs_best"], table_worst_run=off[size]["worst_run"],
                        table_ran=sorted(set(off[size]["auto_ran"])))
        lines.append(line)
    return lines


def show(ranks: int, lines: List[dict], args) -> bool:
    passed = True
    print(f"\n## {ranks} ranks ({lines[0]['runs'] if lines else 0} runs)\n")
    print("| size | auto (us) | best of ours | best (us) | auto/best, median | worst run | auto ran | target | "
          "table/best | table worst | table ran |")
    print("|---:|---:|---|---:|---:|---:|---|---|---:|---:|---|")
    for line in lines:
        ok = line["auto_vs_best"] <= args.median_target and line["worst_run"] <= args.single_target
        passed &= ok
        ran = ", ".join(f"{name} x{line['auto_ran'].count(name)}" for name in sorted(set(line["auto_ran"])))
        table = (f"{line['table_vs_best']:.2f}x | {line['table_worst_run']:.2f}x | {', '.join(line['table_ran'])}"
                 if "table_vs_best" in line else "- | - | -")
        print(f"| {line['size']} | {line['auto_us']:.1f} | {line['best']} | {line['best_us']:.1f} | "
              f"{line['auto_vs_best']:.2f}x | {line['worst_run']:.2f}x | {ran} | {'ok' if ok else 'MISSED'} | {table} |")
    return passed


def main(argv: Optional[List[str]] = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    if any(r < 2 for r in args.ranks):
        p.error(f"--ranks must be at least 2 each, got {args.ranks}")
    if not args.summarize:
        measure(args)
    passed, summary = True, {}
    print(f"auto against the fastest of ours: median over runs (target <= {args.median_target}x) and the worst "
          f"single run (target <= {args.single_target}x); runs in {args.out}")
    for ranks in args.ranks:
        runs = load(args.out, "", ranks)
        if not runs:
            print(f"\n## {ranks} ranks: no runs in {args.out}")
            passed = False
            continue
        lines = summarize(runs, load(args.out, "table-", ranks))
        summary[ranks] = lines
        passed &= show(ranks, lines, args)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"\n{'every size met the target' if passed else 'some size missed the target'}; "
          f"wrote {args.out / 'summary.json'}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
