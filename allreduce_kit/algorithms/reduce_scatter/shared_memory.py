"""Reduce-scatter through the node's shared window (``allreduce``'s ``shared_memory``): no
messages, only copies and flags, for small buffers on one node.

In each round every rank copies a slot's worth of ``buf`` into its own slot of the window and
raises its flag; once every rank's flag is up (``shared_memory.arrive``, which also compares the
ranks' ``signature.word`` in a call's first round), rank r folds the part of block r that the
round holds out of every slot, in rank order, into ``out``: the folds ``allreduce``'s
``shared_memory`` makes, so block r is bitwise that allreduce's result there. A buffer larger
than a slot goes in slot-sized rounds (only the ranks whose blocks a round holds fold in it,
which is why ``auto`` takes it for small buffers only). Where the window cannot be made (ranks
on several nodes) or ``op`` has no compiled kernel, ``recursive_halving``.
"""
from typing import Callable, Optional

import numpy as np
from numba import from_dtype, njit, types

from . import register
from .. import shared_memory
from ..signature import mismatch, word
from ...blocks import shard_bounds
from ...kernels import reduce as _loops
from .recursive_halving import reduce_scatter as by_messages

TAG = 210


@njit(cache=True, nogil=True)
def _reduce_scatter(buf, out, lo, hi, slots, state, code, divisor):
    """Block ``[lo, hi)`` of ``buf`` reduced over the window's ranks into ``out``; 0, or -1 if
    the ranks' buffers differ. ``slots``, ``state``: as ``shared_memory._allreduce``'s."""
    rank, size = state[0], state[1]
    per_slot = state[6] // buf.itemsize
    n = buf.size
    signed = word(buf, TAG)
    gen = state[4]
    start = 0
    while start < n:
        stop = min(start + per_slot, n)
        gen += 1
        base = (gen & 1) * size * per_slot
        _loops.copy(slots[base + rank * per_slot:base + rank * per_slot + stop - start], buf[start:stop])
        if shared_memory.arrive(state, gen, signed, start == 0) != 0:
            state[4] = gen
            return -1
        a, b = max(lo, start), min(hi, stop)  # the part of this rank's block in this round
        if a < b:
            mine = out[a - lo:b - lo]
            _loops.copy(mine, slots[base + a - start:base + b - start])
            for k in range(1, size):
                _loops.combine(mine, slots[base + k * per_slot + a - start:base + k * per_slot + b - start], code)
            if divisor != 0:
                _loops.divide(mine, divisor)
        start = stop
    state[4] = gen
    return 0


@register("shared_memory")
def reduce_scatter(comm, buf, out, op):
    window = shared_memory.window_of(comm)
    if window is None or op.code is None:
        by_messages(comm, buf, out, op)
        return
    bounds = shard_bounds(buf.size, comm.nranks)
    lo, hi = bounds[comm.myrank], bounds[comm.myrank + 1]
    if _reduce_scatter(buf, out, lo, hi, window.slots(buf.dtype), window.state, op.code, op.divisor) != 0:
        raise mismatch(comm, buf, "shared_memory", "reduce_scatter", result="out")


@njit(cache=True, nogil=True)
def _reduce_scatter_at(buf, out, lo, hi, state_address, code, divisor):
    """``_reduce_scatter`` on the window whose state is at ``state_address`` (``shared_memory.window_at``)."""
    state, slots = shared_memory.window_at(state_address, buf)
    return _reduce_scatter(buf, out, lo, hi, slots, state, code, divisor)


#: ``_reduce_scatter_at``'s compiled entry point per dtype (``binding``).
_ENTRIES: dict = {}


def binding(comm, dtype, n: int, op) -> Optional[Callable[[np.ndarray, np.ndarray], None]]:
    """``reduce_scatter(comm, buf, out, op)`` for a ``buf`` of ``n`` elements of ``dtype``, with
    the window, this rank's block and ``op`` bound, straight into a compiled entry point (a call
    that repeats, ``collectives.common.Again``); ``None`` where there is no window or ``op`` has
    no kernel."""
    window = comm.state.get(shared_memory.Window)
    if window is None or op.code is None:
        return None
    dtype = np.dtype(dtype)
    address, code, divisor = window.state.ctypes.data, op.code, op.divisor
    bounds = shard_bounds(n, comm.nranks)
    lo, hi = bounds[comm.myrank], bounds[comm.myrank + 1]
    kernel = shared_memory.entry(_reduce_scatter_at, dtype, (types.Array(from_dtype(dtype), 1, "C"), types.int64,
                                 types.int64, types.int64, types.int64, types.int64), _ENTRIES)

    def run(buf: np.ndarray, out: np.ndarray) -> None:
        if kernel(buf, out, lo, hi, address, code, divisor) != 0:
            raise mismatch(comm, buf, "shared_memory", "reduce_scatter", result="out")
    return run
