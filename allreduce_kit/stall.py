"""The stall inspector: name the ranks a stuck collective is waiting for, then end the job.

In synchronous training one rank that never arrives stops everyone, silently. Here every rank
runs a watchdog thread. A collective records which call it is (a per-communicator sequence
number); the watchdog notes when it first saw that call in progress, and if it has not
finished after ``timeout`` seconds, the watchdog
asks every rank's watchdog, over a communicator of its own, which call that rank has reached,
prints the ranks that have not arrived (Horovod's "missing ranks" report) and calls
``MPI.COMM_WORLD.Abort``. Each answer also says what the call is (the collective and its
arguments, as ``describe`` writes them) when that rank is inside it: ranks that have reached
the same call but describe it differently (another collective, algorithm, length, dtype, op or
root) can never complete it, so that too is named and ends the job. Ranks that are all in the
same call, described alike, are only slow, and are waited for. The cost on the calling path is
a counter increment and one tuple per call; the watchdog thread, not the caller, reads the
clock and writes the descriptions.

Point-to-point waits (a pipeline's activations and gradients between stages) are watched too,
by ``Inspector.wait``: they have no call number, since ranks make different numbers of them, so
when one stalls the watchdog asks only the rank it waits on what that rank is doing (``Watch.ask``),
prints both and ends the job.

The timeout comes from ``allreduce(..., stall_timeout=S)``, else ``set_stall_timeout(S)``, else
``ALLREDUCE_KIT_STALL_TIMEOUT`` (seconds; default 60; 0 turns the inspector off).
"""
import atexit
import sys
import threading
import time
import zlib
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np
from mpi4py import MPI

from . import config, faults
from .abort import abort_job
from .progress import IN_FLIGHT, wait_turn

QUERY, REPLY = 1, 2
#: How long a stuck rank waits for the others' watchdogs to answer its query, in seconds.
ANSWER_WINDOW = 3.0
#: The size of an answer: the call reached, whether the rank is inside it, the length and a
#: checksum of the call's description, then the description (cut to what fits).
REPLY_BYTES = 512
_HEAD = 4 * 8


def allreduce_description(algorithm: str, size: int, dtype, op: str = "sum") -> str:
    """How the inspector names an ``allreduce`` call (the op only where it is not ``sum``).
    Every path of one call (``collective``'s full and repeated ones, a plan) names it with this."""
    ops = "" if op == "sum" else f", op={op!r}"
    return f"allreduce(algorithm={algorithm!r}, {size} x {dtype}{ops})"


def describe(current: tuple) -> str:
    """What the call in ``Inspector.current`` is: its description, or the one made from an
    ``allreduce``'s algorithm, buffer and op (``collective.allreduce`` passes those instead of a
    string, so as to build nothing per call)."""
    algorithm, buf = current[2], current[3]
    if buf is None:
        return algorithm
    return allreduce_description(algorithm, buf.size, buf.dtype, current[4] if len(current) > 4 else "sum")


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

    def answer(self) -> np.ndarray:
        """This rank's answer: the call it has reached (``calls``) and, if it is inside that call
        on this communicator, the call's description (kind 1). The caller's thread may move on while
        this is read: the description is given only if the call count did not change around
        reading the call in progress, and that call is this communicator's. A rank waiting
        elsewhere (a point-to-point wait, a collective on another communicator) describes that
        wait (kind 2), which no collective's comparison counts as being inside it."""
        reply = np.zeros(REPLY_BYTES, np.uint8)
        head = reply[:_HEAD].view(np.int64)
        calls = self.calls
        current = INSPECTOR.current
        head[0] = calls
        if current is None:
            return reply
        if current[0] is self:
            if self.calls != calls:
                return reply
            kind = 1
        elif current[0] is not None:
            kind = 2                    # waiting elsewhere: a point-to-point wait, a call on another communicator
        else:
            return reply
        text = describe(current).encode()
        kept = text[:REPLY_BYTES - _HEAD]
        head[1:] = kind, len(text), zlib.crc32(text)
        reply[_HEAD:_HEAD + len(kept)] = np.frombuffer(kept, np.uint8)
        return reply

    def answer_queries(self) -> None:
        """Tell any rank that asked which call this rank has reached, and what it is (``answer``)."""
        status = MPI.Status()
        while self.request.Test(status):
            self.replies.append(self.channel.Isend(self.answer(), dest=status.Get_source(), tag=REPLY))
            self.request = self.channel.Irecv(self.inbox, source=MPI.ANY_SOURCE, tag=QUERY)
        self.replies = [r for r in self.replies if not r.Test()]

    def ask(self, peer: int) -> Optional[Tuple[int, str]]:
        """Ask rank ``peer``'s watchdog what that rank is waiting in: None if it does not answer
        within ``ANSWER_WINDOW``, else (0, "") where it waits in none of the library's calls, (1,
        its description) where it is inside this communicator's collective, (2, its description)
        where it waits elsewhere (a point-to-point wait, a call on another communicator)."""
        answer = np.zeros(REPLY_BYTES, np.uint8)
        receive = self.channel.Irecv(answer, source=peer, tag=REPLY)
        ask = self.channel.Isend(np.array([-1], np.int64), dest=peer, tag=QUERY)
        deadline = time.monotonic() + ANSWER_WINDOW
        while time.monotonic() < deadline and not receive.Test():
            self.answer_queries()  # the peer may be asking us at the same time
            time.sleep(0.01)
        del ask
        if not receive.Test():
            return None
        head = answer[:_HEAD].view(np.int64)
        length = int(head[2])
        text = answer[_HEAD:_HEAD + min(length, REPLY_BYTES - _HEAD)].tobytes().decode(errors="replace")
        return int(head[1]), text if length <= REPLY_BYTES - _HEAD else text + "..."

    def missing_ranks(self, call: int) -> Tuple[List[int], List[int], Dict[int, Tuple[str, int, int]]]:
        """Ask every other rank which call it has reached: (behind ``call``, did not answer, and
        for each rank that is inside ``call``: its description of it as far as it fits in an
        answer, and the whole description's length in bytes and ``zlib.crc32``)."""
        me, size = self.channel.Get_rank(), self.channel.Get_size()
        others = [r for r in range(size) if r != me]
        answers = {r: np.zeros(REPLY_BYTES, np.uint8) for r in others}
        receives = {r: self.channel.Irecv(answers[r], source=r, tag=REPLY) for r in others}
        asks = [self.channel.Isend(np.array([call], np.int64), dest=r, tag=QUERY) for r in others]
        deadline = time.monotonic() + ANSWER_WINDOW
        while time.monotonic() < deadline and not all(q.Test() for q in receives.values()):
            self.answer_queries()  # other stuck ranks may be asking us at the same time
            time.sleep(0.01)
        del asks
        heads = {r: answers[r][:_HEAD].view(np.int64) for r in others}
        behind = [r for r in others if receives[r].Test() and heads[r][0] < call]
        silent = [r for r in others if not receives[r].Test()]
        inside = {}
        for r in others:
            if r not in silent and heads[r][0] == call and heads[r][1] == 1:
                length, checksum = int(heads[r][2]), int(heads[r][3])
                text = answers[r][_HEAD:_HEAD + min(length, REPLY_BYTES - _HEAD)].tobytes().decode(errors="replace")
                inside[r] = (text if length <= REPLY_BYTES - _HEAD else text + "...", length, checksum)
        return behind, silent, inside


class PeerWait:
    """A point-to-point wait on ``watch``'s communicator for rank ``peer`` (its message, or its
    receiving ours): watched like a collective, but with no call number (ranks make different
    numbers of them), and when it stalls only ``peer`` is asked what it is doing."""
    __slots__ = ("watch", "peer")

    def __init__(self, watch: Watch, peer: int):
        self.watch, self.peer = watch, peer

    @property
    def calls(self) -> int:
        return self.watch.calls


def _wait(request: MPI.Request, nap: float) -> None:
    """``request.Wait()``, or with ``nap`` > 0: tests for ``nap`` seconds, then a test every
    ``nap`` seconds, asleep in between."""
    if nap <= 0:
        request.Wait()
        return
    until = time.perf_counter() + nap
    while not request.Test():
        if time.perf_counter() > until:
            time.sleep(nap)


class Inspector:
    """The process's watchdog thread and the collective (or point-to-point wait) it is watching
    now, if any."""

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

    def wait(self, request: MPI.Request, watch: Watch, peer: int, what: Callable[[], str],
             timeout: Optional[float] = None, nap: float = 0.0) -> None:
        """``request.Wait()``, watched: ``request`` is a point-to-point call on ``watch``'s
        communicator with rank ``peer``, and ``what()`` says what this rank waits for (made only
        if the request is not complete at once). If it waits longer than the timeout, the
        watchdog asks ``peer`` what it is doing, prints both and aborts the job. ``nap`` > 0:
        test the request and sleep that many seconds between tests instead of MPI's wait, which
        polls without pause (ranks that share cores: a waiting rank gives its core to one that
        computes)."""
        if request.Test():
            return
        if self.current is None:              # else inside a watched call: that one is watched
            self.start()
            self.current = (PeerWait(watch, peer), timeout, what(), None)
            try:
                _wait(request, nap)
            finally:
                self.current = None
        else:
            _wait(request, nap)

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
    # counter and a tuple (with the op's name as a fifth item), because for small messages a
    # method call is a measurable share of the call; a call it repeats (``collective.Repeat``)
    # and a plan's call set a tuple made once, with ``buf`` None and the description
    # (``allreduce_description``) for ``algorithm``, as other collectives do through
    # ``watching``. The watchdog tells one call from the next by the counter, and it, not the
    # caller, reads the clock and makes the description (``describe``). Every rank must describe
    # one call alike: the watchdogs compare the descriptions when a call stalls.

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
            watch, timeout = current[0], current[1]
            call = 0 if watch is None else watch.calls
            if current is not seen or call != seen_call:
                seen, seen_call, seen_at = current, call, time.monotonic()
                self.slow_reported.clear()
                continue
            if timeout is None:
                timeout = default_timeout or 0.0
            waited = time.monotonic() - seen_at
            if timeout > 0 and waited > timeout * (1 + len(self.slow_reported)):
                what = describe(current)
                if watch is None:
                    self._report_setup(waited, what)
                elif isinstance(watch, PeerWait):
                    self._report_peer(watch, waited, what)
                else:
                    self._report(watch, watch.calls, waited, what)

    def _report_setup(self, waited: float, what: str) -> None:
        """Abort a stalled set-up: no channel exists yet to ask which ranks are missing."""
        rank = MPI.COMM_WORLD.Get_rank()
        abort_job(f"allreduce_kit: stall: {what} has waited {waited:.1f} s on rank {rank} (world): some rank "
                  f"of the communicator has not made its first collective call, and which one cannot be known "
                  f"before the communicator is set up. Aborting the job.")

    def _report_peer(self, wait: PeerWait, waited: float, what: str) -> None:
        """Abort a stalled point-to-point wait, saying what the peer it waits on is doing."""
        with self.lock:
            answer = wait.watch.ask(wait.peer)
        me = wait.watch.channel.Get_rank()
        if answer is None:
            state = "did not answer (dead, or blocked outside Python)"
        elif answer[0] == 0:
            state = "is in none of the library's waits (stuck in its own work: compute, I/O, a sleep)"
        else:
            state = f"is itself waiting: {answer[1]}"
        abort_job(f"allreduce_kit: stall: {what}: has waited {waited:.1f} s on rank {me}; rank {wait.peer} "
                  f"{state}. Aborting the job.")

    def _report(self, watch: Watch, call: int, waited: float, what: str) -> None:
        """Abort, naming the ranks that have not arrived, or the ranks in this call whose
        description of it differs from this rank's; if all are in it, described alike, the
        transfer is only slow."""
        with self.lock:
            behind, silent, inside = watch.missing_ranks(call)
        me = watch.channel.Get_rank()
        head = (f"allreduce_kit: stall: {what} (call #{call} on this communicator) has waited "
                f"{waited:.1f} s on rank {me}; ")
        text = what.encode()
        differ = any((length, checksum) != (len(text), zlib.crc32(text)) for _, length, checksum in inside.values())
        if differ:
            calls = {me: what, **{r: description for r, (description, _, _) in inside.items()}}
            listed = "; ".join(f"rank {r}: {calls[r]}" for r in sorted(calls))
            abort_job(head + f"the ranks are in different calls at this call's number, which can never complete "
                             f"(another collective, or other arguments: {listed}). Every rank must make the same "
                             f"collective calls in the same order with the same algorithm, length, dtype, op and "
                             f"root. Aborting the job.")
            return
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
