"""Node-aware broadcast: from the root to one rank per node across the nodes, then inside each
node.

1. across the nodes, among the root's counterparts (``counterparts.py``: on each node the rank
   with the root's local index, or the one it wraps to on a smaller node; the shard owners'
   communicator of ``hierarchical`` allreduce that holds the root): the binomial tree between two
   nodes or for small messages (one message per link), else ``scatter_allgather`` (the root's
   link carries the buffer once, not once per node);
2. inside each node, from that rank: ``direct`` (every local rank reads the buffer straight out
   of its memory) where the node's ranks can read each other's, else what ``auto`` runs on the
   node.

Each node's link carries the buffer once, the least a broadcast can. On a communicator whose
ranks are all on one node it runs what ``auto`` runs there. Across nodes, one ``Allreduce`` of
four integers first makes every rank raise the same ``ValueError`` if the ranks' buffers differ
in length or dtype (``hierarchical`` allreduce's agreement).
"""
from . import ALGORITHMS, SMALL, choose, register
from .. import counterparts, direct
from .. import hierarchical as allreduce_plan
from ..reduce_scatter.hierarchical import plan_of


@register("hierarchical")
def broadcast(comm, buf, root):
    if comm.layout.single_node:
        ALGORITHMS[choose(comm, buf.nbytes)](comm, buf, root)
        return
    plan = plan_of(comm)
    allreduce_plan._agree(comm, plan, buf)
    cp, me = counterparts.of(comm), comm.myrank
    leaders = sorted(cp.on(root, node) for node in range(cp.nodes))
    if me in leaders:  # 1. across the nodes; the owners of shard local(root) are these ranks, in rank order
        across = plan.owners[cp.local_of[root]]
        name = "binomial" if across.nranks == 2 or buf.nbytes < SMALL else "scatter_allgather"
        ALGORITHMS[name](across, buf, leaders.index(root))
    node = plan.node
    if node.nranks > 1:  # 2. inside the node, from the root's counterpart here
        here = cp.node_of[me]
        local_root = cp.local_of[cp.on(root, here)]
        name = "direct" if direct.peers_for(node) is not None else choose(node, buf.nbytes)
        ALGORITHMS[name](node, buf, local_root)
