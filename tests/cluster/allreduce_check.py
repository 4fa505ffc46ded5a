"""Run on the emulated cluster (``test_cluster.py``): every algorithm, and ``auto``, match MPI's own
``Allreduce`` for every op, dtype and awkward length, and every rank ends bitwise the same.

The cases of ``tests/mpi/test_allreduce.py``, with lengths for a network: empty, fewer than p,
around p, odd; for sum and mean, one past ``hierarchical``'s small-shard split at every shard count;
and large ones (2**20 + 3 for float32 sum, 2**18 + 5 for float64 mean and int32 max) that the
ring between nodes streams in many pieces. Then buffers whose lengths differ between ranks, on
both sides of any split by length: every rank raises ``ValueError``, nothing is left unreceived.
Then, in the same job, the same for ``reduce_scatter``, ``allgather`` and ``broadcast``
(``registries_check.py``). With ``--cover`` (the layouts after the first: what is new there is
where the ranks sit, and dtypes and ops are orthogonal to it) each algorithm checks every pair
of dtype and op with one of the small lengths in turn, and every large length, instead of every
length. Rank 0 prints ``passed: N cases`` or the first failures; the exit
status is 1 on any failure.
"""
import sys

import numpy as np
from mpi4py import MPI

from allreduce_kit import ALGORITHMS, OPS, allreduce, library_comm
from registries_check import pick
from registries_check import check as check_collectives

DTYPES = ("float32", "float64", "int32", "int64")
MPI_OP = {"sum": MPI.SUM, "mean": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}
world = MPI.COMM_WORLD
p, rank = world.Get_size(), world.Get_rank()
comm = world.Dup()
lib = library_comm(comm)


def lengths(dtype: str, op: str):
    base = {0, 1, max(p - 1, 1), p, p + 1, 1000}
    if op in ("sum", "mean"):  # shards past the split, each dtype once with and once without a division
        base.add(3 * (64 << 10) // np.dtype(dtype).itemsize + 7)
    if dtype == "float32" and op == "sum":
        base.add(2 ** 20 + 3)
    if (dtype, op) in (("float64", "mean"), ("int32", "max")):
        base.add(2 ** 18 + 5)
    return sorted(base)


def local_values(n: int, dtype: str) -> np.ndarray:
    rng = np.random.default_rng([n, rank])
    if dtype.startswith("int"):
        return rng.integers(-9, 10, n).astype(dtype)
    return rng.standard_normal(n).astype(dtype)


def oracle(x: np.ndarray, op: str) -> np.ndarray:
    expected = x.copy()
    world.Allreduce(MPI.IN_PLACE, expected, op=MPI_OP[op])
    if op == "mean":
        expected = (expected / p).astype(x.dtype) if x.dtype.kind == "f" else np.trunc(expected / p).astype(x.dtype)
    return expected


def tolerance(x: np.ndarray, op: str, expected: np.ndarray) -> np.ndarray:
    eps = np.finfo(x.dtype).eps
    if op in ("sum", "mean"):
        total = np.abs(x).astype(np.float64)
        world.Allreduce(MPI.IN_PLACE, total, op=MPI.SUM)
        return 2 * p * eps * total / (p if op == "mean" else 1)
    if op == "prod":
        return 2 * p * eps * np.abs(expected).astype(np.float64)
    return np.zeros(x.shape)


failures = []
cases = 0
for algorithm in sorted(ALGORITHMS) + ["auto"]:
    if rank == 0 and "-v" in sys.argv:
        print(f"{algorithm} ({MPI.Wtime():.1f})", flush=True)
    turn = 0
    for dtype in DTYPES:
        for op in OPS:
            turn += 1
            for n in pick(lengths(dtype, op), turn, 1):
                x = local_values(n, dtype)
                expected = oracle(x, op)
                bound = tolerance(x, op, expected) if x.dtype.kind == "f" else None
                allreduce(x, op=op, algorithm=algorithm, comm=comm)
                cases += 1
                ok = np.array_equal(x, expected) if bound is None else bool(
                    np.all(np.abs(x.astype(np.float64) - expected) <= bound))
                same = all(b == x.tobytes() for b in world.allgather(x.tobytes()))
                if not (ok and same) and len(failures) < 10:
                    failures.append(f"rank {rank}: {algorithm} {dtype} {op} n={n}: "
                                    + ("differs from MPI" if not ok else "differs between ranks"))
                flag = lib.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)
                if flag and len(failures) < 10:
                    failures.append(f"rank {rank}: {algorithm} {dtype} {op} n={n}: a message left unreceived")

for algorithm in ("ring", "hierarchical"):  # auto may run MPI's own, which aborts the job
    for n in (1000 + rank, (2 ** 18 - 1) * (1 + rank % 2)):  # small; one rank's twice another's
        y = np.ones(n, np.float32)
        try:
            allreduce(y, algorithm=algorithm, comm=comm)
            raised = ""
        except ValueError as error:
            raised = str(error)
        cases += 1
        if "differs between ranks" not in raised and len(failures) < 10:
            failures.append(f"rank {rank}: {algorithm} n={n} (lengths differ): {raised or 'no ValueError'}")
        if lib.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG) and len(failures) < 10:
            failures.append(f"rank {rank}: {algorithm} n={n} (lengths differ): a message left unreceived")

if rank == 0 and "-v" in sys.argv:
    print(f"reduce_scatter, allgather, broadcast ({MPI.Wtime():.1f})", flush=True)
more, found = check_collectives(world, comm)
cases += more
failures += found

failures = [f for fs in world.allgather(failures) for f in fs]
layout = lib.layout
if rank == 0:
    print("\n".join(failures[:20]) if failures else
          f"passed: {cases} cases on {layout.nodes} nodes, ranks per node {layout.ranks_per_node}", flush=True)
comm.Free()
if rank == 0 and "-v" in sys.argv:
    print(f"freed ({MPI.Wtime():.1f})", flush=True)
sys.exit(1 if failures else 0)
