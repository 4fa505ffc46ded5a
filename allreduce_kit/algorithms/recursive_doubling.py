"""Recursive-doubling allreduce: lg p exchange-and-combine steps of the whole buffer.

In step k (mask = 2**k) every rank swaps its whole buffer with the rank whose number differs in
bit k and combines the two; after lg p steps every rank holds the full reduction. Partners
compute ``a op b`` and ``b op a``: the kernels give the same bits in either order (see
``kernels/reduce.py``), so every rank ends bitwise identical. Latency-optimal (lg p messages,
no separate broadcast phase); every step moves and reduces the whole buffer. MPICH's choice for
short messages. Rank counts that are not a power of two are folded first (``fold.py``).
"""
from . import register
from .fold import fold_in, fold_out, plan

TAG = 104


@register("recursive_doubling")
def allreduce(comm, buf, op):
    fold = plan(comm.nranks, comm.myrank)
    if fold.rem:
        fold_in(comm, buf, op, fold)
    if fold.newrank >= 0:
        incoming = comm.scratch(buf.size, buf.dtype)
        mask, pof2 = 1, fold.pof2
        while mask < pof2:
            partner = fold.real(fold.newrank ^ mask)
            comm.Sendrecv(buf, partner, TAG, incoming, partner, TAG)
            mask <<= 1
            op.combine(buf, incoming, last=(mask == pof2))
    if fold.rem:
        fold_out(comm, buf, fold)
