"""``python -m allreduce_kit.train --backup-workers / --local-sgd``: bad command lines and the report.

Every bad command line gets one message from rank 0 and exit status 2 on every rank, no
traceback (all cases in one 2-rank job, ``bad_options_driver.py``). One 3-rank run with a slow
rank and a backup worker shows the report: the slow rank dropped, the effective batch, the wait
against plain sync's, in the text and in ``--json``; ``compare`` puts it beside a plain run.
"""
import json
from pathlib import Path

import pytest

from allreduce_kit import compare
from conftest import TESTS, run_mpi

TRAIN = ["-m", "allreduce_kit.train"]
QUICK = ["--hidden", "16", "--max-steps", "2", "--progress", "lines"]


def _cases(tmp: Path):
    """(id, argv, the message rank 0 prints once); the job has 2 ranks."""
    return [
        ("backup-equals-p", ["--backup-workers", "2"],
         "argument --backup-workers: 2 backup worker(s) leave no gradient in a step of 2 ranks (at most 1)"),
        ("backup-negative", ["--backup-workers", "-1"], "argument --backup-workers: must be >= 0, got '-1'"),
        ("local-zero", ["--local-sgd", "0"], "argument --local-sgd: must be >= 1, got '0'"),
        ("warmup-negative", ["--local-sgd", "2", "--local-sgd-warmup", "-3"],
         "argument --local-sgd-warmup: must be >= 0, got '-3'"),
        ("async-backup", ["--mode", "async-ps", "--backup-workers", "1"],
         "argument --backup-workers: only with --mode sync"),
        ("async-local", ["--mode", "async-ps", "--local-sgd", "2"], "argument --local-sgd: only with --mode sync"),
        ("async-local-zero-typed", ["--mode", "async-ps", "--backup-workers", "0"],
         "argument --backup-workers: only with --mode sync"),
        ("both", ["--backup-workers", "1", "--local-sgd", "2"],
         "argument --local-sgd: not with --backup-workers (choose one)"),
        ("warmup-alone", ["--local-sgd-warmup", "3"], "argument --local-sgd-warmup: only with --local-sgd H > 1"),
        ("momentum-alone", ["--local-sgd-momentum", "local"],
         "argument --local-sgd-momentum: only with --local-sgd H > 1"),
        ("local-skip", ["--local-sgd", "2", "--on-nonfinite", "skip"],
         "argument --on-nonfinite: skip does not combine with --local-sgd"),
        ("local-checkpoint-every", ["--local-sgd", "2", "--checkpoint-dir", str(tmp / "c"), "--checkpoint-every", "2"],
         "argument --checkpoint-every: not with --local-sgd"),
    ]


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stragglers_bad")
    cases = _cases(tmp)
    (tmp / "cases.json").write_text(json.dumps([QUICK + argv for _, argv, _ in cases]))
    result = run_mpi(2, [TESTS / "bad_options_driver.py", tmp / "cases.json", tmp / "out.json"], timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = json.loads((tmp / "out.json").read_text())
    return {name: (message, ranks) for (name, _, message), ranks in zip(cases, records)}


@pytest.mark.parametrize("case", [name for name, _, _ in _cases(Path("/nonexistent"))])
def test_a_bad_command_line_gives_one_message_from_rank_0_and_status_2(bad_runs, case):
    message, ranks = bad_runs[case]
    for rank, record in enumerate(ranks):
        assert record["raised"] is None, f"rank {rank} raised {record['raised']}"
        assert record["status"] == 2, f"rank {rank} exit status {record['status']}\n{record['stdout'][-2000:]}"
        assert "Traceback" not in record["stderr"] + record["stdout"]
        assert record["stdout"] == ""
    assert ranks[0]["stderr"].count(message) == 1, ranks[0]["stderr"]
    assert ranks[0]["stderr"].count("error:") == 1
    assert all(record["stderr"] == "" for record in ranks[1:])


def test_the_report_names_the_dropped_rank_and_compare_shows_the_modes(tmp_path, capsys):
    out = tmp_path / "backup.json"
    result = run_mpi(3, TRAIN + ["--hidden", "16", "--epochs", "2", "--progress", "lines", "--backup-workers", "1",
                                 "--accum-steps", "2", "--straggler", "1:80", "--json", out], timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    text = result.stdout
    assert "backup workers: 1; every step averages the gradients of the first 2 of 3 ranks" in text
    # the global batch counts the accumulation steps, in the header, the report and --json alike
    assert "(192 global)" in text and " of 192 " in text and "effective global batch " in text
    assert "most often dropped: rank 1" in text and "most often slowest: rank 1 (longest compute)" in text
    assert "replicas bitwise identical on all 3 ranks: yes" in text
    run = json.loads(out.read_text())
    assert run["straggler"]["slowest_rank"] == 1 and run["straggler"]["slowest_by"] == "compute"
    b = run["straggler"]["backup_workers"]
    assert b["ranks"][1]["dropped_share"] == 1.0 and b["most_dropped_rank"] == 1
    assert b["sync_step_wait_ms_p50"] > b["step_wait_ms_p50"]
    assert b["global_batch"] == 192 and b["protocol"] in ("shared window", "messages") and b["groups"] >= 1
    assert 119 < b["effective_global_batch_mean"] <= 128   # 2 of 3 ranks' 2 x 32 (an epoch's last step: 2 x 31)
    assert run["config"]["backup_workers"] == 1 and run["config"]["local_sgd"] == 1
    assert compare.method(run) == "backup-workers 1" and run["summary"]["mode"] == "sync"
    c = run["communication"]
    assert c["allreduce_calls"] == pytest.approx(run["steps"] * 2 / 3)        # 2 of 3 ranks reduce each step
    assert c["samples"] == run["summary"]["samples"] and c["forwarded_bytes"] > 0
    # compare: the method, the step time and the traffic per sample, beside a plain run's summary.
    plain = {**run, "config": {**run["config"], "backup_workers": 0}}
    assert compare.method(plain) == "sync"
    assert compare.method({**run, "config": {**run["config"], "backup_workers": 0, "local_sgd": 4}}) == "local-sgd 4"
    (tmp_path / "plain.json").write_text(json.dumps(plain))
    assert compare.main([str(tmp_path / "plain.json"), str(out), "--target-accuracy", "0.5"]) == 0
    table = capsys.readouterr().out
    assert "backup-workers 1" in table and "allreduce calls per sample" in table and "time to 50% test" in table


def test_time_to_accuracy_counts_the_epochs_until_the_first_that_reaches_the_target():
    run = {"epochs": [{"seconds": 1.5, "test_accuracy": 0.5}, {"seconds": 2.0, "test_accuracy": 0.96},
                      {"seconds": 1.0, "test_accuracy": 0.94}]}
    assert compare.time_to_accuracy(run, 0.95) == 3.5
    assert compare.time_to_accuracy(run, 0.5) == 1.5
    assert compare.time_to_accuracy(run, 0.97) is None and compare.time_to_accuracy({}, 0.5) is None


def test_a_target_accuracy_outside_0_1_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as end:
        compare.main([str(tmp_path / "a.json"), "--target-accuracy", "95"])
    assert end.value.code == 2 and "argument --target-accuracy: expected a fraction in (0, 1], got 95" in capsys.readouterr().err
