"""Gradient buckets in memory every rank of the node maps, averaged there with plain loads and stores.

Where all ranks share one node, a ``DistributedOptimizer``'s float32 and float64 buckets live
in one ``MPI_Win_allocate_shared`` window: rank q's flat buffer of bucket k is row q of the
bucket's block (``stride`` elements apart). The gradients are copied into the row (around
the caches for a large bucket: ``STREAM_ROWS``), each ``.grad`` is then a view of its slice of
it, and the bucket is reduced in place by a two-shot schedule that reads and writes the other
ranks' rows directly, in one compiled call:

1. every rank raises its first flag to the call's number once its row holds its gradients,
   and waits until every rank has;
2. rank r owns segment r of the bucket: a piece at a time, it folds every other rank's copy of
   the piece into its own (ranks r+1, r+2, ... mod p, the order of the library's ``two_shot``),
   divides for the mean, and writes the finished piece, still in cache, into every other row;
3. it raises its second flag and waits until every rank has: all rows hold the result.

Each element is computed once, by the rank that owns it, so every rank ends bitwise the same.
Nothing is overwritten while another rank may read it: rank r alone reads segment r of the
other rows, before writing there; and a rank writes its row again (the next call's gradients)
only after every rank has raised its second flag for this call. Against the library's
``allreduce`` on a private buffer this skips the system calls that read another process's
memory (``algorithms/direct.py``) and the copy through a bounce buffer, and the per-call
choice of algorithm: the schedule is fixed when the optimizer is made.

The window (p rows of every bucket, and two cache lines of flags per rank) is freed by
``hvd.shutdown()``, which first gives every ``.grad`` that is a view of it a private copy.
"""
from typing import List, Optional, Sequence

import numpy as np
import torch
from numba import njit

from ..algorithms.spin import NodeWindow, node_of, raise_flag, wait_on, wait_record
from ..kernels import reduce as _loops
from ..kernels.stream import stream_copy
from ..progress import IN_FLIGHT, wait_turn
from ..stall import INSPECTOR

#: Bucket dtypes reduced in the window; others (and compressed buckets) take ``allreduce``.
DTYPES = (torch.float32, torch.float64)
#: Each flag has a cache line of its own; rows and segments start on a cache line.
_LINE = 64
#: Elements folded per piece: the piece of the own row and the peer's copy stay in the 1 MiB L2.
PIECE = 32 << 10
#: A bucket whose rows over the node's ranks fill at least this many bytes gets its gradients
#: copied into the row around the caches (``kernels.stream``): the other ranks then read the row
#: through memory anyway, and an ordinary store first reads each line it writes. Smaller rows
#: are still in a cache when the other ranks read them. Whole training steps of MLPs on the
#: 2-core machine, streamed against cached: 2 MB of gradients (rows of 4 and 16 MB at 2 and 8
#: ranks) 2-6% slower; 17 MB in one bucket, level at 2 ranks (34 MB), 9% faster at 8; 42 MB in
#: buckets of 8-17 MB, 4% and 9% faster.
STREAM_ROWS = 24 << 20
#: In a streamed bucket, gradients smaller than this are copied by one call for all of them.
STREAM_MIN = 64 << 10


@njit(cache=True, nogil=True)
def _two_shot(area, offset, stride, n, state, code, divisor):
    """Reduce ``n`` elements at ``area[offset + q * stride:]`` over the ranks q in place (the
    module docstring's three steps). ``state``: this rank, the rank count, the flags' address,
    the address of the window's ``wait`` record (``spin.wait_on``), the last call's number
    (advanced here)."""
    rank, size, flags, wait = state[0], state[1], state[2], state[3]
    state[4] += 1
    gen = state[4]
    raise_flag(flags + _LINE * 2 * rank, gen, wait)
    for k in range(size):
        wait_on(flags + _LINE * 2 * k, gen, wait)
    align = _LINE // area.itemsize
    chunk = ((n + size - 1) // size + align - 1) // align * align
    start, end = min(rank * chunk, n), min((rank + 1) * chunk, n)
    mine = offset + rank * stride
    while start < end:
        stop = min(start + PIECE, end)
        piece = area[mine + start:mine + stop]
        for k in range(1, size):
            theirs = offset + ((rank + k) % size) * stride
            _loops.combine(piece, area[theirs + start:theirs + stop], code)
        if divisor != 0:
            _loops.divide(piece, divisor)
        for k in range(1, size):
            theirs = offset + ((rank + k) % size) * stride
            _loops.copy(area[theirs + start:theirs + stop], piece)
        start = stop
    raise_flag(flags + _LINE * (2 * rank + 1), gen, wait)
    for k in range(size):
        wait_on(flags + _LINE * (2 * k + 1), gen, wait)


def _padded(nbytes: int) -> int:
    return -(-nbytes // _LINE) * _LINE


class SharedBuckets:
    """One optimizer's window: every rank's flat buffer of each bucket, and the flags."""

    def __init__(self, lib, node, counts: Sequence[int], dtypes: Sequence[torch.dtype]):
        size, rank = node.Get_size(), node.Get_rank()
        self.lib = lib
        self.size = size
        flag_bytes = 2 * _LINE * size
        blocks, at = [], flag_bytes
        for count, dtype in zip(counts, dtypes):
            row = _padded(count * torch.empty(0, dtype=dtype).element_size()) if dtype in DTYPES else 0
            blocks.append((at, row))
            at += size * row
        self.window = NodeWindow(node, at, lib.oversubscribed)
        memory = self.window.memory
        memory[2 * rank * _LINE:2 * (rank + 1) * _LINE] = 0
        self._record = self.window.record
        self.state = np.array([rank, size, memory.ctypes.data, self._record.ctypes.data, 0], np.int64)
        self._areas, self._calls = [], []
        #: ``flats[k]``: this rank's flat buffer of bucket k in the window, None if its dtype is not in DTYPES
        self.flats: List[Optional[torch.Tensor]] = []
        for (at, row), count, dtype in zip(blocks, counts, dtypes):
            if dtype not in DTYPES:
                self._areas.append(None)
                self._calls.append((0, 0))
                self.flats.append(None)
                continue
            itemsize = torch.empty(0, dtype=dtype).element_size()
            area = memory[at:at + size * row].view(np.dtype(str(dtype).replace("torch.", "")))
            self._areas.append(area)
            self._calls.append((row // itemsize, count))
            self.flats.append(torch.from_numpy(area[rank * (row // itemsize):rank * (row // itemsize) + count]))
        INSPECTOR.start()
        node.Barrier()  # every flag is 0 before any rank raises one

    def yield_while_waiting(self) -> None:
        """Give up the core on every turn of a wait for another rank's flag from now on (the
        window spins without yielding unless the node has more ranks than cores): for a
        background thread on cores that backward keeps busy, where a spinning wait would take
        its time from backward."""
        if self.window.mode == "spin":
            self._record = wait_record("yield")
            self.state[3] = self._record.ctypes.data

    def fill(self, k: int, into: List[torch.Tensor], grads: List[torch.Tensor]) -> None:
        """Copy each of ``grads`` into ``into``, its view of this rank's row of bucket ``k``."""
        stride, _ = self._calls[k]
        if self.size * stride * self._areas[k].itemsize < STREAM_ROWS:
            torch._foreach_copy_(into, grads)
            return
        rest_into, rest = [], []
        for view, grad in zip(into, grads):
            if grad.is_contiguous() and not grad.is_neg() and grad.numel() * grad.element_size() >= STREAM_MIN:
                stream_copy(view.view(-1).numpy(), grad.view(-1).numpy())
            else:
                rest_into.append(view)
                rest.append(grad)
        if rest:
            torch._foreach_copy_(rest_into, rest)

    def reduce(self, k: int, op: str, what: str) -> None:
        """Reduce bucket ``k`` (``flats[k]`` on every rank) in place with ``op`` (sum or mean)."""
        stride, count = self._calls[k]
        reduction = self.lib.reductions[op]
        if IN_FLIGHT[0]:
            wait_turn()  # after the nonblocking calls started before it (``progress``)
        watch = self.lib.watch   # the stall inspector's bookkeeping, as in ``collective.allreduce``
        watch.calls += 1
        INSPECTOR.current = (watch, None, what, None)
        try:
            _two_shot(self._areas[k], 0, stride, count, self.state, reduction.code, reduction.divisor)
        finally:
            INSPECTOR.current = None

    def free(self) -> None:
        """Free the window (collective); ``flats`` must no longer be used."""
        self.flats, self._areas = [], []
        self.window.free()


def make(lib, counts: Sequence[int], dtypes: Sequence[torch.dtype]) -> Optional[SharedBuckets]:
    """A window for the buckets of ``counts`` elements of ``dtypes`` over ``lib``'s ranks (those
    of a dtype in ``DTYPES``), or None where the ranks are not all on one node or no bucket
    qualifies. Collective over ``lib``; every rank must pass the same."""
    if lib.nranks == 1 or not any(d in DTYPES for d in dtypes) or lib.reductions["sum"].code is None:
        return None
    node = node_of(lib)
    return None if node is None else SharedBuckets(lib, node, counts, dtypes)
