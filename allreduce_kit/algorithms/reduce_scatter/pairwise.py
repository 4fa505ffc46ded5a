"""Pairwise reduce-scatter: rank r folds every other rank's copy of block r into its own.

On one node, with direct reads (``direct.py``), it is ``two_shot``'s first shot: rank r takes
block r a piece at a time (``direct.PIECE_BYTES``), copies its own copy of the piece into
``out``, reads every peer's copy of it straight out of the peer's ``buf`` and folds it in while
it is still in cache (``direct.fold_from_peers``, the loop ``two_shot`` runs), in the order r+1,
r+2, ... (mod p): the same folds in the same order as ``two_shot``, so block r is bitwise
``two_shot``'s segment r. One wait at the start (every peer has published its buffer) and one
at the end (nobody reads this rank's ``buf`` any more); each rank reads (p-1)/p n once.

Otherwise by messages: in step k (1 .. p-1) rank r sends its copy of block r-k to rank r-k and
receives rank r+k's copy of block r, which it folds in: the same order, the same bits.

A buffer whose length or dtype differs between ranks raises ``ValueError`` on every rank
(``signature.py``): on one node every rank compares every peer's published word before it reads
any, and by messages every rank receives from every other.
"""
from numba import njit

from . import register
from .. import direct
from ...blocks import shard_bounds
from ...kernels import reduce as _loops
from ..signature import BAD, mismatch, sendrecv, tag as signature

TAG = 207
#: Scratch slot of the library's communicator (``LibraryComm.scratch``) used here.
INCOMING = 45


@njit(cache=True, nogil=True)
def _direct(buf, out, lo, state, piece, iov, code, divisor):
    """0, -1 if a read failed, ``direct.MISMATCH`` if the ranks' buffers differ."""
    first = direct.begin(state, buf, TAG)
    if direct.wait_all(state, first) != 0:  # every peer has published its buffer, the same as this one
        return direct.MISMATCH
    isz = buf.itemsize
    start, n = 0, out.size
    while start < n:
        stop = min(start + piece.size, n)
        mine = out[start:stop]
        mine[:] = buf[lo + start:lo + stop]
        if direct.fold_from_peers(state, mine, (lo + start) * isz, piece, iov, code) != 0:
            return -1
        if divisor != 0:
            _loops.divide(mine, divisor)
        start = stop
    return direct.leave(state, first)


@register("pairwise")
def reduce_scatter(comm, buf, out, op):
    p, rank = comm.nranks, comm.myrank
    bounds = shard_bounds(buf.size, p)
    peers = direct.peers_for(comm)
    if peers is not None and op.code is not None:
        done = _direct(buf, out, bounds[rank], peers.state, peers.piece(buf.dtype), peers.iov, op.code, op.divisor)
        if done == direct.MISMATCH:
            raise mismatch(comm, buf, "pairwise", "reduce_scatter", result="out")
        if done != 0:
            raise RuntimeError(f"reduce_scatter(algorithm='pairwise'): reading a peer's buffer failed on rank "
                               f"{rank}; set {direct.ENV}=0 to use messages")
        return
    out[:] = buf[bounds[rank]:bounds[rank + 1]]
    incoming = comm.scratch(out.size, out.dtype, INCOMING)
    tag = signature(buf, TAG)
    for k in range(1, p):
        to, source = (rank - k) % p, (rank + k) % p
        tag = sendrecv(comm, buf[bounds[to]:bounds[to + 1]], to, incoming, source, tag)
        op.combine(out, incoming, k == p - 1)
    if tag & BAD:
        raise mismatch(comm, buf, "pairwise", "reduce_scatter", result="out")
