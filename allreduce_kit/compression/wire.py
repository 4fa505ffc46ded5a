"""The 16-bit wire formats of a compressed allreduce: what a float32 is sent as, and back.

A ``Wire`` packs float32 values into 16 bits (``encode``) and unpacks them exactly (``decode``);
the loops are numba kernels on bits (``allreduce_kit/kernels/half.py``). Packing rounds to the
nearest 16-bit value, ties to even: relative error at most ``unit_roundoff`` for a value in the
format's normal range.

==========  ======================================  ===============  ===========================
name        format                                  unit roundoff    range
==========  ======================================  ===============  ===========================
``fp16``    IEEE binary16 (numpy's ``float16``)     2**-11           +-65504 (beyond: infinity),
                                                                     subnormals from 2**-24
``bf16``    bfloat16 (float32's top 16 bits)        2**-8            float32's
==========  ======================================  ===============  ===========================
"""
from typing import Dict

import numpy as np

from ..kernels import half



class Wire:
    """One 16-bit format: ``encode`` float32 -> uint16, ``decode`` back, ``round`` in place."""

    __slots__ = ("name", "fmt", "unit_roundoff")

    def __init__(self, name: str, fmt: int, unit_roundoff: float):
        self.name, self.fmt, self.unit_roundoff = name, fmt, unit_roundoff

    def encode(self, dst: np.ndarray, src: np.ndarray) -> np.ndarray:
        """``dst`` (uint16, as long as ``src``) = ``src`` (float32) rounded to 16 bits; returns ``dst``."""
        half.encode(dst, src.view(np.uint32), self.fmt)
        return dst

    def decode(self, dst: np.ndarray, src: np.ndarray) -> np.ndarray:
        """``dst`` (float32, as long as ``src``) = the 16-bit values ``src`` (uint16); returns ``dst``."""
        half.decode(dst.view(np.uint32), src, self.fmt)
        return dst

    def round(self, buf: np.ndarray) -> np.ndarray:
        """``buf`` (float32) rounded to 16-bit values in place, as ``decode(encode(buf))``; returns it."""
        half.round_trip(buf.view(np.uint32), self.fmt)
        return buf

    def __repr__(self) -> str:
        return f"Wire({self.name!r})"


#: name -> its ``Wire``.
WIRES: Dict[str, Wire] = {"fp16": Wire("fp16", half.FP16, 2.0 ** -11), "bf16": Wire("bf16", half.BF16, 2.0 ** -8)}
