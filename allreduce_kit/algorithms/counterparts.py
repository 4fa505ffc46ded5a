"""Counterparts across nodes: which rank of each node stands in for a rank of another node, for
the node-aware ``reduce_scatter``, ``allgather`` and ``broadcast`` (``hierarchical`` in their
registries).

Node ``i``'s ranks in rank order are ``R_i`` (``Topology``, nodes numbered by their lowest rank),
``l_i`` of them; a rank's local index is its place in its node's ``R``. The counterpart of rank
``b`` on node ``i`` is ``R_i[local(b) mod l_i]``: on a node as large as ``b``'s, the rank with
``b``'s local index; on a smaller node one rank stands in for several (3 + 5 ranks: node 0's
local rank 0 for node 1's local ranks 0 and 3). Every rank computes the same map from the
layout alone, whatever the placement (block, round-robin, uneven), so both ends of a message
know it without asking.

The counterparts of a rank's block carry it across the nodes, one rank per node, and every rank
of a node is the counterpart of some ranks of every other node: all ranks of a node use its
link at once, each for its own share, as ``hierarchical`` allreduce's shard owners do.
"""
from typing import List, Sequence, Tuple

from ..topology import Topology


class Counterparts:
    """The counterpart map of one communicator's layout (the same on every rank)."""

    def __init__(self, layout: Topology):
        self.node_of: Tuple[int, ...] = layout.node_of
        self.nodes = layout.nodes
        members: List[List[int]] = [[] for _ in range(layout.nodes)]
        local: List[int] = []
        for rank, node in enumerate(layout.node_of):
            local.append(len(members[node]))
            members[node].append(rank)
        #: ``members[i]``: node i's ranks in rank order.
        self.members: Tuple[Tuple[int, ...], ...] = tuple(tuple(m) for m in members)
        #: ``local_of[r]``: rank r's index among its node's ranks.
        self.local_of: Tuple[int, ...] = tuple(local)

    def on(self, rank: int, node: int) -> int:
        """Rank ``rank``'s counterpart on ``node`` (``rank`` itself on its own node)."""
        ranks = self.members[node]
        return ranks[self.local_of[rank] % len(ranks)]

    def others(self, rank: int) -> List[int]:
        """``rank``'s counterparts on the other nodes, in node order."""
        return [self.on(rank, node) for node in range(self.nodes) if node != self.node_of[rank]]

    def stands_in_for(self, rank: int) -> List[int]:
        """The ranks of other nodes whose counterpart on ``rank``'s node is ``rank``, in rank order."""
        here = self.node_of[rank]
        return [b for b in range(len(self.node_of)) if self.node_of[b] != here and self.on(b, here) == rank]


def of(comm) -> Counterparts:
    """``comm``'s map, made once per communicator (no communication)."""
    found = comm.state.get(Counterparts)
    return found if found is not None else comm.attach(Counterparts, lambda c: Counterparts(c.layout))


def cuts(n: int, itemsize: int, piece_bytes: int) -> List[Tuple[int, int]]:
    """``n`` elements cut into near-equal pieces of at most ``piece_bytes``, as ``(start, stop)``
    (none if ``n`` is 0): the same cut on both ends of a message, from the length alone."""
    if n == 0:
        return []
    m = max(1, -(-n * itemsize // piece_bytes))
    return [((k * n) // m, ((k + 1) * n) // m) for k in range(m)]


def spans(bounds: Sequence[int], ranks: Sequence[int]) -> List[Tuple[int, int]]:
    """``(start, stop)`` of each of ``ranks``' blocks."""
    return [(bounds[r], bounds[r + 1]) for r in ranks]
