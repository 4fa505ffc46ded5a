"""``grouped_allreduce``, ``grouped_allgather``, ``grouped_reducescatter``: one call for a list of
tensors, each reduced (gathered, scattered) as the single call would, in list order; every rank
passes lists of the same length. The results are a list in the same order. Differentiable as
the single calls are."""
from typing import List, Optional, Sequence

import torch

from . import mpi_ops
from .calls import as_collective_error
from .compression import Compression
from .process_sets import global_process_set, running_on, with_set_gradient
from .scatter_rows import reducescatter_here


def _listed(tensors, caller: str) -> List[torch.Tensor]:
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{caller}: tensors must be a list or tuple of tensors, got {type(tensors).__name__}")
    return list(tensors)


def _names(name: Optional[str], count: int) -> List[Optional[str]]:
    return [None if name is None else f"{name}.{i}" for i in range(count)]


def allreduce_each(tensors, average, name, compression, op, prescale_factor, postscale_factor,
                   in_place: bool) -> List[torch.Tensor]:
    listed = _listed(tensors, "grouped_allreduce_" if in_place else "grouped_allreduce")
    if in_place:
        return [mpi_ops.allreduce_(t, average, n, op, prescale_factor, postscale_factor)
                for t, n in zip(listed, _names(name, len(listed)))]
    return [with_set_gradient(lambda x, n=n: mpi_ops.allreduce(x, average, n, compression, op, prescale_factor,
                                                               postscale_factor), t)
            for t, n in zip(listed, _names(name, len(listed)))]


def allgather_each(tensors, name) -> List[torch.Tensor]:
    listed = _listed(tensors, "grouped_allgather")
    return [with_set_gradient(lambda x, n=n: mpi_ops.allgather(x, n), t) for t, n in zip(listed, _names(name, len(listed)))]


def reducescatter_each(tensors, name, compression, op, prescale_factor, postscale_factor) -> List[torch.Tensor]:
    listed = _listed(tensors, "grouped_reducescatter")
    return [reducescatter_here(t, n, compression, op, prescale_factor, postscale_factor)
            for t, n in zip(listed, _names(name, len(listed)))]


@as_collective_error
def grouped_allreduce(tensors: Sequence[torch.Tensor], average: Optional[bool] = None, name: Optional[str] = None,
                      compression=Compression.none, op=None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set=global_process_set) -> List[torch.Tensor]:
    """``allreduce`` of each tensor (new tensors), over the ranks of ``process_set``."""
    with running_on(process_set, "grouped_allreduce"):
        return allreduce_each(tensors, average, name, compression, op, prescale_factor, postscale_factor, False)


@as_collective_error
def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None, name: Optional[str] = None,
                       op=None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set=global_process_set) -> List[torch.Tensor]:
    """``allreduce_`` of each tensor (in place), over the ranks of ``process_set``."""
    with running_on(process_set, "grouped_allreduce_"):
        return allreduce_each(tensors, average, name, None, op, prescale_factor, postscale_factor, True)


@as_collective_error
def grouped_allgather(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                      process_set=global_process_set) -> List[torch.Tensor]:
    """``allgather`` of each tensor, over the ranks of ``process_set``."""
    with running_on(process_set, "grouped_allgather"):
        return allgather_each(tensors, name)


@as_collective_error
def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: Optional[str] = None, compression=Compression.none,
                          op=mpi_ops.Average, process_set=global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> List[torch.Tensor]:
    """``reducescatter`` of each tensor, over the ranks of ``process_set``."""
    with running_on(process_set, "grouped_reducescatter"):
        return reducescatter_each(tensors, name, compression, op, prescale_factor, postscale_factor)
