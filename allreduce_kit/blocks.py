"""The one block rule: which part of a flat buffer of ``n`` elements rank ``r`` of ``p`` owns.

Block ``r`` is ``[r * n // p, (r + 1) * n // p)``: contiguous, in rank order, lengths that differ
by at most one (the longer ones last), covering the buffer exactly. Any ``n`` works: where ``n``
is smaller than ``p`` some blocks are empty, and ``n`` need not divide by ``p``.

``reduce_scatter`` leaves block ``r`` of the reduced buffer on rank ``r``; ``allgather`` without
``counts`` expects block ``r`` from rank ``r``; ``ring``, ``rabenseifner``, ``two_shot`` and
``hierarchical`` cut their buffers by it, and so should anything that shards a flat buffer
(an optimizer's state, a checkpoint), so that its blocks match the collectives' at any rank count.

>>> shard_bounds(10, 4)
[0, 2, 5, 7, 10]
>>> block(10, 4, 1), counts(2, 3)
((2, 5), [0, 1, 1])
"""
from functools import lru_cache
from typing import List, Tuple

import numpy as np

__all__ = ["shard_bounds", "block", "counts", "displacements", "owner"]


def _check(n: int, p: int) -> None:
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if p < 1:
        raise ValueError(f"p must be >= 1, got {p}")


def shard_bounds(n: int, p: int) -> List[int]:
    """Start offsets of the ``p`` blocks of ``n`` elements, then ``n``: block ``r`` is
    ``[bounds[r], bounds[r + 1])``."""
    _check(n, p)
    return [(i * n) // p for i in range(p + 1)]


def block(n: int, p: int, r: int) -> Tuple[int, int]:
    """``(start, stop)`` of rank ``r``'s block of ``n`` elements over ``p`` ranks."""
    _check(n, p)
    if not 0 <= r < p:
        raise ValueError(f"r must be a rank in 0..{p - 1}, got {r}")
    return (r * n) // p, ((r + 1) * n) // p


def counts(n: int, p: int) -> List[int]:
    """The length of each rank's block (MPI's ``recvcounts``)."""
    bounds = shard_bounds(n, p)
    return [bounds[i + 1] - bounds[i] for i in range(p)]


def displacements(n: int, p: int) -> List[int]:
    """The start of each rank's block (MPI's ``displs``)."""
    return shard_bounds(n, p)[:p]


def owner(n: int, p: int, i: int) -> int:
    """The rank whose block holds element ``i`` (``0 <= i < n``)."""
    _check(n, p)
    if not 0 <= i < n:
        raise ValueError(f"i must be an element index in 0..{n - 1}, got {i}")
    r = ((i + 1) * p - 1) // n  # the last r with r * n // p <= i, up to one step off
    while (r * n) // p > i:
        r -= 1
    while ((r + 1) * n) // p <= i:
        r += 1
    return r


@lru_cache(maxsize=256)
def bounds_array(n: int, p: int) -> np.ndarray:
    """``shard_bounds`` as an int64 array for compiled loops (cached: the same few sizes recur;
    not to be written to)."""
    return np.array(shard_bounds(n, p), np.int64)
