"""Flags in memory that several processes map: acquire loads, release stores, and waiting on them.

Compiled helpers shared by the algorithms that synchronise through a shared window instead of
messages (``shared_memory.py``, ``direct.py``), and the window itself (``NodeWindow``).

A wait spins on a flag while every rank has a core of its own. When ranks share cores, a
waiting rank must give its core to a rank that has work to do, and ``sched_yield`` alone does
not: Linux groups the processes of a session (autogroup, on by default) and MPICH's launcher
starts every rank in a session of its own, so a yielding rank is the only task of its group and
keeps the core until its slice ends; a small call at 8 ranks on 2 cores then costs several
slices. So there a waiting rank yields a few times, then sleeps in the kernel on the flag
(``futex``, with a 1 ms timeout), and every rank that raises a flag wakes the flag's sleepers
(``publish``). The ``waiter`` the helpers take is the address of a ``Waiter``'s words (0: spin).
"""
import ctypes
import os
from typing import Optional

import numpy as np
from llvmlite import ir
from mpi4py import MPI
from numba import njit, types
from numba.extending import intrinsic


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
def _syscall(typingctx, function, number, a, b, c, d):
    """``syscall(number, a, b, c, d, 0, 0)`` through libc's ``syscall`` at address ``function``."""
    sig = types.int64(function, number, a, b, c, d)

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        fnty = ir.FunctionType(i64, [i64] * 7)
        fn = builder.inttoptr(args[0], fnty.as_pointer())
        return builder.call(fn, [*args[1:], ir.Constant(i64, 0), ir.Constant(i64, 0)])

    return sig, codegen


#: Words of a ``Waiter``: libc's ``syscall``, the futex system call's number, ``sched_yield``,
#: then a ``struct timespec`` (seconds, nanoseconds): how long one sleep lasts at most.
_SYSCALL, _FUTEX, _YIELD, _TIMEOUT = 0, 1, 2, 3
#: Turns a waiting rank yields before it sleeps.
YIELDS = 4
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1


@njit(cache=True, nogil=True)
def wait_until(address, target, waiter):
    """Until the int64 at ``address`` is at least ``target``. ``waiter`` 0: spin; else the
    address of a ``Waiter``'s words: yield ``YIELDS`` times, then sleep on the flag's low 32 bits
    until ``publish`` wakes this rank (or the timeout ends the sleep)."""
    turns = 0
    while True:
        seen = load_acquire(address)
        if seen >= target:
            return
        if waiter != 0:
            if turns < YIELDS or load_acquire(waiter + 8 * _FUTEX) == 0:
                call(load_acquire(waiter + 8 * _YIELD))
            else:  # returns at once if the word is no longer ``seen``'s low half
                _syscall(load_acquire(waiter + 8 * _SYSCALL), load_acquire(waiter + 8 * _FUTEX), address,
                         _FUTEX_WAIT, seen & 0xFFFFFFFF, waiter + 8 * _TIMEOUT)
            turns += 1


@njit(cache=True, nogil=True)
def publish(address, value, waiter):
    """Raise the flag at ``address`` to ``value`` (a release store) and, unless ``waiter`` is 0,
    wake every rank sleeping on it in ``wait_until``."""
    store_release(address, value)
    if waiter != 0 and load_acquire(waiter + 8 * _FUTEX) != 0:
        _syscall(load_acquire(waiter + 8 * _SYSCALL), load_acquire(waiter + 8 * _FUTEX), address,
                 _FUTEX_WAKE, 0x7FFFFFFF, 0)


def address_of_sched_yield() -> int:
    """The address of libc's ``sched_yield``, or 0 where there is none."""
    try:
        return ctypes.cast(ctypes.CDLL(None).sched_yield, ctypes.c_void_p).value or 0
    except (OSError, AttributeError):
        return 0


#: The futex system call's number where it is known.
_FUTEX_NUMBERS = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}


class Waiter:
    """What ``wait_until`` needs to sleep and ``publish`` to wake. ``address``: 0 where there is
    no ``sched_yield`` (waits spin); where there is no ``futex``, waits yield on every turn."""

    def __init__(self):
        import platform

        syscall = _libc_function("syscall")
        number = _FUTEX_NUMBERS.get(platform.machine().lower(), 0) if hasattr(os, "sched_yield") else 0
        self.words = np.array([syscall, number, address_of_sched_yield(), 0, 1_000_000], np.int64)
        if not syscall:
            self.words[_FUTEX] = 0
        self.address = self.words.ctypes.data if self.words[_YIELD] else 0


def _libc_function(name: str) -> int:
    try:
        return ctypes.cast(getattr(ctypes.CDLL(None), name), ctypes.c_void_p).value or 0
    except (OSError, AttributeError):
        return 0


def node_of(comm) -> Optional[MPI.Intracomm]:
    """A new communicator over the library communicator ``comm``'s ranks if they all share one
    node (``comm.layout``), else ``None``. Collective over ``comm``; the same on every rank."""
    if not comm.layout.single_node:
        return None
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    if node.Get_size() != comm.Get_size():
        node.Free()
        return None
    return node


class NodeWindow:
    """``nbytes`` of memory every rank of ``node`` maps (``memory``, bytes), and, when ranks share
    cores, a ``Waiter`` for the waits (``waiter``: its address, else 0: waits spin). Collective
    over ``node``; owns ``node`` and frees it with the window."""

    def __init__(self, node: MPI.Intracomm, nbytes: int, oversubscribed: bool):
        self.node = node
        # Rank 0 allocates the whole window, so it is one contiguous block for every rank.
        self.win = MPI.Win.Allocate_shared(nbytes if node.Get_rank() == 0 else 0, 1, comm=node)
        memory, _ = self.win.Shared_query(0)
        self.memory = np.frombuffer(memory, np.uint8)
        self._waiter = Waiter() if oversubscribed else None
        self.waiter = self._waiter.address if self._waiter else 0

    def free(self) -> None:
        self.win.Free()
        self.node.Free()
