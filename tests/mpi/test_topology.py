"""Every rank of a communicator sees the same layout of ranks on nodes, and it matches MPI's own
grouping of the ranks that share memory."""
import os

import pytest
from mpi4py import MPI

from allreduce_kit import library_comm
from allreduce_kit.topology import affinity


@pytest.mark.mpi
def test_every_rank_sees_the_same_layout(any_comm):
    layout = library_comm(any_comm).layout
    views = any_comm.allgather((layout.node_of, layout.cores_per_node, layout.oversubscribed))
    assert all(v == views[0] for v in views)
    assert layout.size == any_comm.Get_size() and layout.rank == any_comm.Get_rank()


@pytest.mark.mpi
def test_the_layout_matches_mpis_shared_memory_groups(any_comm):
    layout = library_comm(any_comm).layout
    node = any_comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        members = tuple(sorted(node.allgather(any_comm.Get_rank())))
        union = set()
        for mask in node.allgather(affinity()):
            union.update(mask)
    finally:
        node.Free()
    assert layout.node_ranks == members
    assert layout.local_rank == members.index(any_comm.Get_rank())
    allocated = os.environ.get("SLURM_CPUS_ON_NODE", "")
    expected = min(len(union), int(allocated)) if allocated.isdigit() else len(union)
    assert layout.cores_per_node[layout.node] == expected
    machine = layout.machine_of[layout.node]
    here = sum(1 for n in layout.node_of if layout.machine_of[n] == machine)
    assert layout.ranks_per_machine[machine] >= here  # the job's ranks on the machine, at least this comm's
    assert layout.oversubscribed == (any(r > c for r, c in zip(layout.ranks_per_node, layout.cores_per_node))
                                     or any(r > c for r, c in zip(layout.ranks_per_machine, layout.cores_per_machine)))


@pytest.mark.mpi
def test_a_communicator_of_one_rank_counts_the_jobs_ranks_on_its_machine():
    world = library_comm().layout
    alone = MPI.COMM_WORLD.Split(MPI.COMM_WORLD.Get_rank(), 0)
    try:
        layout = library_comm(alone).layout
        on_machine = world.ranks_per_machine[world.machine_of[world.node]]
        assert layout.ranks_per_machine == (on_machine,)
        assert layout.oversubscribed == (on_machine > layout.cores_per_machine[0])
        assert layout.threads({}) == max(1, min(layout.cores_per_node[0], layout.cores_per_machine[0] // on_machine))
    finally:
        alone.Free()
