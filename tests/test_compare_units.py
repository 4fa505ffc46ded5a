"""The shared summary, the staleness statistics and ``allreduce_kit.compare``, in one process."""
import json
import subprocess
import sys

import numpy as np

from allreduce_kit.compare import table
from allreduce_kit.train.staleness import StalenessLog, per_worker
from allreduce_kit.train.summary import FIELDS, build_summary, epoch_record

from conftest import TESTS


def _epochs(losses, seconds=1.0, samples=100):
    return [epoch_record(i, 10, loss * samples, 0.5 * samples, samples, 30, 40, seconds, 0.05)
            for i, loss in enumerate(losses)]


def test_summary_accumulates_time_and_samples_and_has_every_field():
    s = build_summary("async-ps", 4, 3, _epochs([2.0, 1.0, 0.5], seconds=2.0), 30, 4, [0, 1, 2, 5])
    assert set(FIELDS) <= set(s)
    assert s["curve"]["seconds"] == [2.0, 4.0, 6.0] and s["curve"]["samples"] == [100, 200, 300]
    assert s["samples_per_second"] == 50.0 and s["loss_per_epoch"] == [2.0, 1.0, 0.5]
    assert s["staleness_mean"] == 2.0 and s["staleness_max"] == 5 and s["test_accuracy"] == 0.75


def test_staleness_per_worker_distribution():
    log = StalenessLog(capacity=2)                     # grows past its first capacity
    for staleness in range(20):
        log.record(1, staleness, applied=True)
    for staleness in (0, 3, 9):
        log.record(2, staleness, applied=staleness <= 3)
    rows = {r["rank"]: r for r in per_worker(log.rows, [1, 2, 3])}
    assert rows[1]["staleness"] == {"mean": 9.5, "p50": 9.5, "p95": float(np.percentile(range(20), 95)), "max": 19}
    assert (rows[2]["pushed"], rows[2]["applied"], rows[2]["rejected"]) == (3, 2, 1)
    assert rows[2]["staleness"]["max"] == 3 and rows[3]["pushed"] == 0
    assert list(log.applied_staleness()) == list(range(20)) + [0, 3]


def test_compare_table_lines_up_runs_of_different_lengths():
    a = {"summary": build_summary("sync", 4, 4, _epochs([2.0, 1.0]), 20), "config": {"straggler": None}}
    b = {"summary": build_summary("async-ps", 4, 3, _epochs([3.0]), 9, 1, [1, 2]), "config": {"straggler": [2, 50]}}
    lines = table([a, b], ["A", "B"]).splitlines()
    assert lines[0].split() == ["A", "B"]
    row = {line.split("  ")[0]: line.split()[-2:] for line in lines[2:]}
    assert row["mode"] == ["sync", "async-ps"]
    assert row["loss epoch 2"] == ["1.0000", "-"]
    straggler = next(line for line in lines if line.startswith("straggler"))
    assert straggler.split()[1] == "-" and straggler.endswith("rank 2 +50 ms")


def test_compare_rejects_a_file_without_summary(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"steps": 3}))
    result = subprocess.run([sys.executable, "-m", "allreduce_kit.compare", str(bad), str(bad)],
                            capture_output=True, text=True, timeout=60, cwd=TESTS)
    assert result.returncode == 2 and "has no \"summary\"" in result.stderr and "Traceback" not in result.stderr
