"""Hierarchical allreduce: reduce-scatter inside each node, allreduce of each shard across the
nodes, allgather inside each node. Every rank of a node drives the network at once.

The buffer is cut into S near-equal shards, S the largest number of ranks on any node. On a
node of l ranks, local rank j owns shards j, j + l, j + 2l, ... (all S shards when the nodes are
even, one each). In three steps, over communicators made once per communicator:

1. inside the node, each rank folds every local peer's copy of its shards into its own (a
   reduce-scatter on the node's fast path: read straight out of the peers' memory with
   ``process_vm_readv`` where that works, ``direct.py``; else by messages);
2. for each shard it owns, the rank allreduces the shard with the owners of the same shard on
   the other nodes, one rank per node (``ring`` for large shards, ``recursive_doubling`` for
   small ones). So each node's link carries 2(N-1)/N of the buffer each way, N nodes, as a
   flat ring over all ranks would only at best, and the l ranks of a node share that traffic
   instead of one leader carrying it all;
3. inside the node, each rank writes its finished shards into every local peer's buffer (an
   allgather; directly where step 1 read directly, else by messages).

Every element is computed in one place, the owners' allreduce of step 2, whose result is
bitwise the same on its ranks; steps 1 and 3 fold in a fixed order and copy, so every rank ends
bitwise identical. ``mean`` sums and divides once, after step 2. Uneven nodes (3 + 5 ranks,
2 + 3 + 3) work because a shard's owners are one rank per node whatever the node's size; a
smaller node's ranks own more shards. Block or round-robin placement changes only which ranks
share a node, not the schedule.

On a communicator whose ranks are all on one node there is no network to spare: the call runs
what ``auto`` runs there (``selection.py``). Across nodes, one extra ``Allreduce`` of four
integers makes every rank raise the same ``ValueError`` if the ranks' buffers differ in length or
dtype: before anything is sent where step 1 goes by messages; started before step 1 and waited
for after it where step 1 reads directly (which compares the buffers of the node before it
reads any), so that its round trips over the network overlap the node's folding instead of
adding to it.
"""
from typing import List, Optional

import numpy as np
from mpi4py import MPI
from numba import njit

from . import ALGORITHMS, direct, pipelined, register
from .segments import bounds_array
from .signature import mismatch
from ..kernels import DTYPES
from ..kernels import reduce as _loops

TAG = 108
#: Shards up to this many bytes are allreduced across the nodes with ``recursive_doubling``
#: (lg N messages), larger ones with ``ring`` (bandwidth-optimal).
SMALL_SHARD = 64 << 10


@njit(cache=True, nogil=True)
def _reduce_scatter(buf, bounds, state, piece, iov, code):
    """Step 1 by direct reads: fold every local peer's copy of this rank's shards into its own.
    Returns the call's first counter value, or ``direct.MISMATCH`` if the ranks' buffers
    differ, -1 if a read failed. Counters from ``first``: a rank has published its buffer (``first``), has folded
    its shards (``first + 1``), has written its shards into every peer (``first + 2``)."""
    rank, size = state[0], state[1]
    first = direct.begin(state, buf, TAG)
    if direct.wait_all(state, first) != 0:
        return direct.MISMATCH
    isz = buf.itemsize
    shards = bounds.size - 1
    for k in range(rank, shards, size):
        start, end = bounds[k], bounds[k + 1]
        while start < end:
            stop = min(start + piece.size, end)
            mine, theirs = buf[start:stop], piece[:stop - start]
            for j in range(1, size):
                peer = (rank + j) % size
                if direct.pull(state, peer, theirs, direct.address_of(state, peer) + start * isz, iov) != 0:
                    return -1
                _loops.combine(mine, theirs, code)
            start = stop
    direct.finish(state, first + 1)
    return first


@njit(cache=True, nogil=True)
def _allgather(buf, bounds, state, iov, first):
    """Step 3 by direct writes: this rank's finished shards into every local peer's buffer, then
    wait until every peer has done the same (so nobody still writes into this buffer). 0, or -1.

    A rank's copy of shard k is read (step 1) and written (here) by k's owner alone, which
    writes only after it has read; so no write lands on data someone still reads."""
    rank, size = state[0], state[1]
    isz = buf.itemsize
    shards = bounds.size - 1
    for k in range(rank, shards, size):
        start, end = bounds[k], bounds[k + 1]
        for j in range(1, size):
            peer = (rank + j) % size
            if direct.push(state, peer, buf[start:end], direct.address_of(state, peer) + start * isz, iov) != 0:
                return -1
    direct.finish(state, first + 2)
    for j in range(1, size):
        if direct.wait_for(state, (rank + j) % size, first + 2) != 0:
            return direct.MISMATCH
    return 0


class Plan:
    """One communicator's node-aware plan: the node's communicator, the shards this rank owns
    and, for each, the communicator of its owners on every node. Made collectively once."""

    def __init__(self, comm):
        from ..comm import LibraryComm  # the sub-communicators carry what the flat algorithms need

        layout = comm.layout
        self.single = layout.single_node
        self.node: Optional[LibraryComm] = None
        self.owners: List[Optional[LibraryComm]] = []
        self.shards = max(layout.ranks_per_node)
        if self.single:
            return
        local, size = layout.local_rank, layout.local_size
        self.node = LibraryComm(comm.Split(layout.node, comm.myrank))
        for k in range(self.shards):
            sub = comm.Split(0 if k % size == local else MPI.UNDEFINED, comm.myrank)
            self.owners.append(LibraryComm(sub) if sub != MPI.COMM_NULL else None)
        self.mine = [k for k in range(self.shards) if self.owners[k] is not None]
        self.signature = np.zeros(4, np.int64)

    def free(self) -> None:
        from ..stall import INSPECTOR

        for sub in [self.node, *self.owners]:
            if sub is None:
                continue
            for held in sub.state.values():
                if hasattr(held, "free"):
                    held.free()
            sub.state.clear()
            INSPECTOR.unwatch(sub.watch)
            sub.Free()


def _agree(comm, plan: Plan, buf: np.ndarray, caller: str = "allreduce", result: str = "buf") -> None:
    """Raise the same ``ValueError`` on every rank if the ranks' buffers differ (``caller``: the
    collective it names; ``result``: what the call leaves undefined)."""
    _agreed(comm, plan, buf, _start_agreeing(comm, plan, buf), caller, result)


def _start_agreeing(comm, plan: Plan, buf: np.ndarray) -> MPI.Request:
    """Start the ``Allreduce`` that finds out whether the ranks' buffers differ (``_agreed`` ends it)."""
    sig = plan.signature
    sig[0], sig[1] = buf.size, DTYPES.index(buf.dtype)
    sig[2], sig[3] = -sig[0], -sig[1]
    return comm.Iallreduce(MPI.IN_PLACE, sig, op=MPI.MAX)


def _agreed(comm, plan: Plan, buf: np.ndarray, request: MPI.Request, caller: str = "allreduce",
            result: str = "buf") -> None:
    """Wait for ``_start_agreeing``'s answer; the same ``ValueError`` on every rank if the buffers
    differ, naming ``caller`` (the collective: ``reduce_scatter`` and ``allgather`` agree this way too)."""
    request.Wait()
    sig = plan.signature
    if sig[0] != buf.size or sig[1] != DTYPES.index(buf.dtype) or -sig[2] != buf.size or -sig[3] != sig[1]:
        raise mismatch(comm, buf, "hierarchical", caller, result=result)


def _reduce_scatter_messages(node, buf: np.ndarray, bounds: np.ndarray, op) -> None:
    """Step 1 by messages: send each shard to its owner; fold the peers' copies of ours in rank order."""
    rank, size = node.myrank, node.nranks
    requests = [node.Isend([buf[bounds[k]:bounds[k + 1]], MPI.BYTE], k % size, TAG)
                for k in range(bounds.size - 1) if k % size != rank]
    for k in range(rank, bounds.size - 1, size):
        mine = buf[bounds[k]:bounds[k + 1]]
        incoming = node.scratch(mine.size, mine.dtype)
        for j in range(1, size):
            node.Recv([incoming, MPI.BYTE], (rank + j) % size, TAG)
            op.combine(mine, incoming)
    MPI.Request.Waitall(requests)


def _allgather_messages(node, buf: np.ndarray, bounds: np.ndarray) -> None:
    """Step 3 by messages: every shard from its owner to every other rank of the node."""
    rank, size = node.myrank, node.nranks
    requests = []
    for k in range(bounds.size - 1):
        shard = [buf[bounds[k]:bounds[k + 1]], MPI.BYTE]
        if k % size == rank:
            requests += [node.Isend(shard, (rank + j) % size, TAG + 1) for j in range(1, size)]
        else:
            requests.append(node.Irecv(shard, k % size, TAG + 1))
    MPI.Request.Waitall(requests)


@register("hierarchical")
def allreduce(comm, buf, op):
    plan = comm.state.get(Plan)
    if plan is None:
        plan = comm.attach(Plan, Plan)
    if plan.single:
        from .. import selection

        name = selection.choose_for(comm, buf.nbytes)
        ALGORITHMS["two_shot" if name == "hierarchical" else name](comm, buf, op)  # a tuning file may name it
        return
    node = plan.node
    bounds = bounds_array(buf.size, plan.shards)
    base = node.reductions[op.base]
    peers = direct.peers_for(node) if node.nranks > 1 and op.code is not None else None
    first = 0
    # 1. reduce-scatter inside the node, while the ranks agree on their buffers across the nodes
    if peers is not None:  # direct reads compare the node's buffers before touching any
        agreeing = _start_agreeing(comm, plan, buf)
        first = _reduce_scatter(buf, bounds, peers.state, peers.piece(buf.dtype), peers.iov, op.code)
        _agreed(comm, plan, buf, agreeing)  # a node whose buffers differ (first == -2) raises here
        if first < 0:
            raise RuntimeError(f"allreduce(algorithm='hierarchical'): reading a peer's buffer failed on rank "
                               f"{comm.myrank}; set {direct.ENV}=0 to use messages")
    else:  # messages of different lengths must not be sent: agree first
        _agree(comm, plan, buf)
        if node.nranks > 1:
            _reduce_scatter_messages(node, buf, bounds, base)
    # 2. allreduce of each owned shard with its owners on the other nodes
    for k in plan.mine:
        shard = buf[bounds[k]:bounds[k + 1]]
        if shard.size:
            owners = plan.owners[k]
            if shard.nbytes > SMALL_SHARD:  # the ring, streamed (the buffers agreed above)
                pipelined.stream(owners, shard, owners.reductions[op.base])
            else:
                ALGORITHMS["recursive_doubling"](owners, shard, owners.reductions[op.base])
            op.finish(shard)
    # 3. allgather inside the node
    if peers is not None:
        if _allgather(buf, bounds, peers.state, peers.iov, first) != 0:
            raise RuntimeError(f"allreduce(algorithm='hierarchical'): writing into a peer's buffer failed on rank "
                               f"{comm.myrank}; set {direct.ENV}=0 to use messages")
    elif node.nranks > 1:
        _allgather_messages(node, buf, bounds)
