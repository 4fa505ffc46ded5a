"""Rabenseifner's allreduce: reduce-scatter by recursive halving, allgather by recursive doubling.

The buffer is cut into pof2 near-equal segments. Reduce-scatter: in each of lg p steps a rank
swaps half of the range it is responsible for with the partner whose number differs in the
current bit (highest bit first), keeps the half its own bit selects and combines the partner's
copy of it into its own; afterwards rank r holds the full reduction of segment r. Allgather:
the same steps in reverse (lowest bit first), each doubling the finished range. Every segment
is reduced on exactly one rank and copied to the others, so every rank ends bitwise identical.

Each rank sends 2 (p-1)/p of the buffer in 2 lg p messages and reduces (p-1)/p of it:
bandwidth-optimal like the ring with the tree's message count. MPICH's choice for long
messages. Rank counts that are not a power of two are folded first (``fold.py``).

Two ways to move the ranges, the same steps and the same bits either way:

- on one node, where ranks can read each other's memory (``direct.py``), each step reads the
  partner's range straight out of its buffer, folding it in cache-sized pieces, once the
  partner's counter says it has finished the step before (``_direct``; the fold too);
- otherwise by messages, ``Sendrecv`` with the partner; large reduce-scatter steps go in
  cache-sized pieces when every rank has a core (``pieces.py``).

The schedule is written twice, as a compiled direct loop and as messages: why, in ``direct.py``.
Either way a buffer whose length or dtype differs between ranks raises ``ValueError`` on every
rank (``signature.py``).
"""
from functools import lru_cache

from numba import njit

from . import direct, pieces, register
from ..kernels import reduce as _loops
from .fold import fold_in, fold_out, fold_of, real_rank
from .segments import bounds_array, segment_bounds
from .signature import BAD, mismatch, sendrecv, tag as signature

TAG = 105


@lru_cache(maxsize=256)
def _bounds(n: int, pof2: int) -> tuple:
    return tuple(segment_bounds(n, pof2))


@njit(cache=True, nogil=True)
def _direct(buf, bounds, state, piece, iov, code, divisor):
    """Rabenseifner with direct reads (``direct.py``), the fold included; 0, -1 if a read failed,
    ``direct.MISMATCH`` if the ranks' buffers differ (found before reading a peer whose buffer
    differs, and then on every rank: each rank reads every partner, and the odd rank of a fold
    its even partner, in the reduce-scatter).

    Every step reads the partner's copy of the range this rank keeps (or, in the allgather, the
    partner's finished range) out of the partner's buffer, in the steps and fold order of the
    message version. Counters, from ``first``: a rank has folded its even partner in (or had
    none to fold; or, sitting out, has passed ``direct.begin``) at ``first + 1``, finished
    reduce-scatter step i at ``first + 2 + i`` and allgather step j at ``first + 2 + L + j``
    (L = lg pof2), and is done at ``first + 2 + 2L``.
    A read waits for the partner to have finished the step before, so it sees that step's
    result; nothing is overwritten while someone may still read it: the range a rank hands its
    partner in a reduce-scatter step is left alone until the allgather step with the same
    partner writes the partner's finished range there, and that range is finished only after
    the partner's last read; and a rank returns only once every rank that reads its buffer
    (its partners, and the even partner that takes the result back) has finished reading.
    """
    rank, size = state[0], state[1]
    pof2 = bounds.size - 1  # ``bounds`` cuts the buffer into pof2 segments
    rem, levels = size - pof2, 0
    while (1 << levels) < pof2:
        levels += 1
    first = direct.begin(state, buf, TAG)
    done = first + 2 + 2 * levels
    isz = buf.itemsize
    if rank < 2 * rem and rank % 2 == 0:  # sits out: hand over the buffer, take the result back
        partner = rank + 1
        direct.finish(state, first + 1)  # past ``begin``: the partner may read the buffer
        theirs = direct.reach(state, partner, done - 1)
        if theirs < 0:
            return direct.MISMATCH
        if direct.pull(state, partner, buf, theirs, iov) != 0:
            return -1
    else:
        me = rank // 2 if rank < 2 * rem else rank - rem
        if rank < 2 * rem:  # fold the even partner's buffer in
            theirs = direct.reach(state, rank - 1, first + 1)
            if theirs < 0:
                return direct.MISMATCH
            if direct.pull_combine(state, rank - 1, buf, theirs, piece, iov, code) != 0:
                return -1
        direct.finish(state, first + 1)
        lo, hi = 0, pof2  # the segments this rank is responsible for
        for i in range(levels):  # reduce-scatter by recursive halving
            mask = pof2 >> (i + 1)
            partner = real_rank(me ^ mask, rem)
            if me & mask:
                lo = lo + mask
            else:
                hi = lo + mask
            theirs = direct.reach(state, partner, first + 1 + i)
            if theirs < 0:
                return direct.MISMATCH
            mine = buf[bounds[lo]:bounds[hi]]
            if direct.pull_combine(state, partner, mine, theirs + bounds[lo] * isz, piece, iov, code) != 0:
                return -1
            if i == levels - 1 and divisor != 0:
                _loops.divide(mine, divisor)
            direct.finish(state, first + 2 + i)
        for j in range(levels):  # allgather by recursive doubling
            mask = 1 << j
            partner = real_rank(me ^ mask, rem)
            theirs_lo = lo ^ mask
            theirs = direct.reach(state, partner, first + 1 + levels + j)
            if theirs < 0:
                return direct.MISMATCH
            a, b = bounds[theirs_lo], bounds[theirs_lo + mask]
            if direct.pull(state, partner, buf[a:b], theirs + a * isz, iov) != 0:
                return -1
            lo = min(lo, theirs_lo)
            direct.finish(state, first + 2 + levels + j)
        # The caller may change the buffer on return: wait until every rank that reads it has
        # finished its reads (the partners, and the even partner that takes the result back).
        for j in range(levels):
            if direct.wait_for(state, real_rank(me ^ (1 << j), rem), done - 1) != 0:
                return direct.MISMATCH
        if rank < 2 * rem and direct.wait_for(state, rank - 1, done) != 0:
            return direct.MISMATCH
    direct.finish(state, done)
    return 0


@register("rabenseifner")
def allreduce(comm, buf, op, name: str = "rabenseifner"):
    """``name``: the algorithm the caller asked for, for the error if the ranks' buffers differ."""
    fold = fold_of(comm)
    if direct.run(_direct, comm, buf, op, bounds_array(buf.size, fold.pof2), "rabenseifner"):
        return
    tag = signature(buf, TAG)
    if fold.rem:
        tag = fold_in(comm, buf, op, fold, tag)
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
            tag = pieces.sendrecv_combine(comm, buf[bounds[send_lo]:bounds[send_hi]], partner,
                                          buf[bounds[keep_lo]:bounds[keep_hi]], partner, tag, op, mask == 1, parts)
            lo, hi = keep_lo, keep_hi
            mask >>= 1
        mask = 1
        while mask < pof2:  # allgather by recursive doubling
            partner = fold.partners[mask.bit_length() - 1]
            other = lo ^ mask
            tag = sendrecv(comm, buf[bounds[lo]:bounds[hi]], partner,
                           buf[bounds[other]:bounds[other + mask]], partner, tag)
            lo = min(lo, other)
            mask <<= 1
            hi = lo + mask
    if fold.rem:
        tag = fold_out(comm, buf, fold, tag)
    if tag & BAD:
        raise mismatch(comm, buf, name)
