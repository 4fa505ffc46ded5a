"""allreduce_kit: allreduce algorithms over MPI point-to-point, and tools to use and measure them.

>>> from allreduce_kit import allreduce, ALGORITHMS
>>> allreduce(grad, op="mean", algorithm="ring")   # in place on every rank; returns grad
"""
from . import yield_env  # first: sets MPICH's yield setting before mpi4py starts MPI  # noqa: F401
from .abort import abort_hook_wanted, install_abort_hook
from .algorithms import ALGORITHMS
from .collective import allreduce, validate
from .comm import library_comm
from .params import FlatParameters, average_arrays, average_buffer, broadcast_parameters
from .reduction import OPS

__version__ = "0.1.0"

if abort_hook_wanted():
    install_abort_hook()

__all__ = ["allreduce", "ALGORITHMS", "OPS", "library_comm", "validate", "install_abort_hook", "__version__"]
__all__ += ["average_arrays", "average_buffer", "broadcast_parameters", "FlatParameters"]
