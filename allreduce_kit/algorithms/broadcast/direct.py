"""Broadcast by direct reads on one node: every rank reads the root's buffer straight out of its
memory (``direct.py``), one copy each, all at once; the root waits until all have. Across nodes,
or where direct reads cannot be used, the binomial tree (``binomial.py``)."""
from numba import njit

from . import register
from .. import direct
from ..signature import mismatch
from .binomial import broadcast as binomial

TAG = 209


@njit(cache=True, nogil=True)
def _direct(buf, root, state, iov):
    """0, -1 if a read failed, ``direct.MISMATCH`` if the ranks' buffers differ."""
    first = direct.begin(state, buf, TAG)
    if state[0] != root:
        address = direct.reach(state, root, first)
        if address < 0:
            return direct.MISMATCH
        if direct.pull(state, root, buf, address, iov) != 0:
            return -1
    return direct.leave(state, first)


@register("direct")
def broadcast(comm, buf, root):
    peers = direct.peers_for(comm)
    if peers is None:
        binomial(comm, buf, root)
        return
    done = _direct(buf, root, peers.state, peers.iov)
    if done == direct.MISMATCH:
        raise mismatch(comm, buf, "direct")
    if done != 0:
        raise RuntimeError(f"broadcast(algorithm='direct'): reading the root's buffer failed on rank {comm.myrank}; "
                           f"set {direct.ENV}=0 to use messages")
