"""Broadcast by direct reads on one node: every rank reads the root's buffer straight out of its
memory (``direct.py``), one copy each, all at once; the root waits until all have. Across nodes,
or where direct reads cannot be used, the binomial tree (``binomial.py``).

A call whose length, dtype or root differs between ranks raises ``ValueError`` on every rank:
each rank publishes a word that holds all three (``signature.keyed_word``); every other rank
compares the root's with its own before it reads, and the root compares every rank's, so that
ranks that name different roots find each other (the root of each group of ranks that agree
is in the group, and compares with every rank outside it). Nobody leaves before all have
finished (``direct.leave``), so a void reaches every rank.
"""
from numba import njit

from . import register
from .. import direct
from ..signature import keyed_word, mismatch
from .binomial import broadcast as binomial

TAG = 209


@njit(cache=True, nogil=True)
def _direct(buf, root, state, iov, signed):
    """0, -1 if a read failed, ``direct.MISMATCH`` if the ranks' calls differ (``signed``: this
    rank's word)."""
    first = direct.begin_word(state, buf, signed)
    if state[0] != root:
        address = direct.reach(state, root, first)
        if address < 0:
            return direct.MISMATCH
        if direct.pull(state, root, buf, address, iov) != 0:
            return -1
    elif direct.wait_all(state, first) != 0:
        return direct.MISMATCH
    return direct.leave(state, first)


@register("direct")
def broadcast(comm, buf, root):
    peers = direct.peers_for(comm)
    if peers is None:
        binomial(comm, buf, root)
        return
    done = _direct(buf, root, peers.state, peers.iov, keyed_word(buf, TAG, (root,)))
    if done == direct.MISMATCH:
        fields = (("buf length", buf.size), ("buf dtype", buf.dtype.name), ("root", root), ("algorithm", "direct"))
        raise mismatch(comm, buf, "direct", "broadcast", fields)
    if done != 0:
        raise RuntimeError(f"broadcast(algorithm='direct'): reading the root's buffer failed on rank {comm.myrank}; "
                           f"set {direct.ENV}=0 to use messages")
