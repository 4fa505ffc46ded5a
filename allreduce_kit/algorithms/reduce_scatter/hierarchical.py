"""Node-aware reduce-scatter: inside each node, then across the nodes, each node's link carrying
only what the other nodes lack.

Rank ``b`` must end with block ``b`` (``blocks.shard_bounds``) reduced over every rank. On every
other node one rank stands in for ``b``: its counterpart there (``counterparts.py``; the rank
with ``b``'s local index, or on a smaller node the one that index wraps to). So

1. inside each node, each rank folds every local peer's copy of the blocks it stands in for, and
   of its own block, into its own copy (the node's reduce-scatter: read straight out of the
   peers' buffers with ``process_vm_readv`` a cached piece at a time where that works,
   ``direct.fold_from_peers``, the loop ``pairwise`` runs; else by messages, ``pairwise``'s
   exchanges);
2. across the nodes, each rank sends each block it stands in for, as its node has reduced it,
   to the block's rank, and that rank folds the other nodes' partial blocks into its own, in
   node order: a reduce-scatter of each rank's node-level blocks among its counterparts, one
   rank per node, by a pairwise exchange.

Every rank of a node sends at once, each its own share: the node's link carries, each way, the
node's partial results for the blocks of the other nodes' ranks, (N-1)/N of the buffer with N
even nodes: the least any schedule can (each node's contribution to another node's blocks must
leave it). The exchange needs no step after step: a rank sends a partial block a piece at a time
as soon as step 1 has folded that piece (blocks for other nodes first, its own block last), and
the pieces coming in are posted before step 1 starts, so the link is busy while the node folds.

Which rank ends with which block does not depend on where the ranks sit: any rank count, uneven
nodes (3 + 5: node 0's ranks stand in for node 1's local ranks 0-2 and again 3-4) and block or
round-robin placement, where the blocks a node's ranks own are not next to each other in the
buffer. A rank's block is reduced by that rank alone, the other nodes' partial results folded in
node order, so integers are exact and floats may differ from ``mpi``'s in the last bits.
``mean`` sums and divides once, at the end.

``run`` can also send the partial blocks across the link as 16-bit values (a
``compression.Wire``): each is rounded once as it leaves its node, decoded into float32 where it
arrives and folded there in float32 (compressed reduce-scatter, ``allreduce_kit/compression``);
inside the nodes everything stays float32.

On a communicator whose ranks are all on one node it runs what ``auto`` runs there. Across
nodes, one ``Allreduce`` of four integers (``hierarchical`` allreduce's agreement) makes every
rank raise the same ``ValueError`` if the ranks' buffers differ in length or dtype, before any
message is sent: started before step 1 and waited for before its first message where step 1
reads directly (which compares the node's buffers before it reads any), so that its round
trips across the nodes overlap the node's first folds; else before step 1.
"""
import numpy as np
from mpi4py import MPI

from . import ALGORITHMS, choose, register
from .. import counterparts, direct
from .. import hierarchical as allreduce_plan
from ...blocks import bounds_array

#: The collective a mismatch names.
CALLER = "reduce_scatter"
TAG = 213
#: Scratch slots of the library's communicator (``LibraryComm.scratch``) used here.
STAGING, INCOMING, PACKED = 46, 47, 48
#: With a 16-bit wire: the partial blocks as sent, and a piece that arrived, decoded.
WIRE_OUT, WIRE_IN = 49, 50
#: Pieces a partial block crosses the link in (all posted at once), at most this many bytes.
PIECE = 1 << 20


def plan_of(comm) -> allreduce_plan.Plan:
    """``comm``'s node communicator and shard owners, shared with ``hierarchical`` allreduce."""
    plan = comm.state.get(allreduce_plan.Plan)
    return plan if plan is not None else comm.attach(allreduce_plan.Plan, allreduce_plan.Plan)


@register("hierarchical")
def reduce_scatter(comm, buf, out, op):
    if comm.layout.single_node:
        ALGORITHMS[choose(comm, buf.nbytes)](comm, buf, out, op)
        return
    run(comm, buf, out, op)


def run(comm, buf, out, op, wire=None) -> None:
    """The two steps across nodes (``comm`` spans several), block r of the result into ``out`` on
    rank r. With ``wire`` (a float32 ``buf``), the partial blocks cross the link as its 16-bit values."""
    plan = plan_of(comm)
    node, cp, me = plan.node, counterparts.of(comm), comm.myrank
    bounds = bounds_array(buf.size, comm.nranks)
    base = comm.reductions[op.base]
    isz = buf.itemsize
    lo, hi = int(bounds[me]), int(bounds[me + 1])
    sources = cp.others(me)
    incoming = comm.scratch(len(sources) * (hi - lo), buf.dtype if wire is None else np.uint16, INCOMING)
    cut = counterparts.cuts(hi - lo, isz, PIECE)
    # step 1 folds into staging the blocks this rank stands in for (each sent on to its rank), then its own
    jobs = [(b, int(bounds[b]), int(bounds[b + 1])) for b in cp.stands_in_for(me)] + [(me, lo, hi)]
    staging = comm.scratch(sum(stop - start for _, start, stop in jobs), buf.dtype, STAGING)
    # what leaves for the other nodes: staging's partial blocks (its own block is last), or their 16-bit values
    outgoing = staging if wire is None else comm.scratch(staging.size - (hi - lo), np.uint16, WIRE_OUT)

    def send(start: int, stop: int, to: int) -> MPI.Request:
        """Staging's elements ``start:stop``, folded, on their way to rank ``to``."""
        if wire is not None:
            wire.encode(outgoing[start:stop], staging[start:stop])
        return comm.Isend([outgoing[start:stop], MPI.BYTE], to, TAG)
    arriving, sends = [], []
    peers = direct.peers_for(node) if node.nranks > 1 and op.code is not None else None
    agreeing = allreduce_plan._start_agreeing(comm, plan, buf) if peers is not None else None
    if agreeing is None:  # messages of different lengths must not be sent: agree first
        allreduce_plan._agreed(comm, plan, buf, allreduce_plan._start_agreeing(comm, plan, buf), CALLER, "out")

    def agreed() -> None:
        """Once the ranks agree on their buffers: post the receives of the other nodes' partial
        results of this rank's block, in node order."""
        nonlocal agreeing
        if agreeing is not None:
            allreduce_plan._agreed(comm, plan, buf, agreeing, CALLER, "out")
            agreeing = None
        if not arriving:
            arriving.extend([comm.Irecv([incoming[k * (hi - lo) + s:k * (hi - lo) + e], MPI.BYTE], source, TAG)
                             for s, e in cut] for k, source in enumerate(sources))

    if peers is not None:  # the agreement's round trips overlap the node's first folds
        state, piece, iov = peers.state, peers.piece(buf.dtype), peers.iov
        first = direct.begin(state, buf, TAG)
        if direct.wait_all(state, first) != 0:
            agreed()  # a node whose buffers differ raises here, on every rank
            raise RuntimeError(_failed(me, "a node's buffers differ after the ranks agreed on them"))
        at = 0
        for b, start, stop in jobs:
            for s, e in counterparts.cuts(stop - start, isz, PIECE):
                for u, v in counterparts.cuts(e - s, isz, piece.size * isz):  # a cached piece at a time
                    mine = staging[at + s + u:at + s + v]
                    mine[:] = buf[start + s + u:start + s + v]
                    if direct.fold_from_peers(state, mine, (start + s + u) * isz, piece, iov, op.code) != 0:
                        raise RuntimeError(_failed(me, "reading a peer's buffer failed"))
                if b != me:
                    agreed()
                    sends.append(send(at + s, at + e, b))
            at += stop - start
        agreed()  # before the wait below, which makes no MPI progress: a peer may need this rank's
        if direct.leave(state, first) != 0:  # part of the agreement to finish reading its buffer
            raise RuntimeError(_failed(me, "a peer left the call"))
    else:
        agreed()
        _fold_by_messages(node, cp, cp.node_of[me], bounds, buf, staging, base)
        at = 0
        for b, start, stop in jobs[:-1]:
            sends += [send(at + s, at + e, b) for s, e in counterparts.cuts(stop - start, isz, PIECE)]
            at += stop - start
    # step 2: the other nodes' partial results folded into this node's, in node order
    out[:] = staging[staging.size - (hi - lo):]
    for k, requests in enumerate(arriving):
        for (s, e), request in zip(cut, requests):
            request.Wait()
            piece = incoming[k * (hi - lo) + s:k * (hi - lo) + e]
            if wire is not None:
                piece = wire.decode(comm.scratch(e - s, buf.dtype, WIRE_IN), piece)
            base.combine(out[s:e], piece)
    MPI.Request.Waitall(sends)
    op.finish(out)


def _failed(rank: int, what: str) -> str:
    return f"reduce_scatter(algorithm='hierarchical'): {what} on rank {rank}; set {direct.ENV}=0 to use messages"


def _blocks_of(cp, bounds, rank: int) -> list:
    """``(start, stop)`` of what ``rank`` folds in step 1: the blocks it stands in for, then its own."""
    return [(int(bounds[b]), int(bounds[b + 1])) for b in cp.stands_in_for(rank) + [rank]]


def _fold_by_messages(node, cp, here: int, bounds, buf, staging, base) -> None:
    """Step 1 by messages, ``pairwise``'s exchanges: in step k (1 .. l-1) local rank q sends local
    rank q-k its copy of what q-k folds (packed) and folds in local rank q+k's copy of its own."""
    l, q = node.nranks, node.myrank
    ranks = cp.members[here]  # local rank -> rank: the node's communicator keeps the rank order
    _pack(buf, _blocks_of(cp, bounds, ranks[q]), staging)
    for k in range(1, l):
        to, source = (q - k) % l, (q + k) % l
        wanted = _blocks_of(cp, bounds, ranks[to])
        packed = node.scratch(sum(stop - start for start, stop in wanted), buf.dtype, PACKED)
        _pack(buf, wanted, packed)
        incoming = node.scratch(staging.size, buf.dtype, INCOMING)
        node.Sendrecv([packed, MPI.BYTE], to, TAG, [incoming, MPI.BYTE], source, TAG)
        base.combine(staging, incoming)


def _pack(buf, spans, into) -> None:
    at = 0
    for start, stop in spans:
        into[at:at + stop - start] = buf[start:stop]
        at += stop - start
