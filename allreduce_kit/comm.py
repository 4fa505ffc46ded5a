"""The library's own communicator: a clone of the caller's, made once and cached on it.

Every message the library sends travels on this clone, so it can never match a receive the
user posted on their own communicator, whatever tags either side uses.
"""
from functools import cached_property
from typing import Dict, Optional

import numpy as np
from mpi4py import MPI

from .reduction import Reductions
from .stall import INSPECTOR, Watch
from .threads import cores_available, ranks_on_this_node, thread_share


class LibraryComm(MPI.Intracomm):
    """A cloned intracommunicator, what the algorithms need to know about it, scratch buffers,
    and its stall-inspector watch. Created collectively (see ``library_comm``)."""

    watch: Watch

    def __new__(cls, comm: MPI.Intracomm) -> "LibraryComm":
        self = super().__new__(cls, comm)
        self._scratch: Dict[int, np.ndarray] = {}
        self._views: Dict[tuple, np.ndarray] = {}
        #: ``Get_size()`` and ``Get_rank()``, read once (they never change for a communicator).
        self.nranks, self.myrank = comm.Get_size(), comm.Get_rank()
        node_ranks = ranks_on_this_node(comm)
        #: Threads this rank's reduction kernels may use: its share of the node's cores.
        self.threads = thread_share(ranks=node_ranks)
        #: Some node has more ranks than cores, so a message may cost a context switch. The same
        #: on every rank, so that algorithms that split messages by it agree on the split.
        self.oversubscribed = bool(comm.allreduce(node_ranks > cores_available(), op=MPI.LOR))
        #: ``reductions[op]``: ``op`` over this communicator's ranks, on this rank's threads.
        self.reductions = Reductions(self.nranks, self.threads)
        #: Per-communicator cache for ``algorithm="auto"`` (see ``selection.py``), and its
        #: choices so far by message size (one dictionary lookup per call once made).
        self.auto = None
        self.auto_choices: Dict[int, str] = {}
        #: tag -> an algorithm's compiled exchange loop or shared window, or ``None`` if there
        #: is none (``algorithms/native.py``, ``algorithms/shared_memory.py``).
        self.native: Dict[int, object] = {}
        self.watch = INSPECTOR.watch(self)
        return self

    @cached_property
    def fold(self):
        """This rank's place when the ranks are folded to a power of two (``algorithms/fold.py``)."""
        from .algorithms.fold import plan  # here, not at the top: the algorithms import this module

        return plan(self.nranks, self.myrank)

    def scratch(self, count: int, dtype: np.dtype, slot: int = 0) -> np.ndarray:
        """A reusable 1-D array of ``count`` elements; contents undefined. One per ``slot``.

        The view for the last ``(count, dtype)`` asked of each slot is kept, so the steady
        state of a training loop or a benchmark costs one dictionary lookup per call.
        """
        key = (slot, count, dtype)
        view = self._views.get(key)
        if view is not None:
            return view
        nbytes = count * np.dtype(dtype).itemsize
        raw = self._scratch.get(slot)
        if raw is None or raw.size < nbytes:
            raw = self._scratch[slot] = np.empty(max(nbytes, 64), dtype=np.uint8)
            self._views = {k: v for k, v in self._views.items() if k[0] != slot}  # old buffer's views
        if len(self._views) > 64:
            self._views.clear()
        view = self._views[key] = raw[:nbytes].view(dtype)
        return view


def _free_clone(comm: MPI.Comm, keyval: int, clone: LibraryComm) -> None:
    if not MPI.Is_finalized():
        INSPECTOR.unwatch(clone.watch)
        for held in clone.native.values():
            if hasattr(held, "free"):  # a shared window (``algorithms/shared_memory.py``)
                held.free()
        clone.Free()


_KEYVAL = MPI.Comm.Create_keyval(delete_fn=_free_clone)
_world: list = []


def library_comm(comm: Optional[MPI.Intracomm] = None) -> LibraryComm:
    """The library's clone of ``comm`` (default ``COMM_WORLD``), created on first use.

    Collective the first time it is called for a communicator (it calls ``Clone``); after that
    it is a local lookup. The clone is freed when ``comm`` is freed.
    """
    if comm is None or comm is MPI.COMM_WORLD:  # found without an attribute lookup after the first call
        if not _world:
            _world.append(_clone_of(MPI.COMM_WORLD))
        return _world[0]
    return _clone_of(comm)


def _clone_of(comm: MPI.Intracomm) -> LibraryComm:
    lib = comm.Get_attr(_KEYVAL)
    if lib is None:
        if comm.Is_inter():
            raise TypeError("allreduce: comm must be an intracommunicator, got an intercommunicator")
        lib = LibraryComm(comm.Clone())
        comm.Set_attr(_KEYVAL, lib)
    return lib
