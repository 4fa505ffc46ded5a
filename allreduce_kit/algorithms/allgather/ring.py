"""Ring allgather: in step k (0 .. p-2) rank r sends block (r-k) mod p to its right neighbour and
receives block (r-k-1) mod p from its left, straight into ``out``. Each rank sends and receives
(p-1)/p of the buffer: bandwidth-optimal.

``run`` takes who holds which block as an argument, so that a schedule whose blocks start on
other ranks (``broadcast``'s scatter-allgather) uses the same steps.
"""
from typing import Sequence

from . import register

TAG = 203


def run(comm, out, bounds: Sequence[int], first: int = 0) -> None:
    """The ring where rank r starts with block (r - first) mod p."""
    p, rank = comm.nranks, comm.myrank
    right, left = (rank + 1) % p, (rank - 1) % p
    for k in range(p - 1):
        s, a = (rank - first - k) % p, (rank - first - k - 1) % p
        comm.Sendrecv(out[bounds[s]:bounds[s + 1]], right, TAG, out[bounds[a]:bounds[a + 1]], left, TAG)


@register("ring")
def allgather(comm, out, bounds):
    run(comm, out, bounds)
