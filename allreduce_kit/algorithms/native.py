"""Recursive doubling's exchange loop in compiled code: numba calling MPI's C ``MPI_Sendrecv``.

For a message of a few bytes, the MPI transfer is the smaller part of an exchange driven from
Python: mpi4py reads each buffer's description and builds requests on every call, and then
the combine is a second call into compiled code. Here one compiled function (``exchange``)
runs the whole loop: for every partner it calls ``MPI_Sendrecv`` through the C function pointer
that the MPI library mpi4py loaded exports, and folds the partner's copy in with the same
kernel as everywhere else (``kernels/reduce.py``). At p = 2 and 8 B that is about 2.2 us for
exchange and combine, against 2.5 us for mpi4py's ``Sendrecv`` alone.

Portable across MPI libraries: the function pointer comes from the library mpi4py is linked
to, and the handles are passed with the width that library gives them (``int`` in MPICH and
its derivatives, a pointer in Open MPI and the MPI ABI), which is part of the compiled
function's signature, so a cache compiled against one library is never used with another. If
the symbol cannot be found, ``exchange_for`` returns ``None`` and the caller takes its Python
path (mpi4py's ``Sendrecv``), which gives bitwise the same result (tested).
"""
import ctypes
from typing import Optional, Sequence

import numpy as np
from llvmlite import ir
from mpi4py import MPI
from mpi4py.util.dtlib import from_numpy_dtype
from numba import njit, types
from numba.extending import intrinsic, overload

from ..kernels import DTYPES, reduce as _loops

#: Buffers up to this many bytes take the compiled path; it allocates its receive buffer on
#: every call, which is cheap only while small. Above it, per-call costs no longer matter.
MAX_BYTES = 64 << 10


@intrinsic
def _sendrecv(typingctx, fn, sendbuf, recvbuf, count, datatype, peer, tag, comm, status):
    """``MPI_Sendrecv(sendbuf, count, datatype, peer, tag, recvbuf, count, datatype, peer, tag,
    comm, status)`` through the function at address ``fn``; addresses are integers, and the
    handles have the width of their numba type (the MPI library's handle width)."""
    sig = types.int32(fn, sendbuf, recvbuf, count, datatype, peer, tag, comm, status)

    def codegen(context, builder, signature, args):
        fn_, send, recv, count_, datatype_, peer_, tag_, comm_, status_ = args
        i32, ptr = ir.IntType(32), ir.IntType(8).as_pointer()
        argtypes = signature.args

        def int32(value, ty):
            return context.cast(builder, value, ty, types.int32)

        def pointer(value):
            return builder.inttoptr(value, ptr)

        handle, comm_type = context.get_value_type(argtypes[4]), context.get_value_type(argtypes[7])
        fnty = ir.FunctionType(i32, [ptr, i32, handle, i32, i32, ptr, i32, handle, i32, i32, comm_type, ptr])
        target = builder.inttoptr(fn_, fnty.as_pointer())
        n, peer32, tag32 = int32(count_, argtypes[3]), int32(peer_, argtypes[5]), int32(tag_, argtypes[6])
        return builder.call(target, [pointer(send), n, datatype_, peer32, tag32,
                                     pointer(recv), n, datatype_, peer32, tag32, comm_, pointer(status_)])

    return sig, codegen


def _slot(buf):
    """The index of ``buf``'s dtype in ``kernels.DTYPES``, a constant of each compiled version."""


@overload(_slot)
def _slot_of(buf):
    slot = [np.dtype(d) for d in DTYPES].index(np.dtype(buf.dtype.name))
    return lambda buf: slot


@njit(cache=True, nogil=True)
def exchange(buf, state, handles, code, divisor):
    """For each partner in ``state[3:]``: swap ``buf`` with it, then ``buf = buf op partner's``
    (``op`` is ``code``, see ``kernels.OP_CODES``); then divide by ``divisor`` unless it is 0.

    ``state[:3]`` is the ``MPI_Sendrecv`` address, the tag and a status buffer's address;
    ``handles`` the communicator, then the MPI datatype of each of ``kernels.DTYPES``. Returns 0,
    or the first nonzero MPI error code (the remaining partners are skipped).
    """
    incoming = np.empty_like(buf)
    fn, tag, status = state[0], state[1], state[2]
    send, recv, n, datatype = buf.ctypes.data, incoming.ctypes.data, buf.size, handles[1 + _slot(buf)]
    for k in range(3, state.size):
        err = _sendrecv(fn, send, recv, n, datatype, state[k], tag, handles[0], status)
        if err != 0:
            return err
        _loops.combine(buf, incoming, code)
    if divisor != 0:
        _loops.divide(buf, divisor)
    return 0


def _address_of_sendrecv() -> Optional[int]:
    """The address of ``MPI_Sendrecv`` in the MPI library mpi4py is linked to, or ``None``."""
    try:
        # dlsym on mpi4py's extension searches it and the libraries it was loaded with.
        found = ctypes.CDLL(MPI.__file__).MPI_Sendrecv
    except (OSError, AttributeError):
        return None
    return ctypes.cast(found, ctypes.c_void_p).value


_SENDRECV = _address_of_sendrecv()
_HANDLE_BYTES = MPI._sizeof(MPI.Comm)
_HANDLE_DTYPE = {4: np.int32, 8: np.int64}.get(_HANDLE_BYTES) if MPI._sizeof(MPI.Datatype) == _HANDLE_BYTES else None
#: The compiled path can be used with this MPI library.
AVAILABLE = _SENDRECV is not None and _HANDLE_DTYPE is not None


class Exchange:
    """``exchange``'s ``state`` and ``handles`` for one communicator and list of partners; call
    ``exchange(buf, x.state, x.handles, op.code, op.divisor)`` with a ``Reduction`` ``op``."""

    __slots__ = ("state", "handles", "status")

    def __init__(self, comm: MPI.Intracomm, partners: Sequence[int], tag: int):
        self.status = np.zeros(MPI._sizeof(MPI.Status) // 8 + 1, np.int64)
        self.state = np.array([_SENDRECV, tag, self.status.ctypes.data, *partners], np.int64)
        # ``_handleof`` gives a handle's bits as an unsigned integer; the C type may be signed.
        signed = ctypes.c_int32 if _HANDLE_BYTES == 4 else ctypes.c_int64
        handles = [comm] + [from_numpy_dtype(dtype) for dtype in DTYPES]
        self.handles = np.array([signed(MPI._handleof(h)).value for h in handles], _HANDLE_DTYPE)


def exchange_for(comm, partners: Sequence[int], tag: int) -> Optional[Exchange]:
    """An ``Exchange`` over ``partners``, or ``None`` if this MPI library's ``MPI_Sendrecv`` cannot
    be called from compiled code."""
    return Exchange(comm, partners, tag) if AVAILABLE else None
