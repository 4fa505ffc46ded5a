"""Flags in memory that several processes map: acquire loads, release stores, and waiting on them.

Compiled helpers shared by the algorithms that synchronise through a shared window instead of
messages (``shared_memory.py``, ``direct.py``). A wait spins on a flag; given the address of
``sched_yield`` it yields the core on every turn, which is what ranks that share cores need.
"""
import ctypes

from llvmlite import ir
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
    ``yield_fn`` (the address of ``sched_yield``) is 0."""
    while load_acquire(address) < target:
        if yield_fn != 0:
            call(yield_fn)


def address_of_sched_yield() -> int:
    """The address of libc's ``sched_yield``, or 0 where there is none."""
    try:
        return ctypes.cast(ctypes.CDLL(None).sched_yield, ctypes.c_void_p).value or 0
    except (OSError, AttributeError):
        return 0
