"""MPI's own allgather, in place: ``Allgather`` where every block has one length, else
``Allgatherv``. The oracle and the yardstick."""
from mpi4py import MPI

from . import register


@register("mpi")
def allgather(comm, out, bounds):
    lengths = [bounds[i + 1] - bounds[i] for i in range(comm.nranks)]
    if min(lengths) == max(lengths):
        comm.Allgather(MPI.IN_PLACE, out)
    else:
        comm.Allgatherv(MPI.IN_PLACE, [out, (lengths, list(bounds[:-1]))])
