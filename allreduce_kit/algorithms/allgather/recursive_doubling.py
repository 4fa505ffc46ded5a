"""Allgather by recursive doubling: lg p steps for a power of two p.

The ranks' blocks are grouped as the folded group's (``fold.py``; the same grouping as
``reduce_scatter``'s ``recursive_halving``): folded rank v < rem stands for ranks 2v and 2v+1 and
holds their two blocks, folded rank v >= rem for rank v + rem. First each even rank below
2 rem sends its block to the odd rank above it. Then, with ``d`` = 1, 2, 4, ... pof2/2, each
folded rank swaps the d folded ranks' blocks it holds (a contiguous range of ``out``) with the
folded rank across bit ``d``, so that it holds 2d. Last, each odd rank below 2 rem sends the
whole ``out`` to its even partner.

A call whose ``out`` length, dtype or blocks differ between ranks raises ``ValueError`` on every
rank (``signature.py``): every rank's ``out`` depends on every rank's block.
"""
from . import register
from .signature import mismatch, tag as signature
from ..fold import plan
from ..reduce_scatter.recursive_halving import folded_bounds
from ..signature import BAD, recv, send, sendrecv

TAG = 204


@register("recursive_doubling")
def allgather(comm, out, bounds):
    p, rank = comm.nranks, comm.myrank
    fold = plan(p, rank)
    tag = signature(comm, out, bounds, TAG)
    if fold.newrank < 0:  # an even rank below 2 rem: hand its block over, get everything back
        send(comm, out[bounds[rank]:bounds[rank + 1]], rank + 1, tag)
        tag = recv(comm, out, rank + 1, tag)
    else:
        if rank < 2 * fold.rem:
            tag = recv(comm, out[bounds[rank - 1]:bounds[rank]], rank - 1, tag)
        fb = folded_bounds(list(bounds), fold.pof2, fold.rem)
        v, d = fold.newrank, 1
        while d < fold.pof2:
            mine, theirs = v & ~(d - 1), (v ^ d) & ~(d - 1)  # the first folded rank of each range of d
            partner = fold.real(v ^ d)
            tag = sendrecv(comm, out[fb[mine]:fb[mine + d]], partner, out[fb[theirs]:fb[theirs + d]], partner, tag)
            d *= 2
        if rank < 2 * fold.rem:
            send(comm, out, rank - 1, tag)
    if tag & BAD:
        raise mismatch(comm, out, bounds, "recursive_doubling")
