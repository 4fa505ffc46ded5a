"""What ``algorithm="auto"`` runs: a choice from message size and rank count.

The same inputs give the same choice on every rank, which keeps the ranks in step.
"""

#: Messages of at least this many bytes go around the ring; smaller ones up the tree.
RING_MIN_BYTES = 64 * 1024


def choose(nbytes: int, size: int) -> str:
    """The algorithm ``auto`` uses for a message of ``nbytes`` bytes on ``size`` ranks."""
    return "ring" if nbytes >= RING_MIN_BYTES else "tree"
