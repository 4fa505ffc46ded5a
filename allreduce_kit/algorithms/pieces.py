"""The reduce-scatter step of ``ring`` and ``rabenseifner``, sent in cache-sized pieces.

A step sends one range of the buffer to a partner while receiving that partner's copy of another
range and folding it into this rank's own. Sent whole, a large range lands in the scratch buffer
and has left the cache by the time the fold reads it back. Sent in pieces of at most ``PIECE``
bytes (half of this machine's 1 MiB L2), each piece is folded in while it is still in cache:
measured on the 2-core development machine at p = 2 and 16 MiB, 2.4-3.3 ms instead of
3.8-4.2 ms (docs/performance.md).

Only when every rank has a core of its own: when ranks share cores, each extra message can cost
a context switch, which is more than the cache saves (``LibraryComm.oversubscribed``).
"""
import numpy as np

#: Largest piece in bytes.
PIECE = 512 << 10


def count(nbytes: int, comm) -> int:
    """How many pieces a step of ``nbytes`` bytes is sent in on ``comm`` (the same on every rank)."""
    if comm.oversubscribed or nbytes <= PIECE:
        return 1
    return -(-nbytes // PIECE)


def sendrecv_combine(comm, send: np.ndarray, dest: int, mine: np.ndarray, source: int, tag: int, op,
                     last: bool, pieces: int) -> None:
    """Send ``send`` to ``dest``; receive ``source``'s copy of ``mine`` and fold it into ``mine``.

    Both arrays go in ``pieces`` near-equal pieces; ``dest`` and ``source`` must use the same
    ``pieces`` for this step (compute it with ``count`` from a size both sides share).
    """
    if pieces == 1:
        incoming = comm.scratch(mine.size, mine.dtype)
        comm.Sendrecv(send, dest, tag, incoming, source, tag)
        op.combine(mine, incoming, last)
        return
    incoming = comm.scratch(-(-mine.size // pieces), mine.dtype)
    s, m = send.size, mine.size
    for j in range(pieces):
        a, b = j * m // pieces, (j + 1) * m // pieces
        recv = incoming[:b - a]
        comm.Sendrecv(send[j * s // pieces:(j + 1) * s // pieces], dest, tag, recv, source, tag)
        op.combine(mine[a:b], recv, last)
