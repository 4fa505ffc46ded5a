"""A dead peer as an error, and a communicator rebuilt on the survivors (ULFM).

With a fault-tolerant MPI (Open MPI launched with ``mpirun --with-ft ulfm``), an operation that
needs a dead process fails with ``MPI_ERR_PROC_FAILED`` once Open MPI knows of the death (at
once for a process killed by a signal, which its node's daemon sees end; after the heartbeat
detector's timeout for one that ends without a signal),
and one on a communicator another rank has revoked fails with ``MPI_ERR_REVOKED``; mpi4py
raises both as ``MPI.Exception``. A loop of the user's own recovers in three calls::

    try:
        allreduce(grads, op="mean", comm=comm)
    except MPI.Exception as error:
        if not faults.peer_failed(error):
            raise
        comm = faults.shrink(comm)       # revoke it and its library clone, make one of the survivors
        # agree on where to restart, re-shard (train.resize.reshard), go on with comm

``keep_to_messages()`` first, on every rank: the library's single-copy and shared-window paths
wait on flags in a peer's memory, where a dead peer is never noticed; with it they are not set
up, and every algorithm sends messages (its cost is in docs/elastic.md).
"""
from typing import List, Optional, Sequence

from mpi4py import MPI

from .run import ulfm_launched

__all__ = ["peer_failed", "ulfm_launched", "keep_to_messages", "messages_only", "runs_as", "revoke", "shrink",
           "lost_ranks", "translate"]

#: The error classes of a peer's death: seen directly, pending (on a receive from any source), or
#: passed on by a rank that revoked the communicator.
FAILURE_CLASSES = frozenset(getattr(MPI, name) for name in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING",
                                                            "ERR_REVOKED") if hasattr(MPI, name))

#: Whether the library keeps to messages (``keep_to_messages``): no shared window, no direct reads.
messages_only = False


def peer_failed(error: BaseException) -> bool:
    """Whether ``error`` is an MPI error that says a peer died (or another rank saw one die)."""
    return isinstance(error, MPI.Exception) and error.Get_error_class() in FAILURE_CLASSES


def keep_to_messages(on: bool = True) -> None:
    """Make library communicators created from now on send messages only (see the module's text)."""
    global messages_only
    messages_only = bool(on)


def runs_as(name: str, nbytes: int) -> str:
    """The algorithm that runs when ``name`` is asked for a buffer of ``nbytes``: ``name`` itself,
    except ``shared_memory`` while the library keeps to messages, which has no window then and
    sends its buffer with ``recursive_doubling`` or ``rabenseifner`` (by size, as it does across nodes)."""
    if name != "shared_memory" or not messages_only:
        return name
    from .algorithms.shared_memory import fallback

    return fallback(nbytes)


def revoke(*comms: Optional[MPI.Comm]) -> None:
    """Revoke each communicator and the library's clone of it, if any, so that every rank still
    waiting in one of them gets ``MPI_ERR_REVOKED`` (local; ``None`` and freed ones are skipped)."""
    from .comm import _KEYVAL, _world
    from .stall import INSPECTOR

    for comm in comms:
        if comm is None or comm == MPI.COMM_NULL:
            continue
        clones = [comm.Get_attr(_KEYVAL)] + (list(_world) if comm == MPI.COMM_WORLD else [])
        for lib in clones:
            if lib is not None and lib != MPI.COMM_NULL:
                INSPECTOR.forget(lib.watch)          # its channel is gone with it: no more queries
                _revoke_one(lib)
        _revoke_one(comm)


def _revoke_one(comm: MPI.Comm) -> None:
    try:
        comm.Revoke()
    except MPI.Exception:
        pass                                         # revoked already


def shrink(comm: MPI.Intracomm) -> MPI.Intracomm:
    """Revoke ``comm`` (and its library clone) and return a new communicator of its live ranks,
    which raises errors as exceptions (collective over the survivors; fault tolerant)."""
    revoke(comm)
    survivors = comm.Shrink()
    survivors.Set_errhandler(MPI.ERRORS_RETURN)
    return survivors


def lost_ranks(old: MPI.Intracomm, survivors: MPI.Intracomm) -> List[int]:
    """The ranks of ``old`` missing from ``survivors`` (local)."""
    return [r for r in range(old.Get_size()) if translate(old, [r], survivors)[0] == MPI.UNDEFINED]


def translate(comm: MPI.Comm, ranks: Sequence[int], other: MPI.Comm = MPI.COMM_WORLD) -> List[int]:
    """``comm``'s ``ranks`` as ``other`` numbers them (``MPI.UNDEFINED`` where absent; local)."""
    mine, theirs = comm.Get_group(), other.Get_group()
    try:
        return [int(r) for r in MPI.Group.Translate_ranks(mine, list(ranks), theirs)]
    finally:
        mine.Free()
        theirs.Free()
