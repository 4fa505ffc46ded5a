"""Ring allreduce: reduce-scatter then allgather around a ring, p-1 steps each.

The buffer is cut into p segments whose lengths differ by at most one. In step k of the
reduce-scatter, rank r sends segment (r-k) mod p to its right neighbour and folds the segment
(r-k-1) mod p arriving from its left into its own copy; after p-1 steps rank r holds the full
reduction of segment (r+1) mod p. The allgather then passes the finished segments around the
ring. Each rank sends and receives 2(p-1)/p of the buffer in all: bandwidth-optimal.

Two ways to move the segments, the same steps and the same bits either way:

- on one node, where ranks can read each other's memory (``direct.py``), each step reads the
  segment straight out of the left neighbour's buffer, folding it in cache-sized pieces, once
  the neighbour's counter says it has finished the step before (``_direct``);
- otherwise by messages, ``Sendrecv`` to the right and from the left; large reduce-scatter
  steps go in cache-sized pieces when every rank has a core (``pieces.py``);
- on a communicator that spans nodes, by messages as a stream of pieces, several in flight, each
  forwarded as soon as it has arrived, so that the links between nodes never wait for a step to
  end (``pipelined.py``).

Either way a buffer whose length or dtype differs between ranks raises ``ValueError`` on every
rank (``signature.py``).

The schedule is written twice, as a compiled direct loop and as messages: why, in ``direct.py``.
"""
from numba import njit

from . import direct, pieces, pipelined, register
from ..kernels import reduce as _loops
from .segments import bounds_array, segment_pieces, segments
from .signature import BAD, mismatch, sendrecv, tag as signature

TAG = 103


@njit(cache=True, nogil=True)
def _direct(buf, bounds, state, piece, iov, code, divisor):
    """The ring with direct reads (``direct.py``); 0, -1 if a read failed, ``direct.MISMATCH``
    if the ranks' buffers differ (found before reading the left neighbour, on every rank).

    Counters, from ``first``: rank r has finished reduce-scatter step k at ``first + k + 1`` and
    allgather step k at ``first + p + k``. Rank r reads only from its left neighbour, and only
    once the left has finished the step before. By that chain, when rank r starts allgather
    step k its right neighbour has finished reduce-scatter step k, the last read of the segment
    step k overwrites: only the end of the call needs a wait on the right.
    """
    rank, size = state[0], state[1]
    right, left = (rank + 1) % size, (rank - 1 + size) % size
    first = direct.begin(state, buf, TAG)
    isz = buf.itemsize
    theirs = 0
    for k in range(size - 1):  # reduce-scatter
        s = (rank - k - 1 + size) % size
        theirs = direct.reach(state, left, first + k)  # the left has folded segment s in (step k - 1)
        if theirs < 0:
            return direct.MISMATCH
        mine = buf[bounds[s]:bounds[s + 1]]
        if direct.pull_combine(state, left, mine, theirs + bounds[s] * isz, piece, iov, code) != 0:
            return -1
        if k == size - 2 and divisor != 0:
            _loops.divide(mine, divisor)
        direct.finish(state, first + k + 1)
    for k in range(size - 1):  # allgather
        s = (rank - k + size) % size
        if direct.wait_for(state, left, first + size - 1 + k) != 0:  # segment s is final on the left
            return direct.MISMATCH
        if direct.pull(state, left, buf[bounds[s]:bounds[s + 1]], theirs + bounds[s] * isz, iov) != 0:
            return -1
        direct.finish(state, first + size + k)
    # The caller may change the buffer on return: wait until the right neighbour has read it.
    if direct.wait_for(state, right, first + 2 * size - 2) != 0:
        return direct.MISMATCH
    return 0


@register("ring")
def allreduce(comm, buf, op):
    p, rank = comm.nranks, comm.myrank
    if direct.run(_direct, comm, buf, op, bounds_array(buf.size, p), "ring"):
        return
    if not comm.layout.single_node:  # across nodes: pieces stream through the ring
        pipelined.allreduce(comm, buf, op)
        return
    right, left = (rank + 1) % p, (rank - 1) % p
    seg = segments(buf, p)
    parts = segment_pieces(buf, comm)
    tag = signature(buf, TAG)

    for k in range(p - 1):  # reduce-scatter
        tag = pieces.sendrecv_combine(comm, seg[(rank - k) % p], right, seg[(rank - k - 1) % p], left, tag, op,
                                      k == p - 2, parts)

    for k in range(p - 1):  # allgather
        tag = sendrecv(comm, seg[(rank + 1 - k) % p], right, seg[(rank - k) % p], left, tag)
    if tag & BAD:
        raise mismatch(comm, buf, "ring")
