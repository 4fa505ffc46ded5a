"""What ``auto`` runs across nodes (``multinode.py``) and the bench's "link %": pure functions, no MPI.

(``test_cluster.py`` runs ``auto`` across real, isolated nodes and checks every choice's result.)
"""
import math

import pytest

from allreduce_kit import ALGORITHMS, multinode
from allreduce_kit.bench import network
from allreduce_kit.topology import Topology


def layout(*ranks_per_node: int, placement: str = "block") -> Topology:
    nodes = len(ranks_per_node)
    if placement == "block":
        node_of = [n for n, count in enumerate(ranks_per_node) for _ in range(count)]
    else:  # rank r on node r mod N, as far as each node's count allows
        left, node_of, n = list(ranks_per_node), [], 0
        while any(left):
            if left[n % nodes]:
                node_of.append(n % nodes)
                left[n % nodes] -= 1
            n += 1
    return Topology.from_parts(0, node_of, [max(ranks_per_node)] * nodes, [f"node{i + 1}" for i in range(nodes)])


def test_small_messages_go_to_mpi_large_ones_hierarchical():
    for shape in ((4, 4), (2, 2, 2, 2), (3, 5), (2, 3, 3)):
        top = layout(*shape)
        assert multinode.choose(top, 8) == "mpi", shape
        assert multinode.choose(top, 64 << 20) == "hierarchical", shape
        edge = multinode.crossover(top)
        assert multinode.choose(top, edge - 1) == "mpi"
        assert multinode.choose(top, edge) == "hierarchical"


def test_ranks_sharing_cores_move_the_crossover_up():
    shared = Topology.from_parts(0, [0, 0, 0, 0, 1, 1, 1, 1], [2, 2], ["node1", "node2"])
    assert shared.oversubscribed
    assert not layout(4, 4).oversubscribed
    assert multinode.crossover(layout(4, 4)) == multinode.LATENCY_BYTES // 3
    assert multinode.crossover(shared) == multinode.OVERSUBSCRIBED * multinode.LATENCY_BYTES // 3


def test_the_crossover_follows_the_cost_model():
    # hierarchical from alpha*B / (lg N (l - 1)): more nodes or more ranks per node, sooner
    assert multinode.crossover(layout(2, 2)) == multinode.LATENCY_BYTES
    assert multinode.crossover(layout(4, 4)) == multinode.LATENCY_BYTES // 3
    assert multinode.crossover(layout(2, 2, 2, 2)) == multinode.LATENCY_BYTES // 2
    assert multinode.crossover(layout(3, 5)) == multinode.LATENCY_BYTES // 4
    assert multinode.crossover(layout(2, 3, 3)) == int(multinode.LATENCY_BYTES / (2 * math.log2(3)))


def test_one_rank_per_node_runs_flat():
    top = layout(1, 1, 1)
    assert multinode.choose(top, multinode.LATENCY_BYTES - 1) == "recursive_doubling"
    assert multinode.choose(top, multinode.LATENCY_BYTES) == "ring"
    assert multinode.choose(top, 1 << 30) == "ring"


def test_placement_does_not_change_the_choice():
    for nbytes in (8, 1 << 10, 20 << 10, 1 << 20, 64 << 20):
        assert multinode.choose(layout(4, 4), nbytes) == multinode.choose(layout(4, 4, placement="rr"), nbytes)


def test_every_choice_is_registered_and_auto_says_where_it_comes_from():
    for shape in ((1, 1), (2, 2), (3, 5)):
        auto = multinode.NodeAware(layout(*shape))
        assert auto.choices == {} and "node-aware cost model" in auto.source
        for nbytes in (1, 1 << 12, 1 << 16, 1 << 26):
            assert auto.choose(nbytes) in ALGORITHMS


def test_online_tuning_times_mpis_own_call_alone_against_the_bandwidth_bound_choice():
    """Below ``tuned_below`` the model's choice is timed against the few-round algorithms; from
    there on (``hierarchical``, or ``ring`` with one rank per node) against MPI's own call only,
    never against a flat exchange that would carry many times the link's bytes."""
    assert set(multinode.CANDIDATES) <= set(ALGORITHMS) and set(multinode.LARGE_CANDIDATES) <= set(ALGORITHMS)
    for shape in ((4, 4), (2, 2, 2, 2), (3, 5), (1, 1), (1, 1, 1, 1)):
        auto = multinode.NodeAware(layout(*shape))
        edge = multinode.tuned_below(auto.layout)
        assert edge == (multinode.crossover(auto.layout) if max(shape) > 1 else multinode.LATENCY_BYTES)
        assert not any(auto.untimed(n) for n in (8, edge - 1, edge, 64 << 20))
        assert multinode.candidates(auto.layout, edge - 1) == multinode.CANDIDATES
        assert multinode.candidates(auto.layout, edge) == multinode.candidates(auto.layout, 64 << 20) == ("mpi",)
        assert auto.choose(edge) in ("hierarchical", "ring") and auto.choose(edge - 1) in multinode.CANDIDATES
    assert multinode.NodeAware(layout(2, 2), {"4/2": {"1024": {"algorithm": "tree"}}}).saved == {
        "4/2": {"1024": {"algorithm": "tree"}}}


def test_link_percent_is_the_bytes_a_link_must_carry_over_time_and_bandwidth():
    # 2 nodes: the whole message crosses each link; 16 MiB in 134.2 ms at 1 Gbit/s is the limit
    assert network.link_percent(16 << 20, (16 << 20) * 8 / 1e9 * 1e6, 2, 1e9) == pytest.approx(100)
    # 4 nodes: 3/2 of the message; twice the time is half the link
    assert network.link_percent(1 << 20, 2 * 1.5 * (1 << 20) * 8 / 250e6 * 1e6, 4, 250e6) == pytest.approx(50)
    assert network.link_percent(1, 0, 2, 1e9) == 0


def test_the_bench_names_nodes_and_link_only_across_nodes(monkeypatch):
    monkeypatch.setattr(network, "cluster_link", lambda: None)
    one = layout(4)
    assert network.link_bandwidth(one, 10.0) is None
    assert network.describe(one, None) == ["nodes: 1 (node1), ranks per node: 4"]
    two = layout(3, 5)
    assert network.link_bandwidth(two, None) is None
    lines = network.describe(two, network.link_bandwidth(two, 0.25))
    assert lines[0] == "nodes: 2 (node1, node2), ranks per node: 3, 5"
    assert "0.250 Gbit/s" in lines[1] and "--link-gbps" in lines[1]
    monkeypatch.setattr(network, "cluster_link", lambda: (9.5e8, "measured"))
    assert network.link_bandwidth(two, None) == (9.5e8, "measured")
