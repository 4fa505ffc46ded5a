"""``reducescatter``: every rank gets its block of rows of the sum (or average) over the ranks.

Rank ``r`` of ``p`` gets rows ``[start_r, start_r + rows_r)`` of the reduced tensor, where
``rows_r = n // p + (1 if r < n % p else 0)`` for a first dimension of ``n`` rows (the first
``n % p`` ranks get one row more, so any ``n`` works, even ``n < p``). Every rank passes a tensor
of the same shape and dtype; the shapes are compared across ranks first (one small exchange), so
a difference raises ``CollectiveError`` on every rank. Ops: ``Sum`` and ``Average`` (``Average``
by default; an integer average is rounded toward zero). Scale factors as ``allreduce``'s.
Differentiable: the gradient is the allgather of the output's gradient (times the set's size for
``Sum``, times the scale factors), as Horovod defines it.

The reduction itself is ``scatter_sum`` (MPI's ``Reduce_scatter`` on the library's
communicator); float16 and bfloat16 are summed in float32.
"""
from typing import List, Optional, Tuple

import numpy as np
import torch
from mpi4py import MPI

from ..stall import INSPECTOR
from . import mpi_ops, tensors
from .compression import Compression, check_compression
from .errors import CollectiveError
from .scaling import scale_
from .tensors import check_tensor


def row_blocks(rows: int, parts: int) -> List[Tuple[int, int]]:
    """``(start, count)`` of each of ``parts`` blocks of ``rows`` rows: the first ``rows % parts``
    blocks have one row more."""
    base, extra = divmod(rows, parts)
    blocks, start = [], 0
    for r in range(parts):
        count = base + (1 if r < extra else 0)
        blocks.append((start, count))
        start += count
    return blocks


def scatter_sum(lib: mpi_ops.LibraryComm, send: np.ndarray, counts: List[int], what: str) -> np.ndarray:
    """This rank's block of the element-wise sum over ``lib``'s ranks of the flat array ``send``,
    block ``r`` being ``counts[r]`` elements long (collective)."""
    out = np.empty(counts[lib.myrank], dtype=send.dtype)
    with INSPECTOR.watching(lib.watch, f"{what} ({send.nbytes} bytes)"):
        lib.Reduce_scatter(send, out, counts, op=MPI.SUM)
    return out


def _check(tensor, op, caller: str) -> str:
    check_tensor(tensor, caller, dtypes=tensors.REDUCIBLE)
    if tensor.dim() == 0:
        raise ValueError(f"{caller}: tensor must have at least one dimension (its rows are scattered)")
    name = mpi_ops.reduce_op(op, None, caller)
    if name not in (mpi_ops.Sum, mpi_ops.Average):
        raise ValueError(f"{caller}: op {op!r} is not supported; use Sum or Average")
    return name


def _reduce_scattered(tensor: torch.Tensor, op: str, prescale: float, postscale: float, name: Optional[str],
                      caller: str) -> torch.Tensor:
    s = mpi_ops.state()
    s.drain()
    what = f"{caller}({name!r})" if name else caller
    with INSPECTOR.watching(s.lib.watch, f"{what}: comparing shapes across ranks"):
        entries = s.lib.allgather(tensors.signature(tensor))
    if any(e != entries[0] for e in entries):
        raise CollectiveError(f"{caller}: shape or dtype differs between ranks ({mpi_ops._difference(entries)})")
    blocks = row_blocks(tensor.shape[0], s.size)
    row = 1
    for n in tensor.shape[1:]:
        row *= int(n)
    wide = tensor.dtype in tensors.HALF
    send = scale_(tensor.detach().clone(memory_format=torch.contiguous_format), prescale)
    if wide:
        send = send.float()
    mine = scatter_sum(s.lib, send.reshape(-1).numpy(), [count * row for _, count in blocks], what)
    out = torch.from_numpy(mine).view(blocks[s.rank][1], *tensor.shape[1:])
    if wide:
        out = out.to(tensor.dtype)
    if op == mpi_ops.Average:
        out = out.div_(s.size) if out.dtype.is_floating_point else out.div_(s.size, rounding_mode="trunc")
    return scale_(out.contiguous(), postscale)


class _ReducescatterFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, prescale, postscale, name):
        ctx.scale = (mpi_ops.state().size if op == mpi_ops.Sum else 1) * prescale * postscale
        ctx.state = mpi_ops.state()
        return _reduce_scattered(tensor, op, prescale, postscale, name, "reducescatter")

    @staticmethod
    def backward(ctx, grad):
        previous = getattr(mpi_ops._on_set, "state", None)
        mpi_ops._on_set.state = ctx.state if ctx.state is not mpi_ops._state else None
        try:
            gathered = mpi_ops.allgather(grad.contiguous() * ctx.scale)
        finally:
            mpi_ops._on_set.state = previous
        return gathered, None, None, None, None


def reducescatter_here(tensor: torch.Tensor, name: Optional[str] = None, compression=Compression.none,
                       op=mpi_ops.Average, prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    """``reducescatter`` over this thread's current set (``calls.reducescatter`` is the public one)."""
    caller = "reducescatter"
    opname = _check(tensor, op, caller)
    check_compression(compression, caller)
    pre = mpi_ops.factor(prescale_factor, caller, "prescale_factor")
    post = mpi_ops.factor(postscale_factor, caller, "postscale_factor")
    if name is not None and not isinstance(name, str):
        raise TypeError(f"{caller}: name must be a str, got {type(name).__name__}")
    compressed, ctx = compression.compress(tensor)
    if compressed.requires_grad and torch.is_grad_enabled():
        out = _ReducescatterFunction.apply(compressed, opname, pre, post, name)
    else:
        out = _reduce_scattered(compressed, opname, pre, post, name, caller)
    return compression.decompress(out, ctx)
