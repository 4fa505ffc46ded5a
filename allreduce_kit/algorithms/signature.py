"""A call's signature: how the ranks find out, at no cost, that their buffers differ.

Every rank of a call must pass a buffer of the same length and dtype. Nothing is added to a
well-formed call to check that; instead, what the algorithms exchange anyway carries each
rank's signature, and every rank compares what it receives with its own:

- on the message paths, every message's tag is ``signature << 2 | BAD | MORE``, received with
  ``MPI.ANY_TAG`` from the known source (the library's communicator is private: no other
  message can match). ``BAD`` says the sender has seen a signature other than its own, or a
  message that did not fit (MPI's ``ERR_TRUNCATE``, caught); every message it sends after that
  carries ``BAD`` on. An allreduce makes every rank's result depend on every rank's buffer, so
  along the messages from two ranks whose signatures differ to any third, some receiver sees a
  difference and ``BAD`` travels the rest of the way: at the end every rank knows. ``MORE``
  says another piece of the same step follows (``pieces.py``), so that a step whose pieces are
  counted from a length that differs still ends with every message received. Messages go as
  bytes (``MPI.BYTE``): a message of another dtype is then only a message of another size
  (MPICH asserts, and ends the job, when a message is not a whole number of the receive
  datatype's elements);
- on the single-copy and shared-window paths (``direct.py``, ``shared_memory.py``), each rank
  publishes ``word(buf, algorithm)`` beside its buffer's address. On the shared window every
  rank compares every peer's word with its own before it reads any slot, so every rank finds
  the same difference at the same point. On the single-copy path a rank compares a peer's word
  when it first reads from or writes into that peer; a rank that finds a difference puts a
  mark in its step counter that ends every wait on it and makes the waiter stop too, and so
  every rank learns of it (``direct.py``).

Either way every rank then calls ``mismatch``, which gathers what each rank passed (the only
communication a mismatch adds) and gives every rank the same ``ValueError``. A tag holds the
length's low ``LOW_BITS`` bits (22 with MPICH's tag bound) and 5 bits hashed from the dtype, the
algorithm and the length's high bits: two lengths differ in the tag unless they differ by a
multiple of ``2 ** (LOW_BITS + 5)`` elements (2**27 with MPICH); the published words hold
everything.

``reduce_scatter`` and ``allgather`` do the same (each rank's result depends on every rank's
buffer, so ``BAD`` reaches every rank there too), their errors naming the collective (``mismatch``'s
``caller``); an allgather's uneven blocks are hashed into its tag and word as well
(``keyed_tag``, ``keyed_word``). A broadcast's data flows from the root only: by messages the
ranks agree on the call first (``collectives/broadcast.py``), and on one node its word holds the
root too.
"""
import hashlib
import zlib
from typing import Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI
from numba import njit
from numba.extending import overload

from ..kernels import DTYPES

#: Tag bit: the sender sends another piece in this step (``pieces.py``).
MORE = 1
#: Tag bit: the sender knows the ranks' buffers differ.
BAD = 2

_CODES = {dtype: code for code, dtype in enumerate(DTYPES)}
#: Bits of a length a tag holds exactly; set from ``MPI.TAG_UB`` on first use (MPI must be running).
LOW_BITS = 0
_status = MPI.Status()
#: Open MPI (5.0, shared memory) can write a whole message into a receive buffer smaller than it
#: instead of truncating it, so there each message's size is probed before it is received; MPICH
#: truncates as the standard says, and receives directly.
PROBE_FIRST = "Open MPI" in MPI.Get_library_version()


def low_bits() -> int:
    """``LOW_BITS``, set on the first call (MPI must be running)."""
    global LOW_BITS
    if not LOW_BITS:
        bound = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)  # at least 32767 by the standard; 2**29 - 1 in MPICH
        LOW_BITS = (bound + 1).bit_length() - 1 - 2 - 5  # tag bits, less BAD and MORE, less the hash
    return LOW_BITS


def tag(buf: np.ndarray, algorithm: int) -> int:
    """The tag of ``buf``'s messages for ``algorithm`` (its module's ``TAG``: distinct mod 8)."""
    key = (buf.size, buf.dtype, algorithm)  # the dtype itself: cheaper to reach and hash than its number
    found = _TAGS.get(key)
    if found is None:  # a new length, dtype or algorithm: computed once (a loop's calls repeat them)
        if len(_TAGS) >= 4096:
            _TAGS.clear()
        found = _TAGS[key] = int(tag_bits(buf, algorithm, low_bits()))
    return found


_TAGS: dict = {}


def keyed_tag(buf: np.ndarray, algorithm: int, key) -> int:
    """``tag(buf, algorithm)`` with more of the call in it: ``key`` (a tuple of ints, the same on
    every rank of a well-formed call, such as ``allgather``'s block lengths), hashed into the
    tag's length bits. Calls whose keys differ get different tags but for one chance in
    ``2 ** (LOW_BITS + 5)``."""
    mixed = zlib.crc32(repr(key).encode()) & ((1 << (low_bits() + 5)) - 1)
    return tag(buf, algorithm) ^ (mixed << 2)


def keyed_word(buf: np.ndarray, algorithm: int, key) -> int:
    """``word(buf, algorithm)`` with more of the call in it (``key``, as in ``keyed_tag``), for
    ``direct.begin_word``: calls whose keys differ publish different words but for one chance
    in ``2 ** 62``."""
    mixed = int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little") >> 2
    return int(word(buf, algorithm)) ^ mixed


_BYTE, _ANY_TAG = MPI.BYTE, MPI.ANY_TAG  # looked up once: a short message's call is a few microseconds


def send(comm, buf: np.ndarray, dest: int, tag: int) -> None:
    """Send ``buf`` to ``dest`` with ``tag`` (as bytes, like every message here)."""
    comm.Send([buf, _BYTE], dest, tag)


def _recv(comm, buf: np.ndarray, source: int, tag: int) -> int:
    """Receive ``source``'s message into ``buf``; return ``tag``, with ``BAD`` if the message's
    tag says the call is inconsistent or the message did not fit."""
    try:
        comm.Recv([buf, _BYTE], source, _ANY_TAG, _status)
    except MPI.Exception as error:
        return _truncated(error, tag)
    return tag if _status.tag & ~MORE == tag else tag | BAD


def _sendrecv(comm, send: np.ndarray, dest: int, recv: np.ndarray, source: int, tag: int, more: int = 0) -> int:
    """``Sendrecv`` with ``tag | more`` on the message sent; the received message checked as in ``recv``."""
    try:
        comm.Sendrecv([send, _BYTE], dest, tag | more, [recv, _BYTE], source, _ANY_TAG, _status)
    except MPI.Exception as error:
        return _truncated(error, tag)
    return tag if _status.tag & ~MORE == tag else tag | BAD


def _probed_recv(comm, buf: np.ndarray, source: int, tag: int) -> int:
    """``recv``, but a message larger than ``buf`` is received into a scratch buffer and dropped."""
    message = comm.Mprobe(source, _ANY_TAG, _status)
    size = _status.Get_count(_BYTE)
    if size > buf.nbytes:
        message.Recv([np.empty(size, np.uint8), _BYTE], _status)
        return tag | BAD
    message.Recv([buf, _BYTE], _status)
    return tag if _status.tag & ~MORE == tag else tag | BAD


def _probed_sendrecv(comm, send: np.ndarray, dest: int, recv: np.ndarray, source: int, tag: int,
                     more: int = 0) -> int:
    """``sendrecv``, the message received as in ``_probed_recv``."""
    request = comm.Isend([send, _BYTE], dest, tag | more)
    try:
        return _probed_recv(comm, recv, source, tag)
    finally:
        request.Wait()


#: ``recv(comm, buf, source, tag)`` and ``sendrecv(comm, send, dest, recv, source, tag, more=0)``
#: for this MPI library (``PROBE_FIRST``).
recv, sendrecv = (_probed_recv, _probed_sendrecv) if PROBE_FIRST else (_recv, _sendrecv)


def received() -> int:
    """The tag of the message ``recv`` or ``sendrecv`` received last."""
    return _status.tag


def _truncated(error: MPI.Exception, tag: int) -> int:
    if error.Get_error_class() != MPI.ERR_TRUNCATE:
        raise error
    return tag | BAD


def mismatch(comm, buf: np.ndarray, algorithm: str, caller: str = "allreduce",
             fields: Optional[Sequence[Tuple[str, object]]] = None, result: str = "buf") -> ValueError:
    """The error every rank raises once it knows the ranks' buffers differ: what each passed.

    Collective: every rank of ``comm`` calls it, after it has finished touching its peers. It is
    the only communication a mismatch adds, and also keeps every rank from starting its next
    call until all have left this one.

    ``caller`` names the collective (``allreduce``, ``reduce_scatter``, ...); ``fields`` are the
    ``(name, value)`` pairs compared, the same names on every rank (default: ``buf``'s length and
    dtype, and ``algorithm``); ``result`` names what the call leaves undefined.
    """
    if fields is None:
        fields = (("buf length", buf.size), ("buf dtype", buf.dtype.name), ("algorithm", algorithm))
    calls = comm.allgather(tuple(value for _, value in fields))
    return ValueError(described(caller, [name for name, _ in fields], calls, result))


def described(caller: str, names: Sequence[str], calls: Sequence[Sequence[object]], result: str = "buf") -> str:
    """The message of ``mismatch``: which of ``names`` differ between the ranks' ``calls`` (one
    tuple of values per rank, in rank order), with every rank's value."""
    found = []
    for field, name in enumerate(names):
        if len({c[field] for c in calls}) > 1:
            per_rank = ", ".join(f"rank {r}: {c[field]}" for r, c in enumerate(calls))
            found.append(f"{name} differs between ranks ({per_rank})")
    if not found:  # e.g. lengths whose difference no tag shows, yet a message did not fit
        found.append("the ranks' calls do not match")
    return f"{caller}: {'; '.join(found)}; every rank's {result} is left undefined"


def dtype_code(buf):
    """The index of ``buf``'s dtype in ``kernels.DTYPES`` (compiled: a constant per dtype)."""
    return _CODES[buf.dtype]


@overload(dtype_code)
def _dtype_code(buf):
    code = _CODES[np.dtype(buf.dtype.name)]
    return lambda buf: code


@njit(cache=True, nogil=True)
def tag_bits(buf, algorithm, low):
    """``tag(buf, algorithm)``, computed; ``low`` is ``LOW_BITS``. Compiled code (``native.py``)
    calls it directly."""
    size = buf.size
    mixed = (dtype_code(buf) + 4 * algorithm + 7 * (size >> low)) & 31
    return ((mixed << low) | (size & ((1 << low) - 1))) << 2


@njit(cache=True, nogil=True)
def word(buf, algorithm):
    """What ``direct.py`` and ``shared_memory.py`` publish: length, algorithm and dtype in one int64."""
    return (buf.size << 10) | ((algorithm & 255) << 2) | dtype_code(buf)
