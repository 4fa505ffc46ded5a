"""Broadcast through the node's shared window (``allreduce``'s ``shared_memory``): no messages,
only copies and flags, for small buffers on one node.

In each round the root copies a slot's worth of ``buf`` into its slot of the window, and every
rank raises its flag; once every rank's flag is up (``shared_memory.arrive``, which also
compares the ranks' ``signature.word`` and root in a call's first round), every other rank
copies the root's slot out. Larger buffers go in slot-sized rounds. Where the window cannot be
made (ranks on several nodes), ``binomial``.
"""
from typing import Callable, Optional

import numpy as np
from numba import njit, types

from . import register
from .. import shared_memory
from ..signature import mismatch, word
from ...kernels import reduce as _loops
from .binomial import broadcast as by_messages

TAG = 212


@njit(cache=True, nogil=True)
def _broadcast(buf, root, slots, state):
    """The root's ``buf`` copied into every rank's; 0, or -1 if the ranks' buffers or roots differ."""
    rank, size = state[0], state[1]
    per_slot = state[6] // buf.itemsize
    n = buf.size
    signed = word(buf, TAG) ^ (root << 44)
    gen = state[4]
    start = 0
    while start < n:
        stop = min(start + per_slot, n)
        gen += 1
        base = (gen & 1) * size * per_slot + root * per_slot
        if rank == root:
            _loops.copy(slots[base:base + stop - start], buf[start:stop])
        if shared_memory.arrive(state, gen, signed, start == 0) != 0:
            state[4] = gen
            return -1
        if rank != root:
            _loops.copy(buf[start:stop], slots[base:base + stop - start])
        start = stop
    state[4] = gen
    return 0


def _fields(buf, root: int):
    """What a broadcast's ranks compare when their calls differ (``signature.mismatch``)."""
    return (("buf length", buf.size), ("buf dtype", buf.dtype.name), ("root", root), ("algorithm", "shared_memory"))


@register("shared_memory")
def broadcast(comm, buf, root):
    window = shared_memory.window_of(comm)
    if window is None:
        by_messages(comm, buf, root)
        return
    if _broadcast(buf, root, window.slots(buf.dtype), window.state) != 0:
        raise mismatch(comm, buf, "shared_memory", "broadcast", _fields(buf, root))


@njit(cache=True, nogil=True)
def _broadcast_at(buf, root, state_address):
    """``_broadcast`` on the window whose state is at ``state_address`` (``shared_memory.window_at``)."""
    state, slots = shared_memory.window_at(state_address, buf)
    return _broadcast(buf, root, slots, state)


#: ``_broadcast_at``'s compiled entry point per dtype (``binding``).
_ENTRIES: dict = {}


def binding(comm, dtype, root: int) -> Optional[Callable[..., None]]:
    """``broadcast(comm, buf, root)`` for a ``buf`` of ``dtype``, with the window and ``root``
    bound, straight into a compiled entry point (a call that repeats,
    ``collectives.common.Again``, which passes a second argument, not used); ``None`` where there
    is no window."""
    window = comm.state.get(shared_memory.Window)
    if window is None:
        return None
    address = window.state.ctypes.data
    kernel = shared_memory.entry(_broadcast_at, np.dtype(dtype), (types.int64, types.int64), _ENTRIES)

    def run(buf: np.ndarray, _: object = None) -> None:
        if kernel(buf, root, address) != 0:
            raise mismatch(comm, buf, "shared_memory", "broadcast", _fields(buf, root))
    return run
