"""Rabenseifner's allreduce: reduce-scatter by recursive halving, allgather by recursive doubling.

The buffer is cut into pof2 near-equal segments. Reduce-scatter: in each of lg p steps a rank
swaps half of the range it is responsible for with the partner whose number differs in the
current bit (highest bit first), keeps the half its own bit selects and combines the partner's
copy of it into its own; afterwards rank r holds the full reduction of segment r. Allgather:
the same steps in reverse (lowest bit first), each doubling the finished range. Every segment
is reduced on exactly one rank and copied to the others, so every rank ends bitwise identical.

Each rank sends 2 (p-1)/p of the buffer in 2 lg p messages and reduces (p-1)/p of it:
bandwidth-optimal like the ring with the tree's message count. MPICH's choice for long
messages. Rank counts that are not a power of two are folded first (``fold.py``); large
reduce-scatter steps go in cache-sized pieces (``pieces.py``).
"""
from functools import lru_cache

from . import pieces, register
from .fold import fold_in, fold_out
from .ring import segment_bounds

TAG = 105


@lru_cache(maxsize=256)
def _bounds(n: int, pof2: int) -> tuple:
    return tuple(segment_bounds(n, pof2))


@register("rabenseifner")
def allreduce(comm, buf, op):
    fold = comm.fold
    if fold.rem:
        fold_in(comm, buf, op, fold)
    me = fold.newrank
    if me >= 0:
        pof2 = fold.pof2
        bounds = _bounds(buf.size, pof2)
        lo, hi = 0, pof2  # the segments this rank is responsible for
        mask = pof2 >> 1
        while mask:  # reduce-scatter by recursive halving
            partner = fold.partners[mask.bit_length() - 1]
            mid = lo + mask
            if me & mask:
                keep_lo, keep_hi, send_lo, send_hi = mid, hi, lo, mid
            else:
                keep_lo, keep_hi, send_lo, send_hi = lo, mid, mid, hi
            parts = pieces.count((bounds[hi] - bounds[lo]) * buf.itemsize // 2, comm)  # partners share lo, hi
            pieces.sendrecv_combine(comm, buf[bounds[send_lo]:bounds[send_hi]], partner,
                                    buf[bounds[keep_lo]:bounds[keep_hi]], partner, TAG, op, mask == 1, parts)
            lo, hi = keep_lo, keep_hi
            mask >>= 1
        mask = 1
        while mask < pof2:  # allgather by recursive doubling
            partner = fold.partners[mask.bit_length() - 1]
            other = lo ^ mask
            comm.Sendrecv(buf[bounds[lo]:bounds[hi]], partner, TAG,
                          buf[bounds[other]:bounds[other + mask]], partner, TAG)
            lo = min(lo, other)
            mask <<= 1
            hi = lo + mask
    if fold.rem:
        fold_out(comm, buf, fold)
