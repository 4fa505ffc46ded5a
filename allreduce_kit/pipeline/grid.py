"""P = S x D ranks as a grid: S pipeline stages times D data-parallel replicas.

Every rank is one stage position of one replica. Two placements of the grid on the ranks:

- ``stage-major``: rank = stage x D + replica. A stage's replicas are neighbours in rank order
  (so, with ranks filled node by node, on one node): the gradient allreduce stays inside a node,
  the activations cross between nodes.
- ``replica-major``: rank = replica x S + stage. A replica's stages are neighbours: the
  activations stay inside a node, the gradient allreduce crosses.

``choose_placement`` (``--placement auto``) takes the placement that sends fewer bytes between
nodes (the nodes from ``topology.py``): a stage's gradient allreduce sends about 2 (D-1)/D of the
stage's gradient bytes per step, a stage boundary two activations of the local batch (forward and
backward). On one node it keeps the heavier traffic between neighbouring ranks.
"""
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

__all__ = ["Grid", "PLACEMENTS", "choose_placement", "cross_node_bytes"]

#: The ``--placement`` choices ("auto": ``choose_placement``).
PLACEMENTS = ("auto", "stage-major", "replica-major")


@dataclass(frozen=True)
class Grid:
    """``stages`` x ``replicas`` ranks placed ``stage-major`` or ``replica-major``."""
    stages: int
    replicas: int
    placement: str = "stage-major"

    def __post_init__(self) -> None:
        if self.stages < 1 or self.replicas < 1:
            raise ValueError(f"a grid needs stages >= 1 and replicas >= 1, got {self.stages} x {self.replicas}")
        if self.placement not in PLACEMENTS[1:]:
            raise ValueError(f"placement must be 'stage-major' or 'replica-major', got {self.placement!r}")

    @property
    def size(self) -> int:
        return self.stages * self.replicas

    def rank(self, stage: int, replica: int) -> int:
        """The rank at (``stage``, ``replica``)."""
        if self.placement == "stage-major":
            return stage * self.replicas + replica
        return replica * self.stages + stage

    def position(self, rank: int) -> Tuple[int, int]:
        """(stage, replica) of ``rank``."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is not in a grid of {self.size} ranks")
        if self.placement == "stage-major":
            return divmod(rank, self.replicas)
        replica, stage = divmod(rank, self.stages)
        return stage, replica

    def pipeline(self, replica: int) -> List[int]:
        """The ranks of ``replica``'s stages, stage 0 first."""
        return [self.rank(s, replica) for s in range(self.stages)]

    def replicas_of(self, stage: int) -> List[int]:
        """The ranks holding ``stage``, replica 0 first."""
        return [self.rank(stage, d) for d in range(self.replicas)]


def cross_node_bytes(grid: Grid, node_of: Sequence[int], gradient_bytes: float, activation_bytes: float) -> float:
    """Bytes per step that cross between nodes on ``grid``: each stage's allreduce whose replicas
    are on more than one node (``2 (D-1)/D x gradient_bytes``) and each boundary whose two stages
    are on different nodes (``2 x activation_bytes``, forward and backward), per replica."""
    total = 0.0
    D = grid.replicas
    for s in range(grid.stages):
        if len({node_of[r] for r in grid.replicas_of(s)}) > 1:
            total += 2.0 * gradient_bytes * (D - 1) / D
    for d in range(grid.replicas):
        ranks = grid.pipeline(d)
        total += sum(2.0 * activation_bytes for a, b in zip(ranks[:-1], ranks[1:]) if node_of[a] != node_of[b])
    return total


def choose_placement(stages: int, replicas: int, gradient_bytes: float, activation_bytes: float,
                     node_of: Optional[Sequence[int]] = None) -> str:
    """The placement that sends fewer bytes between nodes, given each rank's node ``node_of``
    (``topology.Topology.node_of``); where both send as many (one node, or no ``node_of``):
    ``stage-major`` if a stage's gradient allreduce sends more per step than its boundary's
    activations and their gradients (so the replicas of a stage are neighbours), else ``replica-major``.

    ``gradient_bytes``: the largest stage's gradient; ``activation_bytes``: the largest boundary's
    activations of one local batch."""
    if node_of is not None and len(set(node_of)) > 1:
        cost = {p: cross_node_bytes(Grid(stages, replicas, p), node_of, gradient_bytes, activation_bytes)
                for p in PLACEMENTS[1:]}
        if cost["stage-major"] != cost["replica-major"]:
            return min(cost, key=cost.get)
    if replicas == 1:
        return "replica-major"      # no allreduce: a pipeline's ranks next to each other
    if stages == 1:
        return "stage-major"
    allreduce = 2.0 * gradient_bytes * (replicas - 1) / replicas
    return "stage-major" if allreduce > 2.0 * activation_bytes else "replica-major"
