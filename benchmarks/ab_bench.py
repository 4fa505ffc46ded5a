"""Two installs of allreduce_kit, benched alternately: does version B cost anything against A?

    python benchmarks/ab_bench.py --a /path/to/old/venv/bin/python --b .venv/bin/python \\
        --ranks 2 4 8 --repeats 3 --out results/ab

For every rank count and repeat, runs ``python -m allreduce_kit.bench`` of A, then of B (each
under its own venv's ``mpiexec``), so that a drift of the machine hits both alike; then prints,
per rank count, algorithm and size, B's median time over the repeats divided by A's, and the
worst ratio per algorithm. Exit status 1 if any algorithm's median is above ``--limit`` (1.15)
times A's at any size. ``--summarize DIR`` only reads the JSON files an earlier run wrote.
"""
import argparse
import json
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Tuple


def run_one(python: str, ranks: int, bench_args: List[str], out: Path) -> None:
    mpiexec = str(Path(python).parent / "mpiexec")
    command = [mpiexec, "-n", str(ranks), python, "-m", "allreduce_kit.bench", *bench_args, "--json", str(out)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, timeout=3600, env=_environment())


def _environment() -> Dict[str, str]:
    import os

    env = dict(os.environ, ALLREDUCE_KIT_TUNING="builtin")
    return env


def medians(files: List[Path]) -> Dict[Tuple[str, int], float]:
    """(algorithm, size) -> median over the files of the row's median time in microseconds."""
    times: Dict[Tuple[str, int], List[float]] = defaultdict(list)
    for path in files:
        for row in json.loads(path.read_text())["rows"]:
            times[(row["algorithm"], row["size"])].append(row["time_us"])
    return {key: statistics.median(values) for key, values in times.items()}


def summarize(out: Path, limit: float) -> bool:
    """Print the ratios; True if every algorithm stays within ``limit`` at every size."""
    ok = True
    for ranks in sorted({int(p.name.split("-")[1][1:]) for p in out.glob("a-p*-r*.json")}):
        a = medians(sorted(out.glob(f"a-p{ranks}-r*.json")))
        b = medians(sorted(out.glob(f"b-p{ranks}-r*.json")))
        worst: Dict[str, Tuple[float, int]] = {}
        for key in sorted(set(a) & set(b), key=lambda k: (k[0], k[1])):
            ratio = b[key] / a[key]
            if key[0] not in worst or ratio > worst[key[0]][0]:
                worst[key[0]] = (ratio, key[1])
        print(f"p = {ranks}: B / A, median over repeats; worst size per algorithm")
        for name, (ratio, size) in sorted(worst.items()):
            flag = "" if ratio <= limit else f"  above {limit}"
            ok &= ratio <= limit
            print(f"  {name:20s} {ratio:5.2f}x at {size} B{flag}")
        sizes = sorted({k[1] for k in a})
        names = sorted({k[0] for k in a} & {k[0] for k in b})
        print("  size      " + " ".join(f"{n[:10]:>10s}" for n in names))
        for size in sizes:
            cells = [f"{b[(n, size)] / a[(n, size)]:10.2f}" if (n, size) in a and (n, size) in b else " " * 10
                     for n in names]
            print(f"  {size:<9d} " + " ".join(cells))
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", help="python of the venv with version A (the reference)")
    parser.add_argument("--b", help="python of the venv with version B")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8], help="rank counts")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each version per rank count")
    parser.add_argument("--out", type=Path, default=Path("results/ab"), help="folder for the JSON files")
    parser.add_argument("--limit", type=float, default=1.15, help="largest B / A median ratio that passes")
    parser.add_argument("--bench-args", default="-b 4 -e 64M -f 4 -n 10 -w 2",
                        help="arguments for python -m allreduce_kit.bench")
    parser.add_argument("--summarize", action="store_true", help="only summarize the files in --out")
    args = parser.parse_args()
    if not args.summarize:
        if not args.a or not args.b:
            parser.error("--a and --b are needed to measure (or --summarize)")
        args.out.mkdir(parents=True, exist_ok=True)
        for ranks in args.ranks:
            for repeat in range(1, args.repeats + 1):
                for label, python in (("a", args.a), ("b", args.b)):
                    print(f"p = {ranks}, repeat {repeat}, version {label.upper()}", flush=True)
                    run_one(python, ranks, args.bench_args.split(), args.out / f"{label}-p{ranks}-r{repeat}.json")
    return 0 if summarize(args.out, args.limit) else 1


if __name__ == "__main__":
    sys.exit(main())
