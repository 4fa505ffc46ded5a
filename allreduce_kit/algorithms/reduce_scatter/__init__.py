"""The registry of reduce-scatter algorithms: one module each, one function ``(comm, buf, out, op)``.

An algorithm reduces ``buf`` (1-D, C-contiguous, the same length ``n`` and dtype on every rank
of ``comm``) with ``op`` (a ``Reduction``) and leaves block ``r`` of the result
(``blocks.shard_bounds(n, p)``) in ``out`` on rank ``r``. ``buf`` is only read; ``out`` does not
overlap it. ``comm`` is the library's own communicator (``LibraryComm``) of at least two ranks;
``n`` is never 0. Validation happens before an algorithm is called
(``allreduce_kit/collectives/reduce_scatter.py``).

=====================  ===========================================  =================================
name                   what it does                                 when it is the right choice
=====================  ===========================================  =================================
``ring``               p-1 steps around the ring: each rank sends   large messages: each rank sends
                       its running sum of one block to the right    and receives (p-1)/p n, one
                       and folds in its own copy of the block that  neighbour per step
                       arrives from the left; rank r finishes
                       block r in the last step
``recursive_halving``  lg p steps, each swapping half of what is    small and mid-sized messages:
                       left with the partner across one rank bit    lg p messages, the same
                       and keeping the half that holds one's own    (p-1)/p n bytes (MPICH's choice
                       block (rank counts that are not a power of   for commutative ops)
                       two folded first, ``fold.py``)
``pairwise``           rank r folds every rank's copy of block r    large messages on one node: each
                       into its own; on one node read straight out  rank reads (p-1)/p n once, one
                       of the peers' buffers a cached piece at a    wait at the start, one at the
                       time (``two_shot``'s first shot), else p-1   end, no partial sums passed on
                       exchanges of messages
``shared_memory``      every rank copies ``buf`` into its slot of   small messages on one node: no
                       the node's shared window (``allreduce``'s    messages, one copy in and one
                       ``shared_memory``), then folds its block     fold per rank, the same folds as
                       out of every slot, in rank order; on         ``allreduce``'s
                       several nodes ``recursive_halving``          ``shared_memory``
``hierarchical``       across nodes: each rank folds its node's     large messages across nodes: each
                       copies of its block and of those it          node's link carries (N-1)/N n
                       stands in for (``counterparts.py``), then    each way, all its ranks at once
                       sends each on to its rank, which folds
                       in the other nodes' partial results
``mpi``                MPI's own ``Reduce_scatter_block`` (blocks   the oracle and the yardstick
                       of one length) or ``Reduce_scatter``
=====================  ===========================================  =================================

``algorithm="auto"`` picks one by the buffer's size and the rank count (``choose``), and
``hierarchical`` across nodes where ``allreduce``'s ``auto`` runs its own (``multinode.crossover``).
"""
from typing import Callable, Dict

import numpy as np

from .. import direct as transport
from ..shared_memory import window_of
from .. import registrar
from ...comm import LibraryComm
from ... import multinode
from ...reduction import Reduction

Algorithm = Callable[[LibraryComm, np.ndarray, np.ndarray, Reduction], None]

#: name -> algorithm; ``reduce_scatter(..., algorithm=name)`` looks names up here.
ALGORITHMS: Dict[str, Algorithm] = {}

#: ``auto``'s table: below this many bytes of ``buf`` ``shared_memory`` on one
#: node, else recursive halving; from it ``pairwise`` where
#: the ranks can read each other's memory (one node), else the ring. A first table: the bench
#: (``--collective reduce_scatter``) is the command to refine it.
SMALL = 64 << 10


#: allreduce algorithm -> the reduce-scatter algorithm that folds every block the way it does, so
#: that block r of ``reduce_scatter(buf, op=op, algorithm=SAME_FOLDS[name])`` is bitwise block r of
#: ``allreduce(buf, op=op, algorithm=name)`` at every rank count (floating-point sums and products
#: depend on the order of folding; swapping two operands of one fold does not change them):
#: ``ring`` and ``two_shot`` fold block r starting from rank r's copy, then r+1, r+2, ... (mod p), as
#: ``pairwise`` does; ``rabenseifner`` and ``recursive_doubling`` fold pairs across one rank bit at
#: a time after the same folding of rank counts that are not a power of two, as
#: ``recursive_halving`` does; ``shared_memory`` folds every element in rank order, 0, 1, ...,
#: p-1, as allreduce's ``shared_memory`` does. The other allreduce algorithms (and MPI's own of either) fold in
#: orders none of these does: their results agree to rounding only. A sharded optimizer that must
#: update what the unsharded one would (``python -m allreduce_kit.train --zero``) takes its
#: reduce-scatter from here.
SAME_FOLDS: Dict[str, str] = {"ring": "pairwise", "two_shot": "pairwise",
                              "rabenseifner": "recursive_halving", "recursive_doubling": "recursive_halving",
                              "shared_memory": "shared_memory"}

#: Decorator: add an algorithm to ``ALGORITHMS`` under ``name``.
register = registrar(ALGORITHMS)


#: Online tuning's short lists on one node (``online.Spec``): ``(from bytes, candidates, calls
#: per timed turn)``, tried beside the table's choice; across nodes the table's choice runs.
#: ``shared_memory`` goes in rounds of a window slot, so it is not tried from 1 MiB.
CANDIDATES = (
    (0, ("shared_memory", "recursive_halving"), 8),
    (16 << 10, ("shared_memory", "pairwise", "recursive_halving"), 4),
    (64 << 10, ("shared_memory", "pairwise", "recursive_halving"), 3),
    (1 << 20, ("pairwise", "ring"), 1),
)


def choose(comm: LibraryComm, nbytes: int) -> str:
    """``auto``'s algorithm for a buffer of ``nbytes`` on ``comm`` (the same on every rank)."""
    if not comm.layout.single_node and nbytes >= multinode.crossover(comm.layout):
        return "hierarchical"  # across nodes, from where allreduce's auto runs its own hierarchical
    if nbytes < SMALL:
        return "shared_memory" if window_of(comm) is not None else "recursive_halving"
    return "pairwise" if transport.peers_for(comm) is not None else "ring"


from . import ring, recursive_halving, pairwise, shared_memory, mpi, hierarchical  # noqa: E402,F401  (each module registers itself)
