"""The registry of broadcast algorithms: one module each, one function ``(comm, buf, root)``.

An algorithm copies rank ``root``'s ``buf`` (1-D, C-contiguous, the same length and dtype on
every rank of ``comm``) into every other rank's ``buf``. ``comm`` is the library's own
communicator (``LibraryComm``) of at least two ranks; ``buf`` is never empty. Validation happens
before an algorithm is called (``allreduce_kit/collectives/broadcast.py``).

======================  ==========================================  =================================
name                    what it does                                when it is the right choice
======================  ==========================================  =================================
``binomial``            a binomial tree from the root: in step k    small messages: lg p steps, the
                        every rank that has the buffer sends it to  whole buffer in each
                        the rank 2^k above it (counted from root)
``scatter_allgather``   the root sends each rank its block          large messages: the root sends
                        (``blocks.shard_bounds``), then a ring      n once in all, every rank
                        allgather of the blocks (the allgather's    receives about 2n, one
                        ``ring``)                                   neighbour per step
                                                                    (van de Geijn's)
``direct``              on one node every rank reads the root's     large messages on one node: one
                        buffer straight out of its memory but one   copy per byte, every rank's core
                        block, which the root writes into it;       copying (the root's too), no
                        elsewhere ``binomial``                      intermediate buffer
``shared_memory``       the root copies ``buf`` into its slot of    small messages on one node: no
                        the node's shared window, every other rank  messages, one copy in and one
                        copies it out; on several nodes             out per rank
                        ``binomial``
``hierarchical``        the root's counterparts, one per node,      large messages across nodes: each
                        broadcast among themselves, then each       node's link carries n once
                        inside its node (``direct``)
``mpi``                 MPI's own ``Bcast``                         the oracle and the yardstick
======================  ==========================================  =================================

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

Algorithm = Callable[[LibraryComm, np.ndarray, int], None]

#: name -> algorithm; ``broadcast(..., algorithm=name)`` looks names up here.
ALGORITHMS: Dict[str, Algorithm] = {}

#: ``auto``'s table: below this many bytes ``shared_memory`` on one node, else the binomial
#: tree; from it ``direct`` where the ranks can read each other's memory (one node), else
#: scatter-allgather. The bench (``--collective broadcast``) is the command to refine it.
SMALL = 64 << 10


#: Decorator: add an algorithm to ``ALGORITHMS`` under ``name``.
register = registrar(ALGORITHMS)


#: Online tuning's short lists on one node (``online.Spec``): ``(from bytes, candidates, calls
#: per timed turn)``, tried beside the table's choice; across nodes the table's choice runs.
#: ``shared_memory`` goes in rounds of a window slot, so it is not tried from 1 MiB.
CANDIDATES = (
    (0, ("shared_memory", "binomial"), 8),
    (16 << 10, ("shared_memory", "direct", "binomial"), 4),
    (64 << 10, ("shared_memory", "direct", "binomial"), 3),
    (1 << 20, ("direct", "scatter_allgather"), 1),
)


def choose(comm: LibraryComm, nbytes: int) -> str:
    """``auto``'s algorithm for a buffer of ``nbytes`` on ``comm`` (the same on every rank)."""
    if not comm.layout.single_node and nbytes >= multinode.crossover(comm.layout):
        return "hierarchical"  # across nodes, from where allreduce's auto runs its own hierarchical
    if nbytes < SMALL:
        return "shared_memory" if window_of(comm) is not None else "binomial"
    return "direct" if transport.peers_for(comm) is not None else "scatter_allgather"


from . import binomial, scatter_allgather, direct, shared_memory, mpi, hierarchical  # noqa: E402,F401  (each module registers itself)
