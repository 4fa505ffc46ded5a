"""Ring allreduce: reduce-scatter then allgather around a ring, p-1 steps each.

The buffer is cut into p segments whose lengths differ by at most one. In step k of the
reduce-scatter, rank r sends segment (r-k) mod p to its right neighbour and folds the segment
(r-k-1) mod p arriving from its left into its own copy; after p-1 steps rank r holds the full
reduction of segment (r+1) mod p. The allgather then passes the finished segments around the
ring. Each rank sends and receives 2(p-1)/p of the buffer in all: bandwidth-optimal. Large
reduce-scatter steps go in cache-sized pieces (``pieces.py``).
"""
from . import pieces, register

TAG = 103


def segment_bounds(n: int, p: int) -> list:
    """Start offsets of p near-equal segments of n elements, plus n at the end."""
    return [(i * n) // p for i in range(p + 1)]


@register("ring")
def allreduce(comm, buf, op):
    p, rank = comm.nranks, comm.myrank
    right, left = (rank + 1) % p, (rank - 1) % p
    bounds = segment_bounds(buf.size, p)
    seg = [buf[bounds[i]:bounds[i + 1]] for i in range(p)]
    parts = pieces.count(-(-buf.size // p) * buf.itemsize, comm)

    for k in range(p - 1):  # reduce-scatter
        pieces.sendrecv_combine(comm, seg[(rank - k) % p], right, seg[(rank - k - 1) % p], left, TAG, op,
                                k == p - 2, parts)

    for k in range(p - 1):  # allgather
        comm.Sendrecv(seg[(rank + 1 - k) % p], right, TAG, seg[(rank - k) % p], left, TAG)
