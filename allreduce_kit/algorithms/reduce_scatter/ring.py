"""Ring reduce-scatter: p-1 steps, each rank talking only to its two neighbours.

In step k (0 .. p-2) rank r sends its running result for block (r-k-1) mod p to its right
neighbour and receives the left neighbour's running result for block (r-k-2) mod p, into which
it folds its own copy of that block. The block arriving in the last step is block r, which is
then complete: every rank's copy of it has been folded in once. Each rank sends and receives
(p-1)/p of the buffer: bandwidth-optimal. ``buf`` is only read; the running results live in two
scratch blocks that take turns (one is being sent while the other receives).

A buffer whose length or dtype differs between ranks raises ``ValueError`` on every rank
(``signature.py``): every block's result depends on every rank's buffer.
"""
from . import register
from ...blocks import shard_bounds
from ..signature import BAD, mismatch, sendrecv, tag as signature

TAG = 201
#: Scratch slots of the library's communicator (``LibraryComm.scratch``) used here.
SLOTS = (40, 41)


@register("ring")
def reduce_scatter(comm, buf, out, op):
    p, rank = comm.nranks, comm.myrank
    bounds = shard_bounds(buf.size, p)
    right, left = (rank + 1) % p, (rank - 1) % p
    longest = max(bounds[i + 1] - bounds[i] for i in range(p))
    running = [comm.scratch(longest, buf.dtype, slot) for slot in SLOTS]
    tag = signature(buf, TAG)
    s = (rank - 1) % p
    sending = buf[bounds[s]:bounds[s + 1]]  # step 0 sends this rank's own copy
    for k in range(p - 1):
        s = (rank - k - 2) % p
        size = bounds[s + 1] - bounds[s]
        last = k == p - 2
        arriving = out if last else running[k % 2][:size]
        tag = sendrecv(comm, sending, right, arriving, left, tag)
        op.combine(arriving, buf[bounds[s]:bounds[s + 1]], last)
        sending = arriving
    if tag & BAD:
        raise mismatch(comm, buf, "ring", "reduce_scatter", result="out")
