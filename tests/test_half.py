"""The 16-bit wire format's conversions (``allreduce_kit.kernels.half``): bitwise numpy's float16
and PyTorch's bfloat16 rounding (round to nearest, ties to even), without MPI."""
from functools import lru_cache

import numpy as np
import pytest

from allreduce_kit.kernels import half


def _encode(x: np.ndarray, fmt: int) -> np.ndarray:
    out = np.empty(x.size, np.uint16)
    half.encode(out, np.ascontiguousarray(x, np.float32).view(np.uint32), fmt)
    return out


def _decode(h: np.ndarray, fmt: int) -> np.ndarray:
    out = np.empty(h.size, np.float32)
    half.decode(out.view(np.uint32), h, fmt)
    return out


@lru_cache(maxsize=1)
def _awkward_floats() -> np.ndarray:
    """Every float32 edge a 16-bit rounding meets: around each half's ties, ranges' ends, specials."""
    rng = np.random.default_rng(0)
    every_half = np.arange(1 << 16, dtype=np.uint32)
    # each fp16 value's float32 bits, and the float32s one ulp and half an fp16 ulp around them
    f16 = every_half.astype(np.uint16).view(np.float16).astype(np.float32).view(np.uint32)
    bf = every_half << 16
    bits = [f16, bf]
    for base in (f16, bf):
        for d in (1, 2, 0xFFF, 0x1000, 0x1001, 0x2000, 0x7FFF, 0x8000, 0x8001):
            bits += [base + d, base - d]
    bits.append(rng.integers(0, 1 << 32, 1 << 18, dtype=np.uint64).astype(np.uint32))
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504, 65519.99, 65520, 65536, 2 ** -24, 2 ** -25,
                         2 ** -25 * 1.0000001, 2 ** -14, 1e-45, 3.4e38, -3.4e38], np.float32).view(np.uint32)
    bits.append(specials)
    floats = np.concatenate(bits).astype(np.uint32).view(np.float32)
    floats.flags.writeable = False  # shared by the tests: each copies what it changes
    return floats


def test_fp16_encode_is_numpys_float16_bitwise():
    x = _awkward_floats()
    with np.errstate(over="ignore", invalid="ignore"):
        expected = x.astype(np.float16).view(np.uint16)
    got = _encode(x, half.FP16)
    assert np.array_equal(got, expected), x[got != expected][:5]


def test_fp16_decode_is_exact_for_every_half():
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    expected = h.view(np.float16).astype(np.float32).view(np.uint32)
    assert np.array_equal(_decode(h, half.FP16).view(np.uint32), expected)


def test_bf16_encode_is_torchs_bfloat16_bitwise():
    torch = pytest.importorskip("torch")
    x = _awkward_floats()
    expected = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    got = _encode(x, half.BF16)
    finite = ~np.isnan(x)
    assert np.array_equal(got[finite], expected[finite])
    # a NaN stays a NaN, with its sign (payloads are not part of the contract)
    back = _decode(got[~finite], half.BF16)
    assert np.isnan(back).all() and np.array_equal(np.signbit(back), np.signbit(x[~finite]))


def test_bf16_decode_is_the_top_half_of_float32():
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    assert np.array_equal(_decode(h, half.BF16).view(np.uint32), h.astype(np.uint32) << 16)


@pytest.mark.parametrize("fmt", [half.FP16, half.BF16])
def test_round_trip_in_place_is_encode_then_decode(fmt):
    x = _awkward_floats()
    buf = x.copy()
    half.round_trip(buf.view(np.uint32), fmt)
    expected = _decode(_encode(x, fmt), fmt)
    assert np.array_equal(buf.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("fmt", [half.FP16, half.BF16])
def test_a_16_bit_value_survives_rounding_unchanged(fmt):
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    values = _decode(h, fmt)
    keep = ~np.isnan(values)
    assert np.array_equal(_encode(values[keep], fmt), h[keep])
