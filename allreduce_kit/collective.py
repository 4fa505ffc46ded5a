"""``allreduce``: validate locally, optionally agree across ranks, then run one algorithm."""
from typing import Optional

import numpy as np
from mpi4py import MPI

from . import config, kernels, online, selection
from .algorithms import ALGORITHMS
from .comm import _world, library_comm
from .reduction import OPS
from .stall import INSPECTOR

_DTYPES = frozenset(kernels.DTYPES)
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


def _signature(buf, op: str, algorithm: str, error: Optional[Exception]) -> np.ndarray:
    """This rank's call as integers: [failed, length, dtype, op, algorithm], then negated."""
    if error is not None:
        fields = [1, 0, 0, 0, 0]
    else:
        names = ["auto", *ALGORITHMS]
        fields = [0, buf.size, kernels.DTYPES.index(buf.dtype), OPS.index(op), names.index(algorithm)]
    return np.array(fields + [-f for f in fields], dtype=np.int64)


def _agree(comm, buf, op: str, algorithm: str, error: Optional[Exception]) -> None:
    """Every rank raises if any rank's call differs from the others' or failed validation.

    The common case costs one ``Allreduce`` (MAX) of ten int64 on the library's communicator:
    the maxima of the fields and of their negations agree only if every rank's fields do.
    Only when something differs does a pickled ``allgather`` collect details for the message.
    """
    signature = _signature(buf, op, algorithm, error)
    comm.Allreduce(MPI.IN_PLACE, signature, op=MPI.MAX)
    half = signature.size // 2
    if signature[0] == 0 and np.array_equal(signature[:half], -signature[half:]):
        return
    mine = (type(error).__name__, str(error)) if error else (buf.size, buf.dtype.str, op, algorithm)
    calls = comm.allgather(mine)
    if error is not None:
        raise error
    errors = [(r, c) for r, c in enumerate(calls) if isinstance(c[0], str)]
    if errors:
        rank, (kind, message) = errors[0]
        raise (TypeError if kind == "TypeError" else ValueError)(f"allreduce(check=True): rank {rank} failed: {message}")
    for field, name in enumerate(("buf length", "buf dtype", "op", "algorithm")):
        if len({c[field] for c in calls}) > 1:
            per_rank = ", ".join(f"rank {r}: {c[field]!r}" for r, c in enumerate(calls))
            raise ValueError(f"allreduce(check=True): {name} differs between ranks ({per_rank})")


def allreduce(buf: np.ndarray, *, op: str = "sum", algorithm: str = "auto",
              comm: Optional[MPI.Intracomm] = None, check: Optional[bool] = None,
              stall_timeout: Optional[float] = None) -> np.ndarray:
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
    """
    try:
        array, name = validate(buf, op, algorithm)
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
    INSPECTOR.current = (watch, stall_timeout, algorithm, array)
    try:
        if checked and lib.nranks > 1:
            _agree(lib, array, name, algorithm, error)
        elif error is not None:
            raise error
        if lib.nranks == 1 or array.size == 0:
            return buf
        if algorithm == "auto":
            fixed = lib.fixed_choices.get(array.nbytes)  # online tuning off, or across nodes
            if fixed is not None:
                algorithm = fixed
            else:
                tuner = lib.state.get(online.Tuner)
                settled = tuner and tuner.by_nbytes.get(array.nbytes)
                if settled and settled.quiet:  # a settled size class between its checks: its winner, untimed
                    settled.quiet -= 1
                    algorithm = settled.winner
                elif tuner is not None or online.tuner_for(lib) is not None:  # exploring, or timing a check
                    lib.state[online.Tuner].call(lib, array if array.ndim == 1 else array.reshape(-1),
                                                 lib.reductions[name], array.nbytes)
                    return buf
                else:  # online tuning off: the table's choice, which stays
                    algorithm = selection.choose_for(lib, array.nbytes)
                    if len(lib.fixed_choices) < selection.MEMO_SIZES:
                        lib.fixed_choices[array.nbytes] = algorithm
        ALGORITHMS[algorithm](lib, array if array.ndim == 1 else array.reshape(-1), lib.reductions[name])
    finally:
        INSPECTOR.current = None
    return buf
