"""The background thread that reduces gradient buckets while backward runs.

One thread per process runs the jobs handed to it, in the order they were handed over, one at a
time. Every collective of ``allreduce_kit.torch`` runs on one communicator, and never on two
threads at once: a collective on the main thread first waits until the worker has run every job
handed to it (``drain``). So the calls reach the communicator in program order, the same on
every rank, and the library's algorithms and the stall inspector see one call at a time.

Reductions on a second thread need ``MPI_THREAD_MULTIPLE`` (what mpi4py asks for by default):
``available()`` says whether MPI gave it; without it gradients are reduced in ``step()`` on the
main thread.
"""
import collections
import threading
from typing import Callable, Deque, Optional

from mpi4py import MPI


def available() -> bool:
    """Whether MPI allows collectives from a second thread (``MPI_THREAD_MULTIPLE``)."""
    return MPI.Query_thread() >= MPI.THREAD_MULTIPLE


class Worker:
    """A thread that runs submitted jobs in order; ``drain`` waits for them and re-raises a failure."""

    def __init__(self):
        self._jobs: Deque[Callable[[], None]] = collections.deque()
        self._ready = threading.Condition()
        self._pending = 0                      # submitted and not finished
        self._error: Optional[BaseException] = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="allreduce_kit-torch-reduce", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job()`` on the worker after every job submitted before it."""
        with self._ready:
            self._jobs.append(job)
            self._pending += 1
            self._ready.notify_all()

    def drain(self) -> None:
        """Wait until every job submitted so far has finished; re-raise the first that failed.
        On the worker's own thread (a job that runs a collective) there is nothing to wait for."""
        if threading.current_thread() is self._thread:
            return
        with self._ready:
            while self._pending:
                self._ready.wait()
            error, self._error = self._error, None
        if error is not None:
            raise error

    def stop(self) -> None:
        """Finish the jobs submitted so far, then end the thread."""
        with self._ready:
            self._stopping = True
            self._ready.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._jobs and not self._stopping:
                    self._ready.wait()
                if not self._jobs:
                    return
                job = self._jobs.popleft()
                failed = self._error is not None
            if not failed:  # after a failure the rest is skipped: the caller sees the first error
                try:
                    job()
                except BaseException as error:  # noqa: B902 - handed to the thread that drains
                    with self._ready:
                        self._error = error
            with self._ready:
                self._pending -= 1
                if not self._pending:
                    self._ready.notify_all()
