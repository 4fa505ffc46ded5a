"""Reduce-scatter by recursive halving: lg p steps for a power of two p.

The ranks' blocks are grouped as the folded group's (``fold.py``): with ``pof2`` the largest
power of two <= p and ``rem = p - pof2``, folded rank v < rem stands for ranks 2v and 2v+1 and
owns their two blocks (which are next to each other), folded rank v >= rem for rank v + rem.
First each even rank below 2 rem sends its whole buffer to the odd rank above it, which folds it
into a copy of its own. Then, with ``d`` = pof2/2, pof2/4, ... 1, each folded rank swaps half of
the blocks it still holds with the folded rank across bit ``d``: it sends the half that holds
the partner's blocks, keeps the half that holds its own, and folds the partner's copy of that
half in. After the last step each folded rank holds its own blocks, complete; an odd rank below
2 rem sends its even partner that rank's block. Each rank of the folded group sends and
receives (pof2-1)/pof2 of the buffer in lg pof2 messages.

A buffer whose length or dtype differs between ranks raises ``ValueError`` on every rank
(``signature.py``): every block's result depends on every rank's buffer.
"""
from . import register
from ...blocks import shard_bounds
from ..fold import plan
from ..signature import BAD, mismatch, recv, send, sendrecv, tag as signature

TAG = 202
#: Scratch slots of the library's communicator (``LibraryComm.scratch``) used here.
WORK, INCOMING = 42, 43


def folded_bounds(bounds: list, pof2: int, rem: int) -> list:
    """Start of each folded rank's blocks, then n: folded rank v holds ``[fb[v], fb[v + 1])``."""
    return [bounds[2 * v if v < rem else v + rem] for v in range(pof2)] + [bounds[-1]]


@register("recursive_halving")
def reduce_scatter(comm, buf, out, op):
    p, rank = comm.nranks, comm.myrank
    fold = plan(p, rank)
    bounds = shard_bounds(buf.size, p)
    tag = signature(buf, TAG)
    if fold.newrank < 0:  # an even rank below 2 rem: hand everything over, get the block back
        send(comm, buf, rank + 1, tag)
        tag = recv(comm, out, rank + 1, tag)
        return _done(comm, buf, tag)
    work = comm.scratch(buf.size, buf.dtype, WORK)
    if rank < 2 * fold.rem:  # an odd rank below 2 rem: fold the even partner's buffer into a copy
        tag = recv(comm, work, rank - 1, tag)
        op.combine(work, buf)
    else:
        work[:] = buf
    fb = folded_bounds(bounds, fold.pof2, fold.rem)
    v, lo, hi = fold.newrank, 0, fold.pof2  # the folded ranks whose blocks this rank still holds
    incoming = comm.scratch(buf.size, buf.dtype, INCOMING)
    d = fold.pof2 // 2
    while d:
        middle = lo + d
        if v < middle:
            keep, give = (lo, middle), (middle, hi)
        else:
            keep, give = (middle, hi), (lo, middle)
        kept = work[fb[keep[0]]:fb[keep[1]]]
        arriving = incoming[:kept.size]
        partner = fold.real(v ^ d)
        tag = sendrecv(comm, work[fb[give[0]]:fb[give[1]]], partner, arriving, partner, tag)
        op.combine(kept, arriving, d == 1)
        lo, hi = keep
        d //= 2
    if rank < 2 * fold.rem:  # the two blocks of ranks rank - 1 and rank
        send(comm, work[bounds[rank - 1]:bounds[rank]], rank - 1, tag)
    out[:] = work[bounds[rank]:bounds[rank + 1]]
    _done(comm, buf, tag)


def _done(comm, buf, tag: int) -> None:
    if tag & BAD:
        raise mismatch(comm, buf, "recursive_halving", "reduce_scatter", result="out")
