"""What the bench runs: for each message size, each algorithm checked against MPI, then timed."""
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
from mpi4py import MPI

from .. import kernels
from ..algorithms import ALGORITHMS
from ..algorithms.mpi import MPI_OPS
from ..collective import allreduce
from ..comm import library_comm
from .. import online, selection
from .timing import time_calls


@dataclass
class Row:
    """One line of the table: one message size and one algorithm."""

    size: int          #: bytes per rank
    count: int         #: elements per rank
    dtype: str
    op: str
    algorithm: str     #: as asked for (``auto`` stays ``auto``)
    chosen: str        #: what ran (``auto``'s choice; else the same as ``algorithm``)
    ranks: int
    time_us: float     #: median over samples of the slowest rank's time per call
    min_us: float
    max_us: float
    algbw: float       #: GB/s, size / time
    busbw: float       #: GB/s, algbw * 2 (p-1) / p
    wrong: int         #: elements that differ from MPI's result, summed over ranks
    samples: int
    batch: int         #: calls per timed sample
    explored: int = 0  #: ``auto``'s calls exploring (online tuning) before its warm-up, checked like the first
    trials: Optional[dict] = None  #: ``auto``: what its exploration measured (``online.report``), if it explored

    def as_dict(self) -> dict:
        return asdict(self)


def local_input(count: int, dtype: np.dtype, op: str, rank: int) -> np.ndarray:
    """Small integers (as ``dtype``): every summation order gives the same exact result."""
    rng = np.random.default_rng([count, rank])
    values = rng.choice(np.array([-1, 1]), count) if op == "prod" else rng.integers(-4, 5, count)
    return values.astype(dtype)


def reference(comm: MPI.Intracomm, x: np.ndarray, op: str) -> np.ndarray:
    """MPI's own answer (a mean is MPI's sum divided by p, integers truncating toward zero)."""
    expected = x.copy()
    comm.Allreduce(MPI.IN_PLACE, expected, op=MPI_OPS["sum" if op == "mean" else op])
    if op == "mean":
        kernels.divide(expected, comm.Get_size())
    return expected


def make_call(name: str, buf: np.ndarray, op: str, comm: MPI.Intracomm,
              mpi_direct: bool = True) -> Callable[[], object]:
    """The timed call. ``mpi`` is mpi4py's ``Allreduce`` called directly, without ``allreduce``'s
    validation, so MPI pays no overhead of ours while our algorithms pay all of it; with
    ``mpi_direct=False`` (``--tune``) it goes through ``allreduce`` like the others, as ``auto``
    would call it, so that the candidates compete on equal terms."""
    if name == "mpi" and mpi_direct:
        lib, mpi_op = library_comm(comm), MPI_OPS["sum" if op == "mean" else op]
        if op == "mean":
            red = lib.reductions[op]
            return lambda: (lib.Allreduce(MPI.IN_PLACE, buf, op=mpi_op), red.finish(buf))
        return lambda: lib.Allreduce(MPI.IN_PLACE, buf, op=mpi_op)
    return lambda: allreduce(buf, op=op, algorithm=name, comm=comm)


def sweep(comm: MPI.Intracomm, sizes: Sequence[int], dtype: np.dtype, op: str, algorithms: Sequence[str],
          samples: int, warmup: int, batch: int = 0,
          on_row: Optional[Callable[[Row], None]] = None, mpi_direct: bool = True) -> List[Row]:
    """Check then time every algorithm at every size; every rank returns the same rows."""
    p, rank = comm.Get_size(), comm.Get_rank()
    lib = library_comm(comm)
    rows: List[Row] = []
    for size in sizes:
        count = size // dtype.itemsize
        x = local_input(count, dtype, op, rank)
        expected = reference(lib, x, op)
        buf = np.empty_like(x)
        restore = lambda: np.copyto(buf, x)  # noqa: E731
        timed, wrong, explored = {}, {}, 0
        for name in algorithms:
            call = timed[name] = make_call(name, buf, op, comm, mpi_direct)
            restore()
            call()  # the first call compiles or loads kernels and allocates scratch: untimed
            wrong[name] = int(np.count_nonzero(buf != expected))
            while name == "auto" and online.exploring(lib, size):  # auto's exploration ends before its warm-up
                restore()
                call()
                explored += 1
                wrong[name] += int(np.count_nonzero(buf != expected))
        wrong = dict(zip(algorithms, comm.allreduce(np.array([wrong[n] for n in algorithms]), op=MPI.SUM).tolist()))
        times, batches = time_calls(timed, restore, comm, samples, warmup, batch)
        for name in algorithms:
            t = times[name] * 1e6
            median = float(np.median(t))
            algbw = size / median / 1e3 if median > 0 else 0.0
            chosen = selection.choose_for(lib, size) if name == "auto" else name
            row = Row(size, count, dtype.name, op, name, chosen, p, median, float(t.min()), float(t.max()),
                      algbw, algbw * 2 * (p - 1) / p, wrong[name], samples, batches[name],
                      explored if name == "auto" else 0, online.report(lib, size) if name == "auto" else None)
            rows.append(row)
            if on_row:
                on_row(row)
        del x, expected, buf
    return rows


def available() -> List[str]:
    """Names ``-a`` accepts: every registered algorithm and ``auto``."""
    return sorted(n for n in ALGORITHMS if n != "mpi") + ["auto", "mpi"]


def ratios(rows: Sequence[Row]) -> Dict[int, dict]:
    """Per size: the best of ours (not mpi, not auto), and auto and the best as ratios to mpi."""
    by_size: Dict[int, Dict[str, Row]] = {}
    for row in rows:
        by_size.setdefault(row.size, {})[row.algorithm] = row
    out = {}
    for size, named in by_size.items():
        ours = {n: r for n, r in named.items() if n not in ("mpi", "auto")}
        entry: dict = {}
        if ours:
            best = min(ours.values(), key=lambda r: r.time_us)
            entry.update(best=best.algorithm, best_us=best.time_us)
            if "mpi" in named:
                entry["best_vs_mpi"] = best.time_us / named["mpi"].time_us
            if "auto" in named:
                entry["auto_vs_best"] = named["auto"].time_us / best.time_us
        if "auto" in named and "mpi" in named:
            entry["auto_vs_mpi"] = named["auto"].time_us / named["mpi"].time_us
        for n, r in ours.items():
            if "mpi" in named:
                entry.setdefault("vs_mpi", {})[n] = r.time_us / named["mpi"].time_us
        out[size] = entry
    return out
