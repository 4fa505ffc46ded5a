"""Compressed ring allreduce: ``reduce_scatter``'s ring with 16-bit messages, then ``allgather``'s
ring on the 16-bit blocks; compressed ring reduce-scatter: its first two steps.

1. Reduce-scatter (``algorithms/reduce_scatter/ring.py``, ``run(..., wire)``): each rank's running
   result for a block leaves as 16-bit values, is decoded into float32 where it arrives and is
   folded there, in float32, with that rank's own float32 copy of the block. After p-1 steps
   rank r holds block r, reduced in float32 (a mean divided in the last fold).
2. Rank r rounds block r to 16 bits once, into a 16-bit copy of the whole buffer.
3. Allgather (``algorithms/allgather/ring.py``) passes the 16-bit blocks around the ring.
4. Every rank, block r's owner too, decodes the whole 16-bit buffer into ``buf``: the result is
   bitwise the same on every rank, and every element of it is a 16-bit value.

Each rank sends (p-1)/p of the buffer in each phase, at 2 bytes an element: half the
uncompressed ring's bytes. Each element is rounded to 16 bits at most once per hop: p times on
its way to the result (p-1 hops and the final rounding), never summed in 16 bits.

``reduce_scatter`` stops after step 2, rank r's block in place of the whole buffer: block r of
the compressed allreduce, bitwise, having sent half of its bytes.
"""
import numpy as np

from ..algorithms.allgather import ring as allgather_ring
from ..algorithms.reduce_scatter import ring as reduce_scatter_ring
from ..algorithms.signature import BAD, mismatch, tag as signature
from ..blocks import shard_bounds

TAG = 112  # not 109: hierarchical's node allgather sends with its TAG + 1
#: Scratch slots of the library's communicator: the finished block, the 16-bit whole buffer.
BLOCK, PACKED = 62, 63


def allreduce(comm, buf: np.ndarray, op, wire) -> None:
    """``buf`` (float32, 1-D) reduced with ``op`` across ``comm`` (at least 2 ranks), its
    messages in ``wire``'s 16-bit format."""
    p, rank = comm.nranks, comm.myrank
    bounds = shard_bounds(buf.size, p)
    lo, hi = bounds[rank], bounds[rank + 1]
    block = comm.scratch(hi - lo, buf.dtype, BLOCK)
    tag = reduce_scatter_ring.run(comm, buf, block, op, signature(buf, TAG), wire)
    packed = comm.scratch(buf.size, np.uint16, PACKED)
    wire.encode(packed[lo:hi], block)
    tag = allgather_ring.run(comm, packed, bounds, tag)
    if tag & BAD:
        raise mismatch(comm, buf, "ring")
    wire.decode(buf, packed)


def reduce_scatter(comm, buf: np.ndarray, out: np.ndarray, op, wire) -> None:
    """Block r of ``buf`` (float32, 1-D) reduced with ``op`` across ``comm`` (at least 2 ranks) into
    ``out`` on rank r, the messages in ``wire``'s 16-bit format, the block rounded to it once."""
    if reduce_scatter_ring.run(comm, buf, out, op, signature(buf, TAG), wire) & BAD:
        raise mismatch(comm, buf, "ring", "reduce_scatter", result="out")
    wire.round(out)
