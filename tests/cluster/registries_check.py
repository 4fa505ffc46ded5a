"""The emulated cluster's cases for ``reduce_scatter``, ``allgather`` and ``broadcast``, run by
``allreduce_check.py`` in the same job (``test_cluster.py``): every algorithm in each
collective's registry, and ``auto``, matches MPI's own call (``Reduce_scatter``,
``Allgatherv``, ``Bcast``) for every op, dtype and awkward length (empty, fewer than p, around p,
odd, and one large-ish, on float32 for the reductions), each root for a broadcast and uneven
blocks for an allgather; every rank ends bitwise the same; nothing is left unreceived (checked
once per algorithm and dtype, between barriers: a call's stray message would also spoil the
next call's result). Then
calls whose lengths differ between ranks: every rank raises ``ValueError``.

``check(world, comm)`` returns ``(cases, failures)``.
"""
import sys
from typing import List, Tuple

import numpy as np
from mpi4py import MPI

from allreduce_kit import OPS, allgather, broadcast, library_comm, reduce_scatter, shard_bounds
from allreduce_kit.algorithms import allgather as allgathers
from allreduce_kit.algorithms import broadcast as broadcasts
from allreduce_kit.algorithms import reduce_scatter as reduce_scatters

DTYPES = ("float32", "float64", "int32", "int64")
MPI_OP = {"sum": MPI.SUM, "mean": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}
#: Past ``auto``'s small-message split (64 KiB) as float32, odd, in blocks of unequal lengths.
LARGE = 2 ** 15 + 3


#: ``--cover``: a layout's cases cover every length in turn, not every length each time
#: (``allreduce_check.py``).
COVER = "--cover" in sys.argv


def pick(lengths: List[int], turn: int, per_turn: int) -> List[int]:
    """``lengths``, or with ``COVER`` the ``per_turn`` small ones (up to 1000) whose turn it is
    and every large one."""
    if not COVER:
        return lengths
    small = [n for n in lengths if n <= 1000]
    return sorted({small[(turn * per_turn + i) % len(small)] for i in range(per_turn)}
                  | {n for n in lengths if n > 1000})


def lengths(p: int, large: bool) -> List[int]:
    return sorted({0, 1, max(p - 1, 1), p + 1, 1000} | ({LARGE} if large else set()))


def local_values(n: int, dtype: str, rank: int) -> np.ndarray:
    rng = np.random.default_rng([n, rank, 7])
    if dtype.startswith("int"):
        return rng.integers(-9, 10, n).astype(dtype)
    return rng.standard_normal(n).astype(dtype)


def check(world: MPI.Intracomm, comm: MPI.Intracomm) -> Tuple[int, List[str]]:
    p, rank = world.Get_size(), world.Get_rank()
    lib = library_comm(comm)
    failures: List[str] = []
    cases = 0

    def quiet(case: str) -> None:
        """No message is left on the library's communicator (between two barriers, so that no
        rank's next call is taken for one)."""
        lib.Barrier()
        stray = lib.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)
        lib.Barrier()
        if stray and len(failures) < 10:
            failures.append(f"rank {rank}: {case}: a message left unreceived")

    def verify(case: str, ok: bool, result: np.ndarray) -> None:
        nonlocal cases
        cases += 1
        same = all(b == result.tobytes() for b in world.allgather(result.tobytes()))
        if not (ok and same) and len(failures) < 10:
            failures.append(f"rank {rank}: {case}: " + ("differs from MPI" if not ok else "differs between ranks"))

    def progress(what: str) -> None:
        if rank == 0 and "-v" in sys.argv:
            print(f"{what} ({MPI.Wtime():.1f})", flush=True)

    for algorithm in sorted(reduce_scatters.ALGORITHMS) + ["auto"]:
        progress(f"reduce_scatter {algorithm}")
        turn = 0
        for dtype in DTYPES:
            for op in OPS:
                turn += 1
                for n in pick(lengths(p, dtype == "float32" and op == "sum"), turn, 1):
                    x = local_values(n, dtype, rank)
                    counts = [int(c) for c in np.diff(shard_bounds(n, p))]
                    expected = np.empty(counts[rank], dtype)
                    world.Reduce_scatter(x, expected, counts, op=MPI_OP[op])
                    if op == "mean":
                        expected = (expected / p).astype(dtype) if dtype[0] == "f" else np.trunc(expected / p).astype(dtype)
                    out = reduce_scatter(x, op=op, algorithm=algorithm, comm=comm)
                    if dtype[0] == "f" and op in ("sum", "mean", "prod"):
                        scale = np.abs(x).astype(np.float64) if op != "prod" else None
                        if scale is not None:
                            world.Allreduce(MPI.IN_PLACE, scale, op=MPI.SUM)
                            lo, hi = shard_bounds(n, p)[rank:rank + 2]
                            bound = 2 * p * np.finfo(dtype).eps * scale[lo:hi] / (p if op == "mean" else 1)
                        else:
                            bound = 2 * p * np.finfo(dtype).eps * np.abs(expected).astype(np.float64)
                        ok = bool(np.all(np.abs(out.astype(np.float64) - expected) <= bound))
                    else:
                        ok = np.array_equal(out, expected)
                    cases += 1  # reduce_scatter's blocks differ between ranks: no bitwise comparison
                    if not ok and len(failures) < 10:
                        failures.append(f"rank {rank}: reduce_scatter {algorithm} {dtype} {op} n={n}: differs from MPI")
            quiet(f"reduce_scatter {algorithm} {dtype}")  # once per algorithm and dtype: time

    for algorithm in sorted(allgathers.ALGORITHMS) + ["auto"]:
        progress(f"allgather {algorithm}")
        for turn, dtype in enumerate(DTYPES):
            for n in pick(lengths(p, dtype == "float32"), turn, 2):
                whole = local_values(n, dtype, 0)  # the same on every rank
                lo, hi = shard_bounds(n, p)[rank:rank + 2]
                out = allgather(whole[lo:hi].copy(), np.zeros(n, dtype), algorithm=algorithm, comm=comm)
                verify(f"allgather {algorithm} {dtype} n={n}", np.array_equal(out, whole), out)
                counts = [(n + 3 * r) % 7 for r in range(p)]  # uneven, some empty: Allgatherv's case
                mine = local_values(counts[rank], dtype, rank)
                expected = np.empty(sum(counts), dtype)
                world.Allgatherv(mine, [expected, (counts, [sum(counts[:r]) for r in range(p)])])
                out = allgather(mine, counts=counts, algorithm=algorithm, comm=comm)
                verify(f"allgather {algorithm} {dtype} counts={counts}", np.array_equal(out, expected), out)
                out = allgather(mine, algorithm=algorithm, comm=comm)
                verify(f"allgather {algorithm} {dtype} lengths exchanged", np.array_equal(out, expected), out)
            quiet(f"allgather {algorithm} {dtype}")

    for algorithm in sorted(broadcasts.ALGORITHMS) + ["auto"]:
        progress(f"broadcast {algorithm}")
        for turn, dtype in enumerate(DTYPES):
            for n in pick(lengths(p, dtype == "float32"), turn, 2):
                for root in sorted({0, p - 1, p // 2}):
                    x = local_values(n, dtype, rank)
                    expected = x.copy()
                    world.Bcast(expected, root)
                    broadcast(x, root, algorithm=algorithm, comm=comm)
                    verify(f"broadcast {algorithm} {dtype} n={n} root={root}", np.array_equal(x, expected), x)
            quiet(f"broadcast {algorithm} {dtype}")

    mismatched = {  # one rank's length differs; MPI's own reduce_scatter and allgather end the job on it
        "reduce_scatter": (sorted(set(reduce_scatters.ALGORITHMS) - {"mpi"}),
                           lambda a, n: reduce_scatter(np.ones(n, np.float32), algorithm=a, comm=comm)),
        "allgather": (sorted(set(allgathers.ALGORITHMS) - {"mpi"}),
                      lambda a, n: allgather(np.ones(int(np.diff(shard_bounds(n, p))[rank]), np.float32),
                                             np.empty(n, np.float32), algorithm=a, comm=comm)),
        "broadcast": (sorted(broadcasts.ALGORITHMS), lambda a, n: broadcast(np.ones(n, np.float32), algorithm=a, comm=comm)),
    }
    for name, (algorithms, call) in mismatched.items():
        for algorithm in algorithms:
            progress(f"{name} {algorithm}, lengths differ")
            n = 1000 + (1 if rank == p // 2 else 0)
            try:
                call(algorithm, n)
                raised = ""
            except ValueError as error:
                raised = str(error)
            cases += 1
            if not raised.startswith(f"{name}: ") or "differs between ranks" not in raised:
                if len(failures) < 10:
                    failures.append(f"rank {rank}: {name} {algorithm} (lengths differ): {raised or 'no ValueError'}")
            quiet(f"{name} {algorithm} (lengths differ)")
    return cases, failures


if __name__ == "__main__":  # alone, for its own time: python -m mpi4py registries_check.py [-v]
    world = MPI.COMM_WORLD
    comm = world.Dup()
    start = MPI.Wtime()
    cases, failures = check(world, comm)
    failures = [f for fs in world.allgather(failures) for f in fs]
    if world.Get_rank() == 0:
        print("\n".join(failures[:20]) if failures else f"passed: {cases} cases in {MPI.Wtime() - start:.1f} s", flush=True)
    comm.Free()
    sys.exit(1 if failures else 0)
