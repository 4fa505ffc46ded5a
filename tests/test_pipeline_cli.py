"""``python -m allreduce_kit.train --pipeline S``: a run end to end, with ``--json``'s pipeline
figures, and every command line it refuses: one message from rank 0, exit status 2 on every
rank, no traceback. All in one 2-rank job (``bad_options_driver.py``); ``python -m
allreduce_kit.pipeline show`` runs in this process (no MPI)."""
import json
import os
from pathlib import Path

import pytest

from allreduce_kit.pipeline.__main__ import main as show_main
from conftest import TESTS, run_mpi

QUICK = ["--hidden", "16", "--max-steps", "2", "--progress", "lines"]
P2 = ["--pipeline", "2"]
REFUSED = [
    (P2[:1] + ["3"], "argument --pipeline: 3 stages do not divide the 2 ranks (P = S x D)"),
    (P2 + ["--hidden", ""], "argument --pipeline: 2 stages exceed the model's 1 layer (--hidden)"),
    (P2 + ["--schedule", "interleaved", "--virtual-stages", "2"],
     "argument --virtual-stages: 2 stages x 2 virtual stages exceed the model's 2 layers (--hidden)"),
    (P2 + ["--micro-batches", "3"], "argument --micro-batches: 3 does not divide --batch-size 32"),
    (P2 + ["--hidden", "16,8,4", "--virtual-stages", "2"],
     "argument --virtual-stages: only with --schedule interleaved (got --schedule 1f1b)"),
    (P2 + ["--schedule", "interleaved", "--micro-batches", "5", "--batch-size", "10"],
     "argument --micro-batches: --schedule interleaved takes micro-batches in max(1, M // S) = 2 equal rounds: "
     "5 does not divide by 2 (with 2 stages: any M below 4, or a multiple of the round count)"),
    (P2 + ["--hidden", "16,8", "--split", "3"],
     "argument --split: stage start layers must increase strictly within 1..2"),
    (["--micro-batches", "2"], "argument --micro-batches: only with --pipeline"),
    (["--schedule", "gpipe"], "argument --schedule: only with --pipeline"),
    (P2 + ["--mode", "async-ps"], "argument --pipeline: not with --mode async-ps (a pipeline run is synchronous)"),
    *[(P2 + extra, f"argument {extra[0]}: not with --pipeline (docs/pipeline.md lists what combines)")
      for extra in (["--zero", "1"], ["--backup-workers", "1"], ["--local-sgd", "2"], ["--accum-steps", "2"],
                    ["--elastic"], ["--jitter-ms", "1"])],
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipeline_cli")
    good = QUICK + ["--hidden", "16,8", "--pipeline", "2", "--micro-batches", "4", "--schedule", "1f1b",
                    "--straggler", "1:1", "--json", str(tmp / "run.json"), "--checkpoint-dir", str(tmp / "ckpt"),
                    "--plot", str(tmp / "run.png")]
    (tmp / "cases.json").write_text(json.dumps([good] + [QUICK + argv for argv, _ in REFUSED]))
    result = run_mpi(2, [TESTS / "bad_options_driver.py", tmp / "cases.json", tmp / "out.json"], timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = json.loads((tmp / "out.json").read_text())
    return records[0], {**json.loads((tmp / "run.json").read_text()), "saved": sorted(os.listdir(tmp / "ckpt")),
                                                           "png": (tmp / "run.png").read_bytes()[:8]}, \
        records[1:]


def test_a_pipeline_run_trains_and_reports_idle_share_and_peak_live_per_stage(runs):
    ranks, payload, _ = runs
    for record in ranks:
        assert record["raised"] is None and record["status"] == 0, record["stderr"][-2000:]
    out = ranks[0]["stdout"]
    assert "pipeline: 2 stages x 1 replica" in out and "schedule 1f1b, 4 micro-batches" in out
    assert "replicas of each stage bitwise identical: yes" in out
    pipe = payload["pipeline"]
    assert (pipe["stages"], pipe["replicas"], pipe["micro_batches"]) == (2, 1, 4)
    assert pipe["peak_live"] == [2, 1] == pipe["simulated_peak_live"]
    assert len(pipe["idle_share"]) == 2 and all(0 <= x < 1 for x in pipe["idle_share"])
    # idle: not computing over the pipeline's span; waiting: for a message, over the rank's own span
    assert all(0 <= w <= i for w, i in zip(pipe["wait_share"], pipe["idle_share"]))
    # each stage's measured forward and backward of one micro-batch, and the schedule simulated with them
    assert all(len(pipe[k]) == 2 for k in ("forward_ms", "backward_ms", "expected_idle_share"))
    assert all(t > 0 for t in pipe["forward_ms"] + pipe["backward_ms"])
    assert all(0 <= x < 1 for x in pipe["expected_idle_share"]) and "expected" in out
    assert payload["steps"] == 2 and payload["replicas_identical"]
    assert pipe["straggler_stage"] == 1 and "the straggler holds stage 1" in out
    assert payload["config"]["pipeline"] == 2
    assert payload["saved"] == ["checkpoint-000000002.npz", "checkpoint-000000002.shards"]   # --checkpoint-dir
    assert payload["resumed_from"] is None
    assert payload["png"] == b"\x89PNG\r\n\x1a\n" and "wrote" in out and "run.png" in out     # --plot
    assert len(payload["step_ms"]["per_step"]) == 2


@pytest.mark.parametrize("index", range(len(REFUSED)))
def test_a_pipeline_command_line_that_cannot_run_is_refused(runs, index):
    message = REFUSED[index][1]
    ranks = runs[2][index]
    for rank, record in enumerate(ranks):
        assert record["raised"] is None, f"rank {rank} raised {record['raised']}"
        assert record["status"] == 2, f"rank {rank} exit status {record['status']}\n{record['stdout'][-2000:]}"
        assert "Traceback" not in record["stderr"] + record["stdout"]
    assert ranks[0]["stderr"].count(message) == 1, ranks[0]["stderr"]
    assert ranks[1]["stderr"] == ""


def test_show_prints_the_timeline_the_bubble_and_peak_live(capsys):
    assert show_main(["show", "--stages", "2", "--micro-batches", "2", "--schedule", "gpipe",
                      "--backward-cost", "1"]) == 0
    out = capsys.readouterr().out
    assert "rank 0: F0 F1 .. .. B0 B1\nrank 1: .. F0 F1 B0 B1 .." in out
    assert "bubble (idle share of the step): 33.3%; (S-1)/(M+S-1) = 33.3%" in out
    assert show_main(["show", "--stages", "4", "--micro-batches", "8", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["peak_live"] == [4, 3, 2, 1] and figures["bubble"] == pytest.approx(3 / 11)
    with pytest.raises(SystemExit) as exit_:
        show_main(["show", "--stages", "2", "--micro-batches", "2", "--virtual-stages", "2"])
    assert exit_.value.code == 2
    assert "argument --virtual-stages" in capsys.readouterr().err
