"""``sparse_allreduce_async``: the sum or average of sparse COO tensors, as an allgather of
their indices and values.

Every rank passes a sparse tensor of the same dense shape; the result is a sparse tensor (not
coalesced: an index that several ranks hold appears once per rank, and ``to_dense()`` adds them)
whose dense form is the ``allreduce`` of the ranks' dense forms. The exchange runs when it is
called; the handle is a function that returns the result, as Horovod's is.
"""
from typing import Callable, Optional

import torch

from . import mpi_ops
from .calls import as_collective_error
from .process_sets import global_process_set, running_on


@as_collective_error
def sparse_allreduce_async(tensor: torch.Tensor, name: Optional[str] = None, op=mpi_ops.Average,
                           process_set=global_process_set) -> Callable[[], torch.Tensor]:
    """Start the reduction of a sparse ``tensor`` over ``process_set``; call the handle for the result."""
    caller = "sparse_allreduce_async"
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
        raise TypeError(f"{caller}: tensor must be a sparse COO tensor, got "
                        f"{type(tensor).__name__ if not isinstance(tensor, torch.Tensor) else tensor.layout}")
    opname = mpi_ops.reduce_op(op, None, caller)
    if opname not in (mpi_ops.Sum, mpi_ops.Average):
        raise ValueError(f"{caller}: op {op!r} is not supported; use Sum or Average")
    t = tensor.coalesce()
    with running_on(process_set, caller):
        shapes = mpi_ops.allgather_object(tuple(t.shape), name)
        if any(s != shapes[0] for s in shapes):
            raise ValueError(f"{caller}: the dense shape differs between ranks ({mpi_ops._difference(shapes)})")
        indices = mpi_ops.allgather(t.indices().t().contiguous(), name)
        values = mpi_ops.allgather(t.values().contiguous(), name)
        count = mpi_ops.state().size
    if opname == mpi_ops.Average:
        values = values / count
    result = torch.sparse_coo_tensor(indices.t(), values, t.shape)
    return lambda: result
