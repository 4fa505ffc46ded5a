"""Run on the emulated cluster (``test_cluster_collectives.py``): ``hierarchical`` and ``auto`` of
``reduce_scatter``, ``allgather`` and ``broadcast`` match MPI's own calls across the nodes, for
every op and dtype, lengths that are empty, fewer than p, around p, odd and large (pieces on the
link), ``allgather``'s blocks of other lengths (``counts``) and every root; and ``reduce_scatter``
with ``compression`` against MPI's reduction of the 16-bit-rounded inputs. Rank 0 prints
``passed: N cases`` or the first failures; the exit status is 1 on any failure.
"""
import sys

import numpy as np
from mpi4py import MPI

from allreduce_kit import OPS, allgather, broadcast, library_comm, reduce_scatter
from allreduce_kit.blocks import block, counts
from allreduce_kit.compression import OPS as COMPRESSED_OPS, WIRES

DTYPES = ("float32", "float64", "int32", "int64")
MPI_OP = {"sum": MPI.SUM, "mean": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}
ALGORITHMS = ("hierarchical", "auto")
world = MPI.COMM_WORLD
p, rank = world.Get_size(), world.Get_rank()
comm = world.Dup()
lib = library_comm(comm)


def lengths(dtype: str) -> list:
    base = {0, 1, max(p - 1, 1), p, p + 1, 1000}
    if dtype in ("float32", "int64"):  # blocks of several pieces on the link
        base.add((3 << 20) // np.dtype(dtype).itemsize + 7)
    return sorted(base)


def values(n: int, dtype: str, seed: int) -> np.ndarray:
    rng = np.random.default_rng([n, seed])
    if dtype.startswith("int"):
        return rng.integers(-3, 4, n).astype(dtype)
    return rng.standard_normal(n).astype(dtype)


failures = []
cases = 0


def check(ok: bool, what: str) -> None:
    global cases
    cases += 1
    if not ok and len(failures) < 10:
        failures.append(f"rank {rank}: {what}")
    world.Barrier()  # every rank is done with the call ...
    status = MPI.Status()
    if lib.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status) and len(failures) < 10:
        failures.append(f"rank {rank}: {what}: a message left unreceived (from {status.Get_source()}, "
                        f"tag {status.Get_tag()}, {status.Get_count()} B)")
    world.Barrier()  # ... and none starts the next before every rank has looked


for algorithm in ALGORITHMS:
    for dtype in DTYPES:
        for n in lengths(dtype):
            for op in OPS:  # reduce_scatter: rank r's block of the reduced buffer
                x = values(n, dtype, rank)
                expected = x.copy()
                world.Allreduce(MPI.IN_PLACE, expected, op=MPI_OP[op])
                lo, hi = block(n, p, rank)
                got = reduce_scatter(x, op=op, algorithm=algorithm, comm=comm)
                if op == "mean":
                    want = expected[lo:hi] / p
                    ok = np.allclose(got, want.astype(dtype), rtol=1e-4, atol=1e-4) if x.dtype.kind == "f" else \
                        np.array_equal(got, np.trunc(want).astype(dtype))
                elif x.dtype.kind == "f" and op in ("sum", "prod"):
                    ok = np.allclose(got, expected[lo:hi], rtol=1e-4, atol=1e-4)
                else:
                    ok = np.array_equal(got, expected[lo:hi])
                check(ok, f"reduce_scatter {algorithm} {dtype} {op} n={n}")
            whole = values(n, dtype, 7)  # allgather: the block rule's blocks, then blocks of other lengths
            lo, hi = block(n, p, rank)
            check(np.array_equal(allgather(whole[lo:hi].copy(), np.empty(n, dtype), algorithm=algorithm, comm=comm),
                                 whole), f"allgather {algorithm} {dtype} n={n}")
            sizes = [(n * (r + 1)) % (2 * p + 3) + (n if r == p - 1 else 0) for r in range(p)]
            whole = values(sum(sizes), dtype, 8)
            start = sum(sizes[:rank])
            check(np.array_equal(allgather(whole[start:start + sizes[rank]].copy(), counts=sizes,
                                           algorithm=algorithm, comm=comm), whole),
                  f"allgather {algorithm} {dtype} counts={sizes}")
            for root in range(p):  # broadcast from every root
                mine = values(n, dtype, rank + 100 * root)
                want = values(n, dtype, root + 100 * root)
                check(np.array_equal(broadcast(mine, root, algorithm=algorithm, comm=comm), want),
                      f"broadcast {algorithm} {dtype} n={n} root={root}")

for algorithm in ALGORITHMS:  # reduce_scatter with 16-bit partial blocks between the nodes
    for compression, wire in sorted(WIRES.items()):
        for n in lengths("float32"):
            for op in COMPRESSED_OPS:
                x = values(n, "float32", rank + 11)
                rounded = wire.round(x.copy())
                expected = rounded.copy()
                world.Allreduce(MPI.IN_PLACE, expected, op=MPI_OP[op])
                magnitude = np.abs(rounded).astype(np.float64)
                world.Allreduce(MPI.IN_PLACE, magnitude, op=MPI.SUM)
                lo, hi = block(n, p, rank)
                got = reduce_scatter(x, op=op, algorithm=algorithm, comm=comm, compression=compression)
                want, bound = expected[lo:hi], (p + 2) * wire.unit_roundoff * magnitude[lo:hi] + 2.0 ** -24
                if op == "mean":
                    want, bound = want / np.float32(p), bound / p
                ok = np.array_equal(wire.round(got.copy()), got) and (
                    np.array_equal(got, want) if op in ("max", "min") else bool((np.abs(got - want) <= bound).all()))
                check(ok, f"reduce_scatter {algorithm} compression={compression} {op} n={n}")

failures = [f for fs in world.allgather(failures) for f in fs]
layout = lib.layout
if rank == 0:
    print("\n".join(failures[:20]) if failures else
          f"passed: {cases} cases on {layout.nodes} nodes, ranks per node {layout.ranks_per_node}", flush=True)
comm.Free()
sys.exit(1 if failures else 0)
