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
Importing ``allreduce_kit`` does not import this module (nor torch).
"""
from .async_calls import (allgather_async, allreduce_async, allreduce_async_, alltoall_async, broadcast_async,
                          broadcast_async_, grouped_allgather_async, grouped_allreduce_async, grouped_allreduce_async_,
                          grouped_reducescatter_async, reducescatter_async)
from .calls import (allgather, allgather_object, allreduce, allreduce_, alltoall, barrier, broadcast, broadcast_,
                    broadcast_object, reducescatter)
from .compression import Compression, Compressor
from .errors import CollectiveError, HorovodInternalError
from .functions import broadcast_optimizer_state, broadcast_parameters
from .grouped import grouped_allgather, grouped_allreduce, grouped_allreduce_, grouped_reducescatter
from .handles import poll, synchronize
from .mpi_ops import (Adasum, Average, Max, Min, Product, Sum, ccl_built, cross_rank, cross_size, cuda_built,
                      ddl_built, gloo_built, gloo_enabled, init, is_homogeneous, is_initialized, local_rank, local_size,
                      mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank, rocm_built, shutdown, size)
from .process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from .sparse import sparse_allreduce_async
from .optimizer import BUCKET_MB, DistributedOptimizer
from .timing import Timing

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
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "CollectiveError", "HorovodInternalError",
    "Compression", "Compressor", "DistributedOptimizer", "BUCKET_MB", "Timing",
]
