"""What a tensor is sent as: ``Compression.none`` (itself) or ``Compression.fp16`` (2-byte floats).

The interface is Horovod's: ``compress(tensor) -> (compressed, ctx)`` before the reduction and
``decompress(compressed, ctx)`` after it; a class of your own with these two static methods
works too (the compressed tensor must be of a dtype ``allreduce`` takes).
"""
from typing import Any, Tuple

import torch


class Compressor:
    """Turns a tensor into what is sent, and the result back."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Send the tensor as it is."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class FP16Compressor(Compressor):
    """Send floating-point tensors as float16 (half the bytes of float32); others as they are.

    Each rank's values are rounded to float16 before the reduction; the reduction itself adds
    in float32 and rounds the result to float16 once, then it is cast back to the tensor's dtype.
    """

    @staticmethod
    def compress(tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        if tensor.dtype.is_floating_point and tensor.dtype != torch.float16:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor if ctx is None else tensor.to(ctx)


class Compression:
    """The compressions ``allreduce`` and ``DistributedOptimizer`` take: ``none`` and ``fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor


def check_compression(compression: Any, caller: str) -> Any:
    """``compression`` if it has ``compress`` and ``decompress``, else ``TypeError``."""
    if not (callable(getattr(compression, "compress", None)) and callable(getattr(compression, "decompress", None))):
        raise TypeError(f"{caller}: compression must be Compression.none, Compression.fp16 or a class with "
                        f"compress and decompress, got {compression!r}")
    return compression
