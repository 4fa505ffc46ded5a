"""``benchmarks/zero_torch.py`` sets each version's step beside PyTorch's ZeroRedundancyOptimizer
over Gloo, by the median step and by wall time, and says whether stages 1 and 2 meet 0.5x."""
import importlib.util

import numpy as np
import pytest

from conftest import TESTS

pytest.importorskip("torch")


def load():
    spec = importlib.util.spec_from_file_location("zero_torch", TESTS.parent / "benchmarks" / "zero_torch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ratios_to_pytorchs_zero_and_the_target_lines():
    bench = load()
    steps = lambda ms: [np.full(8, ms / 1e3)] * 3
    samples = {"floor": steps(10.0), "zero1": steps(20.0), "zero2": steps(30.0), "fully_shard": steps(40.0),
               "torch_zero": steps(50.0)}
    walls = {v: [float(np.median(s[0])) * 1e3 + 1.0] * 3 for v, s in samples.items()}
    rows = bench.measures(samples, walls)
    assert rows["zero1"]["step_ratio_to_torch_zero"] == pytest.approx(0.4)
    assert rows["zero2"]["step_ratio_to_torch_zero_wall"] == pytest.approx(31 / 51)
    assert rows["zero1"]["overhead_ms_p50"] == pytest.approx(10.0) and "step_ratio_to_torch_zero" not in rows["floor"]
    for row in rows.values():
        row["optimizer_step_ms_p50"] = 1.0
    result = {"model": "10m", "parameters": 10512394, "batch_per_rank": 32, "rounds": 3, "steps": 8, "versions": rows,
              "targets": {"zero1": {"at_most": 0.5, "met": True, "met_wall": True},
                          "zero2": {"at_most": 0.5, "met": False, "met_wall": False}}}
    text = "\n".join(bench.lines(result, 4))
    assert "step/torch_zero  0.40x" in text and "optimizer.step()" in text
    assert "target: zero1 step/torch_zero <= 0.5x: by the median step met, by wall time met" in text
    assert "target: zero2 step/torch_zero <= 0.5x: by the median step NOT met" in text
