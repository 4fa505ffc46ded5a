"""The per-rank recorder: events appended as tuples, converted only when the run ends.

The library's hooks read ``ACTIVE[0]``: ``None`` (tracing off, or outside the window of steps)
costs one list index and one comparison per collective call. A recorded event is
``(name, category, thread ident, start ns, end ns, args)`` on this rank's ``clock``
(``time.perf_counter_ns`` unless a test gives another), appended to one list.
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
_ident = threading.get_ident


class Recorder:
    """One rank's events. ``window``: the steps recorded, ``[first, stop)`` (``stop`` ``None``:
    to the end); calls outside a step (no trainer) are recorded while ``ACTIVE`` holds it."""

    def __init__(self, window: Tuple[int, Optional[int]] = (0, None),
                 clock: Callable[[], int] = time.perf_counter_ns):
        self.window = window
        self.clock = clock
        self.events: List[Event] = []
        #: threads that are inside a recorded collective call: a call it makes itself is not recorded again
        self.busy: set = set()
        #: thread ident -> its name, for the thread tracks
        self.threads: Dict[int, str] = {threading.get_ident(): "main"}
        self.warned = False
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
        call makes inside itself (``collective`` runs the library's function again)."""
        return _ident() not in self.busy

    def collective(self, fn: Callable[..., Any], buf: Any, args: tuple, kwargs: Dict[str, Any]) -> Any:
        """Run ``fn(buf, *args, **kwargs)`` (a library collective; its hook sees this thread
        busy and runs the call itself) and record it with its algorithm, bytes, op and
        communicator size (kept as a tuple here, made an ``args`` object by ``described``)."""
        ident = _ident()
        busy = self.busy
        busy.add(ident)
        start = self.clock()
        try:
            return fn(buf, *args, **kwargs)
        finally:
            end = self.clock()
            busy.discard(ident)
            if ident not in self.threads:
                self.threads[ident] = threading.current_thread().name
            comm = kwargs["comm"]
            try:
                size = self.world_size if comm is None else comm.Get_size()
            except Exception:  # noqa: BLE001 - not a communicator: the call itself said what is wrong
                size = None
            self.events.append((fn.__name__, "collective", ident, start, end,
                                (buf.nbytes if isinstance(buf, np.ndarray) else None, size, kwargs.get("op"),
                                 kwargs["algorithm"], args[0] if fn.__name__ == "broadcast" else None)))

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
                      {"algorithm": plan.requested, "ran": plan.algorithm, "bytes": length * plan._dtype.itemsize,
                       "op": plan.op, "comm_size": plan._lib.nranks, "plan": True})

    # -- the window of steps -------------------------------------------------------------------
    def begin(self, step: int) -> None:
        """Step ``step`` (from 0) starts: record it if it is inside the window."""
        first, stop = self.window
        ACTIVE[0] = self if first <= step and (stop is None or step < stop) else None
        if not self.warned and len(self.events) > WARN_EVENTS:
            self.warned = True
            print(f"allreduce_kit.trace: this rank has recorded {len(self.events):,} events (about "
                  f"{len(self.events) * 150 / 1e6:.0f} MB of trace); --trace-steps A:B bounds them", file=sys.stderr)

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
    ``(bytes, communicator size, op, algorithm, root)``."""
    if not isinstance(args, tuple):
        return args
    nbytes, size, op, algorithm, root = args
    out: Dict[str, Any] = {"algorithm": algorithm, "bytes": nbytes, "comm_size": size}
    if op is not None:
        out["op"] = op if isinstance(op, str) else str(op)
    if root is not None:
        out["root"] = root
    return out
