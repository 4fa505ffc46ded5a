"""Pairwise allgather: every rank gives its block to every other rank directly.

On one node, with direct writes (``direct.py``), it is ``two_shot``'s second shot: each rank
writes its block straight into every peer's ``out`` (``direct.push_to_peers``, the loop
``two_shot`` runs), one copy per peer and no intermediate buffer. One wait at the start (every
peer has published its ``out``) and one at the end (nobody writes into this rank's ``out`` any
more).

Otherwise by messages: in step k (1 .. p-1) rank r sends its block to rank r+k and receives
rank r-k's.

A call whose ``out`` length, dtype or blocks differ between ranks raises ``ValueError`` on every
rank (``signature.py``): on one node every rank compares every peer's published word before it
writes into any, and by messages every rank receives from every other.
"""
from numba import njit

from . import register
from .. import direct
from .signature import mismatch, tag as signature, word
from ..signature import BAD, sendrecv

TAG = 208


@njit(cache=True, nogil=True)
def _direct(out, lo, hi, state, iov, signed):
    """0, -1 if a write failed, ``direct.MISMATCH`` if the ranks' calls differ (``signed``: this
    rank's word, ``signature.word``)."""
    first = direct.begin_word(state, out, signed)
    if direct.wait_all(state, first) != 0:  # every peer has published its out, the same as this one
        return direct.MISMATCH
    if hi > lo and direct.push_to_peers(state, out[lo:hi], lo * out.itemsize, iov) != 0:
        return -1
    return direct.leave(state, first)


@register("pairwise")
def allgather(comm, out, bounds):
    p, rank = comm.nranks, comm.myrank
    peers = direct.peers_for(comm)
    if peers is not None:
        done = _direct(out, bounds[rank], bounds[rank + 1], peers.state, peers.iov, word(comm, out, bounds, TAG))
        if done == direct.MISMATCH:
            raise mismatch(comm, out, bounds, "pairwise")
        if done != 0:
            raise RuntimeError(f"allgather(algorithm='pairwise'): writing into a peer's buffer failed on rank "
                               f"{rank}; set {direct.ENV}=0 to use messages")
        return
    tag = signature(comm, out, bounds, TAG)
    for k in range(1, p):
        to, source = (rank + k) % p, (rank - k) % p
        tag = sendrecv(comm, out[bounds[rank]:bounds[rank + 1]], to, out[bounds[source]:bounds[source + 1]], source, tag)
    if tag & BAD:
        raise mismatch(comm, out, bounds, "pairwise")
