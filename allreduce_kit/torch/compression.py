"""What a tensor is sent as: ``Compression.none`` (itself) or ``Compression.fp16`` (2-byte floats).

The interface is Horovod's: ``compress(tensor) -> (compressed, ctx)`` before the reduction and
``decompress(compressed, ctx)`` after it; a class of your own with these two static methods
works too (the compressed tensor must be of a dtype ``allreduce`` takes).

``Compression.powersgd(rank=R, start_iter=S)`` is for ``DistributedOptimizer`` only: each bucket's
gradients are averaged by PowerSGD (``allreduce_kit.compression.powersgd``, PyTorch's
``powerSGD_hook`` steps and defaults), with its state (error feedback, warm start) kept per bucket
in the object; give each optimizer its own.
"""
from typing import Any, Dict, List, Tuple

import numpy as np
import torch

from ..compression.powersgd import DEFAULTS, PowerSGD, matrix_shape


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


class PowerSGDCompressor(Compressor):
    """PowerSGD for ``DistributedOptimizer``'s buckets: ``Compression.powersgd(rank=..., start_iter=...)``.

    The other arguments are PyTorch's ``PowerSGDState``'s, with its defaults. Arguments are checked
    when it is made; the rank against the model's matrices when ``DistributedOptimizer`` wraps it."""

    def __init__(self, rank: int = DEFAULTS["matrix_approximation_rank"],
                 start_iter: int = DEFAULTS["start_powerSGD_iter"],
                 min_compression_rate: float = DEFAULTS["min_compression_rate"], use_error_feedback: bool = True,
                 warm_start: bool = True, orthogonalization_epsilon: float = 0.0, random_seed: int = 0):
        caller = "Compression.powersgd"
        for arg, value, least in (("rank", rank, 1), ("start_iter", start_iter, 0), ("random_seed", random_seed, 0)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{caller}: {arg} must be an int, got {type(value).__name__}")
            if value < least:
                raise ValueError(f"{caller}: {arg} must be >= {least}, got {value}")
        for arg, value in (("min_compression_rate", min_compression_rate),
                           ("orthogonalization_epsilon", orthogonalization_epsilon)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ValueError(f"{caller}: {arg} must be a finite number >= 0, got {value!r}")
        self.options = dict(matrix_approximation_rank=rank, start_powerSGD_iter=start_iter,
                            min_compression_rate=min_compression_rate, use_error_feedback=bool(use_error_feedback),
                            warm_start=bool(warm_start), orthogonalization_epsilon=float(orthogonalization_epsilon),
                            random_seed=random_seed)
        #: bucket index -> its ``PowerSGD`` state, made at the bucket's first reduction
        self.states: Dict[int, PowerSGD] = {}
        self.rank, self.start_iter = rank, start_iter

    def __repr__(self) -> str:
        return f"Compression.powersgd({', '.join(f'{k}={v!r}' for k, v in self.options.items())})"

    def compress(self, tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        raise TypeError("Compression.powersgd averages a DistributedOptimizer's gradients (it needs their shapes "
                        "and keeps state between steps); a single allreduce takes Compression.none or fp16")

    decompress = compress

    def check(self, shapes: List[Tuple[int, ...]], caller: str) -> None:
        """``ValueError`` naming ``rank`` if it is above the smaller side of every gradient matrix."""
        matrices = [matrix_shape(s) for s in shapes if len(s) >= 2]
        if matrices and self.rank > max(min(s) for s in matrices):
            raise ValueError(f"{caller}: Compression.powersgd rank {self.rank} is above the smaller side of every "
                             f"gradient matrix (at most {max(min(s) for s in matrices)} here)")

    def average(self, k: int, params: List[torch.Tensor], views: List[torch.Tensor], reduce, ranks: int) -> None:
        """Average bucket ``k``'s gradients (``views``, CPU tensors of ``params``' shapes) across the
        ranks in place; ``reduce(array)`` sums a numpy array across them (collective)."""
        state = self.states.get(k)
        if state is None:
            dtype = np.dtype(str(views[0].dtype).replace("torch.", ""))
            state = self.states[k] = PowerSGD([tuple(p.shape) for p in params], reduce, ranks, dtype=dtype,
                                              matmul=_torch_matmul, qr=_torch_qr, **self.options)
        state.average([v.view(p.shape).numpy() for p, v in zip(params, views)])


def _torch_matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """``out[...] = a @ b`` by torch on the arrays' memory: torch's threads (which ``init`` fits to
    the rank's share of the node's cores), not numpy's BLAS's own (one per core, whatever else runs)."""
    torch.matmul(torch.from_numpy(a), torch.from_numpy(b), out=torch.from_numpy(out))


def _torch_qr(a: np.ndarray) -> np.ndarray:
    """The Q factor of ``a``'s QR factorization, by torch (as PyTorch's hook takes it)."""
    return torch.linalg.qr(torch.from_numpy(a)).Q.numpy()


class Compression:
    """The compressions ``allreduce`` and ``DistributedOptimizer`` take: ``none`` and ``fp16``;
    ``DistributedOptimizer`` also ``powersgd(rank=R, start_iter=S)``."""

    none = NoneCompressor
    fp16 = FP16Compressor

    @staticmethod
    def powersgd(rank: int = DEFAULTS["matrix_approximation_rank"], start_iter: int = DEFAULTS["start_powerSGD_iter"],
                 **options: Any) -> PowerSGDCompressor:
        """PowerSGD with rank ``rank`` from step ``start_iter`` (PyTorch's ``matrix_approximation_rank``
        and ``start_powerSGD_iter``; ``options``: the rest of its ``PowerSGDState``'s)."""
        return PowerSGDCompressor(rank, start_iter, **options)


def check_compression(compression: Any, caller: str) -> Any:
    """``compression`` if it has ``compress`` and ``decompress``, else ``TypeError``."""
    if not (callable(getattr(compression, "compress", None)) and callable(getattr(compression, "decompress", None))):
        raise TypeError(f"{caller}: compression must be Compression.none, Compression.fp16 or a class with "
                        f"compress and decompress, got {compression!r}")
    return compression
