"""``allreduce``: validate locally, optionally agree across ranks, then run one algorithm."""
import weakref
from threading import get_ident as _ident
from typing import Any, Dict, Optional

import numpy as np
from mpi4py import MPI

from . import compression as _compression, config, kernels, online, selection
from .algorithms import ALGORITHMS, shared_memory
from .algorithms import mpi as native
from .algorithms.signature import mismatch
from .comm import _world, library_comm
from .progress import IN_FLIGHT, wait_turn
from .reduction import OPS
from .stall import INSPECTOR, allreduce_description
from .trace.recorder import ACTIVE as _TRACING

_DTYPES = frozenset(kernels.DTYPES)
_COMM_WORLD = MPI.COMM_WORLD
_IN_PLACE = MPI.IN_PLACE
_OPS = frozenset(OPS)


#: MPI's reduction operations that ``op`` may also be given as, and the names they stand for.
_MPI_OPS = ((MPI.SUM, "sum"), (MPI.PROD, "prod"), (MPI.MAX, "max"), (MPI.MIN, "min"))


def op_name(op, caller: str = "allreduce") -> str:
    """The name in ``OPS`` that ``op`` stands for: a name in any case (``"sum"``, ``"SUM"``), or
    one of MPI's ``MPI.SUM``, ``MPI.PROD``, ``MPI.MAX``, ``MPI.MIN``."""
    if isinstance(op, str):
        if op.lower() in _OPS:
            return op.lower()
        raise ValueError(f"{caller}: unknown op {op!r}; choose one of {', '.join(OPS)}")
    if isinstance(op, MPI.Op):
        for mpi_op, name in _MPI_OPS:
            if op == mpi_op:
                return name
        raise ValueError(f"{caller}: op {op!r} is not supported; choose one of {', '.join(OPS)} "
                         f"(or MPI.SUM, MPI.PROD, MPI.MAX, MPI.MIN)")
    raise TypeError(f"{caller}: op must be a name such as 'sum' or an MPI.Op, got {type(op).__name__}")


def array_of(buf, caller: str = "allreduce") -> np.ndarray:
    """The array a collective works on in place: ``buf`` itself, or a view of it that is a plain
    C-contiguous ``numpy.ndarray`` over the same memory (of a subclass such as ``np.matrix``, of a
    Fortran-ordered array). ``TypeError``/``ValueError`` name what is wrong."""
    if not isinstance(buf, np.ndarray):
        raise TypeError(f"{caller}: buf must be a numpy.ndarray, got {type(buf).__name__}")
    if isinstance(buf, np.ma.MaskedArray):
        raise TypeError(f"{caller}: buf is a masked array, whose mask a reduction cannot honour; pass buf.filled(...)")
    array = buf if type(buf) is np.ndarray else buf.view(np.ndarray)
    if array.dtype not in _DTYPES:
        names = ", ".join(d.name for d in kernels.DTYPES)
        raise TypeError(f"{caller}: buf has unsupported dtype {array.dtype.str} ({array.dtype}); supported: {names} "
                        f"in native byte order")
    flags = array.flags
    if not flags.writeable:
        raise ValueError(f"{caller}: buf is read-only, but the result is written into it in place")
    if not flags.c_contiguous:
        if not flags.f_contiguous:
            raise ValueError(f"{caller}: buf must be contiguous (it is written in place); pass "
                             f"np.ascontiguousarray(buf) and copy the result back")
        array = array.T  # the same memory in C order: an element-wise reduction does not care
    return array


def validate(buf, op, algorithm: str, caller: str = "allreduce"):
    """Raise ``TypeError``/``ValueError`` naming the argument if this rank's call is malformed;
    else return ``(array, op)``: the C-contiguous array to reduce in place (``buf`` or a view of
    it, see ``array_of``) and ``op``'s name in ``OPS``. Sends nothing."""
    try:
        if (type(buf) is np.ndarray and buf.flags.carray and buf.dtype in _DTYPES and op in _OPS
                and (algorithm == "auto" or algorithm in ALGORITHMS)):
            return buf, op  # the common case in one expression; below, each check names what is wrong
    except TypeError:  # an unhashable op or algorithm: named below
        pass
    array = array_of(buf, caller)
    name = op_name(op, caller)
    if not isinstance(algorithm, str):
        raise TypeError(f"{caller}: algorithm must be a name such as 'auto' or 'ring', got {type(algorithm).__name__}")
    if algorithm != "auto" and algorithm not in ALGORITHMS:
        raise ValueError(f"{caller}: unknown algorithm {algorithm!r}; choose 'auto' or one of {', '.join(ALGORITHMS)}")
    return array, name


def validate_compression(buf: np.ndarray, op: str, algorithm: str, compression, caller: str = "allreduce",
                         algorithms: Optional[Dict[str, Any]] = None) -> None:
    """Raise ``TypeError``/``ValueError`` naming the argument if ``compression`` cannot apply to a
    call that ``validate`` accepted: an unknown name; a 16-bit wire for a buffer other than
    float32 (float64 and integers are refused: rounding them to 16 bits would throw away what
    their type is for), for ``op="prod"``, or with an algorithm that cannot compress (one not in
    ``algorithms``, default allreduce's ``compression.COMPRESSED``). Sends nothing."""
    if algorithms is None:
        algorithms = _compression.COMPRESSED
    if not isinstance(compression, str) or compression not in _compression.COMPRESSIONS:
        raise ValueError(f"{caller}: unknown compression {compression!r}; choose one of "
                         f"{', '.join(_compression.COMPRESSIONS)}")
    if compression == "none":
        return
    if buf.dtype != np.float32:
        raise TypeError(f"{caller}: compression={compression!r} takes float32 buffers, but buf is {buf.dtype}; "
                        f"pass compression='none', or a float32 copy")
    if op not in _compression.OPS:
        raise ValueError(f"{caller}: compression={compression!r} does not support op={op!r}; "
                         f"choose op from {', '.join(_compression.OPS)}, or compression='none'")
    if algorithm != "auto" and algorithm not in algorithms:
        raise ValueError(f"{caller}: algorithm {algorithm!r} does not support compression={compression!r}; "
                         f"choose 'auto' or one of {', '.join(algorithms)}")


def _signature(buf, op: str, algorithm: str, error: Optional[Exception], compression: str = "none") -> np.ndarray:
    """This rank's call as integers: [failed, length, dtype, op, algorithm, compression], then negated."""
    if error is not None:
        fields = [1, 0, 0, 0, 0, 0]
    else:
        names = ["auto", *ALGORITHMS]
        fields = [0, buf.size, kernels.DTYPES.index(buf.dtype), OPS.index(op), names.index(algorithm),
                  _compression.COMPRESSIONS.index(compression)]
    return np.array(fields + [-f for f in fields], dtype=np.int64)


def _agree(comm, buf, op: str, algorithm: str, error: Optional[Exception], compression: str = "none") -> None:
    """Every rank raises if any rank's call differs from the others' or failed validation.

    The common case costs one ``Allreduce`` (MAX) of twelve int64 on the library's communicator:
    the maxima of the fields and of their negations agree only if every rank's fields do.
    Only when something differs does a pickled ``allgather`` collect details for the message.
    """
    signature = _signature(buf, op, algorithm, error, compression)
    comm.Allreduce(MPI.IN_PLACE, signature, op=MPI.MAX)
    half = signature.size // 2
    if signature[0] == 0 and np.array_equal(signature[:half], -signature[half:]):
        return
    mine = (type(error).__name__, str(error)) if error else (buf.size, buf.dtype.str, op, algorithm, compression)
    calls = comm.allgather(mine)
    if error is not None:
        raise error
    errors = [(r, c) for r, c in enumerate(calls) if isinstance(c[0], str)]
    if errors:
        rank, (kind, message) = errors[0]
        raise (TypeError if kind == "TypeError" else ValueError)(f"allreduce(check=True): rank {rank} failed: {message}")
    for field, name in enumerate(("buf length", "buf dtype", "op", "algorithm", "compression")):
        if len({c[field] for c in calls}) > 1:
            per_rank = ", ".join(f"rank {r}: {c[field]!r}" for r, c in enumerate(calls))
            raise ValueError(f"allreduce(check=True): {name} differs between ranks ({per_rank})")


class Repeat:
    """How ``allreduce`` reduced one buffer with one algorithm, kept so that the same call again
    (the same buffer object, op and algorithm: a loop that reduces one buffer) skips the lookups.
    Kept per buffer and algorithm, so that calls that take turns on one buffer with different
    algorithms (as the bench does) each stay on the short path.

    Kept, in ``COMM_WORLD``'s ``LibraryComm.repeats`` (the one used last also in ``LAST``), only
    for a plain 1-D C-contiguous buffer without ``check`` or ``stall_timeout``, and only where the
    algorithm that ran cannot change on the next call: a named one, ``auto``'s fixed choice, or
    ``auto``'s settled winner while its size class is quiet (``online``). A repeated call still
    checks everything that could have changed since: that the buffer is the same object with the
    same shape, dtype and flags, and that ``auto``'s class is still quiet with the same winner;
    anything else takes the full path, which then keeps the new call."""

    __slots__ = ("lib", "watch", "ref", "shape", "dtype", "op", "reduction", "algorithm", "settled", "winner", "fn",
                 "kernel", "address", "code", "divisor", "watched", "native", "native_op")

    #: Calls (buffer and algorithm) remembered per communicator; all are forgotten when one more
    #: comes, and each goes the full path again at its next call (and is kept anew at the one after).
    SIZE = 16

    def __init__(self, lib, buf: np.ndarray, op, name: str, algorithm: str, settled, winner: str):
        self.lib, self.watch = lib, lib.watch
        self.ref = weakref.ref(buf)
        self.shape, self.dtype = buf.shape, buf.dtype
        self.op, self.reduction, self.algorithm = op, lib.reductions[name], algorithm
        self.settled, self.winner = settled, winner
        #: What the stall inspector is told while the call runs (``stall.Inspector``).
        self.watched = (lib.watch, None, allreduce_description(algorithm, buf.size, buf.dtype, name), None)
        self.fn = ALGORITHMS[winner]
        bound = shared_memory.binding(lib, buf.dtype, self.reduction) if winner == "shared_memory" else None
        # set where the call goes straight into a compiled kernel: ``kernel(buf, address, code, divisor)``
        self.kernel, self.address, self.code, self.divisor = bound or (None, 0, 0, 0)
        # set where the call is MPI's own: ``native(MPI.IN_PLACE, buf, native_op)``
        self.native, self.native_op = (native.binding(lib, self.reduction) if winner == "mpi" else None) or (None, None)

    @staticmethod
    def keep(lib, buf: np.ndarray, op, name: str, algorithm: str, settled, winner: str) -> None:
        """After a call on the full path: the first call on a buffer with an algorithm only notes
        that it was seen (a loop over many buffers pays no more than that); a later one keeps the call."""
        key = (id(buf), algorithm)
        if key in lib.repeats:
            lib.repeats[key] = LAST[0] = Repeat(lib, buf, op, name, algorithm, settled, winner)
            return
        if len(lib.repeats) >= Repeat.SIZE:  # forgotten together, also the one the next call looks at first
            lib.repeats.clear()
            LAST[0] = None
        lib.repeats[key] = None

    @staticmethod
    def find(lib, buf: np.ndarray, algorithm: str) -> Optional["Repeat"]:
        """The call kept for ``buf`` and ``algorithm`` (then also ``LAST[0]``), or ``None``."""
        again = lib.repeats.get((id(buf), algorithm))
        if again is None or again.ref() is not buf or again.algorithm is not algorithm:
            return None
        LAST[0] = again
        return again


def _compressed(lib, buf: np.ndarray, op: str, algorithm: str, compression: str) -> None:
    """``allreduce`` with a 16-bit wire, the call validated: one rank rounds its buffer only, as
    every rank's result is 16-bit values."""
    wire = _compression.WIRES[compression]
    if buf.size == 0:
        return
    if lib.nranks == 1:
        wire.round(buf)
        return
    runs = _compression.choose(lib, buf.nbytes) if algorithm == "auto" else algorithm
    _compression.COMPRESSED[runs](lib, buf, lib.reductions[op], wire)


#: ``[the Repeat used last]`` on ``COMM_WORLD`` (or ``None``): a loop over one buffer finds it
#: without a lookup (a module's list, read faster than an attribute of the communicator).
LAST: list = [None]


def allreduce(buf: np.ndarray, *, op: str = "sum", algorithm: str = "auto",
              comm: Optional[MPI.Intracomm] = None, check: Optional[bool] = None,
              stall_timeout: Optional[float] = None, compression: str = "none") -> np.ndarray:
    """Reduce ``buf`` across the ranks of ``comm`` in place and return it.

    Collective: every rank of ``comm`` (default ``COMM_WORLD``) calls it with a C-contiguous,
    writable numpy array of the same length and dtype (float32, float64, int32 or int64), and
    the same ``op`` (sum, mean, max, min, prod) and ``algorithm`` (``auto`` or a name in
    ``ALGORITHMS``). Afterwards every rank's ``buf`` holds bitwise the same result.

    A malformed call raises ``TypeError`` or ``ValueError`` on the rank that made it, before it
    sends anything. ``check=True`` (or ``ALLREDUCE_KIT_CHECK=1``) adds one small agreement step
    so that a call that differs between ranks, or is malformed on any rank, raises on every
    rank instead of hanging or producing garbage.

    If the call has not finished after ``stall_timeout`` seconds (default: see
    ``allreduce_kit.stall``; 0 turns it off), the ranks that are waiting print which ranks have
    not arrived and the job is aborted.

    While nonblocking calls (``iallreduce``, ...) are in flight, it first waits for them to
    finish (``progress``): collectives reach a communicator in the order the program made them.

    ``compression="fp16"`` or ``"bf16"`` (float32 buffers; ops sum, mean, max, min; ``auto`` or
    an algorithm in ``compression.COMPRESSED``) sends 16-bit values and folds in float32: the
    result, bitwise the same on every rank, is made of 16-bit values (docs/compression.md).
    """
    tracer = _TRACING[0]
    if tracer is not None and _ident() not in tracer.busy:  # tracing (allreduce_kit/trace): recorded
        return tracer.allreduce(allreduce, buf, op, algorithm, comm, check, stall_timeout, compression)
    if IN_FLIGHT[0]:
        wait_turn()
    if (check is None and stall_timeout is None and (comm is None or comm is _COMM_WORLD)
            and compression == "none"):
        again = LAST[0]
        if again is None or again.ref() is not buf or again.algorithm is not algorithm:
            again = Repeat.find(_world[0], buf, algorithm) if _world else None
        if (again is not None and op is again.op and buf.shape == again.shape and buf.dtype is again.dtype
                and buf.flags.carray):
            settled = again.settled
            if settled is None or (settled.quiet and settled.winner is again.winner):
                if settled is not None:
                    settled.quiet -= 1
                again.watch.calls += 1
                INSPECTOR.current = again.watched
                try:
                    kernel = again.kernel
                    if kernel is not None:  # set only where the reduction has a compiled kernel
                        if kernel(buf, again.address, again.code, again.divisor) != 0:
                            raise mismatch(again.lib, buf, "shared_memory")
                    elif again.native is not None:
                        again.native(_IN_PLACE, buf, again.native_op)
                    else:
                        again.fn(again.lib, buf, again.reduction)
                finally:
                    INSPECTOR.current = None
                return buf
    try:
        array, name = validate(buf, op, algorithm)
        if compression != "none":
            validate_compression(array, name, algorithm, compression)
        error = None
    except (TypeError, ValueError) as malformed:  # raised here, before anything is sent, unless checked
        if not (check or (check is None and config.read(config.CHECK))):
            raise
        array, name, error = buf, op, malformed
    if stall_timeout is not None:
        try:
            stall_timeout = config.seconds_argument(stall_timeout)
        except (TypeError, ValueError) as bad:
            raise type(bad)(f"allreduce: stall_timeout: {bad}") from None
    lib = _world[0] if comm is None and _world else library_comm(comm)
    checked = check or (check is None and lib.check_default)
    # The stall inspector's bookkeeping, inline: a small message's whole call is a few
    # microseconds (see the comment in ``stall.Inspector``).
    watch = lib.watch
    watch.calls += 1
    INSPECTOR.current = (watch, stall_timeout, algorithm, array, name)
    try:
        if checked and lib.nranks > 1:
            _agree(lib, array, name, algorithm, error, compression if error is None else "none")
        elif error is not None:
            raise error
        if compression != "none":
            _compressed(lib, array if array.ndim == 1 else array.reshape(-1), name, algorithm, compression)
            return buf
        if lib.nranks == 1 or array.size == 0:
            return buf
        runs, settled = algorithm, None
        if algorithm == "auto":
            fixed = lib.fixed_choices.get(array.nbytes)  # online tuning off
            if fixed is not None:
                runs = fixed
            else:
                tuner = lib.state.get(online.Tuner)
                settled = tuner and tuner.by_nbytes.get(array.nbytes)
                if settled and settled.quiet:  # a settled size class between its checks: its winner, untimed
                    settled.quiet -= 1
                    runs = settled.winner
                elif tuner is not None or online.tuner_for(lib) is not None:  # exploring, or timing a check
                    lib.state[online.Tuner].call(lib, array.nbytes, array if array.ndim == 1 else array.reshape(-1),
                                                 lib.reductions[name])
                    return buf
                else:  # online tuning off: the table's choice, which stays
                    runs = selection.choose_for(lib, array.nbytes)
                    if len(lib.fixed_choices) < selection.MEMO_SIZES:
                        lib.fixed_choices[array.nbytes] = runs
        ALGORITHMS[runs](lib, array if array.ndim == 1 else array.reshape(-1), lib.reductions[name])
        if (check is None and not checked and stall_timeout is None and array is buf and buf.ndim == 1 and _world
                and lib is _world[0]):  # what the short path at the top takes
            Repeat.keep(lib, buf, op, name, algorithm, settled, runs)
    finally:
        INSPECTOR.current = None
    return buf
