"""Cutting a buffer into p near-equal segments: the shared arithmetic of ``ring``, ``two_shot``
and ``rabenseifner`` (both their message schedules and their compiled direct loops)."""
from functools import lru_cache

import numpy as np

from . import pieces


def segment_bounds(n: int, p: int) -> list:
    """Start offsets of p near-equal segments of n elements, plus n at the end."""
    return [(i * n) // p for i in range(p + 1)]


def segments(buf: np.ndarray, p: int) -> list:
    """The p near-equal segments of ``buf`` (views, in order)."""
    bounds = segment_bounds(buf.size, p)
    return [buf[bounds[i]:bounds[i + 1]] for i in range(p)]


@lru_cache(maxsize=256)
def bounds_array(n: int, p: int) -> np.ndarray:
    """``segment_bounds`` as an int64 array for compiled loops (cached: the same few sizes recur)."""
    return np.array(segment_bounds(n, p), np.int64)


def segment_pieces(buf: np.ndarray, comm) -> int:
    """How many pieces (``pieces.count``) a step that folds one segment in is sent in by messages:
    from the largest segment, so the same on every rank."""
    return pieces.count(-(-buf.size // comm.nranks) * buf.itemsize, comm)
