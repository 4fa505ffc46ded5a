"""Binomial-tree allreduce: reduce up a binomial tree to rank 0, then broadcast down it.

Both phases walk the rank bits with ``mask <<= 1``, as in mpi4py's ``demo/reductions``, and
take ceil(lg p) steps each, for any p. Latency-optimal; every step moves the whole buffer.
"""
from . import register

TAG = 102


def reduce_to_root(comm, buf, op) -> None:
    """Binomial reduce: afterwards rank 0's ``buf`` holds the full reduction."""
    p, rank = comm.nranks, comm.myrank
    incoming = None
    mask = 1
    while mask < p:
        if rank & mask:
            comm.Send(buf, dest=rank - mask, tag=TAG)
            return
        if rank + mask < p:
            if incoming is None:
                incoming = comm.scratch(buf.size, buf.dtype)
            comm.Recv(incoming, source=rank + mask, tag=TAG)
            op.combine(buf, incoming, last=(rank == 0 and 2 * mask >= p))
        mask <<= 1


def broadcast_from_root(comm, buf) -> None:
    """Binomial broadcast of rank 0's ``buf`` to every rank."""
    p, rank = comm.nranks, comm.myrank
    mask = 1
    while mask < p:
        if rank & mask:
            comm.Recv(buf, source=rank - mask, tag=TAG)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if rank + mask < p:
            comm.Send(buf, dest=rank + mask, tag=TAG)
        mask >>= 1


@register("tree")
def allreduce(comm, buf, op):
    reduce_to_root(comm, buf, op)
    broadcast_from_root(comm, buf)
