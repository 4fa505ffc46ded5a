"""Flags in memory that several processes map: acquire loads, release stores, and waiting on them.

Compiled helpers shared by the algorithms that synchronise through a shared window instead of
messages (``shared_memory.py``, ``direct.py``), and the window itself (``NodeWindow``). A wait
spins on a flag; given the address of ``sched_yield`` it yields the core on every turn, which
is what ranks that share cores need.
"""
import ctypes
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


def address_of_sched_yield() -> int:
    """The address of libc's ``sched_yield``, or 0 where there is none."""
    try:
        return ctypes.cast(ctypes.CDLL(None).sched_yield, ctypes.c_void_p).value or 0
    except (OSError, AttributeError):
        return 0


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
    """``nbytes`` of memory every rank of ``node`` maps (``memory``, bytes), and the address of
    ``sched_yield`` for waits when ranks share cores (``yield_fn``, else 0). Collective over
    ``node``; owns ``node`` and frees it with the window."""

    def __init__(self, node: MPI.Intracomm, nbytes: int, oversubscribed: bool):
        self.node = node
        # Rank 0 allocates the whole window, so it is one contiguous block for every rank.
        self.win = MPI.Win.Allocate_shared(nbytes if node.Get_rank() == 0 else 0, 1, comm=node)
        memory, _ = self.win.Shared_query(0)
        self.memory = np.frombuffer(memory, np.uint8)
        self.yield_fn = address_of_sched_yield() if oversubscribed else 0

    def free(self) -> None:
        self.win.Free()
        self.node.Free()
