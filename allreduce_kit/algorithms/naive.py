"""Naive allreduce: every rank sends to rank 0, rank 0 reduces, then sends the result to all.

Rank 0 does all p-1 reductions and 2(p-1) transfers of the whole buffer: the baseline. Each
rank's part is a list of steps (``steps.py``), run in compiled code for a short buffer.
"""
from typing import List, Tuple

from . import register, steps
from .steps import COMBINE, LAST, RECV, SEND

TAG = 101


class Star(steps.Schedule):
    """This rank's steps of the naive schedule on a communicator."""

    __slots__ = ()


def schedule(p: int, rank: int) -> List[Tuple[int, int]]:
    """Rank ``rank``'s steps among ``p`` ranks: rank 0 folds in every other rank's buffer in rank
    order, the last one finishing the reduction, and sends the result to each; the others send
    and receive."""
    if rank != 0:
        return [(SEND, 0), (RECV, 0)]
    return [(COMBINE if src < p - 1 else LAST, src) for src in range(1, p)] + [(SEND, dst) for dst in range(1, p)]


@register("naive")
def allreduce(comm, buf, op):
    star = comm.state.get(Star) or comm.attach(Star, lambda c: Star(c, schedule(c.nranks, c.myrank), TAG))
    steps.run(comm, buf, op, star, TAG, "naive")
