"""Binomial-tree broadcast. Counted from the root (virtual rank ``v = (rank - root) mod p``), a
rank receives the buffer from ``v`` less its lowest set bit, then sends it to ``v + 2^k`` for
each bit ``2^k`` below that one, highest first: after step k, 2^(k+1) ranks have it."""
from . import register

TAG = 205


@register("binomial")
def broadcast(comm, buf, root):
    p = comm.nranks
    v = (comm.myrank - root) % p
    mask = 1
    while mask < p:
        if v & mask:
            comm.Recv(buf, (v - mask + root) % p, TAG)
            break
        mask <<= 1
    mask >>= 1
    while mask:
        if v + mask < p:
            comm.Send(buf, (v + mask + root) % p, TAG)
        mask >>= 1
