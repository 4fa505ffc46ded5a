"""Backup workers on one node: who is in and the average they make, through one shared window.

When every rank of the trainer's communicator shares one node, ``backup.py`` agrees on the first
P - B ranks of a step without a message: a rank that has its gradient

1. waits until every chosen rank of step k - 2 has read the slots of that step (the slots of
   step k reuse them; those ranks are the fast ones, so the wait is short), copies its gradient
   into its own slot of step k's set (two sets of P slots, by the step's parity);
2. takes a **ticket**: an atomic compare-and-swap on the step's counter (the step's number in
   its high bits, the count of tickets drawn in its low bits), so the first P - B ranks to
   arrive hold tickets 0 to P - B - 1, in arrival order. A ticket of P - B or more, or a step
   already decided when the rank looks, means the rank is late: it takes the average by message;
3. if in, writes its rank beside its ticket, waits until the P - B tickets in are all written
   (the step's set is then known to every rank in it), folds the chosen slots **in rank order**
   (sum, then division by P - B) into its gradient buffer and counts itself done with step k.

The decision and the reduction are one wait: for the (P - B)-th rank to arrive. Every chosen
rank computes each element from the same operands in the same order, so all of them hold
bitwise the same average, which the late ranks receive as it is.

Four step records (counter, readers done, P - B ticket entries) are used in turn; the counter's
step number tells a late rank looking at an old record that the step was decided. Readers done
counts every chosen rank of every step that used the record, so it never needs a reset. Waits
spin on acquire loads and yield the core when ranks share cores, like ``shared_memory``.
"""
from typing import Optional, Tuple

import numpy as np
from llvmlite import ir
from mpi4py import MPI
from numba import njit, typeof, types
from numba.extending import intrinsic

from ..algorithms.spin import NodeWindow, load_acquire, store_release, wait_until
from ..kernels import reduce as _loops
from ..topology import Topology

#: Step records used in turn (at least 3: a record is reused only once step k - 2's readers are done).
RECORDS = 4
#: A ticket entry holds ``(step + 1) << RANK_BITS | rank``.
RANK_BITS = 20
_LINE = 64
_LOW = (1 << 32) - 1


@intrinsic
def compare_and_swap(typingctx, address, expected, new):
    """Atomically: if the int64 at ``address`` is ``expected``, write ``new``; return what was there."""
    sig = types.int64(address, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        pointer = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
        return builder.extract_value(builder.cmpxchg(pointer, args[1], args[2], "acq_rel", "acquire"), 0)

    return sig, codegen


@intrinsic
def fetch_add(typingctx, address, value):
    """Atomically add ``value`` to the int64 at ``address``; return what was there."""
    sig = types.int64(address, types.int64)

    def codegen(context, builder, signature, args):
        pointer = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
        return builder.atomic_rmw("add", pointer, args[1], "acq_rel")

    return sig, codegen


@njit(cache=True, nogil=True)
def _record(state, k):
    return state[3] + (k % RECORDS) * state[4]


@njit(cache=True, nogil=True)
def decided(state, k):
    """Whether step ``k`` (counted from the window's first step) has its P - B ranks."""
    word = load_acquire(_record(state, k))
    stamp = word >> 32
    return stamp > k + 1 or (stamp == k + 1 and (word & _LOW) >= state[2])


@njit(cache=True, nogil=True)
def _step(grads, slots, state, k, chosen):
    """Steps 1-3 for step ``k``: the ticket if this rank is in (``grads`` then holds the average,
    ``chosen`` the ranks in, in arrival order), else -1 (``grads`` untouched)."""
    rank, size, need, yield_fn, per = state[0], state[1], state[2], state[5], state[6]
    record = _record(state, k)
    if decided(state, k):
        return -1
    if k >= 2:                                          # step k - 2's readers are done with this set
        wait_until(_record(state, k - 2) + 8, need * ((k - 2) // RECORDS + 1), yield_fn)
    n = grads.size
    mine = ((k & 1) * size + rank) * per
    _loops.copy(slots[mine:mine + n], grads)
    stamp = k + 1
    while True:
        word = load_acquire(record)
        seen = word >> 32
        if seen > stamp:
            return -1                                   # the record has moved on to a later step
        new = (stamp << 32) | 1 if seen < stamp else word + 1
        if compare_and_swap(record, word, new) == word:
            ticket = 0 if seen < stamp else word & _LOW
            break
    if ticket >= need:
        return -1
    store_release(record + 16 + 8 * ticket, (stamp << RANK_BITS) | rank)
    for t in range(need):
        wait_until(record + 16 + 8 * t, stamp << RANK_BITS, yield_fn)
        chosen[t] = load_acquire(record + 16 + 8 * t) & ((1 << RANK_BITS) - 1)
    ordered = np.sort(chosen)
    first = ((k & 1) * size + ordered[0]) * per
    _loops.copy(grads, slots[first:first + n])
    for i in range(1, need):
        other = ((k & 1) * size + ordered[i]) * per
        _loops.combine(grads, slots[other:other + n], _loops.SUM)
    _loops.divide(grads, need)
    fetch_add(record + 8, 1)
    return ticket


def _layout(ranks: int, need: int, grads: np.ndarray) -> Tuple[int, int]:
    """Bytes of one step record and of one slot, each a whole number of cache lines."""
    return -(-8 * (2 + need) // _LINE) * _LINE, max(-(-grads.nbytes // _LINE) * _LINE, _LINE)


def window_bytes(ranks: int, need: int, grads: np.ndarray) -> int:
    """The bytes of a ``Tickets`` window for ``ranks`` ranks: the step records and 2 x ``ranks`` slots."""
    record, slot = _layout(ranks, need, grads)
    return RECORDS * record + 2 * ranks * slot


def state_of(memory: np.ndarray, rank: int, ranks: int, need: int, grads: np.ndarray, yield_fn: int) -> np.ndarray:
    """``_step``'s state for ``rank`` on ``memory`` (``window_bytes`` bytes, 64-byte aligned, records zeroed)."""
    record, slot = _layout(ranks, need, grads)
    return np.array([rank, ranks, need, memory.ctypes.data, record, yield_fn, slot // grads.itemsize], np.int64)


class Tickets(NodeWindow):
    """The window of one ``BackupWorkers`` on one node: step records and two sets of gradient slots
    (collective over ``node``, which it owns)."""

    def __init__(self, node: MPI.Intracomm, grads: np.ndarray, need: int, oversubscribed: bool):
        size, rank = node.Get_size(), node.Get_rank()
        super().__init__(node, window_bytes(size, need, grads), oversubscribed)
        records = RECORDS * _layout(size, need, grads)[0]
        if rank == 0:
            self.memory[:records] = 0
        self._slots = self.memory[records:].view(grads.dtype)
        self.state = state_of(self.memory, rank, size, need, grads, self.yield_fn)
        self.chosen = np.zeros(need, dtype=np.int64)
        # Compiled (or loaded from numba's cache) here, not in the first step.
        _step.compile(tuple(typeof(a) for a in (grads, self._slots, self.state, 0, self.chosen)))
        decided(self.state, 0)
        node.Barrier()                                  # the records are zero before any rank draws

    def step(self, grads: np.ndarray, k: int) -> Optional[np.ndarray]:
        """The ranks in step ``k`` in arrival order, with their average in ``grads``; None if this rank is late."""
        return self.chosen.copy() if _step(grads, self._slots, self.state, k, self.chosen) >= 0 else None

    def decided(self, k: int) -> bool:
        """Whether step ``k`` has its ranks (this rank, not among them, then takes the average by message)."""
        return bool(decided(self.state, k))


def tickets_for(comm: MPI.Intracomm, layout: Topology, grads: np.ndarray, need: int, oversubscribed: bool,
                limit: int) -> Optional[Tickets]:
    """A ``Tickets`` window over ``comm`` if all its ranks share one node (``layout``, a ``Topology``)
    and the window takes at most ``limit`` bytes, else None. Collective; the same answer on every rank."""
    if not layout.single_node or window_bytes(comm.Get_size(), need, grads) > limit:
        return None
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    if node.Get_size() != comm.Get_size():
        node.Free()
        return None
    return Tickets(node, grads, need, oversubscribed)
