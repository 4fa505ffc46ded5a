"""Asynchronous calls: ``*_async`` returns a handle at once; ``poll`` and ``synchronize`` take it.

A call is validated and run, in the order the calls were made, on the background thread that
reduces ``DistributedOptimizer``'s gradients (``worker.py``); a call on the main thread first
waits for every call started before it, so every rank's calls reach the communicator in the same
order. Without a background thread (one rank, or MPI without ``MPI_THREAD_MULTIPLE``) the call
runs before ``*_async`` returns. ``synchronize(handle)`` waits and returns the call's result, or
raises what the blocking call would have raised (a ``TypeError``/``ValueError`` as it is,
anything else as ``HorovodInternalError``). A ``name`` is in use from the call until
``synchronize`` returns: a second call of the same kind with a name in use raises
``ValueError`` at once.
"""
import itertools
import threading
from typing import Any, Callable, Dict, Optional, Set, Tuple

from . import mpi_ops
from .errors import HorovodInternalError
from .process_sets import check_process_set


class _Handle:
    def __init__(self, key: Optional[Tuple[str, str]]):
        self.key = key
        self.done = threading.Event()
        self.result: Any = None
        self.error: Optional[BaseException] = None


_handles: Dict[int, _Handle] = {}
_names: Set[Tuple[str, str]] = set()
_numbers = itertools.count(1)


def start(caller: str, name: Optional[str], process_set, run: Callable[[], Any]) -> int:
    """Run ``run()`` (a blocking call) asynchronously on ``process_set``; return its handle."""
    if name is not None and not isinstance(name, str):
        raise TypeError(f"{caller}: name must be a str, got {type(name).__name__}")
    key = (caller.rstrip("_"), name) if name is not None else None
    if key in _names:
        raise ValueError(f"{caller}: name {name!r} is in use by a call not yet synchronized")
    ps = check_process_set(process_set, caller)
    s = mpi_ops.state()
    handle = _Handle(key)

    def job() -> None:
        previous = getattr(mpi_ops._on_set, "state", None)
        if ps is not None:
            mpi_ops._on_set.state = ps._state
        try:
            handle.result = run()
        except BaseException as error:  # noqa: B902 - raised by synchronize
            handle.error = error
        finally:
            mpi_ops._on_set.state = previous
            handle.done.set()

    number = next(_numbers)
    _handles[number] = handle
    if key is not None:
        _names.add(key)
    worker = s.worker()
    if worker is None:
        job()
    else:
        worker.submit(job)
    return number


def _handle(handle: Any, caller: str) -> _Handle:
    found = _handles.get(handle) if isinstance(handle, int) else None
    if found is None:
        raise ValueError(f"{caller}: {handle!r} is not a handle of a call in flight")
    return found


def poll(handle: int) -> bool:
    """Whether the call of ``handle`` has finished (``synchronize`` then returns at once); never waits."""
    return _handle(handle, "poll").done.is_set()


def synchronize(handle: int) -> Any:
    """Wait for the call of ``handle`` and return its result (the handle is then spent)."""
    h = _handle(handle, "synchronize")
    h.done.wait()
    del _handles[handle]
    _names.discard(h.key)
    if h.error is None:
        return h.result
    if isinstance(h.error, (TypeError, ValueError)):
        raise h.error
    raise HorovodInternalError(f"{type(h.error).__name__}: {h.error}") from h.error


def forget() -> None:
    """Drop every handle (``shutdown``: the calls in flight have finished)."""
    _handles.clear()
    _names.clear()
