"""Allreduce through a window every rank of the node maps: no messages, only copies and flags.

Every rank copies its buffer into its own slot of an ``MPI_Win_allocate_shared`` window and
publishes the call's number in its flag (a release store); once every other rank's flag has
reached that number (acquire loads), the slots are folded together, in rank order. A small
round is folded whole by every rank. A round of ``SCATTER_FROM`` bytes or more is reduced
scattered: each rank folds its 1/p of the round into slot 0, raises a second flag, and once all
have, every rank copies the whole result out. Either way each element is computed from the
same operands in the same order wherever it is computed, so every rank ends bitwise identical.
A buffer larger than a slot goes in slot-sized rounds, each with its own call number. The
whole loop runs in one compiled function (``_allreduce``).

Slots come in two sets, used by odd and even rounds. A rank raises its flag for round g + 1 only
after it has read everything of round g, so no rank can overwrite a slot (at round g + 2) that
another rank is still reading.

Waiting is a spin on the flags, which is right when every rank has a core of its own; when
ranks share cores (``LibraryComm.oversubscribed``), each turn of the spin yields the core
(``sched_yield``) to a rank that has work to do (``ALLREDUCE_KIT_WAIT=block``: a wait sleeps
until the flag is raised, ``spin.py``); this is where it beats MPI's messages most
on the 2-core development machine (docs/performance.md). A communicator that spans nodes, or
an op without a numba kernel (the bench's ``--kernel numpy``), takes ``recursive_doubling``
(small buffers) or ``rabenseifner`` instead. The window (``2 p SLOT_BYTES`` bytes and two
cache lines of flags per rank) is made on the first call on a communicator and freed with it.

A buffer whose length or dtype differs between ranks raises ``ValueError`` on every rank, from
the first round, before any rank reads another's slot (``_allreduce``); without a window, also
when the lengths fall on both sides of ``FALLBACK_SPLIT`` (``recursive_doubling.py``).
"""
from typing import Dict, Optional

import numpy as np
from mpi4py import MPI
from numba import carray, from_dtype, njit, types

from . import ALGORITHMS, register
from .signature import mismatch, word
from .spin import NodeWindow, load_acquire, node_of, pointer_to, raise_flag, store_release, wait_on
from ..kernels import reduce as _loops

#: Bytes in one rank's slot, per set; larger buffers go in rounds of this size. Read when a
#: communicator's window is made, like ``SCATTER_FROM``.
SLOT_BYTES = 64 << 10
#: Rounds of at least this many bytes are reduced scattered, smaller ones whole on every rank.
SCATTER_FROM = 16 << 10
#: Without a window, buffers up to this many bytes take ``recursive_doubling``, larger ones
#: ``rabenseifner`` (MPICH's own split between the two is of this order).
FALLBACK_SPLIT = 64 << 10
#: Each flag has a cache line to itself, so raising one never disturbs another (the first flag's
#: line also holds the rank's ``signature.word``, one per set of slots, written with the flag).
_LINE = 64
#: This algorithm's number in a call's signature (``signature.word``), as the other
#: algorithms' message tags are theirs; no message carries it.
TAG = 107


@njit(cache=True, nogil=True)
def _wait_all(flags, line, size, gen, wait):
    """Until every rank's flag number ``line`` (0 or 1) has reached ``gen``."""
    for k in range(size):
        wait_on(flags + _LINE * (2 * k + line), gen, wait)


@njit(cache=True, nogil=True)
def arrive(state, gen, signed, first):
    """Round ``gen``: this rank's slot is written; raise its flag to ``gen`` and wait until every
    rank has raised theirs. In a call's ``first`` round the rank also publishes ``signed`` (its
    ``signature.word``, beside its flag, in a word of the round's set) and compares every rank's
    with it: 0, or -1 if one differs (every rank finds that, at the same round). The collectives
    on the window (``allreduce``'s ``shared_memory``, and ``shared_memory`` of ``reduce_scatter``,
    ``allgather`` and ``broadcast``) each go through their rounds with it, so calls of any of them
    may follow each other on one window."""
    rank, size, flags, wait = state[0], state[1], state[2], state[3]
    if first:
        store_release(flags + _LINE * 2 * rank + 8 + 8 * (gen & 1), signed)
    raise_flag(flags + _LINE * 2 * rank, gen, wait)
    _wait_all(flags, 0, size, gen, wait)
    if first:
        same = True
        for k in range(size):
            same &= load_acquire(flags + _LINE * 2 * k + 8 + 8 * (gen & 1)) == signed
        if not same:
            return -1
    return 0


@njit(cache=True, nogil=True)
def _allreduce(buf, slots, state, code, divisor):
    """Reduce ``buf`` in place with every rank of the window (``code``: ``kernels.OP_CODES``;
    ``divisor``: divide the result by it unless 0); 0, or -1 if the ranks' buffers differ.

    ``slots``: the window's slot area viewed as ``buf``'s dtype; ``state``: this rank, the rank
    count, the flags' address, the window's ``wait`` (``spin.py``; 0: spin), the
    number of the last round (advanced here), ``SCATTER_FROM``, ``SLOT_BYTES`` and the slot
    area's address (``_allreduce_at``).

    The first round of a call also publishes ``signature.word`` beside the rank's first flag,
    in a word of the round's set, and compares every rank's before reading any slot: if one
    differs, every rank returns -1 there, at the same round (the caller raises, collectively).
    A word is rewritten only two rounds later, as a slot is, so the words read are this call's.
    """
    rank, size, flags, wait = state[0], state[1], state[2], state[3]
    gen = state[4]
    scatter_from = state[5]
    per_slot = state[6] // buf.itemsize
    n = buf.size
    signed = word(buf, TAG)
    start = 0
    while start < n:
        stop = min(start + per_slot, n)
        m = stop - start
        gen += 1
        base = (gen & 1) * size * per_slot
        _loops.copy(slots[base + rank * per_slot:base + rank * per_slot + m], buf[start:stop])
        if arrive(state, gen, signed, start == 0) != 0:
            state[4] = gen
            return -1
        if m * buf.itemsize >= scatter_from:
            a, b = rank * m // size, (rank + 1) * m // size  # this rank's block (blocks.py)
            mine = slots[base + a:base + b]
            for k in range(1, size):
                _loops.combine(mine, slots[base + k * per_slot + a:base + k * per_slot + b], code)
            if divisor != 0:
                _loops.divide(mine, divisor)
            raise_flag(flags + _LINE * (2 * rank + 1), gen, wait)
            _wait_all(flags, 1, size, gen, wait)
            _loops.copy(buf[start:stop], slots[base:base + m])
        else:
            piece = buf[start:stop]
            _loops.copy(piece, slots[base:base + m])
            for k in range(1, size):
                _loops.combine(piece, slots[base + k * per_slot:base + k * per_slot + m], code)
            if divisor != 0:
                _loops.divide(piece, divisor)
        start = stop
    state[4] = gen
    return 0


#: Words in a window's ``state``: ``_allreduce``'s seven, then the slot area's address.
_STATE_WORDS = 8


@njit(cache=True, nogil=True)
def _allreduce_at(buf, state_address, code, divisor):
    """``_allreduce`` with the window given by the address of its ``state`` (``binding``)."""
    state = carray(pointer_to(state_address, state_address), _STATE_WORDS)
    slots = carray(pointer_to(state[7], buf), 2 * state[1] * state[6] // buf.itemsize)
    return _allreduce(buf, slots, state, code, divisor)


@njit(cache=True, nogil=True)
def window_at(state_address, like):
    """The window's ``state`` and its slot area viewed as ``like``'s dtype, from the address of
    its ``state``: how a compiled entry point that a repeated call runs (``entry``) finds the
    window without unpacking arrays."""
    state = carray(pointer_to(state_address, state_address), _STATE_WORDS)
    return state, carray(pointer_to(state[7], like), 2 * state[1] * state[6] // like.itemsize)


def entry(function, dtype: np.dtype, rest: tuple, made: Dict[np.dtype, object]):
    """``function`` compiled for a first argument of a 1-D C-contiguous array of ``dtype`` and
    the argument types ``rest``, once per dtype (kept in ``made``): called without numba's type
    dispatch, which is a share of a small call. The caller passes arguments of exactly those types."""
    kernel = made.get(dtype)
    if kernel is None:
        kernel = made[dtype] = function.compile((types.Array(from_dtype(dtype), 1, "C"), *rest))
    return kernel


#: ``_allreduce_at``'s compiled entry point per dtype (``binding``).
_ENTRIES: Dict[np.dtype, object] = {}


class Window(NodeWindow):
    """One communicator's shared window: two flags per rank, two sets of slots, and
    ``_allreduce``'s state."""

    def __init__(self, node: MPI.Intracomm, oversubscribed: bool):
        size, rank = node.Get_size(), node.Get_rank()
        flag_bytes = 2 * _LINE * size
        super().__init__(node, flag_bytes + 2 * size * SLOT_BYTES, oversubscribed)
        flags = self.memory[:flag_bytes].view(np.int64)
        flags[2 * rank * _LINE // 8:(2 * rank + 2) * _LINE // 8] = 0  # flags, words, sleeper counts
        self._area = self.memory[flag_bytes:]
        self._views: Dict[np.dtype, np.ndarray] = {}
        self.state = np.array([rank, size, flags.ctypes.data, self.wait, 0, SCATTER_FROM, SLOT_BYTES,
                               self._area.ctypes.data], np.int64)
        node.Barrier()  # every flag is 0 before any rank raises one

    def slots(self, dtype: np.dtype) -> np.ndarray:
        """The slot area viewed as ``dtype``."""
        view = self._views.get(dtype)
        if view is None:
            view = self._views[dtype] = self._area.view(dtype)
        return view


def window_for(comm) -> Optional[Window]:
    """A ``Window`` over all of ``comm``'s ranks, or ``None`` if they are not all on one node.
    Collective over ``comm``."""
    node = node_of(comm)
    return None if node is None else Window(node, comm.oversubscribed)


def binding(comm, dtype: np.dtype, op) -> Optional[tuple]:
    """How a caller that repeats one call many times (``plans``, ``allreduce``'s repeated calls)
    runs ``op`` on ``dtype`` through ``comm``'s window: ``(kernel, address, code, divisor)``,
    where ``kernel(buf, address, code, divisor)`` is ``_allreduce(buf, slots, state, code,
    divisor)`` (0, or -1 if the ranks' buffers differ); or ``None`` if there is no window (not
    made yet, or not usable here) or ``op`` has no numba kernel, where a call takes
    ``fallback``'s algorithm.

    ``kernel`` is the compiled entry point for ``dtype``, called without numba's type dispatch,
    and the window goes by the address of its state, so that ``buf`` is the one array a call
    unpacks: that halves the cost of a call of a few bytes. Nothing checks its arguments: the
    caller makes sure, on every call, that ``buf`` is a writable 1-D C-contiguous array of
    ``dtype``, and calls it only while ``comm`` lives."""
    window = comm.state.get(Window)
    if window is None or op.code is None:
        return None
    kernel = _ENTRIES.get(dtype)
    if kernel is None:
        kernel = _ENTRIES[dtype] = _allreduce_at.compile(
            (types.Array(from_dtype(dtype), 1, "C"), types.int64, types.int64, types.int64))
    return kernel, window.state.ctypes.data, op.code, op.divisor


def fallback(nbytes: int) -> str:
    """The algorithm that sends a buffer of ``nbytes`` when there is no window (``FALLBACK_SPLIT``)."""
    return "recursive_doubling" if nbytes <= FALLBACK_SPLIT else "rabenseifner"


def window_of(comm) -> Optional[Window]:
    """``comm``'s ``Window``, made on the first call (collective then), or ``None`` where its ranks
    are not all on one node."""
    window = comm.state.get(Window, False)
    if window is False:
        window = comm.attach(Window, window_for)
    return window


@register("shared_memory")
def allreduce(comm, buf, op):
    window = window_of(comm)
    if window is None or op.code is None:
        ALGORITHMS[fallback(buf.nbytes)](comm, buf, op, "shared_memory")
    elif _allreduce(buf, window.slots(buf.dtype), window.state, op.code, op.divisor) != 0:
        raise mismatch(comm, buf, "shared_memory")
