"""``join``: a rank that has run out of data waits for the others while their reductions go on.

Horovod's contract: a rank calls ``join()`` when it has no more batches. Until every rank has
joined, the others' ``allreduce`` calls (``Sum`` or ``Average``) proceed, the joined ranks
contributing zeros (an ``Average`` still divides by the number of ranks); their other calls
(``allgather``, ``broadcast``, ...) raise ``CollectiveError`` (a ``RuntimeError``) on every rank
that made them. ``join()`` returns, on every rank, the rank that joined last.

How a joined rank learns of the others' calls: a call that compares itself across ranks
(``check=True`` or ``ALLREDUCE_KIT_CHECK=1``: ``mpi_ops.agree``) starts with one pickled
``allgather`` of each rank's description of it, and so do ``allgather`` (its shapes) and
``allgather_object``. A joined rank sits in that same ``allgather`` in a loop, sending a
``Joined`` marker instead of a description. From the entries every rank decides alike
(``contribution``): where every rank still in the call describes the same reduction and says
what a joined rank adds to it (a ``Zeros``), the joined ranks run that reduction on zeros;
otherwise the call raises on the ranks that made it and the joined ranks wait for the next
one. When every entry is a marker, every rank has joined and ``join`` returns. Each wait of a
joined rank lasts from one of the others' calls to the next, and is watched as any call is: the
stall inspector ends the job where it passes the stall timeout (a rank that never calls
``join``, or ranks that stop making calls).

A call that does not start with that ``allgather`` (one made without ``check``, a
``DistributedOptimizer``'s gradient reductions, ``barrier``, ``broadcast_object``, calls on
process sets that hold a joined rank) cannot be matched by a joined rank: it stalls, and the
stall inspector names the ranks' calls and ends the job.
"""
from typing import Any, List, NamedTuple, Optional, Sequence

import torch

from ..stall import INSPECTOR
from . import mpi_ops, tensors
from .errors import CollectiveError


class Joined(NamedTuple):
    """What a rank in ``join`` sends in place of a call's description."""

    #: how many calls of the others this rank has waited through in ``join``: the rank that
    #: joined last has waited through the fewest
    waited: int


class Zeros(NamedTuple):
    """What a joined rank contributes to a call: ``mpi_ops.reduce_`` of zeros of this shape, dtype and op."""

    shape: tuple
    dtype: str
    op: str
    what: str


def zeros_for(shape: tuple, dtype: torch.dtype, op: str, what: str) -> Optional[Zeros]:
    """What a joined rank adds to the reduction ``reduce_(tensor, op, what)`` of a tensor of this
    shape and dtype: zeros, for ``Sum`` and ``Average``; None (the call cannot run while a rank
    has joined) for the other ops."""
    if op not in (mpi_ops.Sum, mpi_ops.Average):
        return None
    return Zeros(shape, str(dtype).replace("torch.", ""), op, what)


def joined_ranks(entries: Sequence[Any]) -> List[int]:
    return [r for r, e in enumerate(entries) if isinstance(e, Joined)]


def contribution(entries: Sequence[Any]) -> Optional[Zeros]:
    """The reduction the joined ranks run on zeros for the call whose ``agree`` entries these
    are, or None where the call does not run. Every rank computes it from the same entries."""
    live = [e for e in entries if not isinstance(e, Joined)]
    if not live or not all(isinstance(e, tuple) and len(e) == 3 and e[0] == "ok" for e in live):
        return None
    first = live[0]
    if not isinstance(first[2], Zeros) or any(e[1] != first[1] or e[2] != first[2] for e in live):
        return None
    return first[2]


def refuse(caller: str, entries: Sequence[Any]) -> None:
    """Raise ``CollectiveError`` if a rank has joined (``caller`` cannot run with a joined rank)."""
    joined = joined_ranks(entries)
    if joined:
        raise CollectiveError(f"{caller}: rank{'s' if len(joined) > 1 else ''} {', '.join(map(str, joined))} "
                              f"called join(); until every rank has joined, only allreduce (Sum or Average, "
                              f"with check) can run")


def join(device: int = -1) -> int:
    """Wait until every rank has called ``join``, taking part meanwhile in the others'
    reductions with zeros (module docstring); return the rank that joined last (the highest
    of those that joined in the same call), the same on every rank. ``device`` is taken for
    Horovod's signature (an int; tensors here are CPU tensors). Collective over every rank."""
    if isinstance(device, bool) or not isinstance(device, int):
        raise TypeError(f"join: device must be an int, got {type(device).__name__}")
    if getattr(mpi_ops._on_set, "state", None) is not None:
        raise ValueError("join: call it outside calls on a process set (it joins every rank)")
    s = mpi_ops.state()
    s.drain()
    if s.size == 1:
        return s.rank
    waited = 0
    while True:
        # watched as every call is: a joined rank waits for the others' next call, and the stall
        # inspector names the ranks if none comes within the stall timeout
        with INSPECTOR.watching(s.lib.watch, "join"):
            entries = s.lib.allgather(Joined(waited))
        if len(joined_ranks(entries)) == len(entries):
            fewest = min(e.waited for e in entries)
            return max(r for r, e in enumerate(entries) if e.waited == fewest)
        waited += 1
        zeros = contribution(entries)
        if zeros is not None:
            dtype = getattr(torch, zeros.dtype)
            mpi_ops.reduce_(tensors.empty(zeros.shape, dtype).zero_(), zeros.op, zeros.what)
