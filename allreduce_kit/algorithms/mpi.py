"""MPI's own ``Allreduce``: the correctness oracle and the speed yardstick.

Nothing is added to it, so a buffer whose length or dtype differs between ranks is MPI's to
catch: MPICH ends the whole job ("Message truncated") when the byte counts differ, and cannot
tell dtypes of one size apart (float32 against int32 returns garbage). ``check=True`` catches
both before the call.
"""
from typing import Callable, Optional, Tuple

from mpi4py import MPI

from . import register

MPI_OPS = {"sum": MPI.SUM, "prod": MPI.PROD, "max": MPI.MAX, "min": MPI.MIN}


@register("mpi")
def allreduce(comm, buf, op):
    comm.Allreduce(MPI.IN_PLACE, buf, MPI_OPS[op.base])
    op.finish(buf)


def binding(comm, op) -> Optional[Tuple[Callable, MPI.Op]]:
    """How a caller that repeats one call many times (``allreduce``'s repeated calls) runs
    ``op`` through ``comm`` with nothing of ours between: ``(call, mpi_op)``, where
    ``call(MPI.IN_PLACE, buf, mpi_op)`` is the communicator's bound ``Allreduce``; ``None`` for
    a mean, which divides afterwards.

    A call of a few bytes takes microseconds, and where ranks share cores every microsecond of
    Python around it costs many more (docs/multinode.md), so this skips the registry's wrapper."""
    if op.base != op.op:
        return None
    return comm.Allreduce, MPI_OPS[op.base]
