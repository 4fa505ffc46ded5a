"""What a little work between two small allreduces costs when ranks share cores.

    mpirun -n 8 python benchmarks/between_calls.py [--bytes 8] [--calls 500] [--rounds 9]
    python -m allreduce_kit.cluster run -n 8 -- python benchmarks/between_calls.py

Times back-to-back calls of MPI's own ``Allreduce`` (sum, in place, float32) with nothing
between them, then with a Python loop of 10, 40 and 160 steps before each call, and, beside
them, ``allreduce(buf, algorithm="mpi")`` (the same MPI call behind this package's per-call
path) and ``allreduce(buf)`` (``auto``, with whatever it runs there). Every way runs
``--calls`` calls after a barrier and a warm-up, in an order that rotates between the
``--rounds`` rounds; a round's figure is the slowest rank's mean time per call. Prints each
way's median over the rounds, its range, and the time over the bare calls'.
"""
import statistics
import time
from typing import Callable, Dict

import numpy as np
from mpi4py import MPI

import allreduce_kit
from allreduce_kit.cli import RankZeroParser

LOOP_STEPS = (10, 40, 160)


def spin(steps: int) -> int:
    total = 0
    for i in range(steps):
        total += i
    return total


def ways(buf: np.ndarray) -> Dict[str, Callable[[], object]]:
    world = MPI.COMM_WORLD

    def bare():
        world.Allreduce(MPI.IN_PLACE, buf, MPI.SUM)

    def after(steps: int):
        def call():
            spin(steps)
            world.Allreduce(MPI.IN_PLACE, buf, MPI.SUM)
        return call

    found = {"Allreduce": bare}
    for steps in LOOP_STEPS:
        found[f"{steps}-step Python loop, Allreduce"] = after(steps)
    found["allreduce(algorithm='mpi')"] = lambda: allreduce_kit.allreduce(buf, algorithm="mpi")
    found["allreduce() (auto)"] = lambda: allreduce_kit.allreduce(buf)
    return found


def main() -> None:
    parser = RankZeroParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bytes", type=int, default=8, help="message size, a multiple of 4")
    parser.add_argument("--calls", type=int, default=500, help="timed calls per way and round")
    parser.add_argument("--rounds", type=int, default=9, help="rounds; the median is reported")
    args = parser.parse_args()
    if args.bytes < 4 or args.bytes % 4 or args.calls < 1 or args.rounds < 1:
        parser.error("--bytes: a positive multiple of 4; --calls and --rounds at least 1")
    world = MPI.COMM_WORLD
    buf = np.ones(args.bytes // 4, np.float32)
    table = ways(buf)
    names = list(table)
    times: Dict[str, list] = {name: [] for name in names}
    for r in range(args.rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            call = table[name]
            for _ in range(20):
                call()
            world.Barrier()
            start = time.perf_counter()
            for _ in range(args.calls):
                call()
            times[name].append(world.allreduce((time.perf_counter() - start) / args.calls, op=MPI.MAX))
    if world.rank == 0:
        base = statistics.median(times["Allreduce"])
        print(f"{world.size} ranks, {args.bytes} B: slowest rank's mean us per call, "
              f"median of {args.rounds} rounds [range]")
        for name in names:
            m = statistics.median(times[name])
            print(f"  {name:45s} {m * 1e6:9.1f} us  [{min(times[name]) * 1e6:.1f}, {max(times[name]) * 1e6:.1f}]"
                  f"  {m / base:5.2f}x")


if __name__ == "__main__":
    main()
