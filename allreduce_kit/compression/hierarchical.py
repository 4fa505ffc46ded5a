"""Compressed hierarchical allreduce: ``hierarchical``'s three steps with 16-bit values where the
link's bytes are, between the nodes.

Over ``algorithms/hierarchical.py``'s plan (the node's communicator, the shards each rank owns and
the communicator of each shard's owners on every node), and with its steps 1 and 3 as they are:

1. inside the node, each rank folds every local peer's float32 copy of its shards into its own
   (direct reads, or messages), while the ranks agree on their buffers across the nodes;
2. each owned shard is allreduced with its owners on the other nodes by the compressed ring
   (``ring.py``): 16-bit messages, float32 folds, a mean divided by the whole rank count in the
   last fold, the owner of each piece rounding it once; every owner ends with bitwise the same
   16-bit values;
3. inside the node, each rank copies its finished shards into every local peer's buffer.

Each node's link carries 2(N-1)/N of the buffer each way at 2 bytes an element, N nodes: half of
uncompressed ``hierarchical``'s. An element is rounded to 16 bits N times (N - 1 hops and the
final rounding), never summed in 16 bits. On a communicator whose ranks are all on one node the
call is the compressed ring.

``reduce_scatter`` is ``reduce_scatter``'s own ``hierarchical`` with 16-bit values on the link:
float32 folds inside each node, each node's partial results for the other nodes' blocks sent as
16-bit values and folded in float32, in node order, by the block's rank, which rounds its block
once. Each node's link carries (N-1)/N of the buffer at 2 bytes an element; an element is
rounded at most twice (leaving its node, and at the end).
"""
import numpy as np

from ..algorithms import direct
from ..algorithms import hierarchical as plain
from ..algorithms.reduce_scatter import hierarchical as plain_reduce_scatter
from ..algorithms.segments import bounds_array
from . import ring


def allreduce(comm, buf: np.ndarray, op, wire) -> None:
    """``buf`` (float32, 1-D) reduced with ``op`` across ``comm`` (at least 2 ranks), 16-bit between nodes."""
    plan = comm.state.get(plain.Plan)
    if plan is None:
        plan = comm.attach(plain.Plan, plain.Plan)
    if plan.single:
        ring.allreduce(comm, buf, op, wire)
        return
    node = plan.node
    bounds = bounds_array(buf.size, plan.shards)
    base = node.reductions[op.base]
    peers = direct.peers_for(node) if node.nranks > 1 and op.code is not None else None
    first = 0
    # 1. reduce-scatter inside the node, in float32, while the ranks agree across the nodes
    if peers is not None:
        agreeing = plain._start_agreeing(comm, plan, buf)
        first = plain._reduce_scatter(buf, bounds, peers.state, peers.piece(buf.dtype), peers.iov, op.code)
        plain._agreed(comm, plan, buf, agreeing)
        if first < 0:
            raise RuntimeError(f"allreduce(algorithm='hierarchical', compression={wire.name!r}): reading a peer's "
                               f"buffer failed on rank {comm.myrank}; set {direct.ENV}=0 to use messages")
    else:
        plain._agree(comm, plan, buf)
        if node.nranks > 1:
            plain._reduce_scatter_messages(node, buf, bounds, base)
    # 2. compressed ring of each owned shard with its owners on the other nodes (a mean divides by
    #    the whole communicator's rank count: ``op`` is the call's own reduction)
    for k in plan.mine:
        shard = buf[bounds[k]:bounds[k + 1]]
        if shard.size:
            ring.allreduce(plan.owners[k], shard, op, wire)
    # 3. allgather inside the node
    if peers is not None:
        if plain._allgather(buf, bounds, peers.state, peers.iov, first) != 0:
            raise RuntimeError(f"allreduce(algorithm='hierarchical', compression={wire.name!r}): writing into a "
                               f"peer's buffer failed on rank {comm.myrank}; set {direct.ENV}=0 to use messages")
    elif node.nranks > 1:
        plain._allgather_messages(node, buf, bounds)


def reduce_scatter(comm, buf: np.ndarray, out: np.ndarray, op, wire) -> None:
    """Block r of ``buf`` (float32, 1-D) reduced with ``op`` across ``comm`` (at least 2 ranks) into
    ``out`` on rank r, 16-bit between nodes, the block rounded to 16 bits once."""
    if comm.layout.single_node:
        ring.reduce_scatter(comm, buf, out, op, wire)
        return
    plain_reduce_scatter.run(comm, buf, out, op, wire)
    wire.round(out)
