"""Naive allreduce: every rank sends to rank 0, rank 0 reduces, then sends the result to all.

Rank 0 does all p-1 reductions and 2(p-1) transfers of the whole buffer: the baseline.
"""
from . import register

TAG = 101


@register("naive")
def allreduce(comm, buf, op):
    p, rank = comm.nranks, comm.myrank
    if rank != 0:
        comm.Send(buf, dest=0, tag=TAG)
        comm.Recv(buf, source=0, tag=TAG)
        return
    incoming = comm.scratch(buf.size, buf.dtype)
    for src in range(1, p):
        comm.Recv(incoming, source=src, tag=TAG)
        op.combine(buf, incoming, last=(src == p - 1))
    for dst in range(1, p):
        comm.Send(buf, dest=dst, tag=TAG)
