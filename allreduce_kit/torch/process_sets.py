"""Process sets: collectives over a subset of the ranks, with Horovod's names.

``add_process_set(ranks)`` is collective over every rank (each passes the same ranks): it splits
the communicator ``init`` was given into the set's members and the rest, and gives the members a
communicator of their own (and the library's clone of it), so a set's calls never meet another
set's or the global ones. A call with ``process_set=s`` runs on ``s``'s communicator, with
ranks and sizes counted inside the set; only the set's members call it. Before it starts, the
reductions the background thread holds for the global set are finished (calls reach the
communicators in program order). ``global_process_set`` is every rank; it is the default of
every call and cannot be removed. ``shutdown()`` frees every set; a set added before it must be
added again after the next ``init()``.
"""
import contextlib
import itertools
from typing import Callable, Iterator, List, Optional, Sequence, Union

import torch

from mpi4py import MPI

from ..stall import INSPECTOR
from . import mpi_ops


class ProcessSet:
    """A set of ranks (global ranks, ascending). Usable in calls once ``add_process_set`` has
    registered it; ``global_process_set`` is every rank."""

    def __init__(self, ranks_or_comm: Union[Sequence[int], MPI.Comm]):
        if isinstance(ranks_or_comm, MPI.Comm):
            raise TypeError("ProcessSet: give a list of ranks (a set made from a communicator is not supported)")
        ranks = list(ranks_or_comm)
        for r in ranks:
            if isinstance(r, bool) or not isinstance(r, int):
                raise TypeError(f"ProcessSet: ranks must be ints, got {r!r}")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"ProcessSet: ranks must be distinct, got {ranks}")
        #: the members' global ranks, ascending
        self.ranks: List[int] = sorted(ranks)
        #: 0 for the global set, a positive number once added, None before
        self.process_set_id: Optional[int] = None
        self._state: Optional["mpi_ops._State"] = None   # the set's communicators, on its members

    def _is_global(self) -> bool:
        return self.process_set_id == 0

    def size(self) -> Optional[int]:
        """The number of ranks in the set (None before it is added)."""
        if self._is_global():
            return mpi_ops.size()
        return len(self.ranks) if self.process_set_id is not None else None

    def rank(self) -> Optional[int]:
        """This process's rank within the set; None if it is not a member or the set is not added."""
        if self._is_global():
            return mpi_ops.rank()
        return self._state.rank if self._state is not None else None

    def included(self) -> Optional[bool]:
        """Whether this process is a member (None before the set is added)."""
        if self._is_global():
            return True
        if self.process_set_id is None:
            return None
        return mpi_ops.rank() in self.ranks

    def __str__(self) -> str:
        shown = "every rank" if self._is_global() else self.ranks
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={shown})"

    __repr__ = __str__


#: Every rank; the default ``process_set`` of every call.
global_process_set = ProcessSet([])
global_process_set.process_set_id = 0

_ids = itertools.count(1)
_added: List[ProcessSet] = []


def _agree_on_ranks(caller: str, ranks: List[int]) -> None:
    """Raise ``ValueError`` on every rank unless every rank passed the same ranks."""
    s = mpi_ops.state()
    with INSPECTOR.watching(s.lib.watch, f"{caller}: comparing the ranks across ranks"):
        everyone = s.lib.allgather(ranks)
    if any(r != everyone[0] for r in everyone):
        raise ValueError(f"{caller}: ranks differ between ranks ({mpi_ops._difference(everyone)})")


def add_process_set(process_set: Union[ProcessSet, Sequence[int]]) -> ProcessSet:
    """Register a set of ranks and return it (collective over every rank, each passing the same ranks).

    ``ValueError`` on every rank for a rank that does not exist, an empty set, ranks that
    differ between ranks, or a set with the same ranks already added.
    """
    caller = "add_process_set"
    s = mpi_ops.state()
    if getattr(mpi_ops._on_set, "state", None) is not None:
        raise ValueError(f"{caller}: call it outside calls on a process set")
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.process_set_id is not None:
        raise ValueError(f"{caller}: {ps} is already added")
    if not ps.ranks:
        raise ValueError(f"{caller}: a process set needs at least one rank")
    if ps.ranks[0] < 0 or ps.ranks[-1] >= s.size:
        raise ValueError(f"{caller}: ranks {ps.ranks} are not all ranks of {s.size}")
    s.drain()
    _agree_on_ranks(caller, ps.ranks)
    if any(other.ranks == ps.ranks for other in _added):
        raise ValueError(f"{caller}: a process set with ranks {ps.ranks} is already added")
    member = s.rank in ps.ranks
    with INSPECTOR.watching(s.lib.watch, f"{caller}({ps.ranks}): splitting the communicator"):
        sub = s.dup.Split(0 if member else MPI.UNDEFINED, key=s.rank)
    if member:
        try:
            state = mpi_ops._State(sub)
        finally:
            sub.Free()  # the state holds its own duplicate, which is also the set's communicator
        state.comm = state.dup
        state.threaded = False      # calls on a set run on the caller's thread (or the global worker's)
        ps._state = state
    ps.process_set_id = next(_ids)
    _added.append(ps)
    if len(_added) == 1:
        s.on_shutdown(_forget_all)
    return ps


def _release(ps: ProcessSet) -> None:
    if ps._state is not None and not MPI.Is_finalized():
        for release in ps._state._on_shutdown:
            release()
        ps._state.dup.Free()
    ps._state = None
    ps.process_set_id = None


def _forget_all() -> None:
    for ps in _added:
        _release(ps)
    _added.clear()


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a set added with ``add_process_set`` and free its communicators (collective
    over every rank). False for the global set or a set not added."""
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"remove_process_set: process_set must be a ProcessSet, got {type(process_set).__name__}")
    s = mpi_ops.state()
    if process_set._is_global() or process_set not in _added:
        return False
    s.drain()
    _added.remove(process_set)
    with INSPECTOR.watching(s.lib.watch, f"remove_process_set({process_set.ranks})"):
        s.lib.Barrier()      # no member frees the communicator while another still uses it
    _release(process_set)
    return True


def check_process_set(process_set, caller: str) -> Optional[ProcessSet]:
    """``process_set`` if a call on it can run on this rank (None for the global set), else
    ``TypeError``/``ValueError`` naming it."""
    if process_set is None or process_set is global_process_set:
        return None
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"{caller}: process_set must be a ProcessSet, got {type(process_set).__name__}")
    if process_set._is_global():
        return None
    if process_set not in _added:
        raise ValueError(f"{caller}: {process_set} has not been added (add_process_set) or was removed")
    if process_set._state is None:
        raise ValueError(f"{caller}: this rank ({mpi_ops.rank()}) is not in {process_set}")
    return process_set


@contextlib.contextmanager
def running_on(process_set, caller: str) -> Iterator[None]:
    """Inside the block, this thread's calls run on ``process_set`` (nothing changes for the global
    set). The global background thread's reductions are finished first."""
    ps = check_process_set(process_set, caller)
    if ps is None:
        yield
        return
    mpi_ops.state().drain()
    previous = getattr(mpi_ops._on_set, "state", None)
    mpi_ops._on_set.state = ps._state
    try:
        yield
    finally:
        mpi_ops._on_set.state = previous



class _OnSet(torch.autograd.Function):
    """A differentiable call made on a process set, whose backward runs on the same set: the call
    runs on a detached leaf inside forward, and backward differentiates that call with the set's
    state in place (as ``running_on`` does), whatever thread runs backward."""

    @staticmethod
    def forward(ctx, set_state, run, tensor):
        leaf = tensor.detach().requires_grad_()
        with torch.enable_grad():
            out = run(leaf)
        ctx.set_state, ctx.leaf, ctx.out = set_state, leaf, out
        return out.detach()

    @staticmethod
    def backward(ctx, grad):
        previous = getattr(mpi_ops._on_set, "state", None)
        mpi_ops._on_set.state = ctx.set_state
        try:
            (grad_in,) = torch.autograd.grad(ctx.out, ctx.leaf, grad)
        finally:
            mpi_ops._on_set.state = previous
        return None, None, grad_in


def with_set_gradient(run: Callable[[torch.Tensor], torch.Tensor], tensor: torch.Tensor) -> torch.Tensor:
    """``run(tensor)``, inside ``running_on``; where it is differentiated, on a process set, the
    gradient is computed on the same set."""
    set_state = getattr(mpi_ops._on_set, "state", None)
    if set_state is None or not isinstance(tensor, torch.Tensor) or not (tensor.requires_grad
                                                                          and torch.is_grad_enabled()):
        return run(tensor)
    return _OnSet.apply(set_state, run, tensor)
