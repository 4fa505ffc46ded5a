"""``benchmarks/powersgd_torch.py`` sets each allreduce_kit version beside DDP with the same
compression (ours uncompressed against DDP's, ours with PowerSGD against DDP's ``powerSGD_hook``),
gives both sides the same ``PowerSGDState`` settings, and says whether PowerSGD meets 0.5x; with
``--accuracy``, the median test accuracy over seeds against uncompressed training."""
import importlib.util

import numpy as np
import pytest

from conftest import TESTS

pytest.importorskip("torch")


def load():
    spec = importlib.util.spec_from_file_location("powersgd_torch", TESTS.parent / "benchmarks" / "powersgd_torch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_version_is_set_against_ddp_with_the_same_compression_and_the_target_line():
    bench = load()
    steps = lambda ms: [np.full(8, ms / 1e3)] * 3
    samples = {"floor": steps(10.0), "allreduce_kit": steps(20.0), "ddp": steps(40.0),
               "allreduce_kit+powersgd": steps(30.0), "ddp+powersgd": steps(50.0)}
    walls = {v: [float(np.median(s[0])) * 1e3 + 2.0] * 3 for v, s in samples.items()}
    rows = bench.measures(samples, walls)
    ours = rows["allreduce_kit+powersgd"]
    assert ours["against"] == "ddp+powersgd" and ours["step_ratio"] == pytest.approx(0.6)
    assert ours["overhead_ratio"] == pytest.approx(0.5) and ours["step_ratio_wall"] == pytest.approx(32 / 52)
    assert rows["allreduce_kit"]["against"] == "ddp" and rows["allreduce_kit"]["step_ratio"] == pytest.approx(0.5)
    assert "step_ratio" not in rows["ddp+powersgd"] and rows["floor"]["overhead_ms_p50"] == 0.0
    settings = bench.powersgd_settings(4, 10)
    assert settings["matrix_approximation_rank"] == 4 and settings["start_powerSGD_iter"] == 10
    assert settings["use_error_feedback"] and settings["warm_start"]
    assert bench.compressed([(2048, 64), (2048,), (10, 512)], 4) == [[2048, 64, 4], [10, 512, 4]]
    result = {"model": "5m", "parameters": 5383690, "batch_per_rank": 32, "rounds": 3, "steps": 8,
              "powersgd": settings, "compressed_matrices": [[2048, 64, 4]], "versions": rows,
              "target": {"version": "allreduce_kit+powersgd", "at_most": 0.5, "met": False, "met_wall": False}}
    text = "\n".join(bench.lines(result, 4))
    assert "step/ddp+powersgd  0.60x" in text and "overhead/ddp  0.33x" in text
    assert "target: allreduce_kit+powersgd step/ddp+powersgd <= 0.5x: by the median step NOT met" in text


def test_accuracy_rows_are_the_median_over_seeds_against_uncompressed():
    accuracy = load().powersgd_accuracy
    rows = accuracy.summary({"none": [90.0, 93.3, 90.0], "powersgd": [91.9, 89.7, 92.2]})
    assert rows["none"]["median"] == 90.0 and rows["powersgd"]["median_minus_none"] == pytest.approx(1.9)
    assert accuracy.final_accuracy("Accuracy: 50.00%\n...\nTest set: Average loss: 0.3, Accuracy: 91.94%\n") == 91.94
