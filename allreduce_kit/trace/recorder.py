"""The per-rank recorder: events appended as tuples, converted only when the run ends.

The library's hooks read ``ACTIVE[0]``: ``None`` (tracing off, or outside the window of steps)
costs one list index and one comparison per collective call. A recorded collective call is two
readings of this rank's ``clock`` (``time.perf_counter_ns`` unless a test gives another) and one
tuple of what the call was given, appended to ``calls``: no dictionary, no string, no lookup of
the communicator's size or the thread's name while the program runs. ``recorded`` turns them, at
the end, into the events the trace file is made of: ``(name, category, thread ident, start ns,
end ns, args)``, as the trainer's steps and phases are recorded (``events``).
"""
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

#: ``[the recorder]`` while events are recorded, else ``[None]``: the check every hook makes.
ACTIVE: list = [None]
#: ``[the recorder]`` while this process traces (inside or outside the window), else ``[None]``.
CURRENT: list = [None]

#: Events a rank records before it warns that the trace is growing large (about 150 bytes each
#: in the file): ``--trace-steps`` bounds it.
WARN_EVENTS = 500_000

Event = Tuple[str, str, int, int, int, Any]
#: A collective call as recorded: ``(name, thread ident, start ns, end ns, bytes, communicator
#: (``None``: the world), op, algorithm, root)``.
Call = Tuple[str, int, int, int, Optional[int], Any, Any, str, Optional[int]]
_ident = threading.get_ident
_ndarray = np.ndarray


class Recorder:
    """One rank's events. ``window``: the steps recorded, ``[first, stop)`` (``stop`` ``None``:
    to the end); calls outside a step (no trainer) are recorded while ``ACTIVE`` holds it.

    A hook records a call only where ``records_here``: not a call that a recorded call makes
    inside itself (each recording method runs the library's function again, whose hook then
    sees this thread ``busy``). The hooks inline that test: ``_ident() not in recorder.busy``."""

    def __init__(self, window: Tuple[int, Optional[int]] = (0, None),
                 clock: Callable[[], int] = time.perf_counter_ns):
        self.window = window
        self.clock = clock
        self.events: List[Event] = []
        self.calls: List[Call] = []
        #: threads that are inside a recorded collective call: a call it makes itself is not recorded again
        self.busy: set = set()
        #: thread ident -> its name, for the thread tracks (completed by ``recorded``)
        self.threads: Dict[int, str] = {threading.get_ident(): "main"}
        self.warned = False
        #: added to every recorded reading when the events are converted (a test's clock offset)
        self.skew_ns = 0
        from mpi4py import MPI
        self.world_size = MPI.COMM_WORLD.Get_size()

    # -- recording ---------------------------------------------------------------------------
    def span(self, name: str, category: str, start_ns: int, end_ns: int,
             args: Optional[Dict[str, Any]] = None) -> None:
        """An event on the calling thread from ``start_ns`` to ``end_ns`` (this rank's clock)."""
        ident = _ident()
        if ident not in self.threads:
            self.threads[ident] = threading.current_thread().name
        self.events.append((name, category, ident, start_ns, end_ns, args))

    def span_s(self, name: str, category: str, start_s: float, end_s: float,
               args: Optional[Dict[str, Any]] = None) -> None:
        """``span`` from ``time.perf_counter()`` seconds (the clock ``perf_counter_ns`` counts in ns)."""
        self.span(name, category, int(start_s * 1e9), int(end_s * 1e9), args)

    def records_here(self) -> bool:
        """Whether a collective called now on this thread is recorded: not one that a recorded
        call makes inside itself."""
        return _ident() not in self.busy

    def allreduce(self, fn: Callable[..., Any], buf: Any, op: Any, algorithm: str, comm: Any, check: Any,
                  stall_timeout: Any, compression: str) -> Any:
        """Run the library's ``allreduce`` ``fn`` with these arguments, and record the call."""
        ident = _ident()
        busy = self.busy
        busy.add(ident)
        clock = self.clock
        start = clock()
        try:
            return fn(buf, op=op, algorithm=algorithm, comm=comm, check=check, stall_timeout=stall_timeout,
                      compression=compression)
        finally:
            self.calls.append(("allreduce", ident, start, clock(), buf.nbytes if isinstance(buf, _ndarray) else None,
                               comm, op, algorithm, None))
            busy.discard(ident)

    def reduce_scatter(self, fn: Callable[..., Any], buf: Any, out: Any, op: Any, algorithm: str, comm: Any,
                       check: Any, stall_timeout: Any, compression: str = "none") -> Any:
        """Run the library's ``reduce_scatter`` ``fn`` with these arguments, and record the call."""
        ident = _ident()
        busy = self.busy
        busy.add(ident)
        clock = self.clock
        start = clock()
        try:
            return fn(buf, out, op=op, algorithm=algorithm, comm=comm, check=check, stall_timeout=stall_timeout,
                      compression=compression)
        finally:
            self.calls.append(("reduce_scatter", ident, start, clock(),
                               buf.nbytes if isinstance(buf, _ndarray) else None, comm, op, algorithm, None))
            busy.discard(ident)

    def allgather(self, fn: Callable[..., Any], block: Any, out: Any, counts: Any, algorithm: str, comm: Any,
                  check: Any, stall_timeout: Any) -> Any:
        """Run the library's ``allgather`` ``fn`` with these arguments, and record the call."""
        ident = _ident()
        busy = self.busy
        busy.add(ident)
        clock = self.clock
        start = clock()
        try:
            return fn(block, out, counts=counts, algorithm=algorithm, comm=comm, check=check,
                      stall_timeout=stall_timeout)
        finally:
            self.calls.append(("allgather", ident, start, clock(),
                               block.nbytes if isinstance(block, _ndarray) else None, comm, None, algorithm, None))
            busy.discard(ident)

    def broadcast(self, fn: Callable[..., Any], buf: Any, root: Any, algorithm: str, comm: Any, check: Any,
                  stall_timeout: Any) -> Any:
        """Run the library's ``broadcast`` ``fn`` with these arguments, and record the call."""
        ident = _ident()
        busy = self.busy
        busy.add(ident)
        clock = self.clock
        start = clock()
        try:
            return fn(buf, root, algorithm=algorithm, comm=comm, check=check, stall_timeout=stall_timeout)
        finally:
            self.calls.append(("broadcast", ident, start, clock(), buf.nbytes if isinstance(buf, _ndarray) else None,
                               comm, None, algorithm, root))
            busy.discard(ident)

    def planned(self, plan: Any, buf: Any, comm: Any) -> Any:
        """Run the persistent allreduce ``plan`` (``allreduce_kit.plan``; the trainer's
        gradient buckets) and record it as an ``allreduce`` with the algorithm it runs."""
        ident = _ident()
        self.busy.add(ident)
        start = self.clock()
        try:
            return plan(buf, comm=comm)
        finally:
            end = self.clock()
            self.busy.discard(ident)
            span = plan._span
            length = span[1] - span[0] if span is not None else int(np.prod(plan._shape))
            self.span("allreduce", "collective", start, end,
                      (length * plan._dtype.itemsize, plan._lib.nranks, plan.op, plan.requested, None, plan.algorithm))

    def recorded(self) -> List[Event]:
        """Every event, the calls converted (collective, at the end of a run: a communicator's
        size is read now, ``None`` for one freed since), with each thread that made one named
        and every reading moved by ``skew_ns``."""
        sizes: Dict[int, Optional[int]] = {}
        skew = self.skew_ns
        out = [(name, category, ident, start + skew, end + skew, args)
               for name, category, ident, start, end, args in self.events]
        names = {t.ident: t.name for t in threading.enumerate()}
        for name, ident, start, end, nbytes, comm, op, algorithm, root in self.calls:
            if comm is None:
                size = self.world_size
            else:
                size = sizes.get(id(comm), -1)
                if size == -1:
                    try:
                        size = comm.Get_size()
                    except Exception:  # noqa: BLE001 - freed, or not a communicator (the call said so)
                        size = None
                    sizes[id(comm)] = size
            if ident not in self.threads:
                self.threads[ident] = names.get(ident, "thread")
            out.append((name, "collective", ident, start + skew, end + skew,
                        (nbytes, size, op if op is None or isinstance(op, str) else str(op), algorithm, root)))
        return out

    # -- the window of steps -------------------------------------------------------------------
    def begin(self, step: int) -> None:
        """Step ``step`` (from 0) starts: record it if it is inside the window."""
        first, stop = self.window
        ACTIVE[0] = self if first <= step and (stop is None or step < stop) else None
        if not self.warned and len(self.events) + len(self.calls) > WARN_EVENTS:
            self.warned = True
            count = len(self.events) + len(self.calls)
            print(f"allreduce_kit.trace: this rank has recorded {count:,} events (about "
                  f"{count * 150 / 1e6:.0f} MB of trace); --trace-steps A:B bounds them", file=sys.stderr)

    def step(self, step: int, start_s: float, end_s: float,
             phases: Tuple[Tuple[str, float, float], ...] = ()) -> None:
        """Step ``step`` took ``start_s`` to ``end_s`` (``time.perf_counter()``), with its phases
        ``(name, start, end)``; recorded if the step is inside the window."""
        if ACTIVE[0] is not self:
            return
        self.span_s(f"ProfilerStep#{step}", "user_annotation", start_s, end_s, {"step": step})
        for name, start, end in phases:
            self.span_s(name, "compute" if name != "gradient_average" else "communication", start, end,
                        {"step": step})


def described(args: Any) -> Optional[Dict[str, Any]]:
    """An event's ``args`` object: as recorded, or made from a collective's tuple
    ``(bytes, communicator size, op, algorithm, root)``, or a plan's, which adds the algorithm
    it ran."""
    if not isinstance(args, tuple):
        return args
    nbytes, size, op, algorithm, root = args[:5]
    out: Dict[str, Any] = {"algorithm": algorithm, "bytes": nbytes, "comm_size": size}
    if len(args) > 5:
        out["ran"] = args[5]
    if op is not None:
        out["op"] = op if isinstance(op, str) else str(op)
    if root is not None:
        out["root"] = root
    if len(args) > 5:
        out["plan"] = True
    return out
