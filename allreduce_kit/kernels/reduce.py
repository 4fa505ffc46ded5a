"""Element-wise reduction kernels, compiled by numba and cached on disk.

Every kernel works in place on 1-D contiguous arrays of one dtype: ``dst = dst op src``.
Each comes in a serial and a ``prange`` form; the caller picks one per call (see
``__init__.py``). Inside ``prange`` every iteration writes only its own ``dst[i]``.

Semantics, chosen so that ``op(a, b)`` and ``op(b, a)`` give the same bits, which keeps every
rank's result identical whichever operand order an algorithm uses:

- sum and prod: IEEE arithmetic for floats, wrap-around (two's complement) for integers, as MPI.
- max and min: a NaN in either operand gives NaN (as ``np.maximum``); ``max(+0.0, -0.0)`` is
  ``+0.0`` and ``min`` of them is ``-0.0``, in either order.
- mean is sum followed by a division by the rank count; for integers the division truncates
  toward zero (C and NCCL semantics).
"""

from numba import njit, prange, types
from numba.extending import overload

_FLAGS = dict(cache=True, nogil=True, error_model="numpy")


@njit(inline="always")
def _max(a, b):
    # Branchless (``|``, ``&`` and one select each, no ``or``/``and`` and no copysign) so that
    # LLVM vectorises the loop: about numpy's speed instead of half of it. Take ``a`` if it is
    # larger or NaN, else ``b`` (so a NaN in ``b`` wins too). Two zeros give their sum, which
    # is +0.0 unless both are -0.0: max(+0.0, -0.0) is +0.0 in either order.
    larger = a if (a > b) | (a != a) else b
    return a + b if (a == 0) & (b == 0) else larger


@njit(inline="always")
def _min(a, b):
    # As ``_max``; two zeros give -((-a) + (-b)), which is -0.0 unless both are +0.0.
    smaller = a if (a < b) | (a != a) else b
    return -((-a) + (-b)) if (a == 0) & (b == 0) else smaller


@njit(inline="always")
def _trunc_div(s, d):
    q = s // d
    if q < 0 and q * d != s:
        q += 1
    return q


SUM, PROD, MAX, MIN = 0, 1, 2, 3


@njit(**_FLAGS)
def combine(dst, src, op):
    """dst = dst op src, element by element, on the calling thread."""
    n = dst.size
    if op == SUM:
        for i in range(n):
            dst[i] += src[i]
    elif op == PROD:
        for i in range(n):
            dst[i] *= src[i]
    elif op == MAX:
        for i in range(n):
            dst[i] = _max(dst[i], src[i])
    else:
        for i in range(n):
            dst[i] = _min(dst[i], src[i])


@njit(parallel=True, **_FLAGS)
def combine_parallel(dst, src, op):
    """``combine`` split over numba's threads; worth it only for large arrays."""
    n = dst.size
    if op == SUM:
        for i in prange(n):
            dst[i] += src[i]
    elif op == PROD:
        for i in prange(n):
            dst[i] *= src[i]
    elif op == MAX:
        for i in prange(n):
            dst[i] = _max(dst[i], src[i])
    else:
        for i in prange(n):
            dst[i] = _min(dst[i], src[i])


@njit(**_FLAGS)
def copy(dst, src):
    """dst = src, element by element. Inside compiled code this is several times faster than
    ``dst[:] = src`` on small arrays, which numba runs through its general slice assignment."""
    for i in range(src.size):
        dst[i] = src[i]


@njit(**_FLAGS)
def fdivide(buf, d):
    for i in range(buf.size):
        buf[i] = buf[i] / d


@njit(**_FLAGS)
def idivide(buf, d):
    for i in range(buf.size):
        buf[i] = _trunc_div(buf[i], d)


def _divide_in_dtype(buf, d):
    """``fdivide`` or ``idivide``, chosen by ``buf``'s dtype when a caller is compiled."""


@overload(_divide_in_dtype)
def _divide_for(buf, d):
    if isinstance(buf.dtype, types.Float):
        return lambda buf, d: fdivide(buf, buf.dtype.type(d))
    return lambda buf, d: idivide(buf, d)


@njit(**_FLAGS)
def divide(buf, d):
    """buf = buf / d in buf's dtype; integers truncate toward zero. Callable from compiled code."""
    _divide_in_dtype(buf, d)


@njit(**_FLAGS)
def fsum_divide(dst, src, d):
    for i in range(dst.size):
        dst[i] = (dst[i] + src[i]) / d


@njit(**_FLAGS)
def isum_divide(dst, src, d):
    for i in range(dst.size):
        dst[i] += src[i]  # wrap to dst's width first, as MPI's sum would
        dst[i] = _trunc_div(dst[i], d)
