"""The shared summary, the staleness statistics and ``allreduce_kit.compare``, in one process."""
import json
import os
import subprocess
import sys

import numpy as np

from allreduce_kit.compare import figure, losses, repeats, table
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


def _compare(*args, cwd=TESTS):
    return subprocess.run([sys.executable, "-m", "allreduce_kit.compare", *map(str, args)],
                          capture_output=True, text=True, timeout=60, cwd=cwd)


def test_compare_lines_epochs_up_by_number_not_by_position(tmp_path):
    """A report that starts at epoch 2 (a run resumed from an older checkpoint) sits under epoch 2."""
    whole = {"summary": build_summary("sync", 2, 2, _epochs([2.0, 1.0]), 20), "config": {}}
    late = _epochs([9.0, 0.5])[1:]
    assert late[0]["epoch"] == 2
    resumed = {"summary": build_summary("sync", 2, 2, late, 10), "config": {}}
    assert resumed["summary"]["epoch_numbers"] == [2]
    rows = {line.split("  ")[0]: line.split()[-2:] for line in table([whole, resumed], ["A", "B"]).splitlines()[2:]}
    assert rows["loss epoch 1"] == ["2.0000", "-"] and rows["loss epoch 2"] == ["1.0000", "0.5000"]
    # A file written before the summary listed its epoch numbers: its per-epoch records say them.
    old = {"summary": {k: v for k, v in resumed["summary"].items() if k != "epoch_numbers"}, "epochs": late}
    assert losses(old) == {2: 0.5}


def test_compare_plot_writes_exactly_the_png_it_names_and_refuses_other_paths(tmp_path):
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"summary": build_summary("sync", 2, 2, _epochs([2.0, 1.0]), 20)}))
    png = tmp_path / "curves.png"
    done = _compare(run, run, "--plot", png)
    assert done.returncode == 0 and done.stdout.strip().endswith(f"wrote {png}"), done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curves.png", "run.json"]
    for bad, message in ((tmp_path / "curves", f"argument --plot: {tmp_path / 'curves'} does not end in .png"),
                         (tmp_path, f"argument --plot: {tmp_path} is a directory"),
                         (tmp_path / "no" / "x.png", f"argument --plot: directory {tmp_path / 'no'} does not exist")):
        done = _compare(run, "--plot", bad)
        assert done.returncode == 2 and done.stderr.count(message) == 1, done.stderr
        assert "Traceback" not in done.stderr and done.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curves.png", "run.json"]


def test_compare_plot_without_matplotlib_says_how_to_get_it(tmp_path):
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"summary": build_summary("sync", 2, 2, _epochs([2.0, 1.0]), 20)}))
    (tmp_path / "matplotlib").mkdir()
    (tmp_path / "matplotlib" / "__init__.py").write_text("raise ImportError('no matplotlib here')\n")
    done = subprocess.run([sys.executable, "-m", "allreduce_kit.compare", str(run), "--plot", str(tmp_path / "x.png")],
                          capture_output=True, text=True, timeout=60, cwd=TESTS,
                          env=dict(os.environ, PYTHONPATH=str(tmp_path)))
    assert done.returncode == 2 and "Traceback" not in done.stderr and done.stdout == ""
    assert done.stderr.count('argument --plot: matplotlib is not installed: pip install ".[plot]"') == 1, done.stderr


def test_repeats_are_drawn_as_their_median_with_the_range():
    """Three repeats of one configuration, one slow: the line is the median, the bars reach the slowest."""
    repeats_ = []
    for slow in (1.0, 4.0, 1.5):
        epochs = _epochs([2.0 * slow, 1.0])
        for e in epochs:
            e["seconds"] *= slow
        repeats_.append({"summary": build_summary("sync", 8, 8, epochs, 20)})
    names = ["sync_p8-0", "sync_p8-1", "sync_p8-2"]
    assert repeats(names) == [("sync_p8", [0, 1, 2])]
    fig = figure(repeats_, names, median=True)
    try:
        by_time = fig.axes[0]
        [line] = by_time.get_lines()[:1]
        assert list(line.get_xdata()) == [1.5, 3.0]                # median cumulative seconds: 1, 1.5, 4 and 2, 3, 8
        assert list(line.get_ydata()) == [3.0, 1.0]                # median loss: 2, 3, 8 and 1, 1, 1
        ranges = [c for c in by_time.collections]                  # the bars: min to max, in x and in y
        spans = sorted(tuple(sorted(round(v, 6) for v in segment[:, 0])) for c in ranges for segment in c.get_segments()
                       if segment[0, 1] == segment[1, 1] and segment[0, 0] != segment[1, 0])  # horizontal
        assert spans == [(1.0, 4.0), (2.0, 8.0)]
        assert "median of 3 runs" in by_time.get_legend_handles_labels()[1][0]
    finally:
        import matplotlib.pyplot as plt
        plt.close(fig)
