"""PyTorch on allreduce_kit: Horovod's API for CPU tensors, over MPI.

A Horovod PyTorch script runs with its import line changed::

    import allreduce_kit.torch as hvd          # was: import horovod.torch as hvd

    hvd.init()
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    ...                                         # the training loop, unchanged
    optimizer.report()                          # the straggler report, and the share hidden

Tensors are CPU tensors; a contiguous one is reduced in place through a numpy array over its
memory, with the library's algorithms. ``DistributedOptimizer`` reduces gradients in buckets on
a background thread while backward runs. What is and is not supported: docs/pytorch.md.
Importing ``allreduce_kit`` does not import this module (nor torch). Importing this one imports
torch but does not start MPI, and changes nothing else in the process: ``init()`` comes first and
may prepare MPI's start (``start.py``); the other names are imported on first use.
"""
from importlib import import_module
from typing import Any

from .compression import Compression, Compressor
from .errors import CollectiveError, HorovodInternalError
from .ops import Adasum, Average, Max, Min, Product, Sum
from .start import init, is_initialized


def _names(module: str, names: str) -> dict:
    return {name: module for name in names.split()}


#: public name -> the module that defines it, imported on first use (they import mpi4py.MPI,
#: which starts MPI: after ``init``, which must come first to prepare MPI's start)
_PUBLIC = {
    **_names("mpi_ops", "shutdown rank size local_rank local_size cross_rank cross_size is_homogeneous "
                        "mpi_threads_supported mpi_built mpi_enabled gloo_built gloo_enabled nccl_built cuda_built "
                        "rocm_built ccl_built ddl_built"),
    **_names("calls", "allreduce allreduce_ allgather broadcast broadcast_ broadcast_object allgather_object barrier "
                      "alltoall reducescatter"),
    **_names("async_calls", "allgather_async allreduce_async allreduce_async_ alltoall_async broadcast_async "
                            "broadcast_async_ grouped_allgather_async grouped_allreduce_async grouped_allreduce_async_ "
                            "grouped_reducescatter_async reducescatter_async"),
    **_names("grouped", "grouped_allgather grouped_allreduce grouped_allreduce_ grouped_reducescatter"),
    **_names("handles", "poll synchronize"),
    **_names("process_sets", "ProcessSet add_process_set global_process_set remove_process_set"),
    **_names("sparse", "sparse_allreduce_async"),
    "broadcast_parameters": "functions", "broadcast_optimizer_state": "functions",
    "DistributedOptimizer": "optimizer", "BUCKET_MB": "optimizer",
    "Timing": "timing",
    "ZeroRedundancyOptimizer": "zero",
    "fully_shard": "layer_sharding", "full_state_dict": "layer_sharding",
    "join": "joining",
}

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
    "is_homogeneous", "mpi_threads_supported", "mpi_built", "mpi_enabled", "gloo_built", "gloo_enabled",
    "nccl_built", "cuda_built", "rocm_built", "ccl_built", "ddl_built",
    "Average", "Sum", "Min", "Max", "Product", "Adasum",
    "allreduce", "allreduce_", "allgather", "broadcast", "broadcast_", "broadcast_object", "allgather_object",
    "reducescatter", "alltoall", "barrier", "broadcast_parameters", "broadcast_optimizer_state",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allgather", "grouped_reducescatter",
    "allreduce_async", "allreduce_async_", "allgather_async", "broadcast_async", "broadcast_async_",
    "reducescatter_async", "alltoall_async", "grouped_allreduce_async", "grouped_allreduce_async_",
    "grouped_allgather_async", "grouped_reducescatter_async", "poll", "synchronize", "sparse_allreduce_async",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set", "join",
    "CollectiveError", "HorovodInternalError",
    "Compression", "Compressor", "DistributedOptimizer", "BUCKET_MB", "Timing",
    "ZeroRedundancyOptimizer", "fully_shard", "full_state_dict",
]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        try:
            return import_module(f"{__name__}.{name}")  # a submodule: allreduce_kit.torch.mpi_ops, ...
        except ModuleNotFoundError as missing:
            if missing.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
