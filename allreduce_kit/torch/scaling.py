"""Scale factors (``prescale_factor``, ``postscale_factor``) applied as Horovod applies them.

A floating-point tensor is multiplied in its own dtype, float16 and bfloat16 through float32;
an integer tensor is multiplied in float64 and cast back (toward zero), so
``allreduce(int_tensor, prescale_factor=0.5)`` sums each rank's ``trunc(x * 0.5)``.
"""
import torch


def scale_(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """Multiply ``tensor`` by ``factor`` in place (nothing for 1.0) and return it."""
    if factor == 1.0:
        return tensor
    if tensor.dtype in (torch.float16, torch.bfloat16):
        return tensor.copy_(tensor.float().mul_(factor))
    if not tensor.dtype.is_floating_point:
        return tensor.copy_(tensor.double().mul_(factor))
    return tensor.mul_(factor)
