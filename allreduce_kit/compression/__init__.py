"""Sending fewer bytes: 16-bit wire formats for allreduce, and PowerSGD for gradients.

``allreduce(buf, compression="fp16" | "bf16")`` reduces a float32 buffer whose messages carry
16-bit values (``wire.py``); every fold is done in float32 and the result, bitwise the same on
every rank, is made of 16-bit values. Only the algorithms in ``COMPRESSED`` run compressed;
``auto`` chooses among them (``choose``). ``reduce_scatter(buf, compression=...)`` likewise, with
the algorithms in ``REDUCE_SCATTER``: the same two, each a reduce-scatter that sends what the
allreduce of that name sends in its reduce-scatter. ``powersgd.py`` holds PowerSGD's state.

=================  ============================================  ================================
name               what it does                                  bytes each rank sends
=================  ============================================  ================================
``ring``           reduce-scatter around the ring, running        2 (p-1)/p n x 2 bytes: half the
                   results sent as 16 bits and folded in          uncompressed ring's
                   float32; the owner rounds its block once;
                   allgather of the 16-bit blocks (``ring.py``)
``hierarchical``   float32 reduce-scatter inside each node, the   2 (N-1)/N n x 2 bytes over each
                   compressed ring of each shard across the       node's link, N nodes; on one
                   nodes, allgather inside the node               node, ``ring``
                   (``hierarchical.py``)
=================  ============================================  ================================

Importing this package (as ``allreduce_kit.torch`` does) loads no MPI: the schedules and the
numba conversions (``WIRES``) are imported when first used. The docs (``docs/compression.md``)
state the error bound.
"""
from typing import Any, Callable, Dict, Tuple

#: What ``allreduce(..., compression=...)`` accepts: ``none`` sends the buffer's own dtype.
COMPRESSIONS: Tuple[str, ...] = ("none", "fp16", "bf16")

#: The ops a compressed allreduce takes: a product's rounding errors compound without bound.
OPS = ("sum", "mean", "max", "min")


def _ring(comm, buf, op, wire) -> None:
    from .ring import allreduce
    allreduce(comm, buf, op, wire)


def _hierarchical(comm, buf, op, wire) -> None:
    from .hierarchical import allreduce
    allreduce(comm, buf, op, wire)


#: name -> compressed allreduce algorithm ``(comm, buf, op, wire)``: the algorithms that accept
#: ``compression`` other than ``"none"``.
COMPRESSED: Dict[str, Callable[..., None]] = {"ring": _ring, "hierarchical": _hierarchical}


def _ring_reduce_scatter(comm, buf, out, op, wire) -> None:
    from .ring import reduce_scatter
    reduce_scatter(comm, buf, out, op, wire)


def _hierarchical_reduce_scatter(comm, buf, out, op, wire) -> None:
    from .hierarchical import reduce_scatter
    reduce_scatter(comm, buf, out, op, wire)


#: name -> compressed reduce-scatter algorithm ``(comm, buf, out, op, wire)``, as ``COMPRESSED``;
#: ``choose`` picks among them as for allreduce.
REDUCE_SCATTER: Dict[str, Callable[..., None]] = {"ring": _ring_reduce_scatter,
                                                  "hierarchical": _hierarchical_reduce_scatter}


def choose(comm: Any, nbytes: int) -> str:
    """``auto``'s compressed algorithm for ``nbytes`` of float32 on ``comm`` (the same on every
    rank): across nodes ``hierarchical`` (16 bits only between the nodes), on one node ``ring``."""
    return "ring" if comm.layout.single_node else "hierarchical"


def __getattr__(name: str) -> Any:
    """``WIRES`` and ``Wire`` (``wire.py``), loaded on first use."""
    if name in ("WIRES", "Wire"):
        from . import wire
        return getattr(wire, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["COMPRESSIONS", "COMPRESSED", "OPS", "REDUCE_SCATTER", "WIRES", "Wire", "choose"]
