"""Broadcast by direct reads and writes on one node (``direct.py``): the root's buffer is split
into p blocks (``blocks.shard_bounds``); every other rank r reads every block but block r
straight out of the root's memory, while the root writes block r straight into rank r's
buffer. Every rank copies about (p-1)/p of the buffer, all at once, one copy per byte and no
intermediate buffer: with no more ranks than cores the root's core copies too, where a plain
read by every rank would leave it waiting. The root waits until every rank has its copy.
Across nodes, or where direct reads cannot be used, the binomial tree (``binomial.py``).

A call whose length, dtype or root differs between ranks raises ``ValueError`` on every rank:
each rank publishes a word that holds all three (``signature.keyed_word``); every other rank
compares the root's with its own before it reads, and the root compares every rank's before it
writes, so that ranks that name different roots find each other (the root of each group of
ranks that agree is in the group, and compares with every rank outside it). Nobody leaves
before all have finished (``direct.leave``), so a void reaches every rank.
"""
import numpy as np
from numba import njit

from . import register
from .. import direct
from ..signature import keyed_word, mismatch
from ...blocks import shard_bounds
from .binomial import broadcast as binomial

TAG = 209


@njit(cache=True, nogil=True)
def _direct(buf, root, bounds, state, iov, signed):
    """0, -1 if a transfer failed, ``direct.MISMATCH`` if the ranks' calls differ (``signed``:
    this rank's word)."""
    rank, size = state[0], state[1]
    first = direct.begin_word(state, buf, signed)
    if rank == root:
        if direct.wait_all(state, first) != 0:  # every rank has published its buffer, the same as the root's
            return direct.MISMATCH
        for k in range(1, size):
            peer = (rank + k) % size
            lo, hi = bounds[peer], bounds[peer + 1]
            if hi > lo and direct.push(state, peer, buf[lo:hi], direct.address_of(state, peer) + lo * buf.itemsize,
                                       iov) != 0:
                return -1
    else:
        address = direct.reach(state, root, first)
        if address < 0:
            return direct.MISMATCH
        for k in range(size):
            block = (rank + 1 + k) % size
            lo, hi = bounds[block], bounds[block + 1]
            if block != rank and hi > lo and direct.pull(state, root, buf[lo:hi], address + lo * buf.itemsize,
                                                         iov) != 0:
                return -1
    return direct.leave(state, first)


@register("direct")
def broadcast(comm, buf, root):
    peers = direct.peers_for(comm)
    if peers is None:
        binomial(comm, buf, root)
        return
    bounds = np.asarray(shard_bounds(buf.size, comm.nranks), np.int64)
    done = _direct(buf, root, bounds, peers.state, peers.iov, keyed_word(buf, TAG, (root,)))
    if done == direct.MISMATCH:
        fields = (("buf length", buf.size), ("buf dtype", buf.dtype.name), ("root", root), ("algorithm", "direct"))
        raise mismatch(comm, buf, "direct", "broadcast", fields)
    if done != 0:
        raise RuntimeError(f"broadcast(algorithm='direct'): reading the root's buffer or writing a rank's failed on "
                           f"rank {comm.myrank}; set {direct.ENV}=0 to use messages")
