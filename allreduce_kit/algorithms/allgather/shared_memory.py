"""Allgather through the node's shared window (``allreduce``'s ``shared_memory``): no messages,
only copies and flags, for small blocks on one node.

In each round every rank copies a slot's worth of its block into its own slot of the window and
raises its flag; once every rank's flag is up (``shared_memory.arrive``, which also compares the
ranks' ``signature.word`` and blocks in a call's first round), every rank copies every other
rank's part out of its slot into ``out``. Blocks longer than a slot go in slot-sized rounds, as
many as the longest block needs. Where the window cannot be made (ranks on several nodes),
``recursive_doubling``.
"""
from typing import Callable, Optional

import numpy as np
from numba import from_dtype, njit, types

from . import register
from .. import shared_memory
from ..signature import word
from ...kernels import reduce as _loops
from .recursive_doubling import allgather as by_messages
from .signature import mismatch

TAG = 211


@njit(cache=True, nogil=True)
def _allgather(out, bounds, slots, state):
    """Every rank's block ``out[bounds[r]:bounds[r + 1]]`` copied into every rank's ``out``; 0,
    or -1 if the ranks' ``out`` or blocks differ."""
    rank, size = state[0], state[1]
    per_slot = state[6] // out.itemsize
    longest, mix = 0, 0
    for r in range(size):
        longest = max(longest, bounds[r + 1] - bounds[r])
        mix = (mix * 1000003 + bounds[r + 1]) & 0x3FFFFF
    signed = word(out, TAG) ^ (mix << 41)
    gen = state[4]
    start = 0
    while True:
        gen += 1
        base = (gen & 1) * size * per_slot
        a = min(bounds[rank] + start, bounds[rank + 1])
        b = min(a + per_slot, bounds[rank + 1])
        _loops.copy(slots[base + rank * per_slot:base + rank * per_slot + b - a], out[a:b])
        if shared_memory.arrive(state, gen, signed, start == 0) != 0:
            state[4] = gen
            return -1
        for k in range(1, size):
            peer = (rank + k) % size
            a = min(bounds[peer] + start, bounds[peer + 1])
            b = min(a + per_slot, bounds[peer + 1])
            _loops.copy(out[a:b], slots[base + peer * per_slot:base + peer * per_slot + b - a])
        start += per_slot
        if start >= longest:
            break
    state[4] = gen
    return 0


@register("shared_memory")
def allgather(comm, out, bounds):
    window = shared_memory.window_of(comm)
    if window is None:
        by_messages(comm, out, bounds)
        return
    if _allgather(out, np.asarray(bounds, np.int64), window.slots(out.dtype), window.state) != 0:
        raise mismatch(comm, out, bounds, "shared_memory")


@njit(cache=True, nogil=True)
def _allgather_at(out, mine, bounds, state_address):
    """``mine`` copied into its block of ``out``, then ``_allgather`` on the window whose state is at
    ``state_address`` (``shared_memory.window_at``)."""
    state, slots = shared_memory.window_at(state_address, out)
    rank = state[0]
    _loops.copy(out[bounds[rank]:bounds[rank + 1]], mine)
    return _allgather(out, bounds, slots, state)


#: ``_allgather_at``'s compiled entry point per dtype (``binding``).
_ENTRIES: dict = {}


def binding(comm, dtype, bounds) -> Optional[Callable[[np.ndarray, np.ndarray], None]]:
    """``allgather`` of ``mine`` into an ``out`` of ``dtype`` with ``bounds``, the window and the
    blocks bound, straight into a compiled entry point (a call that repeats,
    ``collectives.common.Again``); ``None`` where there is no window."""
    window = comm.state.get(shared_memory.Window)
    if window is None:
        return None
    blocks, address = np.asarray(bounds, np.int64), window.state.ctypes.data
    kernel = shared_memory.entry(_allgather_at, np.dtype(dtype), (types.Array(from_dtype(np.dtype(dtype)), 1, "C"),
                                 types.Array(types.int64, 1, "C"), types.int64), _ENTRIES)

    def run(mine: np.ndarray, out: np.ndarray) -> None:
        if kernel(out, mine, blocks, address) != 0:
            raise mismatch(comm, out, bounds, "shared_memory")
    return run
