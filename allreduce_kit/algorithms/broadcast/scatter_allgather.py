"""Scatter-allgather broadcast (van de Geijn): the root sends rank r its block r of the buffer
(``blocks.shard_bounds``), then the ranks allgather the blocks around the ring (the allgather's
``ring``, the same steps). The root sends (p-1)/p of the buffer instead of lg p copies of it.

By messages, so the call's ranks have agreed first (``collectives/broadcast.py``)."""
from mpi4py import MPI

from . import register
from ..allgather.ring import run as ring_allgather
from ..signature import tag as signature
from ...blocks import shard_bounds

TAG = 206


@register("scatter_allgather")
def broadcast(comm, buf, root):
    p, rank = comm.nranks, comm.myrank
    bounds = shard_bounds(buf.size, p)
    if rank == root:  # scatter
        MPI.Request.Waitall([comm.Isend(buf[bounds[r]:bounds[r + 1]], r, TAG) for r in range(p) if r != root])
    else:
        comm.Recv(buf[bounds[rank]:bounds[rank + 1]], root, TAG)
    ring_allgather(comm, buf, bounds, signature(buf, TAG))
