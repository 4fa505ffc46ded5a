"""Helpers for a data-parallel loop of your own: average gradients, broadcast parameters.

Both work on one flat contiguous buffer (gradient fusion): one collective per bucket instead of
one per layer. ``FlatParameters`` keeps all of a model's arrays as views into one buffer so that
nothing is copied; ``average_arrays`` packs arbitrary arrays into a fused buffer and back.

>>> flat = FlatParameters([(64, 32), (32,), (32, 10), (10,)])
>>> W1, b1, W2, b2 = flat.views(flat.params)        # per-layer views into one buffer
>>> broadcast_parameters(flat.params)                # rank 0's initial values everywhere
>>> average_buffer(flat.grads, bucket_mb=4)          # mean over ranks, 4 MB at a time
"""
from typing import List, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from . import config
from .collective import allreduce, array_of, validate
from .comm import library_comm
from .progress import IN_FLIGHT, wait_turn
from .plans import bucket_plans
from .stall import INSPECTOR

__all__ = ["FlatParameters", "average_arrays", "average_buffer", "broadcast_parameters", "bucket_bounds"]


class FlatParameters:
    """Parameters and gradients of the given shapes, each in one flat contiguous buffer."""

    def __init__(self, shapes: Sequence[Tuple[int, ...]], dtype=np.float32):
        self.shapes = [tuple(int(n) for n in s) for s in shapes]
        sizes = [int(np.prod(s)) for s in self.shapes]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
        self.size = int(self.offsets[-1])
        self.dtype = np.dtype(dtype)
        self.params = np.zeros(self.size, dtype=self.dtype)
        self.grads = np.zeros(self.size, dtype=self.dtype)

    def views(self, flat: np.ndarray) -> List[np.ndarray]:
        """One view per shape into ``flat`` (writing to a view writes the buffer)."""
        return [flat[a:b].reshape(s) for a, b, s in zip(self.offsets[:-1], self.offsets[1:], self.shapes)]


def bucket_bounds(count: int, itemsize: int, bucket_mb: float) -> List[Tuple[int, int]]:
    """Split ``count`` elements into consecutive ``[start, stop)`` buckets of at most ``bucket_mb`` MB.

    ``bucket_mb <= 0`` means one bucket for everything. Every rank computes the same split.
    """
    if count == 0:
        return []
    _check_bucket_mb(bucket_mb, "bucket_bounds")
    if bucket_mb <= 0:
        return [(0, count)]
    per = max(1, int(bucket_mb * 1e6) // itemsize)
    return [(start, min(start + per, count)) for start in range(0, count, per)]


def average_buffer(buf: np.ndarray, *, bucket_mb: float = 0.0, comm: Optional[MPI.Intracomm] = None,
                   algorithm: str = "auto", check: Optional[bool] = None,
                   stall_timeout: Optional[float] = None) -> np.ndarray:
    """Average ``buf`` over the ranks of ``comm`` in place, one bucket after another.

    Collective; ``allreduce(op="mean")`` per bucket of at most ``bucket_mb`` MB of 10^6 bytes
    (0: one bucket), over ``buf``'s elements in memory order. ``buf`` is what ``allreduce``
    takes. Returns ``buf``, bitwise the same on every rank. Each bucket runs as a persistent
    plan (``allreduce_kit.plan``), made on the first call for ``buf`` and reused by later calls
    with the same buffer and arguments (unless checked: ``check`` runs ``allreduce`` per bucket).
    """
    flat = validate(buf, "mean", algorithm, caller="average_buffer")[0].reshape(-1)
    _check_bucket_mb(bucket_mb, "average_buffer")
    bounds = bucket_bounds(flat.size, flat.itemsize, bucket_mb)
    lib = library_comm(comm)
    if check or (check is None and lib.check_default):  # the agreement step on every call: no plan to keep
        for start, stop in bounds:
            allreduce(flat[start:stop], op="mean", algorithm=algorithm, comm=comm, check=check,
                      stall_timeout=stall_timeout)
        return buf
    if stall_timeout is not None:
        try:
            stall_timeout = config.seconds_argument(stall_timeout)
        except (TypeError, ValueError) as bad:
            raise type(bad)(f"average_buffer: stall_timeout: {bad}") from None
    for planned in bucket_plans(buf, bounds, op="mean", algorithm=algorithm, comm=comm, lib=lib,
                                stall_timeout=stall_timeout):
        planned()
    return buf


def average_arrays(arrays: Sequence[np.ndarray], comm: Optional[MPI.Intracomm] = None,
                   algorithm: str = "auto", bucket_mb: float = 0.0, *, check: Optional[bool] = None,
                   stall_timeout: Optional[float] = None) -> List[np.ndarray]:
    """Average each array over the ranks of ``comm``, in place, through one fused buffer per dtype.

    Collective: every rank passes arrays of the same shapes and dtypes in the same order. The
    arrays are copied into a flat buffer, reduced with ``allreduce(op="mean")`` (in buckets of
    ``bucket_mb`` MB if > 0) and copied back, so a model with many small layers costs one
    collective, not one per layer. Returns the arrays.
    """
    if isinstance(arrays, np.ndarray) or not isinstance(arrays, (list, tuple)):
        raise TypeError(f"average_arrays: arrays must be a list or tuple of numpy arrays, got "
                        f"{'one numpy.ndarray (pass [array])' if isinstance(arrays, np.ndarray) else type(arrays).__name__}")
    _check_bucket_mb(bucket_mb, "average_arrays")
    validate(np.zeros(1, np.float32), "mean", algorithm, caller="average_arrays")
    arrays = list(arrays)
    for i, a in enumerate(arrays):
        try:
            array_of(a, caller="average_arrays")
        except (TypeError, ValueError) as error:
            raise type(error)(str(error).replace("average_arrays: buf", f"average_arrays: arrays[{i}]")) from None
    by_dtype = {}
    for i, a in enumerate(arrays):
        by_dtype.setdefault(a.dtype.str, []).append(i)
    for key in sorted(by_dtype):                      # the same order on every rank
        members = by_dtype[key]
        fused = np.concatenate([arrays[i].reshape(-1) for i in members]) if members else None
        average_buffer(fused, bucket_mb=bucket_mb, comm=comm, algorithm=algorithm, check=check,
                       stall_timeout=stall_timeout)
        start = 0
        for i in members:
            n = arrays[i].size
            arrays[i][...] = fused[start:start + n].reshape(arrays[i].shape)
            start += n
    return arrays


def broadcast_parameters(buf: np.ndarray, root: int = 0, comm: Optional[MPI.Intracomm] = None, *,
                         stall_timeout: Optional[float] = None) -> np.ndarray:
    """Overwrite ``buf`` on every rank with ``root``'s values (collective); returns ``buf``.

    Call once before training so that every replica starts from the same parameters.
    """
    array = array_of(buf, caller="broadcast_parameters")
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)):
        raise TypeError(f"broadcast_parameters: root must be an int, got {type(root).__name__}")
    lib = library_comm(comm)
    if not 0 <= root < lib.nranks:
        raise ValueError(f"broadcast_parameters: root {root} is not a rank of comm (size {lib.nranks})")
    if IN_FLIGHT[0]:  # after the nonblocking calls started before it, at any rank count
        wait_turn()
    if lib.nranks > 1 and array.size:
        timeout = None if stall_timeout is None else config.seconds_argument(stall_timeout)
        with INSPECTOR.watching(lib.watch, f"broadcast_parameters(root={root}, {array.size} x {array.dtype})",
                                timeout):
            lib.Bcast(array, root=int(root))
    return buf


def _check_bucket_mb(bucket_mb: float, caller: str) -> None:
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)):
        raise TypeError(f"{caller}: bucket_mb must be a number of MB (10^6 bytes), got {type(bucket_mb).__name__}")
    if not 0 <= bucket_mb < float("inf"):
        raise ValueError(f"{caller}: bucket_mb must be >= 0 (0: one bucket), got {bucket_mb}")
