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
"""
import argparse
import json
import sys
import time

import numpy as np
from mpi4py import MPI

import allreduce_kit as ak
from allreduce_kit.bench.__main__ import parse_bytes


def slowest(comm, run, repeats: int) -> float:
    """Median over ``repeats`` of the slowest rank's time of ``run()`` (after a barrier), in ms."""
    run()
    samples = []
    for _ in range(repeats):
        comm.Barrier()
        start = time.perf_counter()
        run()
        samples.append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    return float(np.median(samples)) * 1e3


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
            mpi, auto = slowest(comm, theirs, args.repeats), slowest(comm, ours, args.repeats)
            rows.append({"collective": name, "bytes": n * 4, "ranks": p, "floor_ms": floor, "mpi_ms": mpi,
                         "auto_ms": auto, "floor_over_mpi": floor / mpi, "auto_over_mpi": auto / mpi})
    if rank == 0:
        sys.stdout.write(f"# {p} ranks, {MPI.Get_library_version().splitlines()[0]}\n"
                         f"{'collective':>15} {'bytes':>10} {'floor ms':>9} {'mpi ms':>9} {'auto ms':>9} "
                         f"{'floor/mpi':>9} {'auto/mpi':>9}\n")
        for row in rows:
            sys.stdout.write(f"{row['collective']:>15} {row['bytes']:>10} {row['floor_ms']:9.2f} {row['mpi_ms']:9.2f} "
                             f"{row['auto_ms']:9.2f} {row['floor_over_mpi']:9.2f} {row['auto_over_mpi']:9.2f}\n")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
