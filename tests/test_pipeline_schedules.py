"""Pipeline schedules as data, checked without MPI: every list is complete and cannot hang, and
the simulator's timeline has the bubble and the memory the schedules are known for."""
import itertools

import pytest

from allreduce_kit.pipeline import schedules as sc
from allreduce_kit.pipeline.grid import Grid, choose_placement, cross_node_bytes
from allreduce_kit.pipeline.stage import balanced_split, check_split, layer_costs, stage_layers

CASES = [(name, S, M, V) for name, V in (("gpipe", 1), ("1f1b", 1), ("interleaved", 1), ("interleaved", 2),
                                          ("interleaved", 3))
         for S in (1, 2, 3, 4, 8) for M in (1, 2, 3, 4, 5, 8, 16)
         if not (V > 1 and S < 2) and not (name == "interleaved" and M % max(1, M // S))]


def simulated(name, S, M, V):
    return sc.simulate(sc.build(S, M, name, V), 1.0 / V, 2.0 / V)


def test_every_forward_and_backward_once_on_its_rank_forward_first():
    for name, S, M, V in CASES:
        check_complete(name, S, M, V)


def check_complete(name, S, M, V):
    lists = sc.build(S, M, name, V)
    assert len(lists) == S
    everything = [a for actions in lists for a in actions]
    assert sorted(everything) == sorted(a(mb, k) for a in (sc.Forward, sc.Backward)
                                        for mb in range(M) for k in range(S * V))
    for r, actions in enumerate(lists):
        assert {a.stage for a in actions} == set(sc.stage_of_rank(r, S, V))
        for a in actions:
            if a.kind == "B":
                assert actions.index(sc.Forward(a.mb, a.stage)) < actions.index(a)


def test_every_send_has_its_receive_and_the_schedule_finishes():
    """A forward at stage k < last sends to k + 1's forward, a backward at k > 0 to k - 1's backward;
    the simulator runs every list to its end (it raises DeadlockError otherwise)."""
    for name, S, M, V in CASES:
        check_pairs(name, S, M, V)


def check_pairs(name, S, M, V):
    lists = sc.build(S, M, name, V)
    sends = [(a.kind, a.mb, a.stage + (1 if a.kind == "F" else -1)) for actions in lists for a in actions
             if (a.kind == "F" and a.stage < S * V - 1) or (a.kind == "B" and a.stage > 0)]
    receives = [(a.kind, a.mb, a.stage) for actions in lists for a in actions
                if (a.kind == "F" and a.stage > 0) or (a.kind == "B" and a.stage < S * V - 1)]
    assert sorted(sends) == sorted(receives)
    t = simulated(name, S, M, V)
    assert sum(map(len, t.spans)) == 2 * M * S * V


def test_gpipe_and_1f1b_idle_share_is_s_minus_1_over_m_plus_s_minus_1():
    for name, S, M in itertools.product(("gpipe", "1f1b"), (1, 2, 3, 4, 8), (1, 2, 4, 8, 16)):
        t = simulated(name, S, M, 1)
        for share in t.idle_share:
            assert share == pytest.approx((S - 1) / (M + S - 1)), (name, S, M)
        assert sc.gpipe_idle_share(S, M) == pytest.approx((S - 1) / (M + S - 1))


def test_peak_live_is_m_for_gpipe_and_at_most_s_for_1f1b():
    for S, M in itertools.product((2, 3, 4, 8), (1, 2, 4, 8, 16)):
        check_peak(S, M)


def check_peak(S, M):
    assert simulated("gpipe", S, M, 1).peak_live == [M] * S
    one = simulated("1f1b", S, M, 1).peak_live
    assert one == [min(S - r, M) for r in range(S)]
    assert max(one) <= S


def test_stages_of_unequal_forward_and_backward():
    # (forward, backward) per stage: GPipe waits for the slower stage in each phase, 1F1B's steady
    # state only for the slower forward + backward, so stages equal in forward + backward idle the
    # bubble under 1F1B but not under GPipe
    f, b, M = (3.0, 2.0), (5.0, 6.0), 8
    gpipe = sc.simulate(sc.build(2, M, "gpipe"), stage_costs={0: (f[0], b[0]), 1: (f[1], b[1])})
    assert gpipe.makespan == pytest.approx(M * (f[0] + b[1]) + f[1] + b[0])
    one = sc.simulate(sc.build(2, M, "1f1b"), stage_costs={0: (f[0], b[0]), 1: (f[1], b[1])})
    assert one.makespan == pytest.approx((M + 1) * (f[0] + b[0]))
    assert one.idle_share == pytest.approx([1 / (M + 1)] * 2)
    assert min(gpipe.idle_share) > 1 / (M + 1)
    # a pair overrides forward_cost and backward_cost; a number scales them
    assert sc.simulate(sc.build(2, 4, "1f1b"), 1.0, 2.0, stage_costs={0: (1.0, 2.0), 1: 1.0}).makespan == \
        sc.simulate(sc.build(2, 4, "1f1b"), 1.0, 2.0).makespan


def test_interleaved_idles_less_than_1f1b():
    # rounds of S (M = S, 2S, 4S) and, as torch.distributed.pipelining takes them, one round of
    # S < M < 2S and two rounds of 5 over 4 stages
    for S, M, V in [(S, M, V) for S in (2, 3, 4, 8) for M in sorted({S, S + 1, 2 * S - 1, 2 * S, 4 * S})
                    for V in (2, 3)] + [(4, 10, 2)]:
        check_interleaved(S, M, V)


def check_interleaved(S, M, V):
    inter, plain = simulated("interleaved", S, M, V), simulated("1f1b", S, M, 1)
    assert max(inter.idle_share) < min(plain.idle_share)
    # Megatron-LM's figure: the bubble is (S-1)/V of a stage's forward and backward per micro-batch
    assert inter.makespan == pytest.approx(plain.makespan - (S - 1) * 3 * (1 - 1 / V))
    for r in range(S):
        assert inter.idle_share[r] == pytest.approx((S - 1) / (V * M + S - 1))
        assert inter.peak_live[r] == min(2 * (S - r - 1) + (V - 1) * (M // sc.interleaved_rounds(S, M)) + 1, V * M)


def test_interleaved_with_one_virtual_stage_is_1f1b():
    for S, M in itertools.product((1, 2, 3, 4), (1, 2, 3, 4, 5, 8, 12)):
        if M % sc.interleaved_rounds(S, M) == 0:
            assert sc.build(S, M, "interleaved", 1) == sc.build(S, M, "1f1b"), (S, M)


def test_every_message_of_a_step_has_its_own_tag_above_the_collectives_tags():
    import importlib
    import pkgutil

    import allreduce_kit.algorithms as algorithms
    for S, M, V in ((2, 8, 1), (4, 16, 2), (8, 64, 3)):
        T = S * V
        tags = [sc.tag_of(kind, mb, k, T) for kind in "FB" for mb in range(M) for k in range(T)]
        assert len(set(tags)) == len(tags)
    collectives = [getattr(importlib.import_module(info.name), "TAG", None)
                   for info in pkgutil.walk_packages(algorithms.__path__, algorithms.__name__ + ".")]
    assert max(tag for tag in collectives if isinstance(tag, int)) < sc.tag_of("F", 0, 0, 1)


def test_a_list_that_waits_on_itself_is_reported_as_a_deadlock():
    lists = sc.build(2, 2, "1f1b")
    lists[1] = [sc.Backward(0, 1), *[a for a in lists[1] if a != sc.Backward(0, 1)]]
    with pytest.raises(ValueError, match="before its forward"):
        sc.simulate(lists)
    lists = [[sc.Forward(0, 0), sc.Backward(0, 0)], [sc.Backward(0, 1), sc.Forward(0, 1)]]
    with pytest.raises(ValueError):
        sc.simulate(lists)
    crossed = [[sc.Forward(0, 0), sc.Forward(1, 0), sc.Backward(1, 0), sc.Backward(0, 0)],
               [sc.Forward(1, 1), sc.Backward(1, 1), sc.Forward(0, 1), sc.Backward(0, 1)]]
    assert sc.simulate(crossed).makespan > 0            # reordered, yet it can finish
    stuck = [[sc.Forward(0, 0), sc.Backward(0, 0), sc.Forward(1, 0), sc.Backward(1, 0)],
             [sc.Forward(1, 1), sc.Backward(1, 1), sc.Forward(0, 1), sc.Backward(0, 1)]]
    with pytest.raises(sc.DeadlockError, match="rank 0 at B0.0"):
        sc.simulate(stuck)


@pytest.mark.parametrize("bad,match", [
    (dict(stages=0, micro_batches=1), "stages"), (dict(stages=2, micro_batches=0), "micro_batches"),
    (dict(stages=2, micro_batches=2, schedule="zb"), "schedule"),
    (dict(stages=2, micro_batches=2, schedule="1f1b", virtual_stages=2), "interleaved"),
    (dict(stages=3, micro_batches=7, schedule="interleaved", virtual_stages=2),
     r"max\(1, M // S\) = 2 equal rounds: 7 does not divide by 2"),
])
def test_build_refuses_what_it_cannot_make(bad, match):
    with pytest.raises(ValueError, match=match):
        sc.build(**bad)


def test_timeline_text_shows_each_slot():
    text = sc.format_timeline(sc.simulate(sc.build(2, 2, "gpipe"), 1, 1))
    assert text.splitlines() == ["rank 0: F0 F1 .. .. B0 B1", "rank 1: .. F0 F1 B0 B1 .."]


def test_grid_placements_are_inverse_and_keep_their_neighbours_together():
    for placement in ("stage-major", "replica-major"):
        g = Grid(3, 2, placement)
        assert sorted(g.rank(s, d) for s in range(3) for d in range(2)) == list(range(6))
        for r in range(6):
            assert g.rank(*g.position(r)) == r
    assert Grid(3, 2, "stage-major").replicas_of(1) == [2, 3]
    assert Grid(3, 2, "replica-major").pipeline(1) == [3, 4, 5]
    assert choose_placement(2, 4, gradient_bytes=100e6, activation_bytes=1e6) == "stage-major"
    assert choose_placement(2, 4, gradient_bytes=1e3, activation_bytes=1e6) == "replica-major"
    with pytest.raises(ValueError, match="placement"):
        Grid(2, 2, "diagonal")


def test_auto_placement_sends_fewer_bytes_between_nodes():
    """2 nodes x 4 ranks, 2 stages x 4 replicas: stage-major puts a stage on each node (only the
    activations cross), replica-major a whole pipeline on a node (every stage's allreduce crosses)."""
    two_nodes = [0, 0, 0, 0, 1, 1, 1, 1]
    stage_major, replica_major = Grid(2, 4, "stage-major"), Grid(2, 4, "replica-major")
    assert cross_node_bytes(stage_major, two_nodes, 100e6, 1e6) == 4 * 2 * 1e6
    assert cross_node_bytes(replica_major, two_nodes, 100e6, 1e6) == 2 * 2 * 100e6 * 3 / 4
    assert choose_placement(2, 4, 100e6, 1e6, two_nodes) == "stage-major"
    # activations heavier than the gradient: a pipeline per node, only the allreduces cross
    assert choose_placement(2, 4, 1e3, 1e6, two_nodes) == "replica-major"
    # one node: nothing crosses; the heavier traffic between neighbours
    assert choose_placement(2, 4, 100e6, 1e6, [0] * 8) == "stage-major"


def test_balanced_split_minimises_the_largest_stage():
    assert balanced_split([1, 1, 1, 1], 2) == [2]
    assert balanced_split([8, 1, 1, 1, 1, 1, 1, 1, 1], 2) == [1]
    assert balanced_split([1, 2, 3, 4, 5], 5) == [1, 2, 3, 4]
    costs = layer_costs([64, 100, 100, 100, 10])          # forward + backward: 2 x 6400 (no input gradient), 3 x ...
    assert costs == [12800, 30000, 30000, 3000]
    assert balanced_split(costs, 2) == [2]
    assert balanced_split(layer_costs([768, 512, 512, 512, 512]), 2) == [2]    # four equal layers
    assert len(set(layer_costs([768, 512, 512, 512, 512]))) == 1
    assert stage_layers([2], 4) == [(0, 2), (2, 4)]
    with pytest.raises(ValueError, match="3 layers into 4"):
        balanced_split([1, 1, 1], 4)
    assert check_split([2], 4, 2) is None
    assert "increase" in check_split([2, 2], 4, 3)
    assert "needs 1" in check_split([1, 2], 4, 2)
