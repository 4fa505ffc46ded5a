"""Short buffers' message loops in compiled code: numba calling MPI's C ``MPI_Sendrecv``,
``MPI_Send`` and ``MPI_Recv``.

For a message of a few bytes, the MPI transfer is the smaller part of a step driven from
Python: mpi4py reads each buffer's description and builds requests on every call, and then
the combine is a second call into compiled code. Here one compiled function runs a whole
loop: ``exchange`` (recursive doubling) calls, for every partner, ``MPI_Sendrecv`` through the
C function pointer that the MPI library mpi4py loaded exports, and folds the partner's copy in
with the same kernel as everywhere else (``kernels/reduce.py``); ``run_steps`` does the same
for a list of sends and receives (``steps.py``: naive's star, tree's binomial tree). At p = 2
and 8 B an exchange and its combine take about 2.2 us, against 2.5 us for mpi4py's
``Sendrecv`` alone.

Portable across MPI libraries: the function pointer comes from the library mpi4py is linked
to, and the handles are passed with the width that library gives them (``int`` in MPICH and
its derivatives, a pointer in Open MPI and the MPI ABI), which is part of the compiled
function's signature, so a cache compiled against one library is never used with another. The
received tag (``signature.py``) is read from the status buffer at the offset this library
gives ``MPI_TAG``, found at import by setting a tag on an ``MPI.Status`` and looking for it. If
a symbol or the offset cannot be found, ``exchange_for`` and ``steps_for`` return ``None`` and
the caller takes its Python path (mpi4py's ``Sendrecv``, ``Send`` and ``Recv``), which gives
bitwise the same result (tested).
"""
import ctypes
from typing import Optional, Sequence, Tuple

import numpy as np
from llvmlite import ir
from mpi4py import MPI
from numba import njit, types
from numba.extending import intrinsic

from ..kernels import reduce as _loops
from .signature import PROBE_FIRST, low_bits, tag_bits

#: Buffers up to this many bytes take the compiled path; it allocates its receive buffer on
#: every call, which is cheap only while small. Above it, per-call costs no longer matter.
MAX_BYTES = 64 << 10


def _call(context, builder, signature, args, params):
    """Code for calling the C function at address ``args[0]``: its parameters are the intrinsic's
    arguments ``params`` names, in order, each as ``(index, kind)``: ``"p"`` an address (an
    integer) passed as a pointer, ``"i"`` an integer passed as ``int``, ``"h"`` a handle passed
    with the width of its numba type (the MPI library's handle width). Returns the ``int`` it returns."""
    i32, ptr = ir.IntType(32), ir.IntType(8).as_pointer()
    types_ = {"p": lambda i: ptr, "i": lambda i: i32, "h": lambda i: context.get_value_type(signature.args[i])}
    values = {"p": lambda i: builder.inttoptr(args[i], ptr),
              "i": lambda i: context.cast(builder, args[i], signature.args[i], types.int32),
              "h": lambda i: args[i]}
    fnty = ir.FunctionType(i32, [types_[kind](i) for i, kind in params])
    return builder.call(builder.inttoptr(args[0], fnty.as_pointer()), [values[kind](i) for i, kind in params])


@intrinsic
def _sendrecv(typingctx, fn, sendbuf, recvbuf, count, datatype, peer, sendtag, recvtag, comm, status):
    """``MPI_Sendrecv(sendbuf, count, datatype, peer, sendtag, recvbuf, count, datatype, peer,
    recvtag, comm, status)`` through the function at address ``fn``; addresses are integers, and
    the handles have the width of their numba type (the MPI library's handle width)."""
    params = ((1, "p"), (3, "i"), (4, "h"), (5, "i"), (6, "i"), (2, "p"), (3, "i"), (4, "h"), (5, "i"), (7, "i"),
              (8, "h"), (9, "p"))
    return (types.int32(fn, sendbuf, recvbuf, count, datatype, peer, sendtag, recvtag, comm, status),
            lambda context, builder, signature, args: _call(context, builder, signature, args, params))


@intrinsic
def _send(typingctx, fn, buf, count, datatype, peer, tag, comm):
    """``MPI_Send(buf, count, datatype, peer, tag, comm)`` through the function at ``fn`` (as in ``_sendrecv``)."""
    params = ((1, "p"), (2, "i"), (3, "h"), (4, "i"), (5, "i"), (6, "h"))
    return (types.int32(fn, buf, count, datatype, peer, tag, comm),
            lambda context, builder, signature, args: _call(context, builder, signature, args, params))


@intrinsic
def _recv(typingctx, fn, buf, count, datatype, peer, tag, comm, status):
    """``MPI_Recv(buf, count, datatype, peer, tag, comm, status)`` through the function at ``fn`` (as in ``_sendrecv``)."""
    params = ((1, "p"), (2, "i"), (3, "h"), (4, "i"), (5, "i"), (6, "h"), (7, "p"))
    return (types.int32(fn, buf, count, datatype, peer, tag, comm, status),
            lambda context, builder, signature, args: _call(context, builder, signature, args, params))


@njit(cache=True, nogil=True)
def exchange(buf, state, handles, code, divisor):
    """For each partner in turn: swap ``buf`` with it, then ``buf = buf op partner's`` (``op`` is
    ``code``, see ``kernels.OP_CODES``); then divide by ``divisor`` unless it is 0. Every message
    sent carries the call's tag (``signature.tag`` of ``buf`` for the caller's algorithm,
    computed here), and every message received is expected to carry it too.

    ``state``: the ``MPI_Sendrecv`` address, ``MPI_ANY_TAG``, the index of ``MPI_TAG`` in an
    ``MPI_Status`` viewed as int32, room for an MPI error code, the algorithm's ``TAG``,
    ``signature.LOW_BITS``, the number of partners n, the n partners, then room for an
    ``MPI_Status`` (``Exchange``). ``handles``: the communicator and
    ``MPI_BYTE`` (messages go as bytes, see ``signature.py``). Returns the number of exchanges
    done: n; or k < n if the exchange with partner k failed (its MPI error code, nonzero, is left in
    ``state[3]``) or received another tag (the ranks' calls differ), before folding that
    partner's copy in: the caller takes over from there.
    """
    incoming = np.empty_like(buf)
    fn, any_tag, where, n = state[0], state[1], state[2], state[6]
    tag = tag_bits(buf, state[4], state[5])
    status = state[7 + n:]
    received = status.view(np.int32)
    send, recv, count, datatype = buf.ctypes.data, incoming.ctypes.data, buf.size * buf.itemsize, handles[1]
    for k in range(n):
        err = _sendrecv(fn, send, recv, count, datatype, state[7 + k], tag, any_tag, handles[0], status.ctypes.data)
        if err != 0 or received[where] != tag:
            state[3] = err
            return k
        _loops.combine(buf, incoming, code)
    if divisor != 0:
        _loops.divide(buf, divisor)
    return n


#: ``run_steps``'s step kinds (``steps.py``): send ``buf``; receive into ``buf``; receive and
#: fold in; receive, fold in and finish (a mean divides).
SEND, RECV, COMBINE, LAST = 0, 1, 2, 3


@njit(cache=True, nogil=True)
def run_steps(buf, state, handles, code, divisor):
    """The steps of a whole-buffer schedule in turn (``steps.py``), each message carrying the
    call's tag (computed here, as in ``exchange``) and each received one expected to carry it.

    ``state``: the ``MPI_Send`` and ``MPI_Recv`` addresses, ``MPI_ANY_TAG``, the index of
    ``MPI_TAG`` in an ``MPI_Status`` viewed as int32, room for an MPI error code, the
    algorithm's ``TAG``, ``signature.LOW_BITS``, the number of steps n, n (kind, peer) pairs,
    then room for an ``MPI_Status`` (``Steps``); ``handles`` as in ``exchange``. Returns the
    number of steps done: n; or k < n if step k failed (its MPI error code, nonzero, in
    ``state[4]``) or received another tag, before folding anything in: the caller takes over.
    """
    n = state[7]
    incoming = np.empty_like(buf)
    send_fn, recv_fn, any_tag, where = state[0], state[1], state[2], state[3]
    tag = tag_bits(buf, state[5], state[6])
    status = state[8 + 2 * n:]
    received = status.view(np.int32)
    count, datatype, comm = buf.size * buf.itemsize, handles[1], handles[0]
    for k in range(n):
        kind, peer = state[8 + 2 * k], state[9 + 2 * k]
        if kind == SEND:
            err = _send(send_fn, buf.ctypes.data, count, datatype, peer, tag, comm)
            if err != 0:
                state[4] = err
                return k
            continue
        into = buf if kind == RECV else incoming
        err = _recv(recv_fn, into.ctypes.data, count, datatype, peer, any_tag, comm, status.ctypes.data)
        if err != 0 or received[where] != tag:
            state[4] = err
            return k
        if kind != RECV:
            _loops.combine(buf, incoming, code)
            if kind == LAST and divisor != 0:
                _loops.divide(buf, divisor)
    return n


def _address_of(name: str) -> Optional[int]:
    """The address of the C function ``name`` in the MPI library mpi4py is linked to, or ``None``."""
    try:
        # dlsym on mpi4py's extension searches it and the libraries it was loaded with.
        found = getattr(ctypes.CDLL(MPI.__file__), name)
    except (OSError, AttributeError):
        return None
    return ctypes.cast(found, ctypes.c_void_p).value


def _tag_index() -> int:
    """Where ``MPI_TAG`` sits in this MPI library's ``MPI_Status``, in int32 units (-1: not found)."""
    status = MPI.Status()
    status.source, status.tag, status.error = 0x1A2B3C, 0x2B3C4D, 0
    words = (ctypes.c_int32 * (MPI._sizeof(MPI.Status) // 4)).from_address(MPI._addressof(status))
    fields = np.ctypeslib.as_array(words)
    found = np.flatnonzero(fields == 0x2B3C4D)
    return int(found[0]) if found.size == 1 else -1


_SENDRECV, _SEND, _RECV = (_address_of(name) for name in ("MPI_Sendrecv", "MPI_Send", "MPI_Recv"))
_TAG_INDEX = _tag_index()
_STATUS_WORDS = MPI._sizeof(MPI.Status) // 8 + 1  # int64 words of a state's room for an MPI_Status
_HANDLE_BYTES = MPI._sizeof(MPI.Comm)
_HANDLE_DTYPE = {4: np.int32, 8: np.int64}.get(_HANDLE_BYTES) if MPI._sizeof(MPI.Datatype) == _HANDLE_BYTES else None
#: The compiled path can be used with this MPI library. Not with Open MPI, which can write a
#: message larger than the receive buffer past its end (``signature.PROBE_FIRST``): there a
#: buffer whose length differs between ranks must be probed before it is received.
AVAILABLE = not PROBE_FIRST and (None not in (_SENDRECV, _SEND, _RECV) and _HANDLE_DTYPE is not None
                                  and _TAG_INDEX >= 0)


class Exchange:
    """``exchange``'s ``state`` and ``handles`` for one communicator, algorithm ``TAG`` and list
    of partners; call ``exchange(buf, x.state, x.handles, op.code, op.divisor)`` with a
    ``Reduction`` ``op``."""

    __slots__ = ("state", "handles")

    def __init__(self, comm: MPI.Intracomm, partners: Sequence[int], algorithm: int):
        self.state = np.array([_SENDRECV, MPI.ANY_TAG, _TAG_INDEX, 0, algorithm, low_bits(), len(partners), *partners]
                              + [0] * _STATUS_WORDS, np.int64)
        self.handles = _handles(comm)

    def error(self) -> int:
        """The MPI error code of the exchange ``exchange`` stopped at (0 if it only saw a tag)."""
        return int(self.state[3])

    def received(self) -> int:
        """The tag of the message received last."""
        return int(self.state[7 + self.state[6]:].view(np.int32)[_TAG_INDEX])


def exchange_for(comm, partners: Sequence[int], algorithm: int) -> Optional[Exchange]:
    """An ``Exchange`` over ``partners`` for ``algorithm`` (its ``TAG``), or ``None`` if this
    MPI library's ``MPI_Sendrecv`` cannot be called from compiled code."""
    return Exchange(comm, partners, algorithm) if AVAILABLE else None


class Steps:
    """``run_steps``'s ``state`` and ``handles`` for one communicator, algorithm ``TAG`` and
    list of ``(kind, peer)`` steps; call ``run_steps(buf, s.state, s.handles, op.code, op.divisor)``."""

    __slots__ = ("state", "handles")

    def __init__(self, comm: MPI.Intracomm, steps: Sequence[Tuple[int, int]], algorithm: int):
        pairs = [field for step in steps for field in step]
        self.state = np.array([_SEND, _RECV, MPI.ANY_TAG, _TAG_INDEX, 0, algorithm, low_bits(), len(steps), *pairs]
                              + [0] * _STATUS_WORDS, np.int64)
        self.handles = _handles(comm)

    def error(self) -> int:
        """The MPI error code of the step ``run_steps`` stopped at (0 if it only saw a tag)."""
        return int(self.state[4])


def steps_for(comm, steps: Sequence[Tuple[int, int]], algorithm: int) -> Optional[Steps]:
    """``Steps`` for ``steps`` of ``algorithm`` (its ``TAG``), or ``None`` if this MPI library's
    ``MPI_Send`` and ``MPI_Recv`` cannot be called from compiled code."""
    return Steps(comm, steps, algorithm) if AVAILABLE else None


def _handles(comm: MPI.Intracomm) -> np.ndarray:
    """``comm`` and ``MPI_BYTE`` as this MPI library's C handles (``exchange``'s ``handles``)."""
    # ``_handleof`` gives a handle's bits as an unsigned integer; the C type may be signed.
    signed = ctypes.c_int32 if _HANDLE_BYTES == 4 else ctypes.c_int64
    return np.array([signed(MPI._handleof(h)).value for h in (comm, MPI.BYTE)], _HANDLE_DTYPE)
