"""The registry of allgather algorithms: one module each, one function ``(comm, out, bounds)``.

On entry rank ``r``'s own block is in place in ``out[bounds[r]:bounds[r + 1]]``; an algorithm
fills in every other rank's block, so that every rank ends with the same ``out``. ``bounds``
(p + 1 offsets, the same on every rank) is ``blocks.shard_bounds(out.size, p)`` in the common
case, or any other blocks in rank order (``Allgatherv``'s case). ``comm`` is the library's own
communicator (``LibraryComm``) of at least two ranks; ``out`` is never empty. Validation happens
before an algorithm is called (``allreduce_kit/collectives/allgather.py``).

=======================  =========================================  =================================
name                     what it does                               when it is the right choice
=======================  =========================================  =================================
``ring``                 p-1 steps around the ring: each rank       large messages: each rank sends
                         passes on the block it received last       and receives (p-1)/p n, one
                         step (its own first)                       neighbour per step
``recursive_doubling``   lg p steps, each swapping everything one   small and mid-sized messages:
                         holds with the partner across one rank     lg p messages (rank counts that
                         bit, so the blocks held double each step   are not a power of two fold
                                                                    first, ``fold.py``: one more
                                                                    message, and n more bytes)
``pairwise``             each rank gives its block to every other   large messages on one node: one
                         rank; on one node written straight into    copy per peer, no intermediate
                         the peers' ``out`` (``two_shot``'s second  buffer, one wait at the start and
                         shot), else p-1 exchanges of messages      one at the end
``shared_memory``        every rank copies its block into its slot  small messages on one node: no
                         of the node's shared window, then every    messages, one copy in and p-1
                         other rank's out of theirs; on several     out per rank
                         nodes ``recursive_doubling``
``hierarchical``         across nodes first: each rank's block to   large messages across nodes: each
                         its counterpart on every other node, then  node's link carries (N-1)/N n
                         each rank writes its own and those it      each way, all its ranks at once
                         received into its node's ranks
``mpi``                  MPI's own ``Allgather`` (blocks of one     the oracle and the yardstick
                         length) or ``Allgatherv``
=======================  =========================================  =================================

``algorithm="auto"`` picks one by the buffer's size and the rank count (``choose``), and
``hierarchical`` across nodes where ``allreduce``'s ``auto`` runs its own (``multinode.crossover``).
"""
from typing import Callable, Dict, Sequence

import numpy as np

from .. import direct as transport
from ..shared_memory import window_of
from .. import registrar
from ...comm import LibraryComm
from ... import multinode

Algorithm = Callable[[LibraryComm, np.ndarray, Sequence[int]], None]

#: name -> algorithm; ``allgather(..., algorithm=name)`` looks names up here.
ALGORITHMS: Dict[str, Algorithm] = {}

#: ``auto``'s table: below this many bytes of ``out`` ``shared_memory`` on one
#: node, else recursive doubling; from it ``pairwise``
#: where the ranks can write into each other's memory (one node), else the ring. A first table:
#: the bench (``--collective allgather``) is the command to refine it.
SMALL = 64 << 10


#: Decorator: add an algorithm to ``ALGORITHMS`` under ``name``.
register = registrar(ALGORITHMS)


#: Online tuning's short lists on one node (``online.Spec``): ``(from bytes, candidates, calls
#: per timed turn)``, tried beside the table's choice; across nodes the table's choice runs.
#: ``shared_memory`` goes in rounds of a window slot, so it is not tried from 1 MiB.
CANDIDATES = (
    (0, ("shared_memory", "recursive_doubling"), 8),
    (16 << 10, ("shared_memory", "pairwise", "recursive_doubling"), 4),
    (64 << 10, ("shared_memory", "pairwise", "recursive_doubling"), 3),
    (1 << 20, ("pairwise", "ring"), 1),
)


def choose(comm: LibraryComm, nbytes: int) -> str:
    """``auto``'s algorithm for an ``out`` of ``nbytes`` on ``comm`` (the same on every rank)."""
    if not comm.layout.single_node and nbytes >= multinode.crossover(comm.layout):
        return "hierarchical"  # across nodes, from where allreduce's auto runs its own hierarchical
    if nbytes < SMALL:
        return "shared_memory" if window_of(comm) is not None else "recursive_doubling"
    return "pairwise" if transport.peers_for(comm) is not None else "ring"


from . import ring, recursive_doubling, pairwise, shared_memory, mpi, hierarchical  # noqa: E402,F401  (each module registers itself)
