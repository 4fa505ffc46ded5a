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
from typing import Sequence

import numpy as np
from numba import njit

from . import register
from .. import direct
from ...blocks import shard_bounds
from ...kernels import reduce as _loops
from ..signature import BAD, dtype_code, mismatch, sendrecv, tag as signature

TAG = 207
#: The code the parts form (``parts``) publishes in its word where the flat form publishes
#: ``TAG``: a rank in one form and a rank in the other void the call instead of reading each
#: other's addresses as data.
PARTS = 215
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


@njit(cache=True, nogil=True)
def _direct_parts(addresses, offsets, out, lo, state, piece, iov, code, divisor, tables):
    """``_direct`` over a buffer held in parts (``direct.pull_parts``): each rank publishes the
    addresses of its parts, every peer's are read first (into ``tables[peer]``), then the same
    pieces, folds and order as ``_direct``, so the block is bitwise ``_direct``'s on the parts
    laid end to end."""
    first = direct.begin_word(state, addresses, (offsets[-1] << 10) | ((PARTS & 255) << 2) | dtype_code(out))
    if direct.wait_all(state, first) != 0:
        return direct.MISMATCH
    rank, size = state[0], state[1]
    tables[rank, :] = addresses
    for k in range(1, size):
        peer = (rank + k) % size
        if direct.pull(state, peer, tables[peer], direct.address_of(state, peer), iov) != 0:
            return -1
    start, n = 0, out.size
    while start < n:
        stop = min(start + piece.size, n)
        mine, theirs = out[start:stop], piece[:stop - start]
        if direct.pull_parts(state, rank, mine, lo + start, offsets, addresses, iov) != 0:
            return -1
        for k in range(1, size):
            peer = (rank + k) % size
            if direct.pull_parts(state, peer, theirs, lo + start, offsets, tables[peer], iov) != 0:
                return -1
            _loops.combine(mine, theirs, code)
        if divisor != 0:
            _loops.divide(mine, divisor)
        start = stop
    return direct.leave(state, first)


def parts(comm, arrays: Sequence[np.ndarray], out: np.ndarray, op) -> bool:
    """Block r of the reduction of ``arrays`` laid end to end (1-D, C-contiguous, one dtype, the
    same lengths in the same order on every rank) into ``out``, read straight out of every
    rank's arrays, without copying them into one buffer first; ``False`` (nothing done) where
    ``comm``'s ranks cannot read each other's memory or ``op`` has no compiled kernel: the caller
    then lays the arrays out in one buffer and calls ``reduce_scatter``. Collective; every rank
    gets the same answer."""
    peers = direct.peers_for(comm)
    if peers is None or op.code is None:
        return False
    offsets = np.zeros(len(arrays) + 1, np.int64)
    np.cumsum([a.size for a in arrays], out=offsets[1:])
    addresses = np.array([a.ctypes.data for a in arrays], np.int64)
    tables = np.empty((comm.nranks, len(arrays)), np.int64)
    lo = shard_bounds(int(offsets[-1]), comm.nranks)[comm.myrank]
    done = _direct_parts(addresses, offsets, out, lo, peers.state, peers.piece(out.dtype), peers.iov, op.code,
                         op.divisor, tables)
    if done == direct.MISMATCH:
        raise ValueError(f"reduce_scatter: the parts' total length or dtype differs between ranks "
                         f"(rank {comm.myrank}: {int(offsets[-1])} x {out.dtype})")
    if done != 0:
        raise RuntimeError(f"reduce_scatter(algorithm='pairwise'): reading a peer's buffer failed on rank "
                           f"{comm.myrank}; set {direct.ENV}=0 to use messages")
    return True
