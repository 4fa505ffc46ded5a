"""What the collectives accept, and the numpy arrays that share a tensor's memory.

A CPU tensor in the default (strided) layout and contiguous is handed to the library as a numpy
array over the same memory (``tensor.detach().numpy()``): nothing is copied. Anything else is
refused with a ``TypeError`` (not a tensor, on another device, sparse, a dtype the operation
cannot take) or a ``ValueError`` (not contiguous) that names the argument.
"""
from typing import Optional, Sequence

import numpy as np
import torch

#: Reduced by the library's own algorithms, in place, on a numpy view of the tensor.
NATIVE = (torch.float32, torch.float64, torch.int32, torch.int64)
#: 2-byte floats: sent as 2 bytes, each segment summed in float32 by the rank that owns it.
HALF = (torch.float16, torch.bfloat16)
#: Small integers: reduced as int32, then cast back (a sum that overflows wraps, as in torch).
SMALL_INT = (torch.uint8, torch.int8, torch.int16)
#: Every dtype ``allreduce`` takes.
REDUCIBLE = NATIVE + HALF + SMALL_INT
#: Floating-point dtypes a ``DistributedOptimizer`` reduces gradients of.
GRADIENT = (torch.float32, torch.float64) + HALF


def names(dtypes: Sequence[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(tensor, caller: str, arg: str = "tensor", dtypes: Optional[Sequence[torch.dtype]] = None,
                 contiguous: bool = True) -> torch.Tensor:
    """Return ``tensor`` if ``caller`` can work on it, else raise naming ``arg`` and what is wrong."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{caller}: {arg} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise TypeError(f"{caller}: {arg} is a {str(tensor.layout).replace('torch.', '')} tensor; only dense "
                        f"(strided) tensors are supported (pass {arg}.to_dense())")
    if tensor.device.type != "cpu":
        raise TypeError(f"{caller}: {arg} is on device {tensor.device}; allreduce_kit.torch works on CPU tensors "
                        f"only (pass {arg}.cpu())")
    if dtypes is not None and tensor.dtype not in dtypes:
        raise TypeError(f"{caller}: {arg} has unsupported dtype {str(tensor.dtype).replace('torch.', '')}; "
                        f"supported: {names(dtypes)}")
    if contiguous and not tensor.is_contiguous():
        raise ValueError(f"{caller}: {arg} is not contiguous (shape {tuple(tensor.shape)}, strides "
                         f"{tuple(tensor.stride())}); pass {arg}.contiguous()")
    return tensor


def empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A new contiguous CPU tensor over memory numpy allocated.

    NumPy asks the kernel for huge pages for large arrays (``madvise``), torch's allocator does
    not; the library's one-node algorithms, which read and write other ranks' buffers, ran twice
    as fast on a 42 MB buffer of numpy's as on one of torch's, and copies into it faster too.
    """
    count = 1
    for n in shape:
        count *= int(n)
    if count == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    raw = np.empty(count * torch.empty(0, dtype=dtype).element_size(), dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).view(tuple(shape))


def as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A numpy array over ``tensor``'s memory (a contiguous CPU tensor of a numpy dtype); no copy."""
    return tensor.detach().numpy()


def as_bytes(tensor: torch.Tensor) -> np.ndarray:
    """``tensor``'s memory as a flat uint8 numpy array, whatever its dtype (contiguous); no copy."""
    flat = tensor.detach().reshape(-1)
    return (flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)).numpy()


def signature(tensor: torch.Tensor) -> tuple:
    """What must agree between ranks for an element-wise collective: shape and dtype."""
    return tuple(tensor.shape), str(tensor.dtype).replace("torch.", "")
