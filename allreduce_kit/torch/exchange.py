"""``alltoall``: each rank sends a block of its rows to every rank and receives one from each.

Rank ``i`` sends its rows ``[sum(splits[:j]), sum(splits[:j+1]))`` to rank ``j``; the output
holds the blocks received, in rank order, and ``received_splits[j]`` is the number of rows
rank ``j`` sent here. ``splits`` (a 1-D int32 tensor or a list of ints, one per rank, summing to
at most the first dimension) defaults to equal blocks, which needs a first dimension divisible
by the number of ranks. The other dimensions and the dtype must be the same on every rank: they
are exchanged with the splits first, so a difference raises ``CollectiveError`` on every rank.
Differentiable: the gradient is the alltoall of the output's gradient back, with the received
splits.
"""
from typing import List, Optional, Tuple, Union

import numpy as np
import torch

from ..stall import INSPECTOR
from . import mpi_ops, tensors
from .errors import CollectiveError
from .tensors import as_bytes, check_tensor


def _splits(tensor: torch.Tensor, splits, size: int, caller: str) -> List[int]:
    check_tensor(tensor, caller)
    if tensor.dim() == 0:
        raise ValueError(f"{caller}: tensor must have at least one dimension (its rows are sent)")
    rows = int(tensor.shape[0])
    if splits is None:
        if rows % size:
            raise ValueError(f"{caller}: without splits the first dimension ({rows}) must divide by the number "
                             f"of ranks ({size})")
        return [rows // size] * size
    if isinstance(splits, torch.Tensor):
        if splits.dtype != torch.int32:
            raise ValueError(f"{caller}: splits must hold int32, got {str(splits.dtype).replace('torch.', '')}")
        listed = [int(v) for v in splits.reshape(-1).tolist()]
    else:
        listed = list(splits)
        if any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) for v in listed):
            raise ValueError(f"{caller}: splits must be ints, got {listed}")
        listed = [int(v) for v in listed]
    if len(listed) != size:
        raise ValueError(f"{caller}: splits has {len(listed)} entries; give one per rank ({size})")
    if any(v < 0 for v in listed):
        raise ValueError(f"{caller}: splits must not be negative, got {listed}")
    if sum(listed) > rows:
        raise ValueError(f"{caller}: splits sum to {sum(listed)}, more than the first dimension ({rows})")
    return listed


def _exchanged(tensor: torch.Tensor, sends: List[int], name: Optional[str], caller: str
               ) -> Tuple[torch.Tensor, List[int]]:
    s = mpi_ops.state()
    s.drain()
    what = f"{caller}({name!r})" if name else caller
    mine = (sends, tuple(tensor.shape[1:]), str(tensor.dtype).replace("torch.", ""))
    with INSPECTOR.watching(s.lib.watch, f"{what}: exchanging splits and shapes"):
        entries = s.lib.allgather(mine)
    for index, field in ((1, "shape after the first dimension"), (2, "dtype")):
        values = [e[index] for e in entries]
        if any(v != values[0] for v in values):
            raise CollectiveError(f"{caller}: {field} differs between ranks ({mpi_ops._difference(values)})")
    received = [e[0][s.rank] for e in entries]
    data = tensor.detach().contiguous()
    out = tensors.empty((sum(received), *tensor.shape[1:]), tensor.dtype)
    row = data[0].numel() * data.element_size() if data.shape[0] else 0
    send_counts = [n * row for n in sends]
    recv_counts = [n * row for n in received]
    send_displs = np.concatenate([[0], np.cumsum(send_counts)[:-1]]).astype(np.int64).tolist()
    recv_displs = np.concatenate([[0], np.cumsum(recv_counts)[:-1]]).astype(np.int64).tolist()
    send_bytes = as_bytes(data) if data.numel() else np.empty(0, np.uint8)
    recv_bytes = as_bytes(out) if out.numel() else np.empty(0, np.uint8)
    with INSPECTOR.watching(s.lib.watch, f"{what} ({sum(send_counts)} bytes out)"):
        s.lib.Alltoallv([send_bytes, (send_counts, send_displs)], [recv_bytes, (recv_counts, recv_displs)])
    return out, received


class _AlltoallFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, sends, name, holder):
        out, received = _exchanged(tensor, sends, name, "alltoall")
        ctx.received = received
        holder.append(received)
        ctx.state = mpi_ops.state()
        return out

    @staticmethod
    def backward(ctx, grad):
        previous = getattr(mpi_ops._on_set, "state", None)
        mpi_ops._on_set.state = ctx.state if ctx.state is not mpi_ops._state else None
        try:
            back, _ = _exchanged(grad.contiguous(), ctx.received, None, "alltoall (gradient)")
        finally:
            mpi_ops._on_set.state = previous
        return back, None, None, None


def alltoall_here(tensor: torch.Tensor, splits: Optional[Union[torch.Tensor, List[int]]] = None,
                  name: Optional[str] = None):
    """``alltoall`` over this thread's current set (``calls.alltoall`` is the public one):
    the output, and with ``splits`` given also the received splits (an int32 tensor)."""
    caller = "alltoall"
    sends = _splits(tensor, splits, mpi_ops.state().size, caller)
    if name is not None and not isinstance(name, str):
        raise TypeError(f"{caller}: name must be a str, got {type(name).__name__}")
    if tensor.requires_grad and torch.is_grad_enabled():
        holder: List[List[int]] = []
        out = _AlltoallFunction.apply(tensor, sends, name, holder)
        received = torch.tensor(holder[0], dtype=torch.int32)
    else:
        out, got = _exchanged(tensor, sends, name, caller)
        received = torch.tensor(got, dtype=torch.int32)
    return out if splits is None else (out, received)
