"""MPI's own reduce-scatter: ``Reduce_scatter_block`` where every block has one length, else
``Reduce_scatter`` with the block rule's counts. The oracle and the yardstick."""
from . import register
from ...blocks import counts
from ..mpi import MPI_OPS


@register("mpi")
def reduce_scatter(comm, buf, out, op):
    lengths = counts(buf.size, comm.nranks)
    if min(lengths) == max(lengths):
        comm.Reduce_scatter_block(buf, out, MPI_OPS[op.base])
    else:
        comm.Reduce_scatter(buf, out, lengths, MPI_OPS[op.base])
    op.finish(out)

