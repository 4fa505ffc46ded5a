"""``benchmarks/torch_vs_ddp.py`` measures the step both ways: the median of per-step times, and
the wall time of a block of steps from a barrier to the slowest rank's end, per step, which
counts the steps where a rank waited for a core (the median leaves them out)."""
import importlib.util
import time

import numpy as np
import pytest

from conftest import TESTS

pytest.importorskip("torch")


def load():
    spec = importlib.util.spec_from_file_location("torch_vs_ddp", TESTS.parent / "benchmarks" / "torch_vs_ddp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_wall_time_per_step_counts_a_step_that_waited():
    from mpi4py import MPI

    bench = load()
    delays = iter([0.001] * 8 + [0.3])   # one step in nine waits 0.3 s, as for a core
    times, wall = bench.timed(MPI.COMM_SELF, lambda: time.sleep(next(delays)), 0, 9)
    assert len(times) == 9 and wall >= times.sum() / 9 >= 0.3 / 9
    assert np.median(times) < wall, "the median hides the step that waited; the wall time must not"


def test_each_version_has_both_measures_their_ratios_and_a_target_for_each():
    bench = load()
    steps = lambda ms: [np.full(10, ms / 1e3)] * 3
    # ours: 2 ms steps by the median, 4 ms per step by wall time (a rank waited); DDP: 10 and 12
    samples = {"floor": steps(1.0), "allreduce_kit": steps(2.0), "ddp": steps(10.0)}
    walls = {"floor": [1.5, 1.5, 1.5], "allreduce_kit": [3.0, 4.0, 9.0], "ddp": [12.0, 12.0, 12.0]}
    rows = bench.measures(samples, walls)
    ours = rows["allreduce_kit"]
    assert ours["step_ms_p50"] == pytest.approx(2.0) and ours["step_ms_wall"] == pytest.approx(4.0)
    assert ours["step_ms_wall_rounds"] == [3.0, 4.0, 9.0]
    assert ours["step_ratio_to_ddp"] == pytest.approx(0.2) and ours["step_ratio_to_ddp_wall"] == pytest.approx(4 / 12)
    assert ours["overhead_ratio_to_ddp"] == pytest.approx(1 / 9)
    assert ours["overhead_ratio_to_ddp_wall"] == pytest.approx(2.5 / 10.5)
    assert "step_ratio_to_ddp" not in rows["floor"] and rows["floor"]["overhead_ms_wall"] == 0.0
    assert bench.target("mlp", 4, "_wall") == {"field": "step_ratio_to_ddp_wall", "at_most": 0.3}
    assert bench.target("10m", 4) == {"field": "overhead_ratio_to_ddp", "at_most": 0.3}
    result = {"model": "mlp", "parameters": 19210, "batch_per_rank": 128, "rounds": 3, "steps": 500,
              "versions": rows, "raw_allreduce_ms_p50": 0.1,
              "target": {"field": "step_ratio_to_ddp", "at_most": 0.3, "met": True},
              "target_wall": {"field": "step_ratio_to_ddp_wall", "at_most": 0.3, "met": False}}
    text = "\n".join(bench.lines(result, 4))
    assert "wall     4.000 ms" in text and "wall/ddp  0.33x" in text
    assert "target by the median step: allreduce_kit step/ddp <= 0.3x: met" in text
    assert "target by wall time: allreduce_kit step/ddp <= 0.3x: NOT met" in text
