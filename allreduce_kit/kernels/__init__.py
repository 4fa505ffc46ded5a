"""Reduction kernels: ``dst op= src`` in place, numba-compiled and cached. No MPI here.

Installed as ``allreduce_kit.kernels``; ``kernels.stream`` holds a copy whose stores bypass
the caches. The functions take 1-D C-contiguous arrays of one supported dtype; the
collectives validate their input before calling them, so these do not.
"""
from typing import Dict, Iterable, Sequence

import numba
import numpy as np

from . import cache

cache.refresh()  # before any cached compiled function of the package is loaded
from . import reduce as _k  # noqa: E402

OPS = ("sum", "prod", "max", "min")
DTYPES = tuple(np.dtype(t) for t in ("float32", "float64", "int32", "int64"))

#: op -> the code ``reduce_serial`` takes.
OP_CODES: Dict[str, int] = {"sum": _k.SUM, "prod": _k.PROD, "max": _k.MAX, "min": _k.MIN}

#: ``reduce_serial(dst, src, OP_CODES[op])``: ``reduce_into`` on the calling thread, without
#: its Python layer (the compiled kernel itself), for callers that call it very often on
#: small arrays.
reduce_serial = _k.combine

#: Arrays at least this long are split over numba's threads when more than one is allowed.
PARALLEL_MIN = 1 << 18


def reduce_into(dst: np.ndarray, src: np.ndarray, op: str, threads: int = 0) -> None:
    """``dst = dst op src`` element-wise, in place; ``op`` is one of ``OPS``.

    Arrays of at least ``PARALLEL_MIN`` elements are split over at most ``threads`` of numba's
    threads (0: as many as numba is set to use). Pass the caller's share of the node's cores:
    ranks that share a node and each start every core's worth of threads slow each other down.
    """
    if dst.size >= PARALLEL_MIN and threads != 1:
        have = numba.get_num_threads()
        use = have if threads <= 0 else min(threads, have)
        if use > 1:
            numba.set_num_threads(use)
            try:
                _k.combine_parallel(dst, src, OP_CODES[op])
            finally:
                numba.set_num_threads(have)
            return
    _k.combine(dst, src, OP_CODES[op])


def divide(buf: np.ndarray, divisor: int) -> None:
    """``buf /= divisor`` in place; integers truncate toward zero."""
    _k.divide(buf, divisor)


def sum_divide_into(dst: np.ndarray, src: np.ndarray, divisor: int) -> None:
    """``dst = (dst + src) / divisor`` in one pass: the last step of a mean."""
    if dst.dtype.kind == "f":
        _k.fsum_divide(dst, src, dst.dtype.type(divisor))
    else:
        _k.isum_divide(dst, src, divisor)


def warm_up(dtypes: Iterable = DTYPES, ops: Sequence[str] = OPS + ("mean",)) -> None:
    """Compile (or load from the cache) the kernels that ``ops`` on ``dtypes`` use, now, not in a timed call.

    One compiled kernel serves every op (the op is its argument), so it is loaded once per
    dtype; ``mean`` adds the division kernels, and the multi-threaded variant is loaded only
    when numba may use more than one thread. A cached kernel loads in a few milliseconds; the
    first one of a process also sets numba's compiler up (about 0.2 s of CPU).
    """
    known = OPS + ("mean",)
    for op in ops:
        if op not in known:
            raise ValueError(f"warm_up: unknown op {op!r}; expected one of {', '.join(known)}")
    for dtype in dtypes:
        a, b = np.ones(2, dtype), np.ones(2, dtype)
        if ops:
            _k.combine(a, b, OP_CODES["sum"])
            if numba.get_num_threads() > 1:
                _k.combine_parallel(a, b, OP_CODES["sum"])
        if "mean" in ops:
            divide(a, 1)
            sum_divide_into(a, b, 1)


__all__ = ["OPS", "DTYPES", "OP_CODES", "PARALLEL_MIN", "reduce_into", "reduce_serial", "divide", "sum_divide_into", "warm_up"]
