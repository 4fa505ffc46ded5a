"""Run on the emulated cluster (``test_cluster.py``): every node is a separate host.

Each rank checks, and rank 0 reports ``isolated: N nodes`` only if all of it held everywhere:

- the library's topology sees as many nodes as the launcher used, each with its own host name;
- a direct read (``process_vm_readv``, the single-copy path) of a rank on another node fails,
  while one of a rank on the same node succeeds (so the check itself works);
- a file in one node's ``/dev/shm`` is not seen on another node;
- the node-local paths are not taken across nodes: no single-copy peers and no shared window on
  the world's communicator, while a node's own communicator has both;
- yet the nodes are one machine: the topology counts every rank of the job against the
  machine's cores, also on a node's own communicator, so ranks that share the cores know it.
"""
import ctypes
import os
import sys

import numpy as np
from mpi4py import MPI

from allreduce_kit import allreduce, library_comm
from allreduce_kit.algorithms import direct, shared_memory

NODES = int(sys.argv[1])
world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
lib = library_comm()
layout = lib.layout
problems = []

if layout.nodes != NODES:
    problems.append(f"topology sees {layout.nodes} nodes, the launch used {NODES}")
if len(set(layout.hosts)) != layout.nodes:
    problems.append(f"node host names are not distinct: {layout.hosts}")

# process_vm_readv of every other rank's token
libc = ctypes.CDLL(None, use_errno=True)


class IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


token = np.array([1000 + rank], np.int64)
seen = world.allgather((os.getpid(), token.ctypes.data, layout.node))
for peer, (pid, address, node) in enumerate(seen):
    if peer == rank:
        continue
    got = np.zeros(1, np.int64)
    local, remote = IoVec(got.ctypes.data, 8), IoVec(address, 8)
    read = libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    same_node = node == layout.node
    if same_node and (read != 8 or got[0] != 1000 + peer):
        problems.append(f"rank {rank} cannot read rank {peer} on its own node (errno {ctypes.get_errno()})")
    if not same_node and read == 8 and got[0] == 1000 + peer:
        problems.append(f"rank {rank} read rank {peer}'s memory across nodes")
world.Barrier()

# /dev/shm is the node's own
marker = f"/dev/shm/allreduce_kit-isolation-{rank}"
if layout.local_rank == 0:
    with open(marker, "w") as out:
        out.write(str(layout.node))
world.Barrier()
for peer, (_, _, node) in enumerate(seen):
    path = f"/dev/shm/allreduce_kit-isolation-{peer}"
    if os.path.exists(path) and node != layout.node:
        problems.append(f"rank {rank} sees node {node}'s /dev/shm")
world.Barrier()
if layout.local_rank == 0:
    os.unlink(marker)

# node-local paths: not across nodes, but within a node
for name in ("ring", "two_shot", "shared_memory"):
    x = np.full(1 << 16, rank + 1.0)
    allreduce(x, algorithm=name)
    if not np.all(x == size * (size + 1) / 2):
        problems.append(f"{name} gave a wrong sum")
if direct.peers_for(lib) is not None:
    problems.append("direct reads are set up across nodes")
if lib.state.get(shared_memory.Window) is not None:
    problems.append("a shared window is set up across nodes")
node_comm = world.Split(layout.node, rank)
node_lib = library_comm(node_comm)
if node_lib.nranks > 1:
    if direct.peers_for(node_lib) is None:
        problems.append("direct reads do not work inside a node (the check cannot tell isolation from failure)")
    allreduce(np.ones(8), algorithm="shared_memory", comm=node_comm)
    if node_lib.state.get(shared_memory.Window) is None:
        problems.append("no shared window inside a node")

# one machine: every node's ranks counted together against its cores
cores = len(os.sched_getaffinity(0))
if layout.machine_of != (0,) * layout.nodes or layout.ranks_per_machine != (size,):
    problems.append(f"the nodes are not seen as one machine of {size} ranks: {layout}")
if node_lib.layout.ranks_per_machine != (size,) or node_lib.oversubscribed != (size > cores):
    problems.append(f"a node's communicator does not count the job's {size} ranks on {cores} cores: {node_lib.layout}")

problems = [p for ps in world.allgather(problems) for p in ps]
if rank == 0:
    print("\n".join(problems) if problems else f"isolated: {layout.nodes} nodes {layout.hosts}", flush=True)
node_comm.Free()
