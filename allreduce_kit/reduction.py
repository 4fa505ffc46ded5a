"""What an algorithm applies when two partial results meet: an op bound to a rank count."""
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from . import kernels

#: Reduction operations ``allreduce`` accepts; ``mean`` is ``sum`` divided by the rank count.
OPS = ("sum", "mean", "max", "min", "prod")


@dataclass(frozen=True)
class Reduction:
    """``op`` for a communicator of ``size`` ranks, as the algorithms apply it.

    Algorithms call ``combine`` for every partial result they fold in and pass ``last=True``
    for the fold that completes an element's reduction (that is where ``mean`` divides, in the
    same pass); ``finish`` does that division for algorithms that never fold last (``mpi``).
    """

    op: str
    size: int

    @property
    def base(self) -> str:
        """The element-wise op the kernels apply: ``sum`` for ``mean``."""
        return "sum" if self.op == "mean" else self.op

    def combine(self, dst: np.ndarray, src: np.ndarray, last: bool = False) -> None:
        if last and self.op == "mean":
            kernels.sum_divide_into(dst, src, self.size)
        else:
            kernels.reduce_into(dst, src, self.base)

    def finish(self, buf: np.ndarray) -> None:
        if self.op == "mean":
            kernels.divide(buf, self.size)


@lru_cache(maxsize=None)
def reduction(op: str, size: int) -> Reduction:
    """The cached ``Reduction`` for ``op`` over ``size`` ranks."""
    return Reduction(op, size)
