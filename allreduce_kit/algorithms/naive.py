"""Naive allreduce: every rank sends to rank 0, rank 0 reduces, then sends the result to all.

Rank 0 does all p-1 reductions and 2(p-1) transfers of the whole buffer: the baseline.
"""
from . import register
from .signature import BAD, mismatch, recv, send, tag as signature

TAG = 101


@register("naive")
def allreduce(comm, buf, op):
    p, rank = comm.nranks, comm.myrank
    tag = signature(buf, TAG)
    if rank != 0:
        send(comm, buf, 0, tag)
        tag = recv(comm, buf, 0, tag)
    else:
        incoming = comm.scratch(buf.size, buf.dtype)
        for src in range(1, p):
            tag = recv(comm, incoming, src, tag)
            op.combine(buf, incoming, last=(src == p - 1))
        for dst in range(1, p):
            send(comm, buf, dst, tag)
    if tag & BAD:
        raise mismatch(comm, buf, "naive")
