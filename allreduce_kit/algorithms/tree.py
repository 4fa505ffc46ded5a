"""Binomial-tree allreduce: reduce up a binomial tree to rank 0, then broadcast down it.

Both phases walk the rank bits with ``mask <<= 1``, as in mpi4py's ``demo/reductions``, and
take ceil(lg p) steps each, for any p. Latency-optimal; every step moves the whole buffer.
Each rank's part is a list of steps (``steps.py``), run in compiled code for a short buffer.
"""
from typing import List, Tuple

from . import register, steps
from .steps import COMBINE, LAST, RECV, SEND

TAG = 102


class Binomial(steps.Schedule):
    """This rank's steps of the binomial tree on a communicator."""

    __slots__ = ()


def reduce_to_root(p: int, rank: int) -> List[Tuple[int, int]]:
    """Binomial reduce: afterwards rank 0's buffer holds the full reduction."""
    found = []
    mask = 1
    while mask < p:
        if rank & mask:
            found.append((SEND, rank - mask))
            break
        if rank + mask < p:
            found.append((LAST if rank == 0 and 2 * mask >= p else COMBINE, rank + mask))
        mask <<= 1
    return found


def broadcast_from_root(p: int, rank: int) -> List[Tuple[int, int]]:
    """Binomial broadcast of rank 0's buffer to every rank."""
    found = []
    mask = 1
    while mask < p:
        if rank & mask:
            found.append((RECV, rank - mask))
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if rank + mask < p:
            found.append((SEND, rank + mask))
        mask >>= 1
    return found


@register("tree")
def allreduce(comm, buf, op):
    tree = comm.state.get(Binomial) or comm.attach(
        Binomial, lambda c: Binomial(c, reduce_to_root(c.nranks, c.myrank) + broadcast_from_root(c.nranks, c.myrank), TAG))
    steps.run(comm, buf, op, tree, TAG, "tree")
