"""Sending fewer bytes: 16-bit wire formats for allreduce, and PowerSGD for gradients.

``allreduce(buf, compression="fp16" | "bf16")`` reduces a float32 buffer whose messages carry
16-bit values (``wire.py``); every fold is done in float32 and the result, bitwise the same on
every rank, is made of 16-bit values. Only the algorithms in ``COMPRESSED`` run compressed;
``auto`` chooses among them (``choose``).

=================  ============================================  ================================
name               what it does                                  bytes each rank sends
=================  ============================================  ================================
``ring``           reduce-scatter around the ring, running        2 (p-1)/p n x 2 bytes: half the
                   results sent as 16 bits and folded in          uncompressed ring's
                   float32; the owner rounds its block once;
                   allgather of the 16-bit blocks (``ring.py``)
=================  ============================================  ================================

The docs (``docs/compression.md``) state the error bound.
"""
from typing import Callable, Dict

import numpy as np

from . import ring
from .wire import COMPRESSIONS, WIRES, Wire
from ..comm import LibraryComm
from ..reduction import Reduction

CompressedAlgorithm = Callable[[LibraryComm, np.ndarray, Reduction, Wire], None]

#: name -> compressed allreduce algorithm ``(comm, buf, op, wire)``: the algorithms that accept
#: ``compression`` other than ``"none"``.
COMPRESSED: Dict[str, CompressedAlgorithm] = {"ring": ring.allreduce}

#: The ops a compressed allreduce takes: a product's rounding errors compound without bound.
OPS = ("sum", "mean", "max", "min")


def choose(comm: LibraryComm, nbytes: int) -> str:
    """``auto``'s compressed algorithm for ``nbytes`` of float32 on ``comm`` (the same on every rank)."""
    return "ring"


__all__ = ["COMPRESSIONS", "COMPRESSED", "OPS", "WIRES", "Wire", "choose"]
