"""16-bit floats as the wire format of a compressed allreduce: float32 <-> fp16 / bf16. No MPI here.

The conversions work on bits, so that they are numba loops over plain integer arrays: a float32
array is passed as its ``uint32`` view, a 16-bit one as ``uint16``. Both round to nearest, ties to
even, and give bitwise what numpy gives (``x.astype(np.float16)``; bf16 as PyTorch's
``torch.bfloat16``):

- fp16 (IEEE binary16): 5 exponent bits, 10 mantissa bits; unit roundoff 2**-11; largest finite
  value 65504 (a float32 from 65520 up rounds to infinity), subnormals down to 2**-24 kept;
  NaN stays NaN (numpy's payload rule), infinities stay.
- bf16 (bfloat16): float32's top 16 bits, rounded: float32's exponent range, 7 mantissa bits;
  unit roundoff 2**-8; a NaN stays a quiet NaN with its sign.

Decoding (16 -> 32 bits) is exact.
"""
from numba import njit

_FLAGS = dict(cache=True, nogil=True, error_model="numpy")

FP16, BF16 = 0, 1


@njit(inline="always")
def _fp16_bits(x):
    """The binary16 bits of the float32 whose bits are ``x`` (an int), rounded to nearest even."""
    sign = (x >> 16) & 0x8000
    a = x & 0x7FFFFFFF
    if a >= 0x7F800000:  # infinity or NaN
        if a == 0x7F800000:
            return sign | 0x7C00
        h = 0x7C00 + ((a & 0x7FFFFF) >> 13)
        return sign | (h + 1 if h == 0x7C00 else h)  # a NaN whose payload is all low bits stays a NaN
    if a >= 0x477FF000:  # 65520 and up: past the largest finite half, 65504, by half a unit or more
        return sign | 0x7C00
    if a >= 0x38800000:  # a normal half: rebias the exponent, round the 13 dropped bits to even
        return sign | ((a - (112 << 23) + 0xFFF + ((a >> 13) & 1)) >> 13)
    e = a >> 23
    if e < 102:  # below 2**-25: rounds to zero
        return sign
    m = (a & 0x7FFFFF) | 0x800000  # a subnormal half: m * 2**(e - 150) in units of 2**-24
    s = 126 - e
    q = m >> s
    rest = m & ((1 << s) - 1)
    half = 1 << (s - 1)
    if rest > half or (rest == half and (q & 1) == 1):
        q += 1
    return sign | q


@njit(inline="always")
def _fp16_float_bits(h):
    """The float32 bits of the binary16 whose bits are ``h`` (exact)."""
    sign = (h & 0x8000) << 16
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 0x1F:
        return sign | 0x7F800000 | (m << 13)
    if e != 0:
        return sign | ((e + 112) << 23) | (m << 13)
    if m == 0:
        return sign
    e = 113
    while (m & 0x400) == 0:
        m <<= 1
        e -= 1
    return sign | (e << 23) | ((m & 0x3FF) << 13)


@njit(inline="always")
def _bf16_bits(x):
    """The bfloat16 bits of the float32 whose bits are ``x``, rounded to nearest even."""
    if (x & 0x7FFFFFFF) > 0x7F800000:  # NaN: keep the sign, make it quiet
        return (x >> 16) | 0x40
    return ((x + 0x7FFF + ((x >> 16) & 1)) >> 16) & 0xFFFF


@njit(**_FLAGS)
def encode(dst, src, fmt):
    """``dst[i]`` (uint16) = the 16-bit float nearest ``src[i]`` (float32 as uint32); ``fmt``: ``FP16`` or ``BF16``."""
    if fmt == FP16:
        for i in range(src.size):
            dst[i] = _fp16_bits(src[i] & 0xFFFFFFFF)
    else:
        for i in range(src.size):
            dst[i] = _bf16_bits(src[i] & 0xFFFFFFFF)


@njit(**_FLAGS)
def decode(dst, src, fmt):
    """``dst[i]`` (float32 as uint32) = the 16-bit float ``src[i]`` (uint16), exactly."""
    if fmt == FP16:
        for i in range(src.size):
            dst[i] = _fp16_float_bits(src[i] & 0xFFFF)
    else:
        for i in range(src.size):
            dst[i] = (src[i] & 0xFFFF) << 16


@njit(**_FLAGS)
def round_trip(buf, fmt):
    """``buf[i]`` (float32 as uint32) = ``buf[i]`` rounded to the nearest 16-bit float, in place."""
    if fmt == FP16:
        for i in range(buf.size):
            buf[i] = _fp16_float_bits(_fp16_bits(buf[i] & 0xFFFFFFFF))
    else:
        for i in range(buf.size):
            buf[i] = _bf16_bits(buf[i] & 0xFFFFFFFF) << 16
