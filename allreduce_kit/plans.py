"""Persistent allreduce plans: validate, choose and bind once, then reduce the same buffer many times.

>>> average = plan(grads, op="mean")      # once: checks, auto's choice, the kernel to call
>>> average()                              # every step: grads reduced in place, least work per call

MPI-4's ``MPI_Allreduce_init`` idea. What ``allreduce`` redoes on every call is done once here:
checking the buffer, the op and the algorithm; looking the communicator up; ``auto``'s choice for
the buffer's size; the op's reduction for the rank count. On its first call a plan also binds
what its algorithm can reuse: for ``shared_memory`` (``auto``'s choice on one node up to 32 MiB)
the compiled loop's entry point for the buffer's dtype and the window's address, so that every
later call goes straight into that loop (``shared_memory.binding``); for ``mpi`` the
communicator's bound ``Allreduce`` (``mpi.binding``); other algorithms are called with everything they take
already looked up. A call checks only what can change behind a plan's back, which costs a few
attribute reads: the buffer is still alive, writable and has its shape and dtype, the
communicator and the plan have not been freed.

A plan holds only a weak reference to its buffer: it does not keep the buffer alive, and
calling it after the buffer is gone raises ``ValueError``, as does calling it after the buffer
was resized, retyped or made read-only in place. Every call is watched by the stall inspector, like
``allreduce`` (``stall_timeout``). Calls of a plan are collective, like ``allreduce``: every rank
of the communicator calls its own plan, made with the same length, dtype, op and algorithm.
"""
import weakref
from threading import get_ident as _ident
from typing import Dict, List, Optional, Tuple

import numpy as np
from mpi4py import MPI

from . import config, selection
from .algorithms import ALGORITHMS
from .algorithms import mpi as native
from .algorithms import shared_memory
from .algorithms.signature import mismatch
from .collective import _agree, array_of, validate
from .comm import library_comm
from .progress import IN_FLIGHT, wait_turn
from .stall import INSPECTOR, allreduce_description
from .trace.recorder import ACTIVE as _TRACING

__all__ = ["Plan", "plan"]


class _Alive:
    """Attached to a library communicator (``LibraryComm.attach``): ``freed`` once the
    communicator is freed (its state's ``free()`` is called then)."""

    __slots__ = ("freed",)

    def __init__(self, _comm=None):
        self.freed = False

    def free(self) -> None:
        self.freed = True


class Plan:
    """A bound allreduce of one buffer; call it (or ``start()`` then ``wait()``) to reduce the
    buffer in place. Made by ``plan``; ``Plan(buf, span=(start, stop), ...)`` reduces only the
    elements ``[start, stop)`` of ``buf``'s flat view (a bucket of a gradient buffer)."""

    __slots__ = ("op", "algorithm", "requested", "comm", "_ref", "_shape", "_dtype", "_plain", "_span", "_lib", "_alive",
                 "_watch", "_watched", "_reduction", "_fn", "_kernel", "_address", "_code", "_divisor", "_native",
                 "_native_op", "_idle",
                 "_bound", "_started", "_freed", "__weakref__")

    def __init__(self, buf: np.ndarray, *, op="sum", algorithm: str = "auto",
                 comm: Optional[MPI.Intracomm] = None, check: Optional[bool] = None,
                 stall_timeout: Optional[float] = None, span: Optional[Tuple[int, int]] = None):
        array, name = validate(buf, op, algorithm, caller="plan")
        if span is not None:
            start, stop = span
            if not 0 <= start <= stop <= array.size:
                raise ValueError(f"plan: span {span} is not within buf's {array.size} elements")
            array = array.reshape(-1)[start:stop]
        if stall_timeout is not None:
            try:
                stall_timeout = config.seconds_argument(stall_timeout)
            except (TypeError, ValueError) as bad:
                raise type(bad)(f"plan: stall_timeout: {bad}") from None
        lib = library_comm(comm)
        #: The op's name in ``OPS``, the algorithm asked for, and the one that runs (``auto``'s choice).
        self.op, self.requested, self.algorithm = name, algorithm, algorithm
        #: The communicator the plan was made on (``COMM_WORLD`` when none was given).
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self._ref = weakref.ref(buf)
        self._shape, self._dtype = buf.shape, buf.dtype
        #: ``buf`` itself is what the algorithms take (1-D, C-contiguous ndarray): no view to make per call.
        self._plain = type(buf) is np.ndarray and buf.ndim == 1 and buf.flags.c_contiguous
        self._span = span
        self._lib, self._watch = lib, lib.watch
        self._alive = lib.attach(_Alive, _Alive)
        self._reduction = lib.reductions[name]
        self._fn = self._kernel = self._native = self._native_op = None
        self._address = self._code = self._divisor = 0
        self._bound = self._started = self._freed = False
        self._idle = lib.nranks == 1 or array.size == 0
        checked = check or (check is None and lib.check_default)
        setup = (checked and lib.nranks > 1) or (algorithm == "auto" and not self._idle
                                                  and selection.Auto not in lib.state)
        if setup:  # collective: the agreement step, or the first ``auto`` on this communicator
            with INSPECTOR.watching(lib.watch, f"plan(op={name!r}, algorithm={algorithm!r}, "
                                               f"{array.size} x {array.dtype})", stall_timeout):
                if checked and lib.nranks > 1:
                    try:
                        _agree(lib, array, name, algorithm, None)
                    except (TypeError, ValueError) as differs:
                        raise type(differs)(str(differs).replace("allreduce(check=True)", "plan(check=True)")) from None
                self._choose(lib, array)
        else:
            self._choose(lib, array)
        #: What the stall inspector is told while a call runs, made once (``stall.Inspector``).
        self._watched = (lib.watch, stall_timeout, allreduce_description(self.algorithm, array.size, array.dtype, name),
                         None)

    def _choose(self, lib, array: np.ndarray) -> None:
        if self.requested == "auto" and not self._idle:
            self.algorithm = selection.choose_for(lib, array.nbytes)
        self._fn = ALGORITHMS.get(self.algorithm)

    def _bind(self, array: np.ndarray) -> None:
        """On the first call, inside it: what the algorithm can reuse on every later call."""
        lib, reduction = self._lib, self._reduction
        self._bound = True
        if self.algorithm == "shared_memory" and reduction.code is not None:
            lib.attach(shared_memory.Window, shared_memory.window_for)  # collective the first time, as in the call
            bound = shared_memory.binding(lib, array.dtype, reduction)
            if bound is not None:
                self._kernel, self._address, self._code, self._divisor = bound
        elif self.algorithm == "mpi":
            self._native, self._native_op = native.binding(lib, reduction) or (None, None)

    def __call__(self, buf: Optional[np.ndarray] = None, *, comm: Optional[MPI.Intracomm] = None) -> np.ndarray:
        """Reduce the plan's buffer in place and return it (collective). ``buf`` and ``comm``, if
        given, must be the plan's own: another raises ``ValueError`` before anything is sent."""
        tracer = _TRACING[0]
        if tracer is not None and _ident() not in tracer.busy:  # tracing (allreduce_kit/trace): recorded
            return tracer.planned(self, buf, comm)
        if IN_FLIGHT[0]:
            wait_turn()  # after the nonblocking calls started before it (``progress``)
        if buf is not None or comm is not None:
            self._same(buf, comm)
        source = self._ref()
        if source is None or source.shape != self._shape or source.dtype is not self._dtype \
                or not source.flags.writeable or self._alive.freed or self._freed:
            self._refuse(source)
        if self._idle:
            return source
        array = source if self._plain and self._span is None else self._view(source)
        self._watch.calls += 1
        INSPECTOR.current = self._watched
        try:
            if not self._bound:
                self._bind(array)
            kernel = self._kernel
            if kernel is not None:
                if kernel(array, self._address, self._code, self._divisor) != 0:
                    raise mismatch(self._lib, array, "shared_memory")
            elif self._native is not None:
                self._native(MPI.IN_PLACE, array, self._native_op)
            else:
                self._fn(self._lib, array, self._reduction)
        finally:
            INSPECTOR.current = None
        return source

    def _view(self, source: np.ndarray) -> np.ndarray:
        """The 1-D array the algorithm reduces: ``source`` flattened, then the plan's span of it."""
        flat = source if self._plain else array_of(source, "plan").reshape(-1)
        return flat if self._span is None else flat[self._span[0]:self._span[1]]

    def start(self) -> None:
        """Start a reduction of the buffer; ``wait()`` completes it. The algorithms here are
        blocking, so the reduction runs to completion in ``start`` and ``wait`` returns at once."""
        if self._started:
            raise ValueError("plan.start: the plan is already started; call wait() first")
        self()
        self._started = True

    def wait(self) -> np.ndarray:
        """Complete the reduction ``start`` began and return the buffer."""
        if not self._started:
            raise ValueError("plan.wait: the plan was not started; call start() first")
        self._started = False
        source = self._ref()
        if source is None:
            self._refuse(source)
        return source

    def free(self) -> None:
        """Release what the plan holds; calling it afterwards raises ``ValueError``."""
        self._freed = True
        self._kernel = self._native = None

    def _same(self, buf, comm) -> None:
        if buf is not None and buf is not self._ref():
            raise ValueError("plan: called with another buffer than the one it was made for; a plan reduces "
                             "only its own buffer (make a plan for each buffer)")
        if comm is not None and (not isinstance(comm, MPI.Comm) or comm != self.comm):
            raise ValueError("plan: called on another communicator than the one it was made on; make a plan "
                             "on that communicator")

    def _refuse(self, source) -> None:
        if self._freed:
            raise ValueError("plan: this plan was freed")
        if self._alive.freed:
            raise ValueError("plan: the communicator this plan was made on has been freed")
        if source is None:
            raise ValueError("plan: the buffer this plan was made for no longer exists (a plan holds only a "
                             "weak reference to it); make a plan for the buffer you reduce")
        if not source.flags.writeable:
            raise ValueError("plan: buf is read-only now, but the result is written into it in place")
        raise ValueError(f"plan: buf's shape or dtype changed since the plan was made (it was "
                         f"{self._shape} {self._dtype}, it is {source.shape} {source.dtype}); make a new plan")

    def __repr__(self) -> str:
        return (f"Plan(op={self.op!r}, algorithm={self.algorithm!r}, {int(np.prod(self._shape))} x {self._dtype}, "
                f"{self._lib.nranks} ranks)")


def plan(buf: np.ndarray, *, op="sum", algorithm: str = "auto", comm: Optional[MPI.Intracomm] = None,
         check: Optional[bool] = None, stall_timeout: Optional[float] = None) -> Plan:
    """A persistent allreduce of ``buf`` in place: ``p = plan(buf, op="mean"); p()`` per step.

    Takes what ``allreduce`` takes and checks it the same way, once, on this rank (``TypeError``/
    ``ValueError`` naming the argument). Collective only where ``allreduce`` would be on its
    first call: the first use of ``comm``, the first ``auto`` on it, and ``check=True`` (or
    ``ALLREDUCE_KIT_CHECK=1``), whose agreement step then runs once here instead of on every call.
    """
    return Plan(buf, op=op, algorithm=algorithm, comm=comm, check=check, stall_timeout=stall_timeout)


class _BufferPlans:
    """A library communicator's plans for ``average_buffer``: buffer and arguments -> one plan
    per bucket. Holds the buffers weakly; at most ``SIZE`` entries, the oldest dropped first."""

    SIZE = 16

    def __init__(self, _comm=None):
        self.entries: Dict[tuple, Tuple[weakref.ref, List[Plan]]] = {}

    def plans(self, buf: np.ndarray, bounds: List[Tuple[int, int]], key: tuple, make) -> List[Plan]:
        entry = self.entries.get(key)
        if entry is not None and entry[0]() is buf:
            return entry[1]
        made = [make(span) for span in bounds]
        if len(self.entries) >= self.SIZE:
            self.entries.pop(next(iter(self.entries)))
        self.entries[key] = (weakref.ref(buf), made)
        return made


def bucket_plans(buf: np.ndarray, bounds: List[Tuple[int, int]], *, op: str, algorithm: str, comm, lib,
                 stall_timeout: Optional[float]) -> List[Plan]:
    """One plan per ``[start, stop)`` of ``bounds`` over ``buf``, made on the first call for this
    buffer and these arguments and reused after (``average_buffer``'s buckets)."""
    cache = lib.state.get(_BufferPlans) or lib.attach(_BufferPlans, _BufferPlans)
    key = (id(buf), buf.shape, buf.dtype, tuple(bounds), op, algorithm, stall_timeout)
    return cache.plans(buf, bounds, key, lambda span: Plan(buf, op=op, algorithm=algorithm, comm=comm, check=False,
                                                           stall_timeout=stall_timeout, span=span))
