"""``allreduce``: validate locally, optionally agree across ranks, then run one algorithm."""
from typing import Optional

import numpy as np
from mpi4py import MPI

from . import config, kernels, selection
from .algorithms import ALGORITHMS
from .comm import _world, library_comm
from .reduction import OPS
from .stall import INSPECTOR

_DTYPES = frozenset(kernels.DTYPES)
_OPS = frozenset(OPS)


def validate(buf, op: str, algorithm: str) -> None:
    """Raise ``TypeError``/``ValueError`` naming the argument if this rank's call is malformed."""
    if (type(buf) is np.ndarray and buf.flags.carray and buf.dtype in _DTYPES and op in _OPS
            and (algorithm == "auto" or algorithm in ALGORITHMS)):
        return  # the common case in one expression; below, each check names what is wrong
    if not isinstance(buf, np.ndarray):
        raise TypeError(f"allreduce: buf must be a numpy.ndarray, got {type(buf).__name__}")
    if buf.dtype not in _DTYPES:
        names = ", ".join(d.name for d in kernels.DTYPES)
        raise TypeError(f"allreduce: buf has unsupported dtype {buf.dtype.str} ({buf.dtype}); supported: {names} in native byte order")
    flags = buf.flags
    if not flags.c_contiguous:
        raise ValueError("allreduce: buf must be C-contiguous (reduced in place); pass np.ascontiguousarray(buf) and copy back")
    if not flags.writeable:
        raise ValueError("allreduce: buf is read-only, but the reduction is written into it in place")
    if op not in OPS:
        raise ValueError(f"allreduce: unknown op {op!r}; choose one of {', '.join(OPS)}")
    if algorithm != "auto" and algorithm not in ALGORITHMS:
        raise ValueError(f"allreduce: unknown algorithm {algorithm!r}; choose 'auto' or one of {', '.join(ALGORITHMS)}")


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
    lib = _world[0] if comm is None and _world else library_comm(comm)
    if stall_timeout is not None:
        try:
            stall_timeout = config.seconds_argument(stall_timeout)
        except (TypeError, ValueError) as error:
            raise type(error)(f"allreduce: stall_timeout: {error}") from None
    if check or (check is None and lib.check_default):
        try:
            validate(buf, op, algorithm)
        except (TypeError, ValueError) as error:
            _agree(lib, buf, op, algorithm, error)
        _agree(lib, buf, op, algorithm, None)
    else:
        validate(buf, op, algorithm)
    if lib.nranks == 1 or buf.size == 0:
        return buf
    if algorithm == "auto":
        auto = lib.state.get(selection.Auto)
        algorithm = (auto and auto.choices.get(buf.nbytes)) or selection.choose_for(lib, buf.nbytes)
    red = lib.reductions[op]
    # The stall inspector's bookkeeping, inline: a small message's whole call is a few
    # microseconds (see the comment in ``stall.Inspector``).
    watch = lib.watch
    watch.calls += 1
    INSPECTOR.current = (watch, stall_timeout, algorithm, buf)
    try:
        ALGORITHMS[algorithm](lib, buf if buf.ndim == 1 else buf.reshape(-1), red)
    finally:
        INSPECTOR.current = None
    return buf
