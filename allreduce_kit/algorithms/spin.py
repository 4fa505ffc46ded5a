"""Flags in memory that several processes map: acquire loads, release stores, and waiting on them.

Compiled helpers shared by the algorithms that synchronise through a shared window instead of
messages (``shared_memory.py``, ``direct.py``), and the window itself (``NodeWindow``).

How a rank waits for a flag depends on whether ranks share cores, and with whom the kernel
lets a waiting rank share its turn (``wait_mode``, decided once per window, the same on every
rank of the node):

- ``spin``: every rank has a core; a wait reads the flag until it is up.
- ``yield``: ranks share cores; each turn of the wait calls ``sched_yield``, which hands the
  core to a rank that has work to do.
- ``block`` (asked for with ``ALLREDUCE_KIT_WAIT=block``): a wait yields ``BLOCK_AFTER`` turns,
  then sleeps in the kernel (``futex``) on the flag; the rank that raises a flag wakes its
  sleepers (``raise_flag``), counted in the flag's cache line (``WAITERS``), so a raise with no
  sleeper costs no system call. Linux's autogroups give every session a scheduler group, MPICH's
  launcher (hydra) starts every rank in a session of its own, and ``sched_yield`` hands the
  core only within a group; on a machine busy with other work a yielding rank then keeps the
  core it waits on, and sleeping is several times faster. On an idle machine a short wait is
  faster yielding (each wake costs a system call and a trip through the scheduler).
- ``auto`` where ranks share cores: ``block`` whose waits yield for ``NAP_AFTER_NS`` before they
  sleep. A wait for a small collective's peers ends within that time and never pays for a
  wake; a wait for a rank that is still computing (ranks reaching a collective at different
  times, ms apart) stops taking turns on the core the late rank needs.
  ``scheduler_group`` tells which group a process runs in.

``ALLREDUCE_KIT_WAIT`` overrides the choice.
"""
import ctypes
import platform
import sys
import weakref
from contextlib import contextmanager
from typing import Iterator, Optional, Sequence

import numpy as np
from llvmlite import ir
from mpi4py import MPI
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .. import config

#: Wait modes, as a window's ``wait`` record holds them.
SPIN, YIELD, BLOCK = 0, 1, 2
MODES = {"spin": SPIN, "yield": YIELD, "block": BLOCK}
#: In ``block`` mode, turns a wait yields before it sleeps.
BLOCK_AFTER = 4
#: With ``ALLREDUCE_KIT_WAIT=auto`` where ranks share cores: how long a wait yields before it
#: sleeps, in nanoseconds (small collectives' waits end sooner, and never sleep).
NAP_AFTER_NS = 1_000_000
#: Longest sleep of one ``futex`` wait, in nanoseconds; a wait that times out reads the flag and
#: sleeps again, so a wake that never comes costs this much, never a hang.
SLEEP_NS = 1_000_000
#: Bytes from a flag to the count of ranks sleeping on it, in the flag's own cache line.
WAITERS = 24
#: ``futex``'s system call number, per machine (no ``block`` mode elsewhere).
_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98, "ppc64le": 221, "riscv64": 98}
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
#: The ``wait`` record's words: mode, ``sched_yield``'s address, ``syscall``'s address, the futex
#: call's number, turns before a wait sleeps (-1: never), a ``struct timespec`` of ``SLEEP_NS``,
#: nanoseconds a wait yields before it sleeps (0: it sleeps after the turns alone), and
#: ``clock_gettime``'s address.
_MODE, _YIELD, _SYSCALL, _NUMBER, _AFTER, _TIMEOUT, _BUDGET, _CLOCK = 0, 8, 16, 24, 32, 40, 56, 64
#: ``clock_gettime``'s clock: ``CLOCK_MONOTONIC`` (Linux).
_MONOTONIC = 1


@intrinsic
def load_acquire(typingctx, address):
    """The int64 at ``address``, read with acquire ordering (later reads are not moved before it)."""
    sig = types.int64(address)

    def codegen(context, builder, signature, args):
        return builder.load_atomic(builder.inttoptr(args[0], ir.IntType(64).as_pointer()), "acquire", 8)

    return sig, codegen


@intrinsic
def store_release(typingctx, address, value):
    """Write the int64 ``value`` at ``address`` with release ordering (earlier writes are visible first)."""
    sig = types.void(address, types.int64)

    def codegen(context, builder, signature, args):
        builder.store_atomic(args[1], builder.inttoptr(args[0], ir.IntType(64).as_pointer()), "release", 8)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def call(typingctx, address):
    """Call the C function ``int f(void)`` at ``address``."""
    sig = types.int32(address)

    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(ir.IntType(32), [])
        return builder.call(builder.inttoptr(args[0], fnty.as_pointer()), [])

    return sig, codegen


@intrinsic
def pointer_to(typingctx, address, like):
    """``address`` as a pointer to ``like``'s elements (``like``: an array, or a number of the
    element type), for ``numba.carray`` to view memory that a caller passed by address."""
    element = like.dtype if isinstance(like, types.Array) else like
    sig = types.CPointer(element)(address, like)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

    return sig, codegen


@intrinsic
def load_seq_cst(typingctx, address):
    """The int64 at ``address``, read in the single total order of sequentially consistent accesses."""
    sig = types.int64(address)

    def codegen(context, builder, signature, args):
        return builder.load_atomic(builder.inttoptr(args[0], ir.IntType(64).as_pointer()), "seq_cst", 8)

    return sig, codegen


@intrinsic
def store_seq_cst(typingctx, address, value):
    """Write the int64 ``value`` at ``address``, sequentially consistent (a later load is not
    moved before it)."""
    sig = types.void(address, types.int64)

    def codegen(context, builder, signature, args):
        builder.store_atomic(args[1], builder.inttoptr(args[0], ir.IntType(64).as_pointer()), "seq_cst", 8)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def fetch_add(typingctx, address, value):
    """Add ``value`` to the int64 at ``address`` atomically (sequentially consistent)."""
    sig = types.int64(address, types.int64)

    def codegen(context, builder, signature, args):
        return builder.atomic_rmw("add", builder.inttoptr(args[0], ir.IntType(64).as_pointer()), args[1], "seq_cst")

    return sig, codegen


@intrinsic
def system_call(typingctx, function, number, a, b, c, d):
    """``syscall(number, a, b, c, d)`` through libc's ``syscall`` at ``function``."""
    sig = types.int64(function, number, a, b, c, d)

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        fnty = ir.FunctionType(i64, [i64], var_arg=True)
        return builder.call(builder.inttoptr(args[0], fnty.as_pointer()), list(args[1:]))

    return sig, codegen


@intrinsic
def monotonic_ns(typingctx, function):
    """``CLOCK_MONOTONIC`` in nanoseconds, by libc's ``clock_gettime`` at address ``function``."""
    sig = types.int64(function)

    def codegen(context, builder, signature, args):
        i32, i64 = ir.IntType(32), ir.IntType(64)
        timespec = ir.ArrayType(i64, 2)
        slot = cgutils.alloca_once(builder, timespec)
        fnty = ir.FunctionType(i32, [i32, timespec.as_pointer()])
        builder.call(builder.inttoptr(args[0], fnty.as_pointer()), [ir.Constant(i32, _MONOTONIC), slot])
        zero = ir.Constant(i32, 0)
        seconds = builder.load(builder.gep(slot, [zero, zero]))
        nanoseconds = builder.load(builder.gep(slot, [zero, ir.Constant(i32, 1)]))
        return builder.add(builder.mul(seconds, ir.Constant(i64, 1_000_000_000)), nanoseconds)

    return sig, codegen


@njit(cache=True, nogil=True)
def _sleep_on(address, target, wait):
    """Sleep until the flag at ``address`` changes, is woken, or ``SLEEP_NS`` pass; counted among
    its sleepers meanwhile. Returns at once if the flag has reached ``target``."""
    fetch_add(address + WAITERS, 1)
    seen = load_seq_cst(address)  # after the count is up: a raise from now on wakes this rank
    if seen < target:
        system_call(load_acquire(wait + _SYSCALL), load_acquire(wait + _NUMBER), address, _FUTEX_WAIT,
                    seen & 0xFFFFFFFF, wait + _TIMEOUT)
    fetch_add(address + WAITERS, -1)


@njit(cache=True, nogil=True)
def wait_until(address, target, yield_fn):
    """Until the int64 at ``address`` is at least ``target``; yield the core on each turn unless
    ``yield_fn`` (the address of ``sched_yield``) is 0. Returns the value seen."""
    seen = load_acquire(address)
    while seen < target:
        if yield_fn != 0:
            call(yield_fn)
        seen = load_acquire(address)
    return seen


@njit(cache=True, nogil=True)
def wait_on(address, target, wait):
    """Until the int64 at ``address`` is at least ``target``; returns the value seen. ``wait``:
    the address of a window's ``wait`` record (spin, or yield the core each turn, and in ``block``
    mode sleep after a few turns, or once the record's budget of yielding is spent), or 0 to
    spin only."""
    seen = load_acquire(address)
    if wait == 0:
        while seen < target:
            seen = load_acquire(address)
        return seen
    spinning = load_acquire(wait + _MODE) == SPIN
    after = load_acquire(wait + _AFTER)
    budget = load_acquire(wait + _BUDGET) if after >= 0 else 0
    turns, since = 0, 0
    while seen < target:
        if after >= 0 and turns >= after and budget == 0:
            _sleep_on(address, target, wait)
        elif after >= 0 and turns >= after:   # the turns are up: yield until the budget is spent too
            now = monotonic_ns(load_acquire(wait + _CLOCK))
            if since == 0:
                since = now
            if now - since >= budget:
                budget = 0
            call(load_acquire(wait + _YIELD))
        elif not spinning:
            call(load_acquire(wait + _YIELD))
        turns += 1
        seen = load_acquire(address)
    return seen


@njit(cache=True, nogil=True)
def raise_flag(address, value, wait):
    """Set the flag at ``address`` to ``value`` (release; ``wait`` as ``wait_on``'s) and wake
    the ranks sleeping on it, if any."""
    if wait == 0 or load_acquire(wait + _AFTER) < 0:
        store_release(address, value)
    else:
        store_seq_cst(address, value)
        if load_seq_cst(address + WAITERS) > 0:  # read after the store: no sleeper is missed
            system_call(load_acquire(wait + _SYSCALL), load_acquire(wait + _NUMBER), address, _FUTEX_WAKE,
                        0x7FFFFFFF, 0)


def _libc(name: str) -> int:
    try:
        return ctypes.cast(getattr(ctypes.CDLL(None), name), ctypes.c_void_p).value or 0
    except (OSError, AttributeError):
        return 0


def address_of_sched_yield() -> int:
    """The address of libc's ``sched_yield``, or 0 where there is none."""
    return _libc("sched_yield")


def can_block() -> bool:
    """True where ``block`` mode works: Linux on a little-endian machine whose ``futex`` call
    number is known, with libc's ``syscall`` and ``sched_yield``."""
    return (sys.platform.startswith("linux") and sys.byteorder == "little"
            and platform.machine().lower() in _FUTEX and bool(_libc("syscall")) and bool(_libc("sched_yield")))


def scheduler_group() -> str:
    """The group whose share of CPU time this process runs in: its cgroups and, where the kernel
    has autogroups on, its autogroup (one per session). Two processes with the same text share
    ``sched_yield``'s turns."""
    parts = []
    for path in ("/proc/self/cgroup", "/proc/sys/kernel/sched_autogroup_enabled", "/proc/self/autogroup"):
        try:
            with open(path) as handle:
                text = handle.read().strip()
        except OSError:
            text = ""
        if path.endswith("enabled") and text != "1":
            break  # no autogroups: the autogroup file names one the scheduler does not use
        parts.append(text.split(" nice")[0])
    return "|".join(parts)


def wait_mode(oversubscribed: bool, requested: str = "auto", blocking: bool = True) -> str:
    """How the ranks of a node wait (module docstring): ``requested`` unless ``auto``; else
    ``spin`` if every rank has a core, or ``block`` (its waits yielding ``NAP_AFTER_NS`` first:
    ``nap_after``). ``block`` becomes ``yield`` where ``blocking`` (``can_block`` on every rank)
    is False."""
    if requested not in ("auto", *MODES):
        raise ValueError(f"wait mode must be one of auto, {', '.join(MODES)}; got {requested!r}")
    if requested == "auto":
        requested = "spin" if not oversubscribed else "block"
    return "yield" if requested == "block" and not blocking else requested


def nap_after(requested: str, mode: str) -> int:
    """Nanoseconds a ``mode`` wait yields before it sleeps when ``requested`` chose it:
    ``NAP_AFTER_NS`` for ``auto``'s ``block``, 0 (the turns alone) for ``block`` asked for."""
    return NAP_AFTER_NS if requested == "auto" and mode == "block" else 0


def wait_record(mode: str, budget_ns: int = 0) -> np.ndarray:
    """The ``wait`` record ``wait_on`` and ``raise_flag`` read for ``mode``; a ``block`` wait
    sleeps after ``BLOCK_AFTER`` turns and, if ``budget_ns``, once it has yielded that long."""
    record = np.zeros(9, np.int64)
    record[0] = MODES[mode]
    record[1] = address_of_sched_yield()
    sleeps = mode == "block" and can_block()
    clock = _libc("clock_gettime")
    if sleeps:
        record[2], record[3] = _libc("syscall"), _FUTEX[platform.machine().lower()]
    record[4] = BLOCK_AFTER if sleeps else -1
    record[5], record[6] = SLEEP_NS // 1_000_000_000, SLEEP_NS % 1_000_000_000
    record[7] = budget_ns if sleeps and clock else 0
    record[8] = clock
    return record


def node_of(comm) -> Optional[MPI.Intracomm]:
    """A new communicator over the library communicator ``comm``'s ranks if they all share one
    node (``comm.layout``), else ``None``. Collective over ``comm``; the same on every rank. ``None``
    as well while the library keeps to messages (``faults.keep_to_messages``): a wait on a dead
    peer's flag would never end."""
    if not comm.layout.single_node or getattr(comm, "messages_only", False):
        return None
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    if node.Get_size() != comm.Get_size():
        node.Free()
        return None
    return node


class NodeWindow:
    """``nbytes`` of memory every rank of ``node`` maps (``memory``, bytes), how its ranks wait
    (``mode``, rank 0's ``ALLREDUCE_KIT_WAIT`` or the module docstring's choice) and what
    ``wait_on`` and ``raise_flag`` take for it (``wait``: the address of ``record``), and the
    address of ``sched_yield`` when ranks share cores (``yield_fn``, else 0) for waits that only
    spin or yield. Collective over ``node``; owns ``node`` and frees it with the window."""

    def __init__(self, node: MPI.Intracomm, nbytes: int, oversubscribed: bool):
        self.node = node
        requested: object = None
        if node.Get_rank() == 0:
            try:
                requested = config.read(config.WAIT)
            except ValueError as error:  # raised on every rank, not on rank 0 alone
                requested = error
        requested = node.bcast(requested)
        if isinstance(requested, ValueError):
            node.Free()
            raise ValueError(str(requested))
        self.mode = wait_mode(oversubscribed, requested, node.allreduce(can_block(), MPI.LAND))
        self.record = wait_record(self.mode, nap_after(requested, self.mode))
        _WINDOWS.add(self)
        self.wait = self.record.ctypes.data
        # Rank 0 allocates the whole window, so it is one contiguous block for every rank.
        self.win = MPI.Win.Allocate_shared(nbytes if node.Get_rank() == 0 else 0, 1, comm=node)
        memory, _ = self.win.Shared_query(0)
        self.memory = np.frombuffer(memory, np.uint8)
        self.yield_fn = address_of_sched_yield() if oversubscribed else 0

    def free(self) -> None:
        _WINDOWS.discard(self)
        self.win.Free()
        self.node.Free()


_WINDOWS: "weakref.WeakSet[NodeWindow]" = weakref.WeakSet()


@contextmanager
def yielding() -> Iterator[None]:
    """While the block runs, this process's waits on every window that spins yield the core on
    each turn instead: for a thread that runs collectives beside another that computes (the
    nonblocking calls' progress thread), where a spinning wait would take the computation's core.
    Which way a rank waits is its own affair (no other rank reads its ``wait`` record)."""
    spinning = [window for window in list(_WINDOWS) if window.record[0] == SPIN]
    for window in spinning:
        window.record[0] = YIELD
    try:
        yield
    finally:
        for window in spinning:
            window.record[0] = SPIN
