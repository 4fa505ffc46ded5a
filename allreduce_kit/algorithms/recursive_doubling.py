"""Recursive-doubling allreduce: lg p exchange-and-combine steps of the whole buffer.

In step k (mask = 2**k) every rank swaps its whole buffer with the rank whose number differs in
bit k and combines the two; after lg p steps every rank holds the full reduction. Partners
compute ``a op b`` and ``b op a``: the kernels give the same bits in either order (see
``kernels/reduce.py``), so every rank ends bitwise identical. Latency-optimal (lg p messages,
no separate broadcast phase); every step moves and reduces the whole buffer. MPICH's choice for
short messages. Rank counts that are not a power of two are folded first (``fold.py``). A
small buffer passed again and again reuses persistent requests (``persistent.py``).
"""
from . import persistent, register
from .fold import fold_in, fold_out

TAG = 104


@register("recursive_doubling")
def allreduce(comm, buf, op):
    fold = comm.fold
    if fold.rem:
        fold_in(comm, buf, op, fold)
    if fold.partners:
        kept = persistent.lookup(comm, buf, fold.partners, TAG)
        if kept is not None:
            kept.run(op)
        else:
            incoming = comm.scratch(buf.size, buf.dtype)
            last = fold.partners[-1]
            for partner in fold.partners:
                comm.Sendrecv(buf, partner, TAG, incoming, partner, TAG)
                op.combine(buf, incoming, partner == last)
    if fold.rem:
        fold_out(comm, buf, fold)
