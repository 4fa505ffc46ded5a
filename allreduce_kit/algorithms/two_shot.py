"""Two-shot allreduce: each rank reduces its own segment from every rank's copy, then every rank
gets every finished segment.

The buffer is cut into p segments as in ``ring``. Rank r owns segment r: it folds every other
rank's copy of segment r into its own, in the order r+1, r+2, ... (mod p), and the finished
segment goes to every rank. Each rank receives 2(p-1)/p of the buffer, as in the ring, but a
segment is reduced by one rank straight from the inputs, not passed along the ring as partial
sums. The name is the one GPU libraries use for the same two phases (PyTorch's
``two_shot_all_reduce``, TensorRT-LLM's two-shot allreduce).

On one node, with direct reads and writes (``direct.py``), that saves memory traffic, which is
what limits a large allreduce when ranks share cores. Rank r takes its segment 256 KiB at a
time: it reads the piece from all p-1 peers, folding each into its own copy while that stays
in cache, and then writes the finished piece, still in cache, into all p-1 peers' buffers. Per
rank and call, with s = n/p: (p-1) s read from peers, s read and written in its own buffer,
(p-1) s written into peers, 2p s in all. The ring's reduce-scatter reads the left neighbour's
partial sum, reads its own segment and writes the sum back at every step, and its allgather
reads and writes each segment again: (5p-5) s, 35 s against 16 s at p = 8. There is also only
one point where a rank waits on others (all have published their buffers) and one at the end,
not 2(p-1) links of a chain (docs/performance.md).

Without direct reads it runs by messages: reduce-scatter by pairwise exchange (step k: send the
segment of rank r-k to it, receive rank r+k's copy of segment r and fold it in), then allgather
by pairwise exchange. Same folds in the same order, so the same bits as on one node.

The schedule is written twice, as a compiled direct loop and as messages: why, in ``direct.py``.
"""
from numba import njit

from . import direct, pieces, register
from ..kernels import reduce as _loops
from .segments import bounds_array, segment_pieces, segments
from .signature import BAD, mismatch, sendrecv, tag as signature

TAG = 106


@njit(cache=True, nogil=True)
def _direct(buf, bounds, state, piece, iov, code, divisor):
    """Two-shot with direct reads and writes; 0, -1 if a read or write failed,
    ``direct.MISMATCH`` if the ranks' buffers differ (found before any read or write).

    Rank r takes segment r a piece at a time: it reads every peer's copy of the piece and folds
    it in, then writes the finished piece into every peer's buffer. Counters, from ``first``:
    rank r has published its buffer (``first``), has written all of segment r into every peer
    (``first + 1``). Nothing is overwritten while someone may still read it: segment r of
    rank q's buffer is read by rank r alone, which writes the finished piece there only after
    reading q's copy of it; rank r writes its own segment r, which nobody else reads; and a
    rank returns only once every rank has reached ``first + 1``, so has finished reading from it
    and writing into it.
    """
    rank = state[0]
    first = direct.begin(state, buf, TAG)
    if direct.wait_all(state, first) != 0:  # every peer has published its buffer, the same as this one
        return direct.MISMATCH
    isz = buf.itemsize
    start, end = bounds[rank], bounds[rank + 1]
    while start < end:
        stop = min(start + piece.size, end)
        mine = buf[start:stop]
        if direct.fold_from_peers(state, mine, start * isz, piece, iov, code) != 0:  # reduce-scatter
            return -1
        if divisor != 0:
            _loops.divide(mine, divisor)
        if direct.push_to_peers(state, mine, start * isz, iov) != 0:  # allgather: the piece, still in cache
            return -1
        start = stop
    return direct.leave(state, first)


@register("two_shot")
def allreduce(comm, buf, op):
    p, rank = comm.nranks, comm.myrank
    if direct.run(_direct, comm, buf, op, bounds_array(buf.size, p), "two_shot"):
        return
    seg = segments(buf, p)
    parts = segment_pieces(buf, comm)
    tag = signature(buf, TAG)
    for k in range(1, p):  # reduce-scatter
        to, source = (rank - k) % p, (rank + k) % p
        tag = pieces.sendrecv_combine(comm, seg[to], to, seg[rank], source, tag, op, k == p - 1, parts)
    for k in range(1, p):  # allgather
        tag = sendrecv(comm, seg[rank], (rank + k) % p, seg[(rank - k) % p], (rank - k) % p, tag)
    if tag & BAD:
        raise mismatch(comm, buf, "two_shot")
