"""What an algorithm applies when two partial results meet: an op bound to a rank count."""
import weakref
from types import ModuleType
from typing import Union

import numpy as np

from . import kernels

#: Reduction operations ``allreduce`` accepts; ``mean`` is ``sum`` divided by the rank count.
OPS = ("sum", "mean", "max", "min", "prod")

#: The module whose ``reduce_into``, ``divide`` and ``sum_divide_into`` do the arithmetic.
_kernels: Union[ModuleType, object] = kernels


class Reduction:
    """``op`` for a communicator of ``size`` ranks, as the algorithms apply it.

    Algorithms call ``combine`` for every partial result they fold in and pass ``last=True``
    for the fold that completes an element's reduction (that is where ``mean`` divides, in the
    same pass); ``finish`` does that division for algorithms that never fold last (``mpi``).
    Everything a call needs is looked up once, here, not on every call.
    """

    __slots__ = ("op", "size", "threads", "base", "code", "divisor", "_reduce_into", "_reduce_serial", "_code",
                 "_sum_divide_into", "_divide", "_mean")

    def __init__(self, op: str, size: int, threads: int = 1, backend=None):
        backend = backend or _kernels
        #: ``threads``: at most this many threads for a large array (this rank's share of its node).
        self.op, self.size, self.threads = op, size, threads
        #: The element-wise op the kernels apply: ``sum`` for ``mean``.
        self.base = "sum" if op == "mean" else op
        self._mean = op == "mean"
        self._reduce_into = backend.reduce_into
        self._reduce_serial, self._code = backend.reduce_serial, backend.OP_CODES[self.base]
        #: The op code of the numba kernels (``kernels.OP_CODES``) for compiled callers that call
        #: ``kernels/reduce.py`` themselves; ``None`` when another backend does the arithmetic.
        self.code = self._code if backend is kernels else None
        #: What a compiled caller divides by after its last fold: ``size`` for a mean, else 0.
        self.divisor = size if self._mean else 0
        self._sum_divide_into = backend.sum_divide_into
        self._divide = backend.divide

    def combine(self, dst: np.ndarray, src: np.ndarray, last: bool = False) -> None:
        """``dst = dst op src``; with ``last=True`` a mean also divides by ``size``."""
        if last and self._mean:
            self._sum_divide_into(dst, src, self.size)
        elif self.threads == 1:  # most calls: straight into the compiled kernel
            self._reduce_serial(dst, src, self._code)
        else:
            self._reduce_into(dst, src, self.base, self.threads)

    def finish(self, buf: np.ndarray) -> None:
        """Divide by ``size`` for a mean whose folds never said ``last`` (e.g. MPI's own)."""
        if self._mean:
            self._divide(buf, self.size)

    def __repr__(self) -> str:
        return f"Reduction({self.op!r}, {self.size}, threads={self.threads})"


class Reductions(dict):
    """op name -> its ``Reduction`` over ``size`` ranks on ``threads`` threads, made on first
    lookup (``reductions[op]`` is one dictionary lookup after that). ``use_kernels`` empties it."""

    def __init__(self, size: int, threads: int):
        super().__init__()
        self.size, self.threads = size, threads
        _made[id(self)] = self

    def __missing__(self, op: str) -> Reduction:
        made = self[op] = Reduction(op, self.size, self.threads)
        return made


#: Every live ``Reductions`` (a communicator's), so that ``use_kernels`` can empty them; weak,
#: so that a freed communicator's goes with it.
_made: "weakref.WeakValueDictionary[int, Reductions]" = weakref.WeakValueDictionary()


def use_kernels(backend) -> None:
    """Do the arithmetic with ``backend`` (a module or object with ``reduce_into``, ``divide``
    and ``sum_divide_into`` as in ``allreduce_kit.kernels``) from now on; ``None`` restores the
    numba kernels. For measuring what the kernels buy (``bench --kernel numpy``)."""
    global _kernels
    _kernels = backend or kernels
    for made in list(_made.values()):
        made.clear()
