"""Binomial-tree allreduce: reduce up a binomial tree to rank 0, then broadcast down it.

Both phases walk the rank bits with ``mask <<= 1``, as in mpi4py's ``demo/reductions``, and
take ceil(lg p) steps each, for any p. Latency-optimal; every step moves the whole buffer.
"""
from . import register
from .signature import BAD, mismatch, recv, send, tag as signature

TAG = 102


def reduce_to_root(comm, buf, op, tag: int) -> int:
    """Binomial reduce: afterwards rank 0's ``buf`` holds the full reduction. ``tag``: the
    call's (``signature.py``), returned with ``BAD`` if a received message showed a mismatch."""
    p, rank = comm.nranks, comm.myrank
    incoming = None
    mask = 1
    while mask < p:
        if rank & mask:
            send(comm, buf, rank - mask, tag)
            return tag
        if rank + mask < p:
            if incoming is None:
                incoming = comm.scratch(buf.size, buf.dtype)
            tag = recv(comm, incoming, rank + mask, tag)
            op.combine(buf, incoming, last=(rank == 0 and 2 * mask >= p))
        mask <<= 1
    return tag


def broadcast_from_root(comm, buf, tag: int) -> int:
    """Binomial broadcast of rank 0's ``buf`` to every rank (``tag`` as in ``reduce_to_root``)."""
    p, rank = comm.nranks, comm.myrank
    mask = 1
    while mask < p:
        if rank & mask:
            tag = recv(comm, buf, rank - mask, tag)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if rank + mask < p:
            send(comm, buf, rank + mask, tag)
        mask >>= 1
    return tag


@register("tree")
def allreduce(comm, buf, op):
    tag = broadcast_from_root(comm, buf, reduce_to_root(comm, buf, op, signature(buf, TAG)))
    if tag & BAD:
        raise mismatch(comm, buf, "tree")
