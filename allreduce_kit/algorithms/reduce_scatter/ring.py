"""Ring reduce-scatter: p-1 steps, each rank talking only to its two neighbours.

In step k (0 .. p-2) rank r sends its running result for block (r-k-1) mod p to its right
neighbour and receives the left neighbour's running result for block (r-k-2) mod p, into which
it folds its own copy of that block. The block arriving in the last step is block r, which is
then complete: every rank's copy of it has been folded in once. Each rank sends and receives
(p-1)/p of the buffer: bandwidth-optimal. ``buf`` is only read; the running results live in two
scratch blocks that take turns (one is being sent while the other receives).

``run`` can also send the running results as 16-bit values (a ``compression.Wire``): each is
rounded once as it leaves, decoded into float32 where it arrives and folded there in float32,
so each element is rounded once per hop and never summed in 16 bits (compressed allreduce,
``allreduce_kit/compression``).

A buffer whose length or dtype differs between ranks raises ``ValueError`` on every rank
(``signature.py``): every block's result depends on every rank's buffer.
"""
import numpy as np

from . import register
from ...blocks import shard_bounds
from ..signature import BAD, mismatch, sendrecv, tag as signature

TAG = 201
#: Scratch slots of the library's communicator (``LibraryComm.scratch``) used here; the last two
#: hold the 16-bit messages of a compressed call.
SLOTS = (40, 41)
WIRE_SLOTS = (60, 61)


def run(comm, buf, out, op, tag: int, wire=None) -> int:
    """The ring's steps, block r of the result into ``out`` on rank r; the messages carry ``tag``
    (``signature.py``). With ``wire``, the running results travel as its 16-bit values. Returns
    the call's tag, with ``BAD`` if the ranks' calls differ."""
    p, rank = comm.nranks, comm.myrank
    bounds = shard_bounds(buf.size, p)
    right, left = (rank + 1) % p, (rank - 1) % p
    longest = max(bounds[i + 1] - bounds[i] for i in range(p))
    running = [comm.scratch(longest, buf.dtype, slot) for slot in SLOTS]
    s = (rank - 1) % p
    sending = buf[bounds[s]:bounds[s + 1]]  # step 0 sends this rank's own copy
    if wire is not None:
        packed = [comm.scratch(longest, np.uint16, slot) for slot in WIRE_SLOTS]
        sending = wire.encode(packed[1][:sending.size], sending)
    for k in range(p - 1):
        s = (rank - k - 2) % p
        size = bounds[s + 1] - bounds[s]
        last = k == p - 2
        arriving = out if last else running[k % 2][:size]
        if wire is None:
            tag = sendrecv(comm, sending, right, arriving, left, tag)
        else:  # received into one 16-bit slot while the other is sent; re-encoded into the one received
            incoming = packed[k % 2][:size]
            tag = sendrecv(comm, sending, right, incoming, left, tag)
            wire.decode(arriving, incoming)
        op.combine(arriving, buf[bounds[s]:bounds[s + 1]], last)
        sending = arriving if wire is None or last else wire.encode(incoming, arriving)
    return tag


@register("ring")
def reduce_scatter(comm, buf, out, op):
    if run(comm, buf, out, op, signature(buf, TAG)) & BAD:
        raise mismatch(comm, buf, "ring", "reduce_scatter", result="out")
