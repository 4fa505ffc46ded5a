"""The public collectives with Horovod's ``process_set=`` argument and exception types.

Each runs ``mpi_ops``' call (or ``reducescatter``'s, ``alltoall``'s) on the given process set
(``process_sets.running_on``; the global set by default). A ``ValueError`` the call raises
(bad input, or a difference between ranks found by the comparison ``check=True`` or
``ALLREDUCE_KIT_CHECK=1`` turns on) reaches the caller as ``errors.CollectiveError``, which is
both a ``ValueError`` and the ``RuntimeError`` Horovod's callers catch.

``barrier`` does not wait for asynchronous calls still in flight (``handles.py``), as Horovod's
does not: a rank may start a call, meet the others at a barrier, and find the call matched after
it. It runs on a communicator of its own.
"""
import functools
from typing import Any, Callable, List, Optional, TypeVar

import torch
from mpi4py import MPI

from ..stall import INSPECTOR
from . import mpi_ops
from .exchange import alltoall_here
from .compression import Compression
from .errors import CollectiveError
from .process_sets import global_process_set, running_on, with_set_gradient
from .scatter_rows import reducescatter_here

T = TypeVar("T")


def as_collective_error(function: Callable[..., T]) -> Callable[..., T]:
    """``function`` with its ``ValueError`` raised as ``CollectiveError`` (the same message)."""
    @functools.wraps(function)
    def call(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except CollectiveError:
            raise
        except ValueError as error:
            raise CollectiveError(str(error)).with_traceback(error.__traceback__) from None
    return call


@as_collective_error
def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression=Compression.none, op=None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set=global_process_set, *, check: Optional[bool] = None) -> torch.Tensor:
    """``mpi_ops.allreduce`` over the ranks of ``process_set``."""
    with running_on(process_set, "allreduce"):
        return with_set_gradient(lambda t: mpi_ops.allreduce(t, average, name, compression, op, prescale_factor,
                                                             postscale_factor, check=check), tensor)


@as_collective_error
def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None, op=None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set=global_process_set, *,
               check: Optional[bool] = None) -> torch.Tensor:
    """``mpi_ops.allreduce_`` (in place) over the ranks of ``process_set``."""
    with running_on(process_set, "allreduce_"):
        return mpi_ops.allreduce_(tensor, average, name, op, prescale_factor, postscale_factor, check=check)


@as_collective_error
def allgather(tensor: torch.Tensor, name: Optional[str] = None, process_set=global_process_set, *,
              check: Optional[bool] = None) -> torch.Tensor:
    """``mpi_ops.allgather`` over the ranks of ``process_set`` (in the set's rank order)."""
    with running_on(process_set, "allgather"):
        return with_set_gradient(lambda t: mpi_ops.allgather(t, name, check=check), tensor)


@as_collective_error
def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None, process_set=global_process_set, *,
              check: Optional[bool] = None) -> torch.Tensor:
    """``mpi_ops.broadcast`` over the ranks of ``process_set``; ``root_rank`` is a global rank in the set."""
    with running_on(process_set, "broadcast"):
        r = _set_root(root_rank, process_set, "broadcast")
        return with_set_gradient(lambda t: mpi_ops.broadcast(t, r, name, check=check), tensor)


@as_collective_error
def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None, process_set=global_process_set, *,
               check: Optional[bool] = None) -> torch.Tensor:
    """``mpi_ops.broadcast_`` (in place) over the ranks of ``process_set``."""
    with running_on(process_set, "broadcast_"):
        return mpi_ops.broadcast_(tensor, _set_root(root_rank, process_set, "broadcast_"), name, check=check)


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None, process_set=global_process_set) -> Any:
    """``mpi_ops.broadcast_object`` over the ranks of ``process_set``."""
    with running_on(process_set, "broadcast_object"):
        return mpi_ops.broadcast_object(obj, _set_root(root_rank, process_set, "broadcast_object"), name)


def allgather_object(obj: Any, name: Optional[str] = None, process_set=global_process_set) -> List[Any]:
    """``mpi_ops.allgather_object`` over the ranks of ``process_set``."""
    with running_on(process_set, "allgather_object"):
        return mpi_ops.allgather_object(obj, name)


def _set_root(root_rank: Any, process_set, caller: str) -> Any:
    """The set's own rank of the global rank ``root_rank`` (Horovod names roots by global rank)."""
    if process_set is None or process_set is global_process_set or not isinstance(root_rank, int):
        return root_rank
    if root_rank not in process_set.ranks:
        raise ValueError(f"{caller}: root_rank {root_rank} is not in {process_set}")
    return process_set.ranks.index(root_rank)


def _barrier_comm(s: "mpi_ops._State") -> MPI.Intracomm:
    """A communicator of ``s``'s ranks that only ``barrier`` uses (made on first use, freed at shutdown)."""
    comm = getattr(s, "barrier_comm", None)
    if comm is None:
        comm = s.barrier_comm = s.dup.Dup()
        s.on_shutdown(comm.Free)
    return comm


def barrier(process_set=global_process_set) -> None:
    """Wait until every rank of ``process_set`` has called ``barrier`` (collective over the set).
    Calls in flight (``*_async``) are not waited for."""
    with running_on(process_set, "barrier"):
        s = mpi_ops.state()
        if s.size == 1:
            return
        comm = _barrier_comm(s)
        with INSPECTOR.watching(s.lib.watch, "barrier"):
            comm.Barrier()


@as_collective_error
def reducescatter(tensor: torch.Tensor, name: Optional[str] = None, compression=Compression.none,
                  op=mpi_ops.Average, process_set=global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """This rank's block of rows of the reduction over the ranks of ``process_set`` (``scatter_rows.py``)."""
    with running_on(process_set, "reducescatter"):
        return reducescatter_here(tensor, name, compression, op, prescale_factor, postscale_factor)


@as_collective_error
def alltoall(tensor: torch.Tensor, splits=None, name: Optional[str] = None, process_set=global_process_set):
    """Rows sent to and received from every rank of ``process_set`` (``exchange.py``): the output,
    and with ``splits`` given, ``(output, received_splits)``."""
    with running_on(process_set, "alltoall"):
        return alltoall_here(tensor, splits, name)
