"""Tracing a run: ``start`` and ``finish`` (both collective), and ``ALLREDUCE_KIT_TRACE``.

``start`` measures the clocks, makes this rank's recorder and turns the library's hooks on;
``finish`` measures the clocks again, sends every rank's events to rank 0 and has rank 0 write
the one file. With ``ALLREDUCE_KIT_TRACE=PATH`` a program that uses the library is traced from
its first library call on ``COMM_WORLD`` until it exits (``finish`` runs at exit).
"""
import atexit
import os
import sys
import threading
import time
from typing import Callable, Dict, Optional, Tuple

from mpi4py import MPI

from .. import config
from . import clock, merge
from .recorder import ACTIVE, CURRENT, Recorder


class TraceError(ValueError):
    """A trace cannot be written as asked (the path, the window)."""


def steps_window(text: str) -> Tuple[int, Optional[int]]:
    """``A:B``: steps A to B-1, counted from 0 (``A:``: from A to the end). ``TraceError`` if
    it does not parse, is inverted or is empty."""
    first, sep, stop = text.partition(":")
    try:
        window = (int(first), int(stop) if stop.strip() else None)
    except ValueError:
        window = None
    if not sep or window is None or window[0] < 0:
        raise TraceError(f"expected A:B (steps A to B-1, from 0; A >= 0), got {text!r}")
    if window[1] is not None and window[1] <= window[0]:
        raise TraceError(f"the window {text!r} is {'empty' if window[1] == window[0] else 'inverted'}: "
                         f"it records steps A to B-1, so B must be greater than A")
    return window


def path_problem(path: str) -> Optional[str]:
    """Why ``path`` cannot be written as a trace (checked without writing it), or ``None``."""
    if not path or path.endswith(os.sep):
        return f"{path!r} is not a file name"
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        return f"the directory {directory} does not exist"
    if os.path.isdir(path):
        return f"{path} is a directory"
    if os.path.exists(path) and not os.access(path, os.W_OK):
        return f"{path} is not writable"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"the directory {directory} is not writable"
    return None


class Session:
    """This rank's tracing of one run. ``ALLREDUCE_KIT_TRACE_CLOCK_SKEW_US`` (a test's) moves this
    rank's clock by its host's offset: the clock measurements read the moved clock, and the
    recorder's events are moved when they are converted (``Recorder.skew_ns``)."""

    def __init__(self, path: str, window: Tuple[int, Optional[int]], comm: MPI.Intracomm,
                 clock_ns: Callable[[], int], skews: Dict[str, int]):
        self.path, self.window = path, window
        self.comm = comm.Dup()                        # the trace's own messages
        self.recorder = Recorder(window, clock_ns)
        self.main_ident = threading.get_ident()
        self.host = MPI.Get_processor_name()
        skew = skews.get(self.host, 0)
        self.recorder.skew_ns = skew
        self.clock_ns = clock_ns if not skew else (lambda: clock_ns() + skew)
        self.comm.Barrier()
        self.start = clock.measure(self.comm, self.clock_ns)


_SESSION: list = [None]


def start(path: str, steps: Tuple[int, Optional[int]] = (0, None), comm: Optional[MPI.Intracomm] = None,
          clock_ns: Callable[[], int] = time.perf_counter_ns) -> Recorder:
    """Start tracing into ``path`` (collective over ``comm``, default ``COMM_WORLD``); the
    recorder. ``steps``: the window of steps a trainer records (``steps_window``); a program
    without steps records everything from here. ``clock_ns``: this rank's clock (for tests).
    ``TraceError`` on every rank for a bad window (before any message) or a path rank 0 cannot
    write (after one broadcast of rank 0's verdict); ``ValueError`` naming the variable for a
    malformed ``ALLREDUCE_KIT_TRACE_CLOCK_SKEW_US`` (before any message)."""
    if steps[0] < 0 or (steps[1] is not None and steps[1] <= steps[0]):
        raise TraceError(f"trace: the window of steps {steps[0]}:{steps[1]} is empty or inverted")
    if _SESSION[0] is not None:
        raise TraceError(f"trace: already tracing into {_SESSION[0].path}")
    skews = config.read(config.TRACE_CLOCK_SKEW_US)
    comm = MPI.COMM_WORLD if comm is None else comm
    problem = comm.bcast(path_problem(path) if comm.Get_rank() == 0 else None, root=0)  # rank 0 writes it
    if problem is not None:
        raise TraceError(f"trace: {problem}")
    session = Session(path, steps, comm, clock_ns, skews)
    _SESSION[0] = session
    CURRENT[0] = session.recorder
    ACTIVE[0] = session.recorder if steps[0] == 0 else None
    return session.recorder


def tracing() -> bool:
    """Whether this process is tracing."""
    return _SESSION[0] is not None


def current_path() -> Optional[str]:
    """The path this process is tracing into, or ``None``."""
    return None if _SESSION[0] is None else _SESSION[0].path


def finish() -> Optional[int]:
    """Stop tracing (collective over the ``start``'s communicator): rank 0 writes the file and
    returns its size in bytes; other ranks return ``None``, as does a process not tracing."""
    session = _SESSION[0]
    if session is None:
        return None
    ACTIVE[0] = CURRENT[0] = None
    _SESSION[0] = None
    comm, recorder = session.comm, session.recorder
    comm.Barrier()
    end = clock.measure(comm, session.clock_ns)
    events = recorder.recorded()
    gathered = comm.gather((session.host, events, recorder.threads, session.main_ident), root=0)
    size = None
    if comm.Get_rank() == 0:
        alignment = clock.Alignment(session.start, end)
        document = merge.trace_document(gathered, alignment, session.window, float(session.start.at[0]))
        size = merge.write(session.path, document)
    comm.Free()
    return size


def from_environment(path: str) -> None:
    """``ALLREDUCE_KIT_TRACE=path``: trace this process from here until it exits (collective:
    called where the library first sets up ``COMM_WORLD``, on every rank)."""
    if _SESSION[0] is not None or not path:
        return
    start(path)
    atexit.register(_finish_at_exit)


def _finish_at_exit() -> None:
    if _SESSION[0] is None:
        return
    if MPI.Is_finalized():
        print(f"allreduce_kit.trace: MPI was finalized before the trace {_SESSION[0].path} was written; "
              f"not written", file=sys.stderr)
        return
    finish()
