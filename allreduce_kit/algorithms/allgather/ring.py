"""Ring allgather: in step k (0 .. p-2) rank r sends block (r-k) mod p to its right neighbour and
receives block (r-k-1) mod p from its left, straight into ``out``. Each rank sends and receives
(p-1)/p of the buffer: bandwidth-optimal.

``run`` takes who holds which block as an argument, so that a schedule whose blocks start on
other ranks (``broadcast``'s scatter-allgather) uses the same steps.

A call whose ``out`` length, dtype or blocks differ between ranks raises ``ValueError`` on every
rank (``signature.py``): where two neighbours differ, the right one sees it in the first step,
and that reaches every rank but the one it came from in the p-2 steps left; the ranks' calls
differ at two places around the ring at least, and each covers the rank the other misses.
"""
from typing import Sequence

from . import register
from .signature import mismatch, tag as signature
from ..signature import BAD, sendrecv

TAG = 203


def run(comm, out, bounds: Sequence[int], tag: int, first: int = 0) -> int:
    """The ring where rank r starts with block (r - first) mod p; the messages carry ``tag``
    (``signature.py``). Returns the call's tag, with ``BAD`` if the ranks' calls differ."""
    p, rank = comm.nranks, comm.myrank
    right, left = (rank + 1) % p, (rank - 1) % p
    for k in range(p - 1):
        s, a = (rank - first - k) % p, (rank - first - k - 1) % p
        tag = sendrecv(comm, out[bounds[s]:bounds[s + 1]], right, out[bounds[a]:bounds[a + 1]], left, tag)
    return tag


@register("ring")
def allgather(comm, out, bounds):
    if run(comm, out, bounds, signature(comm, out, bounds, TAG)) & BAD:
        raise mismatch(comm, out, bounds, "ring")
