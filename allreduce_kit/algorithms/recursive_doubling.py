"""Recursive-doubling allreduce: lg p exchange-and-combine steps of the whole buffer.

In step k (mask = 2**k) every rank swaps its whole buffer with the rank whose number differs in
bit k and combines the two; after lg p steps every rank holds the full reduction. Partners
compute ``a op b`` and ``b op a``: the kernels give the same bits in either order (see
``kernels/reduce.py``), so every rank ends bitwise identical. Latency-optimal (lg p messages,
no separate broadcast phase); every step moves and reduces the whole buffer. MPICH's choice for
short messages. Rank counts that are not a power of two are folded first (``fold.py``). For a
small buffer the exchange loop runs in compiled code (``native.py``).
"""
from mpi4py import MPI

from . import native, register
from .fold import fold_in, fold_of, fold_out

TAG = 104


@register("recursive_doubling")
def allreduce(comm, buf, op):
    fold = fold_of(comm)
    if fold.rem:
        fold_in(comm, buf, op, fold)
    if fold.partners:
        compiled = comm.state.get(native.Exchange, False)
        if compiled is False:
            compiled = comm.attach(native.Exchange, lambda c: native.exchange_for(c, fold.partners, TAG))
        if compiled is not None and op.code is not None and buf.nbytes <= native.MAX_BYTES:
            err = native.exchange(buf, compiled.state, compiled.handles, op.code, op.divisor)
            if err:
                raise MPI.Exception(err)
        else:
            incoming = comm.scratch(buf.size, buf.dtype)
            last = fold.partners[-1]
            for partner in fold.partners:
                comm.Sendrecv(buf, partner, TAG, incoming, partner, TAG)
                op.combine(buf, incoming, partner == last)
    if fold.rem:
        fold_out(comm, buf, fold)
