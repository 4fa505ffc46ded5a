"""Nonblocking collectives: start a call, compute, then wait for it.

>>> handle = iallreduce(grad, op="mean")   # returns at once; grad is being reduced
>>> loss = forward(next_batch)             # meanwhile: anything that does not touch grad
>>> handle.wait()                          # grad holds the result (wait returns it)

How it progresses: the call runs the library's own blocking collective, with everything it
takes, on the process's progress thread (``progress.py``), while the caller goes on. There, a
wait for another rank's flag in a shared window yields the core on every turn instead of
spinning (``spin.yielding``), so that the caller's computation keeps its core. A call is
checked on the calling thread before anything starts; the rest (the agreement step of
``check=True``, the algorithm, the stall inspector's watch) happens on the progress thread as it
would in the blocking call, and what that raises, ``wait()`` raises.

Order: nonblocking calls run one after the other in the order they were started, and a library
collective made on another thread while some are in flight (``allreduce``, a plan, a call of
``allreduce_kit.torch``) runs after them. So every rank's calls reach each communicator in
program order, as if each nonblocking call were the blocking one made where it was started.

A collective with a nonblocking form needs two functions: the blocking one, and the checks it
makes locally before sending anything (``TypeError``/``ValueError`` naming the argument). Its
nonblocking form is ``begin(checks, blocking, *args, **kwargs)`` (see ``iallreduce``).
"""
import threading
from typing import Any, Callable, Iterable, List, Optional

import numpy as np
from mpi4py import MPI

from . import config
from .algorithms.spin import yielding
from .collective import allreduce, validate, validate_compression
from .compression import REDUCE_SCATTER
from .collectives import allgather as _allgather
from .collectives import broadcast as _broadcast
from .collectives import reduce_scatter as _reduce_scatter
from .comm import library_comm
from .progress import available, submit

__all__ = ["Handle", "begin", "iallgather", "iallreduce", "ibroadcast", "ireduce_scatter", "start", "wait_all"]


class Handle:
    """A collective in flight. ``wait()`` returns what the blocking call returns (or raises what
    it raises); ``test()`` says whether it has finished, without waiting. Both may be called
    any number of times."""

    __slots__ = ("what", "_finished", "_result", "_error")

    def __init__(self, what: str):
        #: The collective's name, for messages.
        self.what = what
        self._finished = threading.Event()
        self._result: Any = None
        self._error: Optional[BaseException] = None

    @property
    def done(self) -> bool:
        """Whether the collective has finished (it may have failed: ``wait()`` raises then)."""
        return self._finished.is_set()

    def test(self) -> bool:
        """``True`` if the collective has finished, else ``False`` at once; raises its failure."""
        if not self._finished.is_set():
            return False
        if self._error is not None:
            raise self._error
        return True

    def wait(self) -> Any:
        """Wait until the collective has finished and return its result (the blocking call's);
        raise what the blocking call would have raised."""
        self._finished.wait()
        if self._error is not None:
            raise self._error
        return self._result

    def _run(self, collective: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        try:
            self._result = collective(*args, **kwargs)
        except BaseException as error:  # noqa: B902 - raised by wait(), on the caller's thread
            self._error = error
        finally:
            self._finished.set()

    def __repr__(self) -> str:
        state = ("failed" if self._error is not None else "done") if self.done else "in flight"
        return f"<Handle {self.what}: {state}>"


def wait_all(handles: Iterable[Handle]) -> List[Any]:
    """Wait for every handle, in order, and return their results; the first failure is raised
    after all have finished."""
    handles = list(handles)
    for handle in handles:
        if not isinstance(handle, Handle):
            raise TypeError(f"wait_all: expected Handle objects, got {type(handle).__name__}")
    for handle in handles:
        handle._finished.wait()
    return [handle.wait() for handle in handles]


def start(collective: Callable[..., Any], *args: Any, **kwargs: Any) -> Handle:
    """Start ``collective(*args, **kwargs)`` on the progress thread, after every nonblocking call
    started before it, and return its ``Handle``. Checks nothing: ``begin`` checks first.

    Where MPI does not allow collectives from a second thread (``progress.available()``), the
    call runs here, to completion, and the handle is done when it is returned.
    """
    handle = Handle(getattr(collective, "__name__", "collective"))
    if _threads_allowed():
        def job() -> None:
            with yielding():  # a wait for a peer gives the core to the caller's computation
                handle._run(collective, args, kwargs)

        submit(job)
    else:
        handle._run(collective, args, kwargs)
    return handle


def begin(checks: Callable[..., Any], collective: Callable[..., Any], *args: Any, **kwargs: Any) -> Handle:
    """A nonblocking collective: ``checks(*args, **kwargs)`` on this thread, then ``start``.

    ``checks`` raises ``TypeError``/``ValueError`` naming what is wrong, before anything is sent.
    With ``check=True`` (or ``ALLREDUCE_KIT_CHECK=1``) the other ranks are waiting for this
    one's part of the agreement step: the collective is still started, so that it takes part and
    the others' ``wait()`` raises too (the blocking call's contract), and the error is raised here.
    """
    try:
        checks(*args, **kwargs)
    except (TypeError, ValueError):
        check = kwargs.get("check")
        if check or (check is None and config.read(config.CHECK)):
            start(collective, *args, **kwargs)
        raise
    return start(collective, *args, **kwargs)


def _allreduce_checks(buf, *, op, algorithm: str, comm, check, stall_timeout, compression="none") -> None:
    """What ``allreduce`` checks on the calling rank, under ``iallreduce``'s name; and the
    library's communicator made here (collective the first time), in program order."""
    array, name = validate(buf, op, algorithm, caller="iallreduce")
    validate_compression(array, name, algorithm, compression, "iallreduce")
    if stall_timeout is not None:
        try:
            config.seconds_argument(stall_timeout)
        except (TypeError, ValueError) as bad:
            raise type(bad)(f"iallreduce: stall_timeout: {bad}") from None
    try:
        library_comm(comm)
    except (TypeError, ValueError) as bad:
        raise type(bad)(f"iallreduce: {bad}") from None


def iallreduce(buf: np.ndarray, *, op: str = "sum", algorithm: str = "auto",
               comm: Optional[MPI.Intracomm] = None, check: Optional[bool] = None,
               stall_timeout: Optional[float] = None, compression: str = "none") -> Handle:
    """Start ``allreduce(buf, ...)`` and return its ``Handle`` at once; ``wait()`` returns ``buf``.

    Takes what ``allreduce`` takes, and a malformed call raises the same ``TypeError`` or
    ``ValueError`` here, on this rank, before anything starts. What the call raises later (a
    ``check=True`` mismatch between ranks, on every rank) is raised by ``wait()``. ``buf`` is
    reduced in place while the caller goes on: do not read or write it before ``wait()``.
    """
    return begin(_allreduce_checks, allreduce, buf, op=op, algorithm=algorithm, comm=comm, check=check,
                 stall_timeout=stall_timeout, compression=compression)


def _common_checks(caller: str, comm, stall_timeout) -> None:
    if stall_timeout is not None:
        try:
            config.seconds_argument(stall_timeout)
        except (TypeError, ValueError) as bad:
            raise type(bad)(f"{caller}: stall_timeout: {bad}") from None
    try:
        library_comm(comm)
    except (TypeError, ValueError) as bad:
        raise type(bad)(f"{caller}: {bad}") from None


def _reduce_scatter_checks(buf, out=None, *, op, algorithm, comm, check, stall_timeout, compression="none") -> None:
    array, name, *_ = _reduce_scatter._local(buf, out, op, algorithm, comm, "ireduce_scatter")
    validate_compression(array, name, algorithm, compression, "ireduce_scatter", REDUCE_SCATTER)
    _common_checks("ireduce_scatter", comm, stall_timeout)


def ireduce_scatter(buf: np.ndarray, out: Optional[np.ndarray] = None, *, op: str = "sum", algorithm: str = "auto",
                    comm: Optional[MPI.Intracomm] = None, check: Optional[bool] = None,
                    stall_timeout: Optional[float] = None, compression: str = "none") -> Handle:
    """Start ``reduce_scatter(buf, out, ...)`` and return its ``Handle``; ``wait()`` returns ``out``
    (made by the call where it is ``None``). Checks as ``iallreduce`` does; ``buf`` and ``out``
    must not be touched before ``wait()``."""
    return begin(_reduce_scatter_checks, _reduce_scatter.reduce_scatter, buf, out, op=op, algorithm=algorithm,
                 comm=comm, check=check, stall_timeout=stall_timeout, compression=compression)


def _allgather_checks(block, out=None, *, counts, algorithm, comm, check, stall_timeout) -> None:
    _allgather._local(block, out, counts, algorithm, comm, "iallgather")
    _common_checks("iallgather", comm, stall_timeout)


def iallgather(block: np.ndarray, out: Optional[np.ndarray] = None, *, counts=None, algorithm: str = "auto",
               comm: Optional[MPI.Intracomm] = None, check: Optional[bool] = None,
               stall_timeout: Optional[float] = None) -> Handle:
    """Start ``allgather(block, out, ...)`` and return its ``Handle``; ``wait()`` returns ``out``
    (made by the call where it is ``None``). Checks as ``iallreduce`` does."""
    return begin(_allgather_checks, _allgather.allgather, block, out, counts=counts, algorithm=algorithm,
                 comm=comm, check=check, stall_timeout=stall_timeout)


def _broadcast_checks(buf, root=0, *, algorithm, comm, check, stall_timeout) -> None:
    _broadcast._local(buf, root, algorithm, comm, "ibroadcast")
    _common_checks("ibroadcast", comm, stall_timeout)


def ibroadcast(buf: np.ndarray, root: int = 0, *, algorithm: str = "auto", comm: Optional[MPI.Intracomm] = None,
               check: Optional[bool] = None, stall_timeout: Optional[float] = None) -> Handle:
    """Start ``broadcast(buf, root, ...)`` and return its ``Handle``; ``wait()`` returns ``buf``.
    Checks as ``iallreduce`` does."""
    return begin(_broadcast_checks, _broadcast.broadcast, buf, root, algorithm=algorithm, comm=comm, check=check,
                 stall_timeout=stall_timeout)


_threads: list = []


def _threads_allowed() -> bool:
    if not _threads:
        _threads.append(available())
    return _threads[0]
