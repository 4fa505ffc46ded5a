"""The registry of allreduce algorithms: one module each, one function ``(comm, buf, op)``.

An algorithm reduces ``buf`` (1-D, C-contiguous, the same length and dtype on every rank of
``comm``) in place with ``op`` (a ``Reduction``), so that every rank ends with bitwise the same
result. ``comm`` is the library's own communicator (``LibraryComm``) of at least two ranks;
``buf`` is never empty. Validation happens before an algorithm is called.

=====================  ===========================================  =================================
name                   what it does                                 when it is the right choice
=====================  ===========================================  =================================
``naive``              everyone sends to rank 0, which reduces and  never; the baseline to beat
                       sends the result back to everyone
``tree``               binomial-tree reduce to rank 0, then         small messages: lg p steps
                       binomial-tree broadcast
``ring``               reduce-scatter then allgather around a       large messages: each rank sends
                       ring, p-1 steps each (on one node each step  and receives only 2(p-1)/p n
                       reads the left neighbour's buffer directly)
``recursive_doubling`` lg p steps, each swapping the whole buffer   small messages: lg p messages
                       with the partner across one rank bit and     and no broadcast phase (MPICH's
                       combining                                    short-message choice)
``rabenseifner``       reduce-scatter by recursive halving, then    large messages: the ring's
                       allgather by recursive doubling (on one      2(p-1)/p n traffic in only
                       node each step reads the partner's buffer    2 lg p messages (MPICH's
                       directly)                                    long-message choice)
``shared_memory``      every rank copies its buffer into a slot of  ranks on one node, up to 16 MiB
                       a window the node shares, raises a flag;     here: no messages, and waiting
                       once all flags are up the slots are folded   yields the core when ranks
                       (whole, or 1/p per rank, then copied out)    share cores
``two_shot``           each rank folds its own segment out of every large messages on one node: the
                       rank's copy, then every rank gets every      ring's bytes per rank, but less
                       finished segment (on one node, read from     than half its memory traffic,
                       and written into the peers' buffers          and no chain of 2(p-1) waits
                       directly, a cached piece at a time)
``hierarchical``       reduce-scatter inside each node, allreduce   ranks on several nodes, large
                       of each shard with its owners on the other   messages: each node's link
                       nodes (every local rank at once), allgather  carries 2(N-1)/N n for N nodes,
                       inside the node; on one node, what ``auto``  shared by all its ranks
                       runs there
``mpi``                MPI's own ``Allreduce``                      the oracle and the yardstick;
                                                                    ``auto`` may pick it where a
                                                                    tuning run finds it fastest
=====================  ===========================================  =================================

``recursive_doubling`` and ``rabenseifner`` fold rank counts that are not a power of two into
one that is first (``fold.py``), as MPICH does. On one node ``ring``, ``rabenseifner`` and
``two_shot`` read (and ``two_shot`` writes) their peers' memory instead of sending messages
(``direct.py``); by messages, ``ring``,
``rabenseifner`` and ``two_shot`` send large reduce-scatter steps in cache-sized pieces when every
rank has a core (``pieces.py``); across nodes ``ring`` streams its pieces, several in flight
(``pipelined.py``, which ``hierarchical`` uses between nodes too);
``recursive_doubling`` runs a small buffer's exchange loop in compiled code, calling MPI's C
``MPI_Sendrecv`` (``native.py``), and ``naive`` and ``tree`` their lists of sends and receives
(``steps.py``); ``shared_memory`` runs without a window on communicators
that span nodes, as ``recursive_doubling`` or ``rabenseifner``. ``algorithm="auto"`` picks one
of these by message size and rank count (``allreduce_kit/selection.py``).
"""
from typing import Callable, Dict

import numpy as np

from ..comm import LibraryComm
from ..reduction import Reduction

Algorithm = Callable[[LibraryComm, np.ndarray, Reduction], None]

#: name -> algorithm function; ``allreduce(..., algorithm=name)`` looks names up here.
ALGORITHMS: Dict[str, Algorithm] = {}


def registrar(table: Dict[str, Callable]) -> Callable[[str], Callable[[Callable], Callable]]:
    """A ``register(name)`` decorator that adds a function to ``table`` under ``name``: each
    collective's registry (``ALGORITHMS`` here, ``reduce_scatter/``, ``allgather/``,
    ``broadcast/``) makes its own from its table."""

    def register(name: str) -> Callable[[Callable], Callable]:
        def add(fn: Callable) -> Callable:
            table[name] = fn
            return fn

        return add

    return register


#: Decorator: add an allreduce algorithm to ``ALGORITHMS`` under ``name``.
register = registrar(ALGORITHMS)


from . import naive, tree, ring, recursive_doubling, rabenseifner, shared_memory, two_shot, mpi, hierarchical  # noqa: E402,F401  (each module registers itself)
