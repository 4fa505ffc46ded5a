"""``python -m allreduce_kit.bench --collective reduce_scatter|allgather|broadcast``: each
algorithm of one collective beside MPI's own call, in the allreduce bench's table.

Sizes and bus bandwidth as nccl-tests define them per collective (``doc/PERFORMANCE.md``):

- ``reduce_scatter``: size = the whole buffer each rank passes in (each rank gets size/p back);
  busbw = algbw * (p-1)/p;
- ``allgather``: size = the whole buffer each rank ends with (each rank gives size/p);
  busbw = algbw * (p-1)/p;
- ``broadcast``: size = the buffer; busbw = algbw.

The ``mpi`` row is mpi4py's call made directly (``Reduce_scatter_block``/``Reduce_scatter``,
``Allgather``/``Allgatherv``, ``Bcast``), without the validation every other row pays.
``#wrong`` counts the elements (summed over ranks) that differ from MPI's result; inputs are
small integers, so every order of folding gives the same exact result.
"""
from time import perf_counter
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
from mpi4py import MPI

from .. import compression as wire_formats, online
from ..algorithms.mpi import MPI_OPS
from ..blocks import block, counts
from ..comm import library_comm
from .sweep import Row, local_input
from .timing import batch_for, time_calls

COLLECTIVES = online.COLLECTIVES


def registry(collective: str) -> dict:
    """The collective's ``ALGORITHMS``."""
    return online.spec_of(collective).algorithms


def available(collective: str) -> List[str]:
    """Names ``-a`` accepts for ``collective``: its algorithms, ``auto`` and ``mpi``."""
    return sorted(n for n in registry(collective) if n != "mpi") + ["auto", "mpi"]


def bus_factor(collective: str, p: int) -> float:
    """busbw / algbw (nccl-tests)."""
    return 1.0 if collective == "broadcast" else (p - 1) / p


def chosen(collective: str, lib, nbytes: int, compression: str = "none") -> str:
    """What ``auto`` runs at ``nbytes``: online tuning's winner, else the table's choice (compressed:
    ``compression.choose``'s)."""
    if compression != "none":
        return wire_formats.choose(lib, nbytes)
    tuned = online.spec_of(collective)
    tuner = lib.state.get(("online", tuned.name))
    return tuner.choice(nbytes) if tuner is not None else tuned.table(lib, nbytes)


class Case:
    """One collective at one size: its buffers, MPI's answer, and each algorithm's call. With
    ``compression`` (reduce_scatter), every call but MPI's sends 16-bit values, and is checked
    against MPI's answer rounded to them (the inputs are small integers: exact in 16 bits)."""

    def __init__(self, collective: str, comm: MPI.Intracomm, count: int, dtype: np.dtype, op: str, root: int,
                 compression: str = "none"):
        from .. import allgather, broadcast, reduce_scatter

        self.collective, self.comm, self.op, self.root = collective, comm, op, root
        lib = self.lib = library_comm(comm)
        p, rank = lib.nranks, lib.myrank
        lo, hi = block(count, p, rank)
        if collective == "reduce_scatter":
            self.source = local_input(count, dtype, op, rank)
            self.result = np.empty(hi - lo, dtype)
            expected = self.source.copy()
            lib.Allreduce(MPI.IN_PLACE, expected, op=MPI_OPS["sum" if op == "mean" else op])
            lib.reductions[op].finish(expected)
            self.expected = expected[lo:hi]
            lengths = counts(count, p)
            mpi_op = MPI_OPS["sum" if op == "mean" else op]
            finish = lib.reductions[op].finish
            if min(lengths) == max(lengths):
                self.mpi = lambda: (lib.Reduce_scatter_block(self.source, self.result, mpi_op), finish(self.result))
            else:
                self.mpi = lambda: (lib.Reduce_scatter(self.source, self.result, lengths, mpi_op), finish(self.result))
            self.ours = lambda name: lambda: reduce_scatter(self.source, self.result, op=op, algorithm=name, comm=comm,
                                                            compression=compression)
        elif collective == "allgather":
            self.expected = local_input(count, dtype, "sum", 0)  # the same on every rank
            self.source = self.expected[lo:hi].copy()
            self.result = np.empty(count, dtype)
            lengths = counts(count, p)
            displs = [block(count, p, r)[0] for r in range(p)]
            if min(lengths) == max(lengths):
                self.mpi = lambda: lib.Allgather(self.source, self.result)
            else:
                self.mpi = lambda: lib.Allgatherv(self.source, [self.result, (lengths, displs)])
            self.ours = lambda name: lambda: allgather(self.source, self.result, algorithm=name, comm=comm)
        else:
            self.expected = local_input(count, dtype, "sum", root)
            self.source = local_input(count, dtype, "sum", rank)
            self.result = self.source.copy()
            self.mpi = lambda: lib.Bcast(self.result, root)
            self.ours = lambda name: lambda: broadcast(self.result, root, algorithm=name, comm=comm)

        #: what a call that sent 16-bit values must give
        self.compressed = self.expected if compression == "none" else \
            wire_formats.WIRES[compression].round(self.expected.copy())

    def restore(self) -> None:
        """Before a sample: a broadcast's non-root buffers hold their own values again (the others'
        outputs are overwritten whole by every call)."""
        if self.collective == "broadcast" and self.lib.myrank != self.root:
            np.copyto(self.result, self.source)

    def call(self, name: str) -> Callable[[], object]:
        return self.mpi if name == "mpi" else self.ours(name)

    def wrong(self, name: str = "mpi") -> int:
        """Elements of the last call of ``name`` that differ from what it must give."""
        return int(np.count_nonzero(self.result != (self.expected if name == "mpi" else self.compressed)))


def explore(case: Case, comm: MPI.Intracomm, lib, size: int, call: Callable[[], object], batch: int) -> int:
    """Run ``auto``'s exploring calls at ``size`` (online tuning) until it settles, as the timed
    samples (``timing.time_calls``) will run its choice: in runs of a sample's calls between two
    barriers, each run on a restored input and checked after it (a collective's output is the
    same after every call of a run). Returns the elements this rank's checks found wrong."""
    tuned, wrong = online.spec_of(case.collective), 0
    run = batch if batch > 0 else 1         # the first run, one call, sets the pace
    while online.exploring(lib, size, tuned):
        case.restore()
        comm.Barrier()
        for _ in range(run):
            start = perf_counter()
            call()
            took = perf_counter() - start
            if not online.exploring(lib, size, tuned):
                break
        comm.Barrier()
        wrong += case.wrong("auto")
        if batch <= 0 and run == 1:
            run = batch_for(comm.allreduce(took, op=MPI.MAX))
    return wrong


def sweep(collective: str, comm: MPI.Intracomm, sizes: Sequence[int], dtype: np.dtype, op: str, root: int,
          algorithms: Sequence[str], samples: int, warmup: int, batch: int = 0,
          on_row: Optional[Callable[[Row], None]] = None, compression: str = "none") -> List[Row]:
    """Check then time every algorithm of ``collective`` at every size; every rank returns the
    same rows. ``size`` in a row is nccl-tests' size for the collective (the whole buffer).
    ``compression``: reduce_scatter's, for every algorithm but ``mpi``."""
    lib = library_comm(comm)
    p = lib.nranks
    rows: List[Row] = []
    for size in sizes:
        count = size // dtype.itemsize
        case = Case(collective, comm, count, dtype, op, root, compression)
        timed: Dict[str, Callable[[], object]] = {}
        wrong = []
        for name in algorithms:
            call = timed[name] = case.call(name)
            case.restore()
            call()  # the first call compiles or loads kernels and allocates scratch: untimed
            bad = case.wrong(name)
            if name == "auto" and p > 1 and compression == "none":  # auto's exploration ends before its warm-up
                bad += explore(case, comm, lib, size, call, batch)
            wrong.append(bad)
        wrong = comm.allreduce(np.array(wrong), op=MPI.SUM).tolist()
        times, batches = time_calls(timed, case.restore, comm, samples, warmup, batch)
        for name, bad in zip(algorithms, wrong):
            t = times[name] * 1e6
            median = float(np.median(t))
            algbw = size / median / 1e3 if median > 0 else 0.0
            row = Row(size, count, dtype.name, op if collective == "reduce_scatter" else "none", name,
                      chosen(collective, lib, size, compression) if name == "auto" else name, p, median,
                      float(t.min()), float(t.max()), algbw, algbw * bus_factor(collective, p), int(bad), samples,
                      batches[name], compression="none" if name == "mpi" else compression)
            rows.append(row)
            if on_row:
                on_row(row)
        del case
    return rows
