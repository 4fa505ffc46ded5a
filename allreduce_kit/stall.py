"""The stall inspector: name the ranks a stuck collective is waiting for, then end the job.

In synchronous training one rank that never arrives stops everyone, silently. Here every rank
runs a watchdog thread. A collective records which call it is (a per-communicator sequence
number); the watchdog notes when it first saw that call in progress, and if it has not
finished after ``timeout`` seconds, the watchdog
asks every rank's watchdog, over a communicator of its own, which call that rank has reached,
prints the ranks that have not arrived (Horovod's "missing ranks" report) and calls
``MPI.COMM_WORLD.Abort``. The cost on the calling path is a counter increment and one tuple
per call; the watchdog thread, not the caller, reads the clock.

The timeout comes from ``allreduce(..., stall_timeout=S)``, else ``set_stall_timeout(S)``, else
``ALLREDUCE_KIT_STALL_TIMEOUT`` (seconds; default 60; 0 turns the inspector off).
"""
import atexit
import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator, List, Optional, Tuple

import numpy as np
from mpi4py import MPI

from . import config, faults
from .abort import abort_job
from .progress import IN_FLIGHT, wait_turn

QUERY, REPLY = 1, 2
#: How long a stuck rank waits for the others' watchdogs to answer its query, in seconds.
ANSWER_WINDOW = 3.0


#: The timeout of a call that does not pass its own (seconds; 0: off), once known: set by
#: ``set_stall_timeout``, else read from ``ALLREDUCE_KIT_STALL_TIMEOUT`` when the first library
#: communicator is made (``default_timeout_now``).
default_timeout: Optional[float] = None


def default_timeout_now() -> float:
    """The default stall timeout, read from the settings on first use (``ValueError`` names a bad
    ``ALLREDUCE_KIT_STALL_TIMEOUT``)."""
    global default_timeout
    if default_timeout is None:
        default_timeout = config.read(config.STALL_TIMEOUT)
    return default_timeout


def set_stall_timeout(seconds: float) -> None:
    """Set the default stall timeout for every later collective; 0 turns the inspector off."""
    global default_timeout
    try:
        default_timeout = config.seconds_argument(seconds)
    except (TypeError, ValueError) as error:
        raise type(error)(f"set_stall_timeout: seconds: {error}") from None


class Watch:
    """One communicator's watch: its call counter and a channel for the watchdogs' questions."""

    def __init__(self, comm: MPI.Intracomm):
        self.channel = MPI.Intracomm(comm).Dup()  # collective, once per library communicator
        self.calls = 0
        self.inbox = np.zeros(1, np.int64)
        self.request = self.channel.Irecv(self.inbox, source=MPI.ANY_SOURCE, tag=QUERY)
        self.replies: List[MPI.Request] = []

    def close(self) -> None:
        """Withdraw the pending receive and free the channel (before MPI finalizes)."""
        if self.request != MPI.REQUEST_NULL:
            self.request.Cancel()
            self.request.Wait()
        for reply in self.replies:
            reply.Wait()
        self.channel.Free()

    def answer_queries(self) -> None:
        """Tell any rank that asked which call this rank has reached (``calls``)."""
        status = MPI.Status()
        while self.request.Test(status):
            self.replies.append(self.channel.Isend(np.array([self.calls], np.int64), dest=status.Get_source(), tag=REPLY))
            self.request = self.channel.Irecv(self.inbox, source=MPI.ANY_SOURCE, tag=QUERY)
        self.replies = [r for r in self.replies if not r.Test()]

    def missing_ranks(self, call: int) -> Tuple[List[int], List[int]]:
        """Ask every other rank which call it has reached: (behind ``call``, did not answer)."""
        me, size = self.channel.Get_rank(), self.channel.Get_size()
        others = [r for r in range(size) if r != me]
        answers = {r: np.full(1, -1, np.int64) for r in others}
        receives = {r: self.channel.Irecv(answers[r], source=r, tag=REPLY) for r in others}
        asks = [self.channel.Isend(np.array([call], np.int64), dest=r, tag=QUERY) for r in others]
        deadline = time.monotonic() + ANSWER_WINDOW
        while time.monotonic() < deadline and not all(q.Test() for q in receives.values()):
            self.answer_queries()  # other stuck ranks may be asking us at the same time
            time.sleep(0.01)
        del asks
        behind = [r for r in others if receives[r].Test() and answers[r][0] < call]
        silent = [r for r in others if not receives[r].Test()]
        return behind, silent


class Inspector:
    """The process's watchdog thread and the collective it is watching now, if any."""

    def __init__(self):
        self.current: Optional[tuple] = None
        self.watches: List[Watch] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.thread: Optional[threading.Thread] = None
        self.slow_reported: List[int] = []  # calls found slow but with every rank present

    def watch(self, comm: MPI.Intracomm) -> Watch:
        self.start()
        watch = Watch(comm)
        with self.lock:
            self.watches.append(watch)
        return watch

    def start(self) -> None:
        """Start the watchdog thread if it is not running (a bad timeout setting raises here, in
        the caller, never in the thread)."""
        default_timeout_now()
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="allreduce_kit-stall-inspector", daemon=True)
            self.thread.start()
            atexit.register(self.stop)  # runs before mpi4py's own MPI_Finalize at exit

    @contextmanager
    def watching(self, watch: Optional[Watch], what: str, timeout: Optional[float] = None) -> Iterator[None]:
        """Watch the collective ``what`` on ``watch``'s communicator while the block runs.

        ``watch`` ``None``: the set-up of a library communicator, which is itself collective and
        has no channel yet to ask the other ranks where they are; a stall there ends the job
        with a message that says so. Inside another watched call, the outer one stays watched.
        A collective that is watched runs after the nonblocking calls started before it (``progress``).
        """
        if IN_FLIGHT[0]:
            wait_turn()
        if self.current is not None:
            yield
            return
        self.start()
        if watch is not None:
            watch.calls += 1
        self.current = (watch, timeout, what, None)
        try:
            yield
        finally:
            self.current = None

    def unwatch(self, watch: Watch) -> None:
        with self.lock:
            if watch in self.watches:
                self.watches.remove(watch)
                watch.close()

    def forget(self, watch: Watch) -> None:
        """Stop answering on ``watch``'s channel without closing it: its communicator lost a rank
        and was revoked (``faults.revoke``), so nothing can be sent or cancelled on it any more."""
        with self.lock:
            if watch in self.watches:
                self.watches.remove(watch)

    def stop(self) -> None:
        """End the thread and close every watch; called at exit, before MPI finalizes."""
        self.stopping.set()
        if self.thread is not None:
            self.thread.join()
        with self.lock:
            if not MPI.Is_finalized():
                for watch in self.watches:
                    watch.close()
            self.watches.clear()

    # A collective tells the inspector it started on ``watch``'s communicator with
    # ``watch.calls += 1; INSPECTOR.current = (watch, timeout, algorithm, buf)`` (``timeout`` ``None``:
    # ``default_timeout``, read here), and that it ended
    # with ``INSPECTOR.current = None`` (in a ``finally``). ``allreduce`` does that inline: a
    # counter and a tuple, because for small messages a method call is a measurable share of the
    # call; a call it repeats (``collective.Repeat``) and a plan's call set a tuple made once,
    # with ``buf`` None and the description for ``algorithm``, as other collectives do through
    # ``watching``. The watchdog tells one call from the next by the counter, and it, not the
    # caller, reads the clock.

    def _run(self) -> None:
        """The watchdog's loop; if it fails, the job ends (a job without its watchdog could hang)."""
        try:
            self._watch_loop()
        except BaseException as error:  # noqa: B902 - whatever it was, nothing watches any more
            import traceback

            traceback.print_exc()
            abort_job(f"allreduce_kit: the stall inspector failed ({type(error).__name__}: {error}); "
                      f"aborting the job rather than running unwatched.")

    def _watch_loop(self) -> None:
        seen, seen_call, seen_at = None, 0, 0.0  # the call in progress at the last look, its number, since when
        while not self.stopping.wait(0.25):
            with self.lock:
                for watch in list(self.watches):
                    try:
                        watch.answer_queries()
                    except MPI.Exception as error:   # a peer died: the caller hears of it from its own call
                        if not faults.peer_failed(error):
                            raise
                        self.watches.remove(watch)
            current = self.current
            if current is None:
                self.slow_reported.clear()
                continue
            watch, timeout, algorithm, buf = current
            call = 0 if watch is None else watch.calls
            if current is not seen or call != seen_call:
                seen, seen_call, seen_at = current, call, time.monotonic()
                self.slow_reported.clear()
                continue
            if timeout is None:
                timeout = default_timeout or 0.0
            waited = time.monotonic() - seen_at
            if timeout > 0 and waited > timeout * (1 + len(self.slow_reported)):
                what = algorithm if buf is None else f"allreduce(algorithm={algorithm!r}, {buf.size} x {buf.dtype})"
                if watch is None:
                    self._report_setup(waited, what)
                self._report(watch, watch.calls, waited, what)

    def _report_setup(self, waited: float, what: str) -> None:
        """Abort a stalled set-up: no channel exists yet to ask which ranks are missing."""
        rank = MPI.COMM_WORLD.Get_rank()
        abort_job(f"allreduce_kit: stall: {what} has waited {waited:.1f} s on rank {rank} (world): some rank "
                  f"of the communicator has not made its first collective call, and which one cannot be known "
                  f"before the communicator is set up. Aborting the job.")

    def _report(self, watch: Watch, call: int, waited: float, what: str) -> None:
        """Abort, naming the ranks that have not arrived; if all have, the transfer is only slow."""
        with self.lock:
            behind, silent = watch.missing_ranks(call)
        head = (f"allreduce_kit: stall: {what} (call #{call} on this communicator) has waited "
                f"{waited:.1f} s on rank {watch.channel.Get_rank()}; ")
        if not behind and not silent:
            sys.stderr.write(head + "every rank has reached it, so the transfer is slow, not stuck; still waiting.\n")
            self.slow_reported.append(call)
            return
        parts = []
        if behind:
            parts.append(f"missing ranks (have not reached this call): {behind}")
        if silent:
            parts.append(f"ranks that did not answer (dead, or blocked outside Python): {silent}")
        abort_job(head + "; ".join(parts) + ". Aborting the job.")


INSPECTOR = Inspector()
