"""Each rank's clock offset to rank 0's, measured with MPI messages.

Rank 0 exchanges ``rounds`` ping-pongs with each other rank in turn: it reads its clock (t0),
sends, the peer replies with its own clock's reading (tr), rank 0 reads its clock again (t1).
The peer read ``tr`` somewhere between t0 and t1 on rank 0's clock, so its offset (its clock
minus rank 0's) lies in ``[tr - t1, tr - t0]``. Every round gives such an interval; the offset
lies in all of them, so in their intersection, whose middle is the estimate and whose half
width the uncertainty: at most half the shortest round trip, and less where rounds delayed on
different legs pin it from both sides. Measured at the start and at the end of a run, the two
offsets give the drift between them, corrected linearly (``Alignment.to_reference``).

The ranks not being measured wait asleep (``_wait_asleep``), before their turn and after it
until rank 0 has measured every rank: where ranks share cores, a rank that spins in a blocking
receive takes a core from the two whose round trips set the bound.
"""
import time
from dataclasses import dataclass
from typing import Callable, List, Optional

import numpy as np
from mpi4py import MPI

#: Ping-pongs per rank and measurement: at least ``ROUNDS``, then more until the offset is known
#: within ``TARGET_NS`` (the intersection's width) or ``MAX_ROUNDS`` or ``MAX_NS`` per rank are spent.
ROUNDS = 16
MAX_ROUNDS = 400
TARGET_NS = 4_000
MAX_NS = 50_000_000
_TAG = 48
#: Seconds between checks of a rank waiting asleep for its turn or for the end.
_NAP = 0.0002


@dataclass(frozen=True)
class Sample:
    """One measurement of every rank's offset (on rank 0; indexed by rank, in ns)."""

    at: np.ndarray       # the peer's clock reading of the last round, on the peer's clock
    offset: np.ndarray   # peer clock minus rank 0's clock
    spread: np.ndarray   # the width of the interval the offset is known to lie in


def measure(comm: MPI.Intracomm, clock: Callable[[], int]) -> Optional["Sample"]:
    """Every rank's offset to rank 0 (collective); the ``Sample`` on rank 0, ``None`` elsewhere."""
    p, rank = comm.Get_size(), comm.Get_rank()
    ping = np.ones(1, dtype=np.int64)            # 1: reply; 0: done
    pong = np.zeros(1, dtype=np.int64)
    if rank != 0:
        _wait_asleep(comm, ping)                 # this rank's turn
        while ping[0] != 0:
            pong[0] = clock()
            comm.Send(pong, dest=0, tag=_TAG)
            comm.Recv(ping, source=0, tag=_TAG)
        _wait_asleep(comm, ping)                 # every rank measured
        return None
    at = np.zeros(p, dtype=np.int64)
    offset = np.zeros(p, dtype=np.float64)
    spread = np.zeros(p, dtype=np.int64)
    at[0] = clock()
    for peer in range(1, p):
        low, high, shortest = None, None, None    # the intersection so far; the shortest round
        began, rounds = clock(), 0
        ping[0] = 1
        while True:
            t0 = clock()
            comm.Send(ping, dest=peer, tag=_TAG)
            comm.Recv(pong, source=peer, tag=_TAG)
            t1 = clock()
            rounds += 1
            tr = int(pong[0])
            low = tr - t1 if low is None else max(low, tr - t1)
            high = tr - t0 if high is None else min(high, tr - t0)
            if shortest is None or t1 - t0 < shortest[1] - shortest[0]:
                shortest = (tr - t1, tr - t0)
            if rounds >= ROUNDS and (high - low <= TARGET_NS or rounds >= MAX_ROUNDS or t1 - began > MAX_NS):
                break
        ping[0] = 0
        comm.Send(ping, dest=peer, tag=_TAG)
        if low > high:       # the intervals disagree (a clock stepped): the shortest round alone
            low, high = shortest
        at[peer], offset[peer], spread[peer] = tr, (low + high) / 2, high - low
    for peer in range(1, p):
        comm.Send(ping, dest=peer, tag=_TAG)
    return Sample(at, offset, spread)


def _wait_asleep(comm: MPI.Intracomm, buf: np.ndarray) -> None:
    """Receive rank 0's next word into ``buf``, sleeping between checks instead of spinning."""
    request = comm.Irecv(buf, source=0, tag=_TAG)
    while not request.Test():
        time.sleep(_NAP)


@dataclass(frozen=True)
class Alignment:
    """Offsets at the start and the end: maps a rank's clock onto rank 0's."""

    start: Sample
    end: Sample

    def to_reference(self, rank: int, ns: np.ndarray) -> np.ndarray:
        """Rank ``rank``'s clock readings ``ns`` on rank 0's clock: the offset interpolated
        linearly between the two measurements (and extrapolated beyond them)."""
        a0, a1 = self.start.at[rank], self.end.at[rank]
        o0, o1 = self.start.offset[rank], self.end.offset[rank]
        ns = np.asarray(ns, dtype=np.float64)
        if a1 == a0:
            return ns - o0
        return ns - (o0 + (o1 - o0) * (ns - a0) / (a1 - a0))

    def uncertainty_us(self) -> List[float]:
        """Per rank: the most its offset can be off (the larger half width of the two
        measurements' intervals), in us."""
        return [float(max(a, b)) / 2e3 for a, b in zip(self.start.spread, self.end.spread)]

    def drift_ppm(self) -> List[float]:
        """Per rank: how fast its clock runs against rank 0's, parts per million."""
        span = (self.end.at - self.start.at).astype(np.float64)
        span[span == 0] = 1.0
        return [float(d) for d in (self.end.offset - self.start.offset) / span * 1e6]

    def metadata(self) -> dict:
        """What the trace file's metadata says of the alignment."""
        return {"method": "MPI ping-pongs with rank 0 at the start and the end, intersection of the rounds' intervals; drift corrected linearly",
                "rounds": [ROUNDS, MAX_ROUNDS], "target_us": TARGET_NS / 1e3,
                "offset_start_us": [float(o) / 1e3 for o in self.start.offset],
                "offset_end_us": [float(o) / 1e3 for o in self.end.offset],
                "drift_ppm": self.drift_ppm(),
                "uncertainty_us": self.uncertainty_us()}
