"""The ``*_async`` and ``*_async_`` forms: each starts the blocking call (``calls.py``) and returns
a handle for ``poll`` and ``synchronize`` (``handles.py``); ``synchronize`` returns what the
blocking call returns (``alltoall_async``: always ``(output, received_splits)``)."""
from typing import Optional, Sequence

import torch

from . import grouped, mpi_ops
from .exchange import alltoall_here
from .calls import as_collective_error
from .compression import Compression
from .handles import start
from .process_sets import global_process_set
from .scatter_rows import reducescatter_here


def allreduce_async(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None, op=None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set=global_process_set) -> int:
    """Start ``allreduce`` (into a new tensor); ``synchronize`` returns the result."""
    return start("allreduce_async", name, process_set, as_collective_error(
        lambda: mpi_ops.allreduce(tensor, average, name, Compression.none, op, prescale_factor, postscale_factor)))


def allreduce_async_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None, op=None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set=global_process_set) -> int:
    """Start ``allreduce_`` (in place); ``synchronize`` returns ``tensor``."""
    return start("allreduce_async_", name, process_set, as_collective_error(
        lambda: mpi_ops.allreduce_(tensor, average, name, op, prescale_factor, postscale_factor)))


def allgather_async(tensor: torch.Tensor, name: Optional[str] = None, process_set=global_process_set) -> int:
    """Start ``allgather``."""
    return start("allgather_async", name, process_set, as_collective_error(lambda: mpi_ops.allgather(tensor, name)))


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                    process_set=global_process_set) -> int:
    """Start ``broadcast`` (into a new tensor)."""
    from .calls import _set_root
    r = _set_root(root_rank, process_set, "broadcast_async")
    return start("broadcast_async", name, process_set, as_collective_error(lambda: mpi_ops.broadcast(tensor, r, name)))


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                     process_set=global_process_set) -> int:
    """Start ``broadcast_`` (in place); ``synchronize`` returns ``tensor``."""
    from .calls import _set_root
    r = _set_root(root_rank, process_set, "broadcast_async_")
    return start("broadcast_async_", name, process_set,
                 as_collective_error(lambda: mpi_ops.broadcast_(tensor, r, name)))


def reducescatter_async(tensor: torch.Tensor, name: Optional[str] = None, op=mpi_ops.Average,
                        process_set=global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> int:
    """Start ``reducescatter``."""
    return start("reducescatter_async", name, process_set, as_collective_error(
        lambda: reducescatter_here(tensor, name, Compression.none, op, prescale_factor, postscale_factor)))


def alltoall_async(tensor: torch.Tensor, splits=None, name: Optional[str] = None,
                   process_set=global_process_set) -> int:
    """Start ``alltoall``; ``synchronize`` returns ``(output, received_splits)``."""
    def run():
        result = alltoall_here(tensor, splits, name)
        if splits is None:
            return result, torch.tensor([result.shape[0] // mpi_ops.state().size] * mpi_ops.state().size,
                                        dtype=torch.int32)
        return result
    return start("alltoall_async", name, process_set, as_collective_error(run))


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                            name: Optional[str] = None, op=None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0, process_set=global_process_set) -> int:
    """Start ``grouped_allreduce``; ``synchronize`` returns the list of results."""
    return start("grouped_allreduce_async", name, process_set, as_collective_error(
        lambda: grouped.allreduce_each(tensors, average, name, Compression.none, op, prescale_factor,
                                       postscale_factor, in_place=False)))


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                             name: Optional[str] = None, op=None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0, process_set=global_process_set) -> int:
    """Start ``grouped_allreduce_`` (in place)."""
    return start("grouped_allreduce_async_", name, process_set, as_collective_error(
        lambda: grouped.allreduce_each(tensors, average, name, Compression.none, op, prescale_factor,
                                       postscale_factor, in_place=True)))


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                            process_set=global_process_set) -> int:
    """Start ``grouped_allgather``."""
    return start("grouped_allgather_async", name, process_set,
                 as_collective_error(lambda: grouped.allgather_each(tensors, name)))


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None, op=mpi_ops.Average,
                                process_set=global_process_set, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    """Start ``grouped_reducescatter``."""
    return start("grouped_reducescatter_async", name, process_set, as_collective_error(
        lambda: grouped.reducescatter_each(tensors, name, Compression.none, op, prescale_factor, postscale_factor)))
