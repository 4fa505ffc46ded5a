"""What the bench runs: for each message size, each algorithm checked against MPI, then timed."""
from dataclasses import asdict, dataclass
from time import perf_counter
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from .. import compression as wire_formats, kernels
from ..algorithms import ALGORITHMS
from ..algorithms.mpi import MPI_OPS
from ..collective import allreduce
from ..comm import library_comm
from .. import online, selection
from .timing import batch_for, time_calls


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
    compression: str = "none"  #: what the call sent (``mpi``'s row: always its own dtype, ``none``)

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
              mpi_direct: bool = True, compression: str = "none") -> Callable[[], object]:
    """The timed call. ``mpi`` is mpi4py's ``Allreduce`` called directly, without ``allreduce``'s
    validation, so MPI pays no overhead of ours while our algorithms pay all of it; with
    ``mpi_direct=False`` (``--tune``) it goes through ``allreduce`` like the others, as ``auto``
    would call it, so that the candidates compete on equal terms. ``compression`` goes to every
    call but ``mpi``'s, which stays MPI's own uncompressed call: the yardstick."""
    if name == "mpi" and mpi_direct:
        lib, mpi_op = library_comm(comm), MPI_OPS["sum" if op == "mean" else op]
        if op == "mean":
            red = lib.reductions[op]
            return lambda: (lib.Allreduce(MPI.IN_PLACE, buf, op=mpi_op), red.finish(buf))
        return lambda: lib.Allreduce(MPI.IN_PLACE, buf, op=mpi_op)
    if compression != "none" and name != "mpi":
        return lambda: allreduce(buf, op=op, algorithm=name, comm=comm, compression=compression)
    return lambda: allreduce(buf, op=op, algorithm=name, comm=comm)


def sweep(comm: MPI.Intracomm, sizes: Sequence[int], dtype: np.dtype, op: str, algorithms: Sequence[str],
          samples: int, warmup: int, batch: int = 0,
          on_row: Optional[Callable[[Row], None]] = None, mpi_direct: bool = True,
          compression: str = "none") -> List[Row]:
    """Check then time every algorithm at every size; every rank returns the same rows. With
    ``compression``, every algorithm but ``mpi`` sends 16-bit values and is checked against MPI's
    result rounded to them (the inputs are small integers: their sums are exact in 16 bits)."""
    p, rank = comm.Get_size(), comm.Get_rank()
    lib = library_comm(comm)
    rows: List[Row] = []
    for size in sizes:
        count = size // dtype.itemsize
        x = local_input(count, dtype, op, rank)
        expected = reference(lib, x, op)
        compressed = expected if compression == "none" else wire_formats.WIRES[compression].round(expected.copy())
        buf = np.empty_like(x)
        restore = lambda: np.copyto(buf, x)  # noqa: E731
        timed, wrong, explored = {}, {}, 0
        for name in algorithms:
            call = timed[name] = make_call(name, buf, op, comm, mpi_direct, compression)
            restore()
            call()  # the first call compiles or loads kernels and allocates scratch: untimed
            wrong[name] = int(np.count_nonzero(buf != (expected if name == "mpi" else compressed)))
            if name == "auto" and compression == "none":  # auto's exploration ends before its warm-up
                explored, more = explore(comm, lib, size, call, buf, restore, expected, op, batch)
                wrong[name] += more
        wrong = dict(zip(algorithms, comm.allreduce(np.array([wrong[n] for n in algorithms]), op=MPI.SUM).tolist()))
        times, batches = time_calls(timed, restore, comm, samples, warmup, batch)
        for name in algorithms:
            t = times[name] * 1e6
            median = float(np.median(t))
            algbw = size / median / 1e3 if median > 0 else 0.0
            chosen = name
            if name == "auto":
                chosen = selection.choose_for(lib, size) if compression == "none" else wire_formats.choose(lib, size)
            row = Row(size, count, dtype.name, op, name, chosen, p, median, float(t.min()), float(t.max()),
                      algbw, algbw * 2 * (p - 1) / p, wrong[name], samples, batches[name],
                      explored if name == "auto" else 0, online.report(lib, size) if name == "auto" else None,
                      "none" if name == "mpi" else compression)
            rows.append(row)
            if on_row:
                on_row(row)
        del x, expected, buf
    return rows


def explore(comm: MPI.Intracomm, lib, size: int, call: Callable[[], object], buf: np.ndarray,
            restore: Callable[[], object], expected: np.ndarray, op: str, batch: int) -> Tuple[int, int]:
    """Run ``auto``'s exploring calls at ``size`` (online tuning) until it settles; return how
    many ran and the elements they got wrong (this rank's, summed over its checks).

    The calls run as the timed samples (``timing.time_calls``) will run its choice, so that the
    candidates are timed as the samples time them: in runs of as many calls as a sample takes
    (``batch``, else ``timing.batch_for`` the pace of the first call, the slowest rank's), each
    run on a freshly restored input (where ranks read each other's buffers, a call can cost
    more when its input was just written), with nothing but the calls between two barriers
    (a rank's checks or restores, on a shared core, would be timed in the others' calls).

    Every call is checked, after its run: the first call of a run reduces the restored input,
    each later one a result every rank holds alike, exactly (``again``), so the run's last result
    must be what MPI's result becomes after its calls, and a wrong value in any call of the run
    is carried into it (a sum adds it in, a product multiplies it in). Where a wrong value might
    not be carried (max, min) or a value may round (a mean, or past the dtype's exact
    integers), runs are shorter, down to one call."""
    p = comm.Get_size()
    calls = wrong = 0
    paced = batch > 0
    chain = results_in_a_row(expected, op, p, batch) if paced else [expected]  # the first run, one call, sets the pace
    while online.exploring(lib, size):
        restore()
        comm.Barrier()
        made = 0
        for _ in range(len(chain)):
            start = perf_counter()
            call()
            took = perf_counter() - start
            made += 1
            if not online.exploring(lib, size):
                break
        comm.Barrier()
        calls += made
        wrong += int(np.count_nonzero(buf != chain[made - 1]))
        if not paced:
            chain, paced = results_in_a_row(expected, op, p, batch_for(comm.allreduce(took, op=MPI.MAX))), True
    return calls, wrong


def again(result: np.ndarray, op: str, p: int) -> Optional[np.ndarray]:
    """What an allreduce over ``p`` ranks makes of ``result`` held alike on every rank, where every
    order of folding gives it exactly and a wrong value on one rank would change it; else ``None``
    (a mean, which may round; max and min, where a wrong value may be folded away; values past
    the dtype's exact integers)."""
    if op not in ("sum", "prod"):
        return None
    kind = result.dtype
    limit = 2.0 ** (np.finfo(kind).nmant + 1) if kind.kind == "f" else float(np.iinfo(kind).max)
    largest = float(np.abs(result.astype(np.float64)).max(initial=0.0))
    if (largest ** p if op == "prod" else largest * p) > limit:
        return None
    return result ** p if op == "prod" else result * result.dtype.type(p)


def results_in_a_row(expected: np.ndarray, op: str, p: int, most: int) -> List[np.ndarray]:
    """What each of 1 to ``most`` calls in a row on the restored input gives (the first gives
    ``expected``), as far as each later call's result is known exactly (``again``): the length
    of ``explore``'s runs, and what the last call of a run must give."""
    chain = [expected]
    while len(chain) < most:
        following = again(chain[-1], op, p)
        if following is None:
            break
        chain.append(following)
    return chain


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
