"""What the collectives share: local argument checks that name the argument, the ``check=True``
agreement step, the stall inspector's watch, and the settings they read."""
import weakref
import zlib
from contextlib import contextmanager
from numbers import Integral
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from .. import config, kernels
from ..algorithms.signature import described
from ..comm import LibraryComm, _world
from ..stall import INSPECTOR

_DTYPES = frozenset(kernels.DTYPES)


def input_array(buf, caller: str, name: str = "buf", writable: bool = False) -> np.ndarray:
    """``buf`` as a 1-D C-contiguous ``numpy.ndarray`` over the same memory (its elements in C
    order); ``TypeError``/``ValueError`` naming ``name`` say what is wrong."""
    if not isinstance(buf, np.ndarray):
        raise TypeError(f"{caller}: {name} must be a numpy.ndarray, got {type(buf).__name__}")
    if isinstance(buf, np.ma.MaskedArray):
        raise TypeError(f"{caller}: {name} is a masked array, whose mask a collective cannot honour; "
                        f"pass {name}.filled(...)")
    array = buf if type(buf) is np.ndarray else buf.view(np.ndarray)
    if array.dtype not in _DTYPES:
        names = ", ".join(d.name for d in kernels.DTYPES)
        raise TypeError(f"{caller}: {name} has unsupported dtype {array.dtype.str} ({array.dtype}); supported: "
                        f"{names} in native byte order")
    if writable and not array.flags.writeable:
        raise ValueError(f"{caller}: {name} is read-only, but the result is written into it")
    if not array.flags.c_contiguous:
        raise ValueError(f"{caller}: {name} must be C-contiguous; pass np.ascontiguousarray({name})")
    return array.reshape(-1)


def output_array(out, caller: str, dtype: np.dtype, size: int, why: str) -> np.ndarray:
    """``out`` checked as where ``size`` elements of ``dtype`` are written (``why`` says where
    ``size`` comes from), as a 1-D view."""
    array = input_array(out, caller, "out", writable=True)
    if array.dtype != dtype:
        raise TypeError(f"{caller}: out has dtype {array.dtype}, but the result is {dtype}")
    if array.size != size:
        raise ValueError(f"{caller}: out has {array.size} elements, but {why} has {size}")
    return array


def comm_shape(comm, caller: str) -> Tuple[int, int]:
    """``(size, rank)`` of ``comm`` (default ``COMM_WORLD``), read locally."""
    comm = MPI.COMM_WORLD if comm is None else comm
    if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
        raise TypeError(f"{caller}: comm must be an mpi4py intracommunicator, got {comm!r}")
    return comm.Get_size(), comm.Get_rank()


def algorithm_name(algorithm, names: Sequence[str], caller: str) -> str:
    """``algorithm`` checked against ``auto`` and the collective's registry ``names``."""
    if not isinstance(algorithm, str):
        raise TypeError(f"{caller}: algorithm must be a name such as 'auto' or 'ring', got {type(algorithm).__name__}")
    if algorithm != "auto" and algorithm not in names:
        raise ValueError(f"{caller}: unknown algorithm {algorithm!r}; choose 'auto' or one of {', '.join(names)}")
    return algorithm


def rank_argument(value, p: int, caller: str, name: str) -> int:
    """A rank of a communicator of ``p`` ranks, given as ``name``."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{caller}: {name} must be an int, got {type(value).__name__}")
    if not 0 <= value < p:
        raise ValueError(f"{caller}: {name} must be a rank in 0..{p - 1}, got {value}")
    return int(value)


def counts_argument(counts, p: int, caller: str) -> List[int]:
    """``counts``: one non-negative block length per rank."""
    try:
        lengths = list(counts)
    except TypeError:
        raise TypeError(f"{caller}: counts must be a sequence of {p} ints, got {type(counts).__name__}") from None
    if len(lengths) != p:
        raise ValueError(f"{caller}: counts must have one length per rank ({p}), got {len(lengths)}")
    for length in lengths:
        if isinstance(length, bool) or not isinstance(length, Integral):
            raise TypeError(f"{caller}: counts must hold ints, got {type(length).__name__}")
        if length < 0:
            raise ValueError(f"{caller}: counts must be >= 0, got {length}")
    return [int(length) for length in lengths]


def stall_argument(value, caller: str) -> Optional[float]:
    """``stall_timeout`` checked (``None``: the default)."""
    if value is None:
        return None
    try:
        return config.seconds_argument(value)
    except (TypeError, ValueError) as bad:
        raise type(bad)(f"{caller}: stall_timeout: {bad}") from None


def checking_locally(check: Optional[bool]) -> bool:
    """Whether a call with ``check`` agrees before it runs, as known before the communicator."""
    return bool(check or (check is None and config.read(config.CHECK)))


def _code(value) -> int:
    """An int64 that stands for ``value`` alike on every rank (``hash`` of a str is not)."""
    if isinstance(value, (int, np.integer)) and -(1 << 62) < value < (1 << 62):
        return int(value)
    return zlib.crc32(repr(value).encode())


def settle(lib: LibraryComm, caller: str, fields: Sequence[Tuple[str, object]], error: Optional[Exception],
           check: Optional[bool]) -> None:
    """Before a collective runs: with ``check`` (or the communicator's default) and more than one
    rank, ``agree`` on ``fields``; otherwise raise this rank's local ``error``, if any."""
    if (check or (check is None and lib.check_default)) and lib.nranks > 1:
        agree(lib, caller, fields, error)
    elif error is not None:
        raise error


def agree(lib: LibraryComm, caller: str, fields: Sequence[Tuple[str, object]],
          error: Optional[Exception]) -> None:
    """Every rank raises if any rank's call differs from the others' or failed validation.

    ``fields``: ``(name, value)`` per thing that must be the same on every rank (the same names
    on every rank). The common case costs one ``Allreduce`` (MAX) of a few int64 on the library's
    communicator: the maxima of the fields and of their negations agree only if every rank's
    fields do. Only when something differs does a pickled ``allgather`` collect the details, so
    that every rank raises the same ``ValueError`` naming each rank's value.
    """
    if not differs(lib, fields, error is not None):
        return
    mine = (type(error).__name__, str(error)) if error is not None else ("", tuple(v for _, v in fields))
    calls = lib.allgather(mine)
    if error is not None:
        raise error
    failed = [(r, c) for r, c in enumerate(calls) if c[0]]
    if failed:
        rank, (kind, message) = failed[0]
        raise (TypeError if kind == "TypeError" else ValueError)(f"{caller}(check=True): rank {rank} failed: {message}")
    calls = [c[1] for c in calls]
    for field, (name, _) in enumerate(fields):
        if len({c[field] for c in calls}) > 1:
            per_rank = ", ".join(f"rank {r}: {c[field]!r}" for r, c in enumerate(calls))
            raise ValueError(f"{caller}(check=True): {name} differs between ranks ({per_rank})")


def differs(lib: LibraryComm, fields: Sequence[Tuple[str, object]], failed: bool = False) -> bool:
    """Whether any rank's ``fields`` differ from another's, or any rank ``failed``: one
    ``Allreduce`` (MAX) of a few int64, the maxima of the fields' codes and of their negations.
    Collective."""
    codes = [1] + [0] * len(fields) if failed else [0] + [_code(v) for _, v in fields]
    signature = np.array(codes + [-c for c in codes], dtype=np.int64)
    lib.Allreduce(MPI.IN_PLACE, signature, op=MPI.MAX)
    half = signature.size // 2
    return not (signature[0] == 0 and np.array_equal(signature[:half], -signature[half:]))


def agree_unchecked(lib: LibraryComm, caller: str, fields: Sequence[Tuple[str, object]], result: str) -> None:
    """``agree`` for a well-formed call without ``check``, for a collective whose data moves in
    one direction only (``broadcast``), so that nothing it sends anyway could tell every rank of
    a difference: every rank raises the ``ValueError`` of ``signature.mismatch``, naming
    ``caller``, if any rank's ``fields`` differ. Collective."""
    if differs(lib, fields):
        calls = lib.allgather(tuple(value for _, value in fields))
        raise ValueError(described(caller, [name for name, _ in fields], calls, result))


@contextmanager
def watched(lib: LibraryComm, what: str, timeout: Optional[float]) -> Iterator[None]:
    """The stall inspector watches the block as the call ``what`` on ``lib``."""
    with INSPECTOR.watching(lib.watch, what, timeout):
        yield


class Again:
    """A collective's last call on ``COMM_WORLD``, kept so that the same call again skips the
    checks, the agreement and the choice of algorithm: a loop that gathers, scatters or
    broadcasts the same arrays. (``allreduce``'s own is ``collective.Repeat``.)

    A collective keeps a call only where nothing of it can differ on the next one but what the
    short path checks (in the collective's own first lines, inline: a method call is a share of a
    small call): that it is made with the same two array objects (``first``, ``second``; ``None``
    where the collective has one), with the same shapes, dtype and flags, and the same other
    arguments (``key``), on ``COMM_WORLD`` (``comm`` not given, or ``MPI.COMM_WORLD``), without
    ``check`` or ``stall_timeout``, and no nonblocking call in flight. ``run(first, second)`` is
    the call's algorithm with everything else bound; the stall inspector is told of it as the
    full path would, with the description made there."""

    __slots__ = ("first", "second", "shapes", "dtype", "key", "run", "watched", "tuning", "left")

    def __init__(self, lib: LibraryComm, first: np.ndarray, second: Optional[np.ndarray], key, run, what: str,
                 tuning: Optional["Tuning"] = None):
        self.first = weakref.ref(first)
        self.second = weakref.ref(second) if second is not None else _none
        self.shapes = (first.shape, None if second is None else second.shape)
        self.dtype, self.key, self.run = first.dtype, key, run
        self.watched = (lib.watch, None, what, None)
        #: an ``auto`` call online tuning runs (``Tuning``): ``run`` is its settled winner's call,
        #: taken for the ``left`` quiet calls the size class lent this call; then the tuner's turn
        self.tuning, self.left = tuning, 0

    def __call__(self, first: np.ndarray, second: Optional[np.ndarray]) -> None:
        watched = self.watched
        watched[0].calls += 1
        INSPECTOR.current = watched
        try:
            if self.left:
                self.left -= 1
                self.run(first, second)
            elif self.tuning is None:
                self.run(first, second)
            else:
                self.run, self.left = self.tuning.turn(first, second)
        finally:
            INSPECTOR.current = None


def _none() -> None:
    return None


def keeps(lib: LibraryComm, comm, check: Optional[bool], stall_timeout) -> bool:
    """Whether a call just made the full way may be kept (``Again``)."""
    return ((comm is None or comm is MPI.COMM_WORLD) and check is None and stall_timeout is None
            and not lib.check_default and bool(_world) and lib is _world[0])


def dispatch(lib: LibraryComm, spec, algorithm: str, nbytes: int, *args) -> Tuple[Optional[object], Optional[str]]:
    """Run ``spec``'s collective on ``lib`` as ``algorithm(lib, *args)``: the named algorithm, or for
    ``auto`` online tuning's turn (``online.Tuner``) where it is on, else the table's choice.
    Returns the tuner that ran it, or ``None`` and the algorithm that ran."""
    from .. import online
    tuner = online.tuner_for(lib, spec) if algorithm == "auto" else None
    if tuner is not None:
        tuner.call(lib, nbytes, *args)
        return tuner, None
    runs = spec.table(lib, nbytes) if algorithm == "auto" else algorithm
    spec.algorithms[runs](lib, *args)
    return None, runs


def repeated(lib: LibraryComm, tuner, runs: Optional[str], nbytes: int,
             bind: Callable[[str], Callable]) -> Tuple[Optional[Callable], Optional["Tuning"]]:
    """``Again``'s ``run`` and ``tuning`` for a call ``dispatch`` ran: ``bind(name)`` is algorithm
    ``name``'s call on the kept arrays."""
    if tuner is not None:
        return None, Tuning(lib, tuner, nbytes, bind)
    return bind(runs), None


class Tuning:
    """An ``auto`` call that online tuning runs (``online.Tuner``), as ``Again`` repeats it:
    ``bind(name)`` is algorithm ``name``'s call ``run(first, second)`` on the kept arrays."""

    __slots__ = ("lib", "tuner", "size_class", "bind", "bound")

    def __init__(self, lib: LibraryComm, tuner, nbytes: int, bind: Callable[[str], Callable]):
        self.lib, self.tuner, self.bind = lib, tuner, bind
        self.size_class = tuner.class_for(nbytes)
        self.bound: Dict[str, Callable] = {}

    def _of(self, name: str) -> Callable:
        fn = self.bound.get(name)
        if fn is None:
            fn = self.bound[name] = self.bind(name)
        return fn

    def turn(self, first, second) -> Tuple[Callable, int]:
        """One call as the tuner runs it (the winner while the class is quiet; exploring, or the
        winner timed for a check, otherwise); then the winner's call and the quiet calls left,
        which the repeated call takes over from the class and counts down itself (a call made
        the full way meanwhile finds none, and the tuner's window and check come sooner: the
        same on every rank, as calls are collective)."""
        c = self.size_class
        self.tuner.run(self.lib, c, lambda name: self._of(name)(first, second))
        if c.winner is None or not c.quiet:
            return _none, 0
        left, c.quiet = c.quiet, 0
        return self._of(c.winner), left
