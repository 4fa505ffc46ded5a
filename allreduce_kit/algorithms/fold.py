"""Fold a rank count that is not a power of two into one that is, as MPICH does.

With ``pof2`` the largest power of two <= p and ``rem = p - pof2``, each of the first ``rem``
even ranks sends its buffer to the odd rank above it, which folds it in and stands for both;
the even rank sits out. The ``pof2`` ranks left (odd ranks below ``2 rem``, and every rank from
``2 rem`` up) run a power-of-two algorithm under new ranks ``0 .. pof2-1``; afterwards each odd
rank hands the result back to its even partner. Cost: one extra transfer and reduction of the
whole buffer before, and one transfer after (Thakur, Rabenseifner & Gropp 2005, section 4).
The messages carry the call's tag (``signature.py``), like every other step's.
"""
from functools import lru_cache
from typing import NamedTuple

from numba import njit

from .signature import recv, send


@njit(cache=True, nogil=True)
def real_rank(newrank, rem):
    """The communicator rank that plays ``newrank`` in a group folded with ``rem`` ranks sitting
    out (compiled, so that direct loops can call it too)."""
    return 2 * newrank + 1 if newrank < rem else newrank + rem


class Fold(NamedTuple):
    """This rank's place in the folded group."""

    pof2: int     #: the power of two the group is folded to
    rem: int      #: p - pof2: how many even ranks sit out
    rank: int     #: this rank in the communicator
    newrank: int  #: this rank in the folded group, or -1 if it sits out
    #: the real rank across bit k of ``newrank`` for k = 0, 1, ...: the partners of recursive
    #: doubling, lowest bit first (empty for a rank that sits out)
    partners: tuple

    def real(self, newrank: int) -> int:
        """The communicator rank that plays ``newrank`` in the folded group."""
        return int(real_rank(newrank, self.rem))


@lru_cache(maxsize=None)
def plan(p: int, rank: int) -> Fold:
    """The fold for ``rank`` of ``p`` ranks (cached: computed once per communicator shape)."""
    pof2 = 1 << (p.bit_length() - 1)
    rem = p - pof2
    if rank < 2 * rem:
        newrank = -1 if rank % 2 == 0 else rank // 2
    else:
        newrank = rank - rem
    fold = Fold(pof2, rem, rank, newrank, ())
    if newrank < 0:
        return fold
    return fold._replace(partners=tuple(fold.real(newrank ^ (1 << k)) for k in range(pof2.bit_length() - 1)))


def fold_of(comm) -> Fold:
    """``comm``'s fold for its rank, attached to it on first use."""
    found = comm.state.get(Fold)
    return found if found is not None else comm.attach(Fold, lambda c: plan(c.nranks, c.myrank))


def fold_in(comm, buf, op, fold: Fold, tag: int) -> int:
    """Before: the even ranks below ``2 rem`` hand their buffers to the odd rank above.

    ``tag``: the call's (``signature.tag``); returned, with ``BAD`` if the partner's differs.
    Callers may skip the call when ``fold.rem`` is 0 (a power of two: nothing to fold).
    """
    if fold.rank >= 2 * fold.rem:
        return tag
    if fold.newrank < 0:
        send(comm, buf, fold.rank + 1, tag)
        return tag
    incoming = comm.scratch(buf.size, buf.dtype)
    tag = recv(comm, incoming, fold.rank - 1, tag)
    op.combine(buf, incoming)  # only this rank computes these bits; the partner copies them
    return tag


def fold_out(comm, buf, fold: Fold, tag: int) -> int:
    """After: each odd rank below ``2 rem`` sends the finished result to its even partner."""
    if fold.rank >= 2 * fold.rem:
        return tag
    if fold.newrank < 0:
        return recv(comm, buf, fold.rank + 1, tag)
    send(comm, buf, fold.rank - 1, tag)
    return tag
