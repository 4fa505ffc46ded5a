"""The library's own communicator: a clone of the caller's, made once and cached on it.

Every message the library sends travels on this clone, so it can never match a receive the
user posted on their own communicator, whatever tags either side uses.
"""
import threading
from typing import Callable, Dict, Optional, Type, TypeVar

import numpy as np
from mpi4py import MPI

from . import config, faults
from .reduction import Reductions
from .progress import IN_FLIGHT, wait_turn
from .stall import INSPECTOR, Watch
from .topology import Topology

T = TypeVar("T")


class LibraryComm(MPI.Intracomm):
    """A cloned intracommunicator and the little every collective on it needs: rank and size,
    where its ranks sit (``layout``, a ``Topology``), this rank's reductions, scratch buffers and its stall
    watch. Algorithms and transports keep their own state in ``state``, keyed by its type
    (``attach``). Created collectively (see ``library_comm``)."""

    watch: Watch

    def __new__(cls, comm: MPI.Intracomm) -> "LibraryComm":
        self = super().__new__(cls, comm)
        #: ``Get_size()`` and ``Get_rank()``, read once (they never change for a communicator).
        self.nranks, self.myrank = comm.Get_size(), comm.Get_rank()
        self.layout = Topology.of(comm)
        #: Threads this rank's reduction kernels may use: its share of its node's cores.
        self.threads = self.layout.threads()
        #: Some node has more ranks than cores, so a message may cost a context switch. The same
        #: on every rank, so algorithms that split messages by it agree on the split.
        self.oversubscribed = self.layout.oversubscribed
        #: ``check`` for calls that do not pass one (``ALLREDUCE_KIT_CHECK``).
        self.check_default = config.read(config.CHECK)
        #: Messages only, no shared window or direct reads (``faults.keep_to_messages``), decided
        #: at creation; the same on every rank when every rank asked for it before.
        self.messages_only = faults.messages_only
        #: ``reductions[op]``: ``op`` over this communicator's ranks, on this rank's threads.
        self.reductions = Reductions(self.nranks, self.threads)
        #: type -> the instance an algorithm or transport attached (``attach``); ``None`` where
        #: it found it cannot be used on this communicator.
        self.state: Dict[type, object] = {}
        #: ``auto``'s choice by message size where it cannot change (online tuning off): the
        #: first thing ``allreduce`` reads for ``auto``.
        self.fixed_choices: Dict[int, str] = {}
        #: ``(id(buf), algorithm)`` -> how ``allreduce`` reduced that buffer with that algorithm
        #: last time, for the same call again (``collective.Repeat``).
        self.repeats: Dict[tuple, object] = {}
        self._scratch: Dict[int, np.ndarray] = {}
        self._views: Dict[tuple, np.ndarray] = {}
        self.watch = INSPECTOR.watch(self)
        return self

    def attach(self, kind: Type[T], make: Callable[["LibraryComm"], Optional[T]]) -> Optional[T]:
        """The ``kind`` attached to this communicator, made by ``make(self)`` the first time
        (collective then, if ``make`` is). Instances with a ``free()`` are freed with the clone.

        Hot paths read ``comm.state.get(kind)`` first and call this only on a miss.
        """
        if kind not in self.state:
            self.state[kind] = make(self)
        return self.state[kind]  # type: ignore[return-value]

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
        if IN_FLIGHT[0]:
            wait_turn()  # a nonblocking call on the clone finishes before the clone is freed
        INSPECTOR.unwatch(clone.watch)
        for held in clone.state.values():
            if hasattr(held, "free"):  # a shared window, a node communicator
                held.free()
        clone.state.clear()
        clone.Free()


_KEYVAL = MPI.Comm.Create_keyval(delete_fn=_free_clone)
_world: list = []
#: communicator handle -> the lock held while its clone is made (``_set_up``): one per
#: communicator, so that threads setting up different communicators never wait for each other.
_setting_up: Dict[int, threading.Lock] = {}
_setting_up_guard = threading.Lock()


class ConcurrentCallError(RuntimeError):
    """A thread made the first collective call on a communicator while another thread of the
    same process was setting the library up for it: calls on one communicator from several
    threads at once are not supported."""


def library_comm(comm: Optional[MPI.Intracomm] = None) -> LibraryComm:
    """The library's clone of ``comm`` (default ``COMM_WORLD``), created on first use.

    Collective the first time it is called for a communicator (it calls ``Clone``); after that
    it is a local lookup. The clone is freed when ``comm`` is freed. A second thread that calls
    it while another thread of the process is making that clone gets ``ConcurrentCallError``
    at once (it never waits, and the clone being made is not disturbed).
    """
    if comm is None or comm is MPI.COMM_WORLD:  # found without an attribute lookup after the first call
        if not _world:
            lib = _clone_of(MPI.COMM_WORLD)
            if not _world:
                _world.append(lib)
                traced = config.read(config.TRACE)
                if traced:                           # ALLREDUCE_KIT_TRACE: collective, as this first call is
                    from .trace.session import from_environment
                    from_environment(traced)
        return _world[0]
    return _clone_of(comm)


def _clone_of(comm: MPI.Intracomm) -> LibraryComm:
    if not isinstance(comm, MPI.Comm):
        raise TypeError(f"comm must be an mpi4py intracommunicator, got {type(comm).__name__}")
    if comm == MPI.COMM_NULL:
        raise ValueError("comm is MPI.COMM_NULL")
    if comm.Is_inter():
        raise TypeError("comm must be an intracommunicator, got an intercommunicator")
    lib = comm.Get_attr(_KEYVAL)
    if lib is None:
        lib = _set_up(comm)
    return lib


def _set_up(comm: MPI.Intracomm) -> LibraryComm:
    """Make ``comm``'s clone and cache it on ``comm`` (collective), one thread at a time.

    ``Clone`` is collective: two threads of one rank cloning one communicator at once would
    pair their clones with other ranks' wrongly and leave ``comm`` unusable. The first thread
    holds ``comm``'s lock while it clones (waiting there for the other ranks); a thread that
    finds the lock held raises at once instead of waiting for it, so no thread ever blocks on
    the lock, whatever the holder waits for. Each communicator has its own lock: setting up
    one never stands in the way of setting up another, on any thread.
    """
    with _setting_up_guard:
        lock = _setting_up.setdefault(comm.py2f(), threading.Lock())
    if not lock.acquire(blocking=False):
        raise ConcurrentCallError(
            f"allreduce_kit: another thread of this process is making the first collective call on this "
            f"communicator (size {comm.Get_size()}) right now, which sets the library up for it; calls on one "
            f"communicator from several threads at once are not supported. Make the first call from one "
            f"thread, and the calls after it one at a time.")
    try:
        lib = comm.Get_attr(_KEYVAL)  # another thread may have finished between the look and the lock
        if lib is None:
            with INSPECTOR.watching(None, f"setting up the library's communicator (size {comm.Get_size()}, "
                                          f"the first collective call on it)"):
                lib = LibraryComm(comm.Clone())
            comm.Set_attr(_KEYVAL, lib)
        return lib
    finally:
        lock.release()
