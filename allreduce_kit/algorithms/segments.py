"""Cutting a buffer into p near-equal segments: the shared arithmetic of ``ring``, ``two_shot``
and ``rabenseifner`` (both their message schedules and their compiled direct loops).

The segments are the package's blocks (``allreduce_kit/blocks.py``): segment r of a ring or a
two-shot allreduce is block r of ``reduce_scatter``."""
import numpy as np

from . import pieces
from ..blocks import bounds_array, shard_bounds as segment_bounds

__all__ = ["segment_bounds", "segments", "bounds_array", "segment_pieces"]


def segments(buf: np.ndarray, p: int) -> list:
    """The p near-equal segments of ``buf`` (views, in order)."""
    bounds = segment_bounds(buf.size, p)
    return [buf[bounds[i]:bounds[i + 1]] for i in range(p)]


def segment_pieces(buf: np.ndarray, comm) -> int:
    """How many pieces (``pieces.count``) a step that folds one segment in is sent in by messages:
    from the largest segment, so the same on every rank."""
    return pieces.count(-(-buf.size // comm.nranks) * buf.itemsize, comm)
