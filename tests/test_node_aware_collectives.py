"""The node-aware ``hierarchical`` of ``reduce_scatter``, ``allgather`` and ``broadcast``: who stands in
for whom across nodes, when ``auto`` runs it, and the bench's "link %" for each collective. Pure
functions, no MPI (``test_cluster_collectives.py`` runs them across real, isolated nodes).
"""
from types import SimpleNamespace

import pytest

from allreduce_kit import multinode
from allreduce_kit.algorithms import allgather, broadcast, direct, reduce_scatter, shared_memory
from allreduce_kit.algorithms.counterparts import Counterparts, cuts
from allreduce_kit.bench import network
from test_multinode import layout

SHAPES = [((4, 4), "block"), ((4, 4), "round-robin"), ((3, 5), "block"), ((2, 2, 1), "round-robin"),
          ((1, 2, 2), "block"), ((2, 3, 3), "round-robin"), ((1, 1), "block")]


@pytest.mark.parametrize("shape, placement", SHAPES)
def test_every_rank_has_one_counterpart_on_every_node(shape, placement):
    top = layout(*shape, placement=placement)
    cp = Counterparts(top)
    for b in range(top.size):
        assert cp.on(b, top.node_of[b]) == b
        assert [top.node_of[r] for r in cp.others(b)] == [n for n in range(top.nodes) if n != top.node_of[b]]
    for r in range(top.size):  # what r stands in for is exactly the ranks whose counterpart on r's node is r
        assert cp.stands_in_for(r) == [b for b in range(top.size)
                                       if top.node_of[b] != top.node_of[r] and cp.on(b, top.node_of[r]) == r]
    # every rank of another node is stood in for by exactly one rank of each node
    for node in range(top.nodes):
        here = [b for r in cp.members[node] for b in cp.stands_in_for(r)]
        assert sorted(here) == [b for b in range(top.size) if top.node_of[b] != node]


def test_a_smaller_node_shares_the_standing_in_out():
    cp = Counterparts(layout(3, 5))  # ranks 0-2 on node 0, 3-7 on node 1
    assert [cp.stands_in_for(r) for r in range(3)] == [[3, 6], [4, 7], [5]]
    assert [cp.stands_in_for(r) for r in range(3, 8)] == [[0], [1], [2], [], []]
    assert cp.others(6) == [0]


def test_pieces_are_cut_alike_from_the_length_alone():
    assert cuts(0, 4, 1 << 20) == []
    assert cuts(10, 4, 1 << 20) == [(0, 10)]
    pieces = cuts((3 << 20) // 4 + 7, 4, 1 << 20)
    assert len(pieces) == 4 and pieces[0][0] == 0 and pieces[-1][1] == (3 << 20) // 4 + 7
    assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
    assert max(e - s for s, e in pieces) * 4 <= 1 << 20


#: A communicator's state where neither direct reads nor a shared window can be made: messages only.
MESSAGES_ONLY = {direct.Peers: None, shared_memory.Window: None}


@pytest.mark.parametrize("registry", [reduce_scatter, allgather, broadcast], ids=lambda m: m.__name__.split(".")[-1])
def test_auto_runs_hierarchical_across_nodes_where_allreduce_does(registry):
    assert "hierarchical" in registry.ALGORITHMS
    for shape in ((4, 4), (2, 2, 2, 2), (3, 5)):
        comm = SimpleNamespace(layout=layout(*shape), nranks=sum(shape), state=MESSAGES_ONLY)
        edge = multinode.crossover(comm.layout)
        assert registry.choose(comm, 64 << 20) == "hierarchical"
        assert registry.choose(comm, edge) == "hierarchical"
        assert registry.choose(comm, edge - 1) != "hierarchical"
    # one rank per node: nothing to fold or share inside a node
    one_per_node = SimpleNamespace(layout=layout(1, 1), nranks=2, state=MESSAGES_ONLY)
    assert registry.choose(one_per_node, 64 << 20) != "hierarchical"


def test_link_percent_counts_what_each_collective_must_move_per_node():
    second = 1e6  # us
    # 2 nodes: an allreduce moves the whole buffer over each link, a reduce-scatter or allgather half
    assert network.link_percent(1 << 20, second, 2, 8 << 20) == pytest.approx(100)
    for collective in ("reduce_scatter", "allgather"):
        assert network.link_percent(2 << 20, second, 2, 8 << 20, collective) == pytest.approx(100)
        assert network.link_percent(4 << 20, second, 4, 24 << 20, collective) == pytest.approx(100)  # 3/4
    assert network.link_percent(1 << 20, second, 4, 8 << 20, "broadcast") == pytest.approx(100)  # the buffer
    two = layout(4, 4)
    assert network.describe(two, (2.5e8, "x"), "reduce_scatter")[1].endswith(
        "link % = (N-1)/N x size / time / link bandwidth, N = 2 nodes")
    assert "link % = size / time" in network.describe(two, (2.5e8, "x"), "broadcast")[1]
