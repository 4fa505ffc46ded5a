"""Node-aware allgather: across the nodes first, then inside each node; ``reduce_scatter``'s
``hierarchical`` the other way round.

On every other node one rank stands in for rank ``b``: its counterpart there
(``counterparts.py``). So

1. across the nodes, each rank sends its block to its counterpart on every other node, and
   receives the blocks of the ranks it stands in for, straight into ``out``: an allgather of
   each rank's block among its counterparts, one rank per node, by a pairwise exchange;
2. inside each node, each rank gives every local peer its own block and the blocks it received
   (the node's allgather: written straight into the peers' ``out`` with ``process_vm_writev``
   where that works, ``direct.push_to_peers``, the loop ``pairwise`` runs; else by messages).

Every rank of a node receives at once, each its own share: the node's link carries, each way,
the blocks of the other nodes' ranks, (N-1)/N of ``out`` with N even nodes, the least any
schedule can. The pieces of step 1 are all posted at once, and with direct writes a piece goes
on to the local peers as soon as it has arrived, while the next ones cross the link.

Any blocks in rank order (``Allgatherv``'s case, ``bounds``), any rank count, uneven nodes and
block or round-robin placement: which rank stands in for which is the same map on every rank.
On a communicator whose ranks are all on one node it runs what ``auto`` runs there. Across
nodes, one ``Allreduce`` of four integers (``hierarchical`` allreduce's agreement) makes every
rank raise the same ``ValueError`` if the ranks' ``out`` differ in length or dtype, before any
message is sent.
"""
from mpi4py import MPI

from . import ALGORITHMS, choose, register
from .. import counterparts, direct
from .. import hierarchical as allreduce_plan
from ..reduce_scatter.hierarchical import plan_of

TAG = 214
#: Pieces a block crosses the link in (all posted at once), at most this many bytes.
PIECE = 1 << 20


@register("hierarchical")
def allgather(comm, out, bounds):
    if comm.layout.single_node:
        ALGORITHMS[choose(comm, out.nbytes)](comm, out, bounds)
        return
    plan = plan_of(comm)
    node, cp, me = plan.node, counterparts.of(comm), comm.myrank
    isz = out.itemsize
    peers = direct.peers_for(node) if node.nranks > 1 else None
    allreduce_plan._agree(comm, plan, out, "allgather", "out")
    # step 1: the blocks this rank stands in for, from their ranks; its own block to its counterparts
    arriving = []
    for b in cp.stands_in_for(me):
        lo = bounds[b]
        arriving += [(lo + s, lo + e, comm.Irecv([out[lo + s:lo + e], MPI.BYTE], b, TAG))
                     for s, e in counterparts.cuts(bounds[b + 1] - lo, isz, PIECE)]
    lo, hi = bounds[me], bounds[me + 1]
    cut = counterparts.cuts(hi - lo, isz, PIECE)
    sends = [comm.Isend([out[lo + s:lo + e], MPI.BYTE], to, TAG) for to in cp.others(me) for s, e in cut]
    if peers is not None:  # while the first pieces cross the link, the node's ranks wait for each other
        state, iov = peers.state, peers.iov
        first = direct.begin(state, out, TAG)
        if direct.wait_all(state, first) != 0:
            raise RuntimeError(_failed(me, "a node's buffers differ after the ranks agreed on them"))
        # step 2: inside the node, each piece as soon as it is here
        for start, stop, request in [(lo + s, lo + e, None) for s, e in cut] + arriving:
            if request is not None:
                request.Wait()
            if direct.push_to_peers(state, out[start:stop], start * isz, iov) != 0:
                raise RuntimeError(_failed(me, "writing into a peer's buffer failed"))
        # this rank's sends finish before the wait below, which makes no MPI progress: a peer
        # there may wait for what this rank sends to another node
        MPI.Request.Waitall(sends)
        if direct.leave(state, first) != 0:
            raise RuntimeError(_failed(me, "a peer left the call"))
    else:
        MPI.Request.Waitall([request for _, _, request in arriving])
        if node.nranks > 1:
            _share_by_messages(node, cp, cp.node_of[me], out, bounds)
        MPI.Request.Waitall(sends)


def _failed(rank: int, what: str) -> str:
    return f"allgather(algorithm='hierarchical'): {what} on rank {rank}; set {direct.ENV}=0 to use messages"


def _share_by_messages(node, cp, here: int, out, bounds) -> None:
    """Step 2 by messages: each rank's own block and the blocks it stands in for, to every local peer."""
    l, q = node.nranks, node.myrank
    ranks = cp.members[here]  # local rank -> rank: the node's communicator keeps the rank order
    requests = []
    for local, rank in enumerate(ranks):
        for b in [rank] + cp.stands_in_for(rank):
            block = [out[bounds[b]:bounds[b + 1]], MPI.BYTE]
            if local == q:
                requests += [node.Isend(block, (q + k) % l, TAG) for k in range(1, l)]
            else:
                requests.append(node.Irecv(block, local, TAG))
    MPI.Request.Waitall(requests)
