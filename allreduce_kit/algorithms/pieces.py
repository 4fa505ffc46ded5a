"""The reduce-scatter step of ``ring``, ``rabenseifner`` and ``two_shot``, sent in cache-sized pieces.

A step sends one range of the buffer to a partner while receiving that partner's copy of another
range and folding it into this rank's own. Sent whole, a large range lands in the scratch buffer
and has left the cache by the time the fold reads it back. Sent in pieces of at most ``PIECE``
bytes (half of this machine's 1 MiB L2), each piece is folded in while it is still in cache:
measured on the 2-core development machine at p = 2 and 16 MiB, 2.4-3.3 ms instead of
3.8-4.2 ms (docs/performance.md).

Only when every rank has a core of its own: when ranks share cores, each extra message can cost
a context switch, which is more than the cache saves (``LibraryComm.oversubscribed``).

The number of pieces comes from the sender's own length. Every piece but the last carries
``MORE`` in its tag (``signature.py``), and a rank receives pieces until one comes without it,
so a step still ends with every message received when the ranks' lengths differ (and so their
counts of pieces): the call then fails on every rank instead of hanging.
"""
import numpy as np

from .signature import BAD, MORE, received, recv, send, sendrecv

#: Largest piece in bytes.
PIECE = 512 << 10


def count(nbytes: int, comm) -> int:
    """How many pieces a step of ``nbytes`` bytes is sent in on ``comm`` (the same on every rank
    whose buffer has the same length)."""
    if comm.oversubscribed or nbytes <= PIECE:
        return 1
    return -(-nbytes // PIECE)


def sendrecv_combine(comm, send: np.ndarray, dest: int, mine: np.ndarray, source: int, tag: int, op,
                     last: bool, pieces: int) -> int:
    """Send ``send`` to ``dest``; receive ``source``'s copy of ``mine`` and fold it into ``mine``.

    Both arrays go in ``pieces`` near-equal pieces (compute it with ``count`` from a size both
    sides share). ``tag`` is the call's (``signature.tag``); returns it, with ``BAD`` if a
    received tag or size showed that the ranks' buffers differ (``mine`` is then undefined).
    """
    if pieces == 1:
        incoming = comm.scratch(mine.size, mine.dtype)
        tag = sendrecv(comm, send, dest, incoming, source, tag)
        if received() & MORE == 0:  # always, unless the ranks' buffers differ
            op.combine(mine, incoming, last)
            return tag
        return _drain(comm, incoming, source, tag | BAD)
    incoming = comm.scratch(-(-mine.size // pieces), mine.dtype)
    s, m = send.size, mine.size
    for j in range(pieces):
        a, b = j * m // pieces, (j + 1) * m // pieces
        piece = incoming[:b - a]
        tag = sendrecv(comm, send[j * s // pieces:(j + 1) * s // pieces], dest, piece, source, tag,
                       MORE if j < pieces - 1 else 0)
        if received() & MORE == 0 and j < pieces - 1:  # the source has sent its last piece
            return _send_rest(comm, send, dest, tag | BAD, j + 1, pieces)
        op.combine(mine[a:b], piece, last)
    return _drain(comm, incoming, source, tag | BAD) if received() & MORE else tag


def _drain(comm, incoming: np.ndarray, source: int, tag: int) -> int:
    """Receive the pieces ``source`` still sends in this step (its buffer is longer than ours)."""
    while received() & MORE:
        tag = recv(comm, incoming, source, tag)
    return tag


def _send_rest(comm, out: np.ndarray, dest: int, tag: int, j: int, pieces: int) -> int:
    """Send pieces ``j`` onward of ``out`` alone: the source has no more (its buffer is shorter)."""
    s = out.size
    for k in range(j, pieces):
        send(comm, out[k * s // pieces:(k + 1) * s // pieces], dest, tag | (MORE if k < pieces - 1 else 0))
    return tag
