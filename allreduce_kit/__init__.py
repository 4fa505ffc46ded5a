"""allreduce_kit: allreduce algorithms over MPI point-to-point, and tools to use and measure them.

>>> from allreduce_kit import allreduce, ALGORITHMS
>>> allreduce(grad, op="mean", algorithm="ring")   # in place on every rank; returns grad
>>> average = plan(grad, op="mean"); average()     # the same, checked, chosen and bound once

Importing the package changes nothing in the process: no environment variable is written, no
hook installed, and MPI starts only when something that needs it is first used (``allreduce``,
``ALGORITHMS``, ...), so ``import allreduce_kit.kernels`` never starts it. Abort-on-error and
MPICH's yield setting are asked for: ``python -m allreduce_kit.run script.py``, or
``install_abort_hook()`` (docs/settings.md).
"""
from importlib import import_module
from typing import Any

__version__ = "0.1.0"

#: public name -> the module that defines it, imported on first use
_PUBLIC = {
    "allreduce": "collective", "validate": "collective",
    "ALGORITHMS": "algorithms",
    "OPS": "reduction",
    "library_comm": "comm",
    "install_abort_hook": "abort",
    "set_stall_timeout": "stall",
    "Topology": "topology",
    "FlatParameters": "params", "average_arrays": "params", "average_buffer": "params",
    "broadcast_parameters": "params",
    "plan": "plans", "Plan": "plans",
    "iallreduce": "nonblocking", "Handle": "nonblocking", "wait_all": "nonblocking",
    "ireduce_scatter": "nonblocking", "iallgather": "nonblocking", "ibroadcast": "nonblocking",
    "shard_bounds": "blocks",
    "reduce_scatter": "collectives.reduce_scatter",
    "allgather": "collectives.allgather",
    "broadcast": "collectives.broadcast",
}

__all__ = [*_PUBLIC, "__version__"]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        try:
            return import_module(f"{__name__}.{name}")  # a submodule: allreduce_kit.kernels, ...
        except ModuleNotFoundError as missing:
            if missing.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
