"""What ``auto`` runs on a communicator whose ranks span several nodes: a cost model with the
link as the resource.

N nodes, at most l ranks on a node, n bytes; α the time of one message across the network, B a
node link's bandwidth. The link is what all ranks of a node share, so what counts is the bytes
that cross each node's link, and the rounds of messages over it:

- ``recursive_doubling`` (flat, ranks in blocks): lg N of its lg P steps cross the link, and in
  each every rank of the node sends its whole buffer over it: lg N · l · n bytes per link, in
  lg P rounds;
- ``hierarchical``: the ranks of a node first fold their buffers together (memory, not the
  link), then each node sends 2(N-1)/N · n over its link in all (``ring`` between nodes), or
  lg N · n (``recursive_doubling`` between nodes, for small shards); one more round up front
  (the agreement on the buffers' length and dtype) and two waits inside the node;
- ``ring`` (flat, one rank per node): 2(N-1)/N · n per link in 2(N-1) rounds.

With one rank per node there is nothing to fold inside a node: ``recursive_doubling`` for
small buffers (fewest rounds), ``ring`` from ``LATENCY_BYTES`` up (fewest bytes). With l > 1,
``hierarchical`` saves lg N · (l - 1) · n bytes per link over the flat exchange and costs about one
round more, so it wins once lg N · (l - 1) · n > α · B: from ``LATENCY_BYTES / (lg N · (l - 1))``
bytes. ``LATENCY_BYTES`` stands for α · B, the bytes a link moves in one message's latency: about
64 KiB both on the emulated cluster (1 Gbit/s, ~0.1-0.5 ms per round on 2 cores) and on a
datacenter network (25-100 Gbit/s, a few µs). When ranks share cores (``Topology.oversubscribed``)
each of ``hierarchical``'s waits inside the node can cost a turn of the scheduler, so its fixed
cost is ``OVERSUBSCRIBED`` times larger (measured on the 2-core development machine, 2 nodes x 4
ranks at 250 Mbit/s: ``hierarchical`` overtakes the flat exchange between 64 KiB and 256 KiB, not
at the 21 KiB the plain model gives; docs/multinode.md).

Below that, with several ranks on a node, the model's choice is MPI's own ``Allreduce``: for short
messages MPICH's is node-aware itself (shared memory inside the node, one message per node across),
which a flat exchange by messages is not. Whether it is the fastest there depends on the size and
layout in ways the model has no term for: on 2 cores at 2 nodes x 4 ranks and 4 nodes x 2 ranks,
``tree`` and ``recursive_doubling`` took 0.63x-0.95x its time from 32 B to 512 B, and it was the
fastest at 8 B (docs/multinode.md). So below ``tuned_below`` (where the fixed cost of a round, not
the link's bytes, decides) online tuning times the model's choice against ``CANDIDATES`` on the
first calls of each size class and keeps the fastest (``online.py``); from there on it times
MPI's own call alone against the model's choice (``LARGE_CANDIDATES``): some MPIs' own calls are
node-aware at large sizes too, and exploring the flat exchange there would send many times the
bytes the link must carry, for seconds per call at 64 MiB. Placement (block or round-robin) does
not change the model's choice: ``hierarchical``'s traffic is the same either way, and the flat
exchange's is at best what the model assumes (docs/multinode.md).
"""
import math
from typing import Dict, Optional, Tuple

from .topology import Topology

#: α · B of the model: the bytes a node's link moves in the time of one round of messages.
LATENCY_BYTES = 64 << 10
#: How much more ``hierarchical``'s fixed cost is when ranks share cores.
OVERSUBSCRIBED = 8
#: What online tuning times besides the model's choice below ``tuned_below``: the algorithms
#: with the fewest rounds (MPI's own, node-aware for short messages; the flat exchanges by
#: messages with lg P rounds), and ``hierarchical``, which may overtake them before the model's
#: crossover (an estimate: at 2 nodes x 4 ranks on 2 cores it took 0.85x MPI's time at 64 KiB).
CANDIDATES = ("mpi", "recursive_doubling", "tree", "hierarchical")
#: What online tuning times besides the model's choice from ``tuned_below`` up: MPI's own call
#: alone, which may be node-aware there too (Open MPI 5's ``han``: at 2 nodes x 4 ranks, 16 MiB,
#: it drove the link to the full where ``hierarchical`` reached 74-84%, while at 4 x 2 it reached
#: 29-31%; docs/multinode.md). Not the flat exchanges: one tried there would carry up to l times
#: the bytes the link must, for seconds per call at 64 MiB.
LARGE_CANDIDATES = ("mpi",)


def choose(layout: Topology, nbytes: int) -> str:
    """The algorithm ``auto`` runs for ``nbytes`` bytes on a communicator laid out as ``layout``
    (several nodes)."""
    per_node = max(layout.ranks_per_node)
    if per_node == 1:
        return "ring" if nbytes >= LATENCY_BYTES else "recursive_doubling"
    return "hierarchical" if nbytes >= crossover(layout) else "mpi"


def crossover(layout: Topology) -> int:
    """The smallest message, in bytes, for which ``auto`` runs ``hierarchical`` on ``layout``."""
    per_node = max(layout.ranks_per_node)
    if per_node == 1:
        return 1 << 62
    fixed = LATENCY_BYTES * (OVERSUBSCRIBED if layout.oversubscribed else 1)
    return max(1, int(fixed / (math.log2(layout.nodes) * (per_node - 1))))


def tuned_below(layout: Topology) -> int:
    """The smallest message, in bytes, from which online tuning times only MPI's own call against
    the model's choice: where the model changes to the algorithm that moves the fewest bytes over
    the link."""
    return crossover(layout) if max(layout.ranks_per_node) > 1 else LATENCY_BYTES


def candidates(layout: Topology, nbytes: int) -> Tuple[str, ...]:
    """What online tuning times besides the model's choice for ``nbytes`` bytes on ``layout``."""
    return CANDIDATES if nbytes < tuned_below(layout) else LARGE_CANDIDATES


class NodeAware:
    """``auto`` on a communicator that spans nodes, as ``selection.Auto`` is on one node:
    the choices made so far (``choices``, read first by ``allreduce``), where they come from,
    the online tuner that refines them below ``tuned_below`` (if online tuning is on) and what
    it saved in the tuning file."""

    __slots__ = ("layout", "choices", "source", "online", "saved")

    def __init__(self, layout: Topology, saved: Optional[dict] = None):
        self.layout = layout
        self.choices: Dict[int, str] = {}
        self.online = None
        self.saved: dict = dict(saved or {})
        self.source = (f"node-aware cost model ({layout.nodes} nodes, {max(layout.ranks_per_node)} ranks per node "
                       f"at most; hierarchical from {crossover(layout)} B)" if max(layout.ranks_per_node) > 1 else
                       f"node-aware cost model ({layout.nodes} nodes, 1 rank per node; ring from {LATENCY_BYTES} B)")

    def choose(self, nbytes: int) -> str:
        return choose(self.layout, nbytes)

    def untimed(self, nbytes: int) -> bool:
        """The model's choice for ``nbytes`` stands without online tuning: never, since online
        tuning times MPI's own call against it at every size (``candidates``)."""
        return False
