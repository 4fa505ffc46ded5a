"""The ring by messages with pieces flowing through it: for links between nodes, kept busy.

``ring`` by messages runs its 2(p-1) steps one after another, each a ``Sendrecv`` (or a chain of
them, one piece at a time): every piece waits for the one before it to cross the link and come
back acknowledged, and every step waits for the slowest rank of the step before. On a network
link that leaves the link idle for a round trip per message and at every step boundary.

Here the same schedule (the same segments, the same folds in the same order, so the same bits)
runs as a stream of pieces. Each segment is cut into ``m`` pieces; unit ``i = k·m + j`` is piece
``j`` of step ``k`` (reduce-scatter steps, then allgather steps). A rank

- keeps up to ``window`` receives posted ahead of the one it waits for (the pieces of the
  reduce-scatter land in a ring of scratch slots, those of the allgather straight in the
  buffer, once the reduce-scatter piece sent from the same place has left);
- sends unit ``i`` as soon as unit ``i - m`` has arrived (and been folded in): that is the piece
  it forwards. The first step's pieces go at once.

So every link carries pieces back to back in both directions, and a slow piece delays only the
pieces behind it, not a whole step. The bytes are the ring's: 2(p-1)/p of the buffer each way
per rank.

The pieces are counted from the buffer's length, so the ranks must agree on it before the first
message: ``allreduce`` first runs one ``Allreduce`` of four integers that makes every rank raise
the same ``ValueError`` if the lengths or dtypes differ (one small round over the network: small
beside the buffers this path is for). ``hierarchical``, which has agreed already, calls
``stream`` directly.

``ring`` takes this path on every communicator that spans nodes, whatever the length: a choice
by length could differ between ranks whose lengths differ, and then some ranks would wait in the
agreement and others in a message that never comes (docs/multinode.md).
"""
from typing import List

import numpy as np
from mpi4py import MPI

from .segments import segments
from .signature import mismatch
from ..kernels import DTYPES

TAG = 111
#: A piece is at most this many bytes ...
PIECE = 256 << 10
#: ... and a segment is cut in at least this many pieces, if they stay at least ``MIN_PIECE``.
MIN_PIECES = 8
MIN_PIECE = 32 << 10
#: Receives posted ahead of the one waited for, at most.
WINDOW = 16


def piece_count(segment_bytes: int) -> int:
    """Pieces a segment of ``segment_bytes`` bytes is cut into (the same on every rank)."""
    if segment_bytes <= MIN_PIECE:
        return 1
    by_size = -(-segment_bytes // PIECE)
    return max(by_size, min(MIN_PIECES, segment_bytes // MIN_PIECE))


def agree(comm, buf: np.ndarray, algorithm: str) -> None:
    """Raise the same ``ValueError`` on every rank of ``comm`` if the ranks' buffers differ."""
    sig = np.array([buf.size, DTYPES.index(buf.dtype), -buf.size, -DTYPES.index(buf.dtype)], np.int64)
    comm.Allreduce(MPI.IN_PLACE, sig, op=MPI.MAX)
    if sig[0] != buf.size or -sig[2] != buf.size or sig[1] != DTYPES.index(buf.dtype) or -sig[3] != sig[1]:
        raise mismatch(comm, buf, algorithm)


def allreduce(comm, buf: np.ndarray, op) -> None:
    """``ring``'s result by the streamed schedule, after agreeing on the buffers (collective)."""
    agree(comm, buf, "ring")
    stream(comm, buf, op)


def _split(seg: np.ndarray, m: int) -> List[np.ndarray]:
    n = seg.size
    return [seg[(j * n) // m:((j + 1) * n) // m] for j in range(m)]


def stream(comm, buf: np.ndarray, op) -> None:
    """The streamed ring on ``comm`` (at least 2 ranks), ranks known to pass alike buffers."""
    p, rank = comm.nranks, comm.myrank
    right, left = (rank + 1) % p, (rank - 1) % p
    seg = segments(buf, p)
    m = piece_count(-(-buf.size // p) * buf.itemsize)  # pieces per segment
    parts = [_split(s, m) for s in seg]
    steps = p - 1
    units = 2 * steps * m
    window = min(units, max(WINDOW, m))
    longest = -(-buf.size // p)  # elements in the longest segment
    largest = -(-longest // m)  # ... and in its longest piece
    scratch = comm.scratch(largest * window, buf.dtype)
    slots = [scratch[w * largest:(w + 1) * largest] for w in range(window)]

    def outgoing(i: int) -> np.ndarray:
        k, j = divmod(i, m)
        s = (rank - k) % p if k < steps else (rank + 1 - (k - steps)) % p
        return parts[s][j]

    def target(i: int) -> np.ndarray:
        """Where unit ``i`` arrives: a scratch slot (reduce-scatter) or the buffer (allgather)."""
        k, j = divmod(i, m)
        if k < steps:
            piece = parts[(rank - k - 1) % p][j]
            return slots[i % window][:piece.size]
        return parts[(rank - (k - steps)) % p][j]

    recvs: List[MPI.Request] = []
    sends: List[MPI.Request] = []
    posted = sent = 0
    base = steps * m  # the first allgather unit
    for done in range(units):
        while sent < units and sent < done + m:  # unit sent - m has arrived: forward it
            sends.append(comm.Isend([outgoing(sent), MPI.BYTE], right, TAG))
            sent += 1
        while posted < units and posted < done + window:
            if posted >= base:  # lands in the buffer, where a reduce-scatter piece may still be leaving
                if posted - base >= sent or (posted > done and not sends[posted - base].Test()):
                    break  # post it later
                sends[posted - base].Wait()
            recvs.append(comm.Irecv([target(posted), MPI.BYTE], left, TAG))
            posted += 1
        recvs[done].Wait()
        k, j = divmod(done, m)
        if k < steps:
            op.combine(parts[(rank - k - 1) % p][j], target(done), k == steps - 1)
    MPI.Request.Waitall(sends)
