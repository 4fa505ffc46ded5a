"""The least time a one-node reduce-scatter, allgather or broadcast can take here, beside MPI's
own call and ``auto``: what bounds the speed-up over MPI once MPI itself copies each byte once.

    mpiexec -n 2 python benchmarks/copy_bound.py --sizes 16M 64M --repeats 5

Every rank of a one-node collective must end with bytes that other ranks hold: (p-1)/p of the
buffer for reduce-scatter (read, then folded in) and allgather (written into ``out``); for
broadcast, the p-1 other ranks need the whole buffer, (p-1) n bytes in all, which p ranks can
share at best as (p-1)/p each. So no algorithm finishes before every rank has copied (p-1)/p n
bytes at once, each between two arrays of its own memory, the fastest copy there is (reading
another process's memory, by ``process_vm_readv`` or a shared window, is not faster). That
copy is the ``floor``. Per size it prints, as medians over ``--repeats`` samples (each sample
the slowest rank's time), the floor, MPI's call and ``auto``'s, and ``floor / MPI``: the least
fraction of MPI's time any algorithm can reach. Where that is above a target ratio, the target
cannot be met on this machine.

The floor pretends the bytes are already in the rank's own memory. They are in another
process's, and there are two ways to get them out of it: one copy by the kernel
(``process_vm_readv``, MPI's "CMA" path and ``pairwise``'s), timed as ``cma`` (every rank reading
its (p-1)/p n out of its peers' buffers at once), or two copies through memory the ranks share
(each byte copied in by its owner, then out by the others), at least a copy of n bytes per rank
at once, timed as ``staged``. For allgather and broadcast, whose ranks only move bytes, no
algorithm can beat the faster of the two: ``bound / MPI`` is the least fraction of MPI's time
they can reach with ``buf`` and ``out`` in the ranks' own memory, with ``bound`` ``min(cma,
staged)`` for broadcast and, for allgather, whose ranks also copy their own block into ``out``
(``own``), ``min(own + cma, staged)``. A reduce-scatter's folds read the bytes where they lie,
so its ``bound`` is the floor.
"""
import argparse
import ctypes
import json
import os
import sys
import time

import numpy as np
from mpi4py import MPI

import allreduce_kit as ak
from allreduce_kit.bench.__main__ import parse_bytes


#: Untimed calls of ``auto`` before its samples: its first calls of a size take turns among its
#: candidates (online tuning, docs/auto.md) until it settles on one.
SETTLE = 30


def slowest(comm, run, repeats: int, warmup: int = 1) -> float:
    """Median over ``repeats`` of the slowest rank's time of ``run()`` (after a barrier), in ms,
    after ``warmup`` untimed calls."""
    for _ in range(warmup):
        run()
    samples = []
    for _ in range(repeats):
        comm.Barrier()
        start = time.perf_counter()
        run()
        samples.append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    return float(np.median(samples)) * 1e3


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


def cma_reader(comm, source: np.ndarray, target: np.ndarray):
    """A function that fills ``target`` (this rank's (p-1)/p of the buffer, ``floor``'s length) with
    each peer's block of its ``source`` (the whole buffer) by ``process_vm_readv``, a block per
    peer; None where the ranks cannot read each other's memory."""
    libc = ctypes.CDLL(None, use_errno=True)
    read = libc.process_vm_readv
    read.restype = ctypes.c_ssize_t
    read.argtypes = [ctypes.c_int, ctypes.POINTER(_IOVec), ctypes.c_ulong, ctypes.POINTER(_IOVec), ctypes.c_ulong,
                     ctypes.c_ulong]
    p, rank = comm.Get_size(), comm.Get_rank()
    peers = comm.allgather((os.getpid(), source.ctypes.data))
    bounds = ak.shard_bounds(source.size, p)
    calls, at = [], 0
    for q in range(p):
        if q == rank:
            continue
        length = (bounds[q + 1] - bounds[q]) * source.itemsize
        local = _IOVec(target.ctypes.data + at, length)
        remote = _IOVec(peers[q][1] + bounds[q] * source.itemsize, length)
        calls.append((peers[q][0], local, remote, length))
        at += length
    if at > target.nbytes:
        raise ValueError("cma_reader: target is shorter than the peers' blocks")

    def run(keep=(source, target)) -> None:   # the arrays live as long as the reads do
        for pid, local, remote, length in calls:
            if read(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) != length:
                raise OSError(ctypes.get_errno(), "process_vm_readv")
    try:
        run()
        ok = True
    except OSError:
        ok = False
    return run if all(comm.allgather(ok)) else None


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", type=parse_bytes, default=[16 << 20, 64 << 20],
                        help="buffer sizes in bytes (K, M, G suffixes)")
    parser.add_argument("--repeats", type=positive, default=5, help="samples per figure (the median is printed)")
    parser.add_argument("--json", help="also write the rows as JSON to this path")
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    p, rank = comm.Get_size(), comm.Get_rank()
    rows = []
    for nbytes in args.sizes:
        n = max(nbytes // 4, 1)
        lo, hi = ak.blocks.block(n, p, rank)
        share = (p - 1) * n // p
        source, target = np.ones(share, np.float32), np.zeros(share, np.float32)
        buf, out, whole = np.ones(n, np.float32), np.empty(hi - lo, np.float32), np.empty(n, np.float32)
        floor = slowest(comm, lambda: np.copyto(target, source), args.repeats)
        staged = slowest(comm, lambda: np.copyto(whole, buf), args.repeats)
        own = slowest(comm, lambda: np.copyto(out, buf[lo:hi]), args.repeats)
        read = cma_reader(comm, buf, np.zeros(n - (hi - lo), np.float32))   # the peers' blocks, end to end
        cma = slowest(comm, read, args.repeats) if read is not None else float("inf")
        lengths = [b - a for a, b in zip(ak.shard_bounds(n, p), ak.shard_bounds(n, p)[1:])]
        even = min(lengths) == max(lengths)  # MPI's calls as the bench makes them
        calls = {
            "reduce_scatter": (lambda: ak.reduce_scatter(buf, out),
                               (lambda: comm.Reduce_scatter_block(buf, out)) if even else
                               (lambda: comm.Reduce_scatter(buf, out, lengths))),
            "allgather": (lambda: ak.allgather(out, whole),
                          (lambda: comm.Allgather(out, whole)) if even else
                          (lambda: comm.Allgatherv(out, [whole, lengths]))),
            "broadcast": (lambda: ak.broadcast(whole, 0), lambda: comm.Bcast(whole, 0)),
        }
        for name, (ours, theirs) in calls.items():
            mpi, auto = slowest(comm, theirs, args.repeats), slowest(comm, ours, args.repeats, SETTLE)
            bound = {"reduce_scatter": floor, "allgather": min(own + cma, staged), "broadcast": min(cma, staged)}[name]
            rows.append({"collective": name, "bytes": n * 4, "ranks": p, "floor_ms": floor, "cma_ms": cma,
                         "staged_ms": staged, "own_ms": own, "mpi_ms": mpi, "auto_ms": auto, "floor_over_mpi": floor / mpi,
                         "bound_over_mpi": bound / mpi, "auto_over_mpi": auto / mpi})
    if rank == 0:
        sys.stdout.write(f"# {p} ranks, {MPI.Get_library_version().splitlines()[0]}\n"
                         f"{'collective':>15} {'bytes':>10} {'floor ms':>9} {'cma ms':>9} {'staged ms':>9} "
                         f"{'mpi ms':>9} {'auto ms':>9} {'floor/mpi':>9} {'bound/mpi':>9} {'auto/mpi':>9}\n")
        for row in rows:
            sys.stdout.write(f"{row['collective']:>15} {row['bytes']:>10} {row['floor_ms']:9.2f} {row['cma_ms']:9.2f} "
                             f"{row['staged_ms']:9.2f} {row['mpi_ms']:9.2f} {row['auto_ms']:9.2f} "
                             f"{row['floor_over_mpi']:9.2f} {row['bound_over_mpi']:9.2f} {row['auto_over_mpi']:9.2f}\n")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
