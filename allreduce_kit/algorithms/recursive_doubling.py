"""Recursive-doubling allreduce: lg p exchange-and-combine steps of the whole buffer.

In each step every rank swaps its whole buffer with the rank whose number differs in one bit
(the highest bit first, as in ``rabenseifner``'s reduce-scatter) and combines the two; after
lg p steps every rank holds the full reduction. Partners compute ``a op b`` and ``b op a``: the
kernels give the same bits in either order (see ``kernels/reduce.py``), so every rank ends
bitwise identical. Latency-optimal (lg p messages, no separate broadcast phase); every step
moves and reduces the whole buffer. MPICH's choice for short messages. Rank counts that are
not a power of two are folded first (``fold.py``). For a small buffer the exchange loop runs in
compiled code (``native.py``).

When the ranks' buffers differ (``signature.py``), every rank knows after the lg p steps; it
then swaps an empty message with each partner again, lowest bit first, in the steps of
``rabenseifner``'s allgather, so that ``shared_memory``'s fallback, which runs this for short
buffers and ``rabenseifner`` for long ones, ends with every message received when the ranks'
lengths fall on both sides of its split.
"""
from mpi4py import MPI

from . import native, register
from .fold import Fold, fold_in, fold_of, fold_out
from .pieces import sendrecv_combine
from .signature import BAD, MORE, mismatch, received, recv, sendrecv, tag as signature

TAG = 104


@register("recursive_doubling")
def allreduce(comm, buf, op, name: str = "recursive_doubling"):
    """``name``: the algorithm the caller asked for, for the error if the ranks' buffers differ."""
    fold = comm.state.get(Fold) or fold_of(comm)
    partners = fold.partners  # the lowest bit first; the steps take the highest first
    compiled = None
    if partners and op.code is not None and buf.nbytes <= native.MAX_BYTES:
        compiled = comm.state.get(native.Exchange, False)
        if compiled is False:
            compiled = comm.attach(native.Exchange, lambda c: native.exchange_for(c, partners[::-1], TAG))
    if compiled is not None and not fold.rem:  # a short buffer on a power of two: every step compiled
        done = native.exchange(buf, compiled.state, compiled.handles, op.code, op.divisor)
        if done == len(partners):
            return
        tag = _steps(comm, buf, op, partners, compiled, done, signature(buf, TAG))
    else:
        tag = signature(buf, TAG)
        if fold.rem:
            tag = fold_in(comm, buf, op, fold, tag)
        if tag & BAD:  # the compiled loop sends the call's own tag: a rank that knows takes the Python steps
            compiled = None
        done = 0 if compiled is None else native.exchange(buf, compiled.state, compiled.handles, op.code, op.divisor)
        tag = _steps(comm, buf, op, partners, compiled, done, tag)
        if fold.rem:
            tag = fold_out(comm, buf, fold, tag)
    if tag & BAD:
        raise mismatch(comm, buf, name)


def _steps(comm, buf, op, partners, compiled, done: int, tag: int) -> int:
    """The exchange steps after the ``done`` that ``compiled`` took (all, without it), in Python;
    returns the call's tag."""
    if compiled is not None and done < len(partners):  # a partner's tag or size differed: take over after that step
        tag = _took_over(comm, buf, compiled, partners[-1 - done], tag)
        done += 1
    for k in range(len(partners) - 1 - done, -1, -1):
        tag = sendrecv_combine(comm, buf, partners[k], buf, partners[k], tag, op, k == 0, 1)
    if tag & BAD:  # the steps of ``rabenseifner``'s allgather, for ``shared_memory``'s fallback
        empty = buf[:0]
        for partner in partners:
            tag = sendrecv(comm, empty, partner, empty, partner, tag)
    return tag


def _took_over(comm, buf, compiled, partner: int, tag: int) -> int:
    """The call's tag after the compiled loop stopped at the exchange with ``partner``: ``BAD``
    (a tag that differs, or a message that did not fit), once every piece it sends is received."""
    err = compiled.error()
    if err and MPI.Get_error_class(err) != MPI.ERR_TRUNCATE:
        raise MPI.Exception(err)
    more = compiled.received() & MORE
    while more:  # the partner sends its step in pieces: its buffer is longer
        tag = recv(comm, buf[:0], partner, tag)
        more = received() & MORE
    return tag | BAD
