"""The background thread that reduces gradient buckets while backward runs.

One thread per process runs the jobs handed to it, in the order they were handed over, one at a
time. Every collective of ``allreduce_kit.torch`` runs on one communicator, and never on two
threads at once: a collective on the main thread first waits until the worker has run every job
handed to it (``drain``). So the calls reach the communicator in program order, the same on
every rank, and the library's algorithms and the stall inspector see one call at a time.

Reductions on a second thread need ``MPI_THREAD_MULTIPLE`` (what mpi4py asks for by default):
``available()`` says whether MPI gave it; without it gradients are reduced in ``step()`` on the
main thread.

The thread is a ``progress.Worker``, the class the nonblocking collectives' progress thread is
made of (a second instance: each keeps its own order and failures).
"""
from ..progress import Worker, available

__all__ = ["Worker", "available"]
