"""Background threads that run collectives while the caller computes, and the order they keep.

``Worker`` is a thread that runs the jobs handed to it, in the order they were handed over, one
at a time: ``allreduce_kit.torch`` reduces gradient buckets on one, and the nonblocking
collectives (``nonblocking.py``) run on the process's progress thread, another one (``submit``).

The order every collective keeps: collectives on one communicator must reach it in the same
order on every rank, and the library's algorithms and the stall inspector expect one call at a
time. So while a nonblocking call is in flight (submitted and not finished), a library
collective made on any other thread, on any communicator, first waits until every nonblocking
call started before it has finished (``wait_turn``), and nonblocking calls run one after the
other in the order they were started. A program thus makes the same calls in the same order as
it would if each nonblocking call were the blocking one, run where it was started.

Collectives on a second thread need ``MPI_THREAD_MULTIPLE`` (what mpi4py asks for by default):
``available()`` says whether MPI gave it.
"""
import atexit
import collections
import threading
from typing import Callable, Deque, Optional

from mpi4py import MPI


def available() -> bool:
    """Whether MPI allows collectives from a second thread (``MPI_THREAD_MULTIPLE``)."""
    return MPI.Query_thread() >= MPI.THREAD_MULTIPLE


class Worker:
    """A thread that runs submitted jobs in order; ``drain`` waits for them and re-raises a failure."""

    def __init__(self, name: str = "allreduce_kit-torch-reduce"):
        self._jobs: Deque[Callable[[], None]] = collections.deque()
        self._ready = threading.Condition()
        self._pending = 0                      # submitted and not finished
        self._error: Optional[BaseException] = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        #: The thread's identifier (``threading.get_ident()`` on it).
        self.ident = self._thread.ident

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


#: ``[n]``: nonblocking calls submitted to the progress thread and not finished. Collectives read
#: it first (``if IN_FLIGHT[0]: wait_turn()``): the thread that starts nonblocking calls sees
#: its own increments, so a program that never starts one pays one list read per call.
IN_FLIGHT = [0]
_progress: list = []   # [the progress thread's Worker], once started
_lock = threading.Lock()


def submit(job: Callable[[], None]) -> None:
    """Run ``job()`` on the progress thread after every job submitted before it (the thread is
    started on first use and finishes its jobs at exit, before MPI finalizes). ``job`` must not
    raise: what it produces, a failure included, it hands over itself (``nonblocking.Handle``)."""
    with _lock:
        if not _progress:
            _progress.append(Worker(name="allreduce_kit-progress"))
            atexit.register(_finish)  # runs before mpi4py's MPI_Finalize: mpi4py registered first
        IN_FLIGHT[0] += 1

    def run() -> None:
        try:
            job()
        finally:
            with _lock:
                IN_FLIGHT[0] -= 1

    _progress[0].submit(run)


def on_progress_thread() -> bool:
    """Whether the caller is the progress thread."""
    return bool(_progress) and threading.get_ident() == _progress[0].ident


def wait_turn() -> None:
    """Before a collective runs: on any thread but the progress thread, wait until every
    nonblocking call started so far has finished (their failures are raised by their ``wait``)."""
    if _progress and threading.get_ident() != _progress[0].ident:
        _progress[0].drain()


def _finish() -> None:
    """At exit: finish the nonblocking calls in flight (every rank started them, so they end;
    one that cannot is reported by the stall inspector, which is still running), then stop."""
    if _progress and not MPI.Is_finalized():
        _progress[0].stop()
