"""``python -m allreduce_kit.train --zero`` and ``python -m allreduce_kit.memory`` from the command line.

A stage on a run it does not fit, and a run whose model state would not fit in the node's memory,
are refused before training with one message from rank 0 naming the option and exit status 2; a
sharded run reports the model state it held beside the estimate, and the bytes it sent per step.
The command lines share one 2-rank job (``bad_options_driver.py``).
"""
import json

import pytest

from allreduce_kit import memory
from conftest import TESTS, run_mpi

QUICK = ["--hidden", "16", "--max-steps", "2", "--progress", "lines"]

BAD = [
    ("async-ps", ["--zero", "3", "--mode", "async-ps"], "argument --zero: 3 is for --mode sync only"),
    ("accum-steps", ["--zero", "2", "--accum-steps", "2"], "argument --zero: 2 does not combine with --accum-steps 2"),
    ("backup-workers", ["--zero", "1", "--backup-workers", "1"], "argument --zero: 1 does not combine with --backup-workers"),
    ("local-sgd", ["--zero", "1", "--local-sgd", "2"], "argument --zero: 1 does not combine with --local-sgd"),
    ("bench-allreduce", ["--zero", "2", "--bench-allreduce", "3"], "argument --zero: 2 does not combine with --bench-allreduce"),
    ("stage-4", ["--zero", "4"], "argument --zero: invalid choice: 4"),
    ("adam-momentum", ["--optimizer", "adam", "--momentum", "0.5"], "argument --momentum: only with --optimizer sgd"),
    ("adam-async", ["--optimizer", "adam", "--mode", "async-ps"], "argument --optimizer: adam is for --mode sync only"),
    # 3.2 G parameters with Adam: 51 GB per rank at --zero 0, more than any node here has.
    ("too-big", ["--hidden", "40000,40000", "--optimizer", "adam"], "argument --zero: 0: this run's model state"),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The bad cases and one good sharded run with --json, in one 2-rank job."""
    tmp = tmp_path_factory.mktemp("zero_cli")
    cases = [QUICK + argv for _, argv, _ in BAD]
    cases.append(QUICK + ["--zero", "2", "--optimizer", "adam", "--bucket-mb", "0.004", "--json", str(tmp / "run.json")])
    cases.append(QUICK + ["--zero", "3", "--optimizer", "adam", "--checkpoint-dir", str(tmp / "ck")])
    for stage in ("1", "2", "3"):
        cases.append(QUICK + ["--zero", stage, "--max-steps", "4", "--inject-nan", "1:2"])
    (tmp / "cases.json").write_text(json.dumps(cases))
    result = run_mpi(2, [TESTS / "bad_options_driver.py", tmp / "cases.json", tmp / "out.json"], timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = json.loads((tmp / "out.json").read_text())
    return records, json.loads((tmp / "run.json").read_text()), tmp / "ck"


@pytest.mark.parametrize("case", [name for name, _, _ in BAD])
def test_a_stage_that_does_not_fit_is_refused_with_one_message_and_status_2(runs, case):
    index = [name for name, _, _ in BAD].index(case)
    message = BAD[index][2]
    ranks = runs[0][index]
    for rank, record in enumerate(ranks):
        assert record["raised"] is None, f"rank {rank} raised {record['raised']}"
        assert record["status"] == 2, f"rank {rank} exit status {record['status']}\n{record['stdout'][-2000:]}"
        assert "Traceback" not in record["stderr"] + record["stdout"]
    assert ranks[0]["stderr"].count(message) == 1, ranks[0]["stderr"]
    assert all(record["stderr"] == "" for record in ranks[1:])


def test_a_sharded_run_reports_its_model_state_beside_the_estimate_and_the_bytes_it_sent(runs):
    records, report, _ = runs
    good = records[len(BAD)]
    assert [r["status"] for r in good] == [0, 0], good[0]["stderr"][-2000:]
    assert "memory: --zero 2" in good[0]["stdout"]
    m = report["memory"]
    assert m["zero"] == 2 and m["optimizer"] == "adam"
    assert m["model_state_bytes"] == m["model_state_estimate"] > 0
    assert len(m["model_state_bytes_per_rank"]) == 2 and m["peak_rss_bytes"] > m["model_state_bytes"]
    n = report["parameters"] * 4
    assert report["communication"]["bytes_sent_per_step"] == pytest.approx(2 * n * 1 / 2, rel=0.05)
    assert report["zero"]["stage"] == 2 and report["config"]["zero"] == 2


def test_the_estimator_prints_each_stages_bytes_per_rank(capsys):
    assert memory.main(["--params", "250M", "--ranks", "8", "--optimizer", "adam"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line[:5].strip() in "0123" and line.strip()}
    assert rows["0"][1:3] == ["1.000", "GB"] and rows["0"][9:11] == ["4.000", "GB"]     # 16 bytes x 250M
    assert rows["1"][5:7] == ["0.250", "GB"]                                           # Adam's 8 bytes / 8 ranks
    assert rows["3"][1:3] == ["0.125", "GB"]                                           # parameters / 8 ranks


def test_the_model_state_formulas(capsys):
    psi, n = 10 ** 6, 8
    assert memory.model_state(psi, n, 0, "adam")["total"] == 16 * psi
    assert memory.model_state(psi, n, 1, "adam")["total"] == 8 * psi + 8 * psi // n
    two = memory.model_state(psi, n, 2, "adam", layers=[psi // 10] * 10, bucket=psi // 10)
    assert two["total"] - two["buffers"] == 4 * psi + 12 * psi // n
    three = memory.model_state(psi, n, 3, "adam", layers=[psi // 10] * 10)
    assert three["total"] - three["buffers"] == 16 * psi // n
    assert memory.model_state(1199, 5, 1, "sgd", itemsize=8)["optimizer_state"] == 8 * 240   # the longest block


@pytest.mark.parametrize("argv,message", [(["--params", "lots", "--ranks", "8"], "argument --params"),
                                          (["--params", "1M", "--ranks", "0"], "argument --ranks"),
                                          (["--params", "1M", "--ranks", "4", "--nodes", "5"], "argument --nodes")])
def test_the_estimator_refuses_bad_input_with_status_2(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        memory.main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_consolidate_writes_a_sharded_checkpoint_whole_and_names_a_rank_file_that_does_not_belong(runs, tmp_path,
                                                                                                    capsys):
    import shutil

    import numpy as np

    from allreduce_kit import checkpoint as tool
    from allreduce_kit.train import checkpoint

    records, _, directory = runs
    assert [r["status"] for r in records[len(BAD) + 1]] == [0, 0], records[len(BAD) + 1][0]["stderr"][-2000:]
    manifest = checkpoint.latest(str(directory))
    _, meta = checkpoint.load(manifest)
    assert meta["sharded"]["stage"] == 3 and meta["sharded"]["ranks"] == 2 and "block" in meta["sharded"]["rule"]
    out = tmp_path / "whole.npz"
    assert tool.main(["consolidate", str(directory), str(out)]) == 0
    arrays, record = checkpoint.load(str(out))
    assert set(arrays) == {"params", "exp_avg", "exp_avg_sq"} and arrays["params"].shape == (1210,)
    assert arrays["params"].dtype == np.float32 and record["step"] == 2 and "sharded" not in record
    assert np.abs(arrays["exp_avg_sq"]).max() > 0
    # rank 0's file put where rank 1's belongs: named, exit 2, nothing written
    copy = tmp_path / "copy"
    shutil.copytree(directory, copy)
    shards = checkpoint.shards_dir(str(copy / __import__("os").path.basename(manifest)))
    shutil.copy(f"{shards}/rank-00000.npz", f"{shards}/rank-00001.npz")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        tool.main(["consolidate", str(copy), str(tmp_path / "bad.npz")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "rank-00001.npz is not rank 1's file" in err and "Traceback" not in err
    assert not (tmp_path / "bad.npz").exists()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_nan_in_one_ranks_gradient_stops_a_sharded_run_on_every_rank_at_that_step(runs, stage):
    ranks = runs[0][len(BAD) + 1 + stage]
    assert [r["status"] for r in ranks] == [1, 1], ranks[0]["stderr"][-2000:]
    assert all(r["raised"] is None for r in ranks)
    assert "non-finite averaged gradient (NaN or Inf) at step 2" in ranks[0]["stderr"]
