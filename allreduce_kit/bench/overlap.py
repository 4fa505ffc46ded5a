"""``--overlap``: how much of a nonblocking allreduce hides behind computation.

Per method, three things are timed, each as the slowest rank's time from a barrier to its end:
the computation alone (numpy work calibrated to ``compute_ms``), the collective alone (started,
then waited for at once), and both (the collective started, the computation run, then the
collective waited for). ``ratio`` = both / the longer of the two alone: 1.0 is perfect overlap,
and (compute + collective) / longer is no overlap at all.

Methods: ``iallreduce(algorithm=NAME)``, the library's nonblocking call (its progress thread
runs the algorithm), and ``mpi``: MPI's own ``Iallreduce``, whose progress happens inside MPI
calls, so the computation calls ``Test`` on it between its pieces (about every
``POLL_MS`` ms). The samples of the methods and of the three timings take turns, so a machine
that gets busier during the run slows each alike.
"""
import time
from typing import Callable, Dict, List, Optional

import numpy as np
from mpi4py import MPI

from ..comm import library_comm
from ..nonblocking import iallreduce

#: The computation is run in pieces of about this many milliseconds (``mpi``: ``Test`` between them).
POLL_MS = 0.5
#: MPI's op for each of ours (``mean``: MPI's sum, the same traffic)
_MPI_OPS = {"sum": MPI.SUM, "mean": MPI.SUM, "prod": MPI.PROD, "max": MPI.MAX, "min": MPI.MIN}


class Compute:
    """Numpy work on arrays that stay in cache, run in pieces: ``run(poll)`` calls ``poll()``
    between pieces. ``pieces`` is calibrated once on every rank, then agreed (the mean)."""

    def __init__(self, comm: MPI.Intracomm, milliseconds: float):
        self.a = np.random.default_rng(comm.Get_rank()).random(16384, dtype=np.float32)
        self.b = np.empty_like(self.a)
        self.pieces, self.steps = 1, 1
        self.steps = self._steps_per(POLL_MS)
        one = min(self._seconds(8) for _ in range(3)) / 8  # the least disturbed of three
        mine = max(1, round(milliseconds / 1e3 / one))
        self.pieces = max(1, round(comm.allreduce(mine) / comm.Get_size()))

    def _piece(self) -> None:
        a, b = self.a, self.b
        for _ in range(self.steps):
            np.multiply(a, 1.000001, out=b)
            np.add(b, 1e-6, out=a)

    def run(self, poll: Optional[Callable[[], object]] = None) -> None:
        for _ in range(self.pieces):
            self._piece()
            if poll is not None:
                poll()

    def _seconds(self, pieces: int) -> float:
        started = time.perf_counter()
        for _ in range(pieces):
            self._piece()
        return time.perf_counter() - started

    def _steps_per(self, milliseconds: float) -> int:
        self._seconds(4)
        one = min(self._seconds(20) for _ in range(3)) / 20
        return max(1, round(milliseconds / 1e3 / one))


def _slowest(comm: MPI.Intracomm, run: Callable[[], None]) -> float:
    comm.Barrier()
    started = time.perf_counter()
    run()
    return comm.allreduce(time.perf_counter() - started, op=MPI.MAX)


def measure(comm: MPI.Intracomm, nbytes: int, dtype: np.dtype, op: str, names: List[str], compute_ms: float,
            samples: int, warmup: int, stall_timeout: Optional[float] = None) -> List[Dict]:
    """One row per method in ``names`` (``mpi``, or an algorithm for ``iallreduce``): median
    seconds of the compute alone, the collective alone and both, and the ratio. Collective."""
    count = max(1, nbytes // dtype.itemsize)
    buf = np.ones(count, dtype=dtype)
    compute = Compute(comm, compute_ms)
    lib = library_comm(comm)

    def start(name: str):
        if name == "mpi":
            request = lib.Iallreduce(MPI.IN_PLACE, buf, op=_MPI_OPS[op])
            return request.Wait, request.Test
        handle = iallreduce(buf, op=op, algorithm=name, comm=comm, stall_timeout=stall_timeout)
        return handle.wait, handle.test

    def collective(name: str) -> None:
        wait, _ = start(name)
        wait()

    def both(name: str) -> None:
        wait, test = start(name)
        compute.run(test if name == "mpi" else None)
        wait()

    kinds = {"compute": lambda name: compute.run(), "collective": collective, "both": both}
    times: Dict[str, Dict[str, List[float]]] = {name: {kind: [] for kind in kinds} for name in names}
    for sample in range(warmup + samples):
        order = names[sample % len(names):] + names[:sample % len(names)]
        for name in order:
            for kind, run in kinds.items():
                buf[:] = 1
                seconds = _slowest(comm, lambda: run(name))
                if sample >= warmup:
                    times[name][kind].append(seconds)
    rows = []
    for name in names:
        median = {kind: float(np.median(values)) for kind, values in times[name].items()}
        longer = max(median["compute"], median["collective"])
        rows.append(dict(method="MPI Iallreduce, polled" if name == "mpi" else f"iallreduce(algorithm={name!r})",
                         algorithm=name, size=count * dtype.itemsize, ranks=comm.Get_size(),
                         compute_ms=median["compute"] * 1e3, collective_ms=median["collective"] * 1e3,
                         both_ms=median["both"] * 1e3, ratio=median["both"] / longer,
                         no_overlap_ratio=(median["compute"] + median["collective"]) / longer))
    return rows


HEADER = (f"# {'method':>34} {'size':>10} {'compute ms':>11} {'collective ms':>14} {'both ms':>9} "
          f"{'ratio':>6} {'serial':>7}")


def line(row: Dict) -> str:
    """One row: ``ratio`` is both / the longer alone; ``serial`` the ratio with no overlap at all."""
    return (f"  {row['method']:>34} {row['size']:>10} {row['compute_ms']:>11.2f} {row['collective_ms']:>14.2f} "
            f"{row['both_ms']:>9.2f} {row['ratio']:>6.2f} {row['no_overlap_ratio']:>7.2f}")
