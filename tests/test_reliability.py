"""The trainer under faults: a hung rank, a killed rank, bad numbers, bad options.

Every test launches ``python -m allreduce_kit.train`` under mpiexec on the bundled digits with a
small model. The only time bounds are the launches' timeouts, which separate "ends" from
"hangs"; how soon a job ends after a fault is measured by ``benchmarks/fault_latency.py``.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from allreduce_kit.train import checkpoint
from conftest import TESTS, mpiexec, run_mpi, unwritable_folder

TRAIN = ["-m", "allreduce_kit.train"]
SMALL = ["--hidden", "32", "--batch-size", "16", "--progress", "lines"]


def _ok(result):
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result


# -- a rank that never arrives ---------------------------------------------------------------------
def test_stall_timeout_names_the_hung_rank_and_ends_the_job(mpirun):
    """The straggler sleeps ten minutes per step; the job must end within the 120 s ``mpirun``
    allows it (start-up takes a few seconds on a loaded 2-core machine)."""
    result = mpirun(3, TRAIN + SMALL + ["--straggler", "2:600000", "--stall-timeout", "3"], timeout=120)
    assert result.returncode != 0
    assert "missing ranks (have not reached this call): [2]" in result.stderr, result.stderr[-3000:]
    assert "test accuracy" not in result.stdout


PIPELINE = ["--hidden", "16,8", "--batch-size", "16", "--progress", "lines", "--micro-batches", "2"]


def test_a_pipeline_stage_that_hangs_is_named_by_the_stages_waiting_on_it_and_the_job_ends(mpirun):
    """Stage 1 of 3 (rank 1) sleeps ten minutes before its first step: stage 0 waits for its
    gradient, stage 2 for its activations, in point-to-point waits the stall inspector watches."""
    result = mpirun(3, TRAIN + PIPELINE + ["--pipeline", "3", "--straggler", "1:600000", "--stall-timeout", "2"],
                    timeout=120)
    assert result.returncode != 0
    named = ["pipeline stage 0 (rank 0) waiting for stage 1 (rank 1) to send its gradient of micro-batch 0",
             "pipeline stage 2 (rank 2) waiting for stage 1 (rank 1) to send its activations of micro-batch 0"]
    assert any(text in result.stderr for text in named), result.stderr[-3000:]
    assert "rank 1 is in none of the library's waits (stuck in its own work" in result.stderr, result.stderr[-3000:]
    assert "test accuracy" not in result.stdout


def test_a_pipeline_stage_that_raises_ends_the_job_on_every_rank_naming_the_stage(mpirun):
    """Rank 1's stage (the last of 2) raises in its third forward (step 2); rank 0 waits on it,
    and must not hang."""
    result = mpirun(2, [TESTS / "pipeline_fault_driver.py", 1, 3] + PIPELINE + ["--pipeline", "2"], timeout=120,
                    via_mpi4py=False)
    assert result.returncode != 0
    assert "allreduce_kit: uncaught ValueError on rank 1; aborting the job" in result.stderr, result.stderr[-3000:]
    assert "ValueError: injected fault\nin pipeline stage 1 on rank 1: the forward of micro-batch 0" in result.stderr
    assert "test accuracy" not in result.stdout


# -- a rank killed with SIGKILL in the middle of training ------------------------------------------
def _descendants(pid: int):
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _rank_process(launcher: int, rank: int) -> int:
    """The pid of the MPI process of ``rank`` under the mpiexec ``launcher`` (by its PMI_RANK)."""
    for pid in _descendants(launcher):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if f"PMI_RANK={rank}".encode() in environ and b"allreduce_kit.train" in cmdline:
            return pid
    raise AssertionError(f"no process of rank {rank} under mpiexec {launcher}")


def test_a_killed_rank_ends_the_job_and_resume_matches_an_unbroken_run(mpirun, tmp_path):
    ranks = 3
    common = TRAIN + SMALL + ["--epochs", "5", "--seed", "3"]
    whole = tmp_path / "whole.json"
    _ok(mpirun(ranks, common + ["--json", whole], timeout=180))
    reference = json.loads(whole.read_text())

    # The same run, slowed by a straggler (which changes timing only), checkpointing every 10 steps.
    ckpt = tmp_path / "ckpt"
    command = [mpiexec(), "-n", str(ranks), sys.executable, "-m", "mpi4py", *map(str, common),
               "--straggler", "0:25", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "10",
               "--keep-checkpoints", "2"]
    job = subprocess.Popen(command, cwd=TESTS, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (ckpt.is_dir() and any(s >= 30 for s, _ in checkpoint.listing(str(ckpt)))):
            assert job.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline, "no checkpoint at step 30 after 120 s"
            time.sleep(0.1)
        victim = _rank_process(job.pid, 1)
        os.kill(victim, signal.SIGKILL)
        try:
            out, err = job.communicate(timeout=60)  # (how soon it ends: benchmarks/fault_latency.py)
        except subprocess.TimeoutExpired:
            pytest.fail("the job did not end within 60 s of rank 1's death")
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
    assert job.returncode != 0
    assert "test accuracy" not in out

    newest = checkpoint.latest(str(ckpt))
    arrays, meta = checkpoint.load(newest)                       # intact: checksum verified
    assert 30 <= meta["step"] < reference["steps"]
    assert len(checkpoint.listing(str(ckpt))) <= 2

    resumed_json = tmp_path / "resumed.json"
    resumed = _ok(mpirun(ranks, common + ["--checkpoint-dir", ckpt, "--resume", "--json", resumed_json],
                         timeout=180))
    assert f"resumed at step {meta['step']}" in resumed.stdout
    resumed_report = json.loads(resumed_json.read_text())
    assert resumed_report["steps"] == reference["steps"]
    assert resumed_report["params_digest"] == reference["params_digest"]
    final, final_meta = checkpoint.load(checkpoint.latest(str(ckpt)))
    assert final_meta["step"] == reference["steps"]


# -- NaN in one rank's gradient --------------------------------------------------------------------
def test_nonfinite_gradient_aborts_naming_the_step(mpirun, tmp_path):
    ckpt = tmp_path / "ckpt"
    result = mpirun(2, TRAIN + SMALL + ["--max-steps", "20", "--inject-nan", "1:7", "--checkpoint-dir", ckpt,
                                        "--checkpoint-every", "3"], timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.count("non-finite averaged gradient (NaN or Inf) at step 7 (epoch 1)") == 1
    assert "Traceback" not in result.stderr and "test accuracy" not in result.stdout
    assert [s for s, _ in checkpoint.listing(str(ckpt))] == [3, 6]      # nothing written after the NaN


def test_nonfinite_gradient_is_skipped_on_every_rank_alike(mpirun, tmp_path):
    out = tmp_path / "skip.json"
    result = _ok(mpirun(3, TRAIN + SMALL + ["--epochs", "1", "--inject-nan", "2:5", "--on-nonfinite", "skip",
                                            "--json", out], timeout=120))
    report = json.loads(out.read_text())
    assert report["skipped_steps"] == [5]
    assert report["replicas_identical"] and "replicas bitwise identical on all 3 ranks: yes" in result.stdout
    assert result.stdout.count("skipped the update of 1 step(s)") == 1
    assert report["test_accuracy"] > 0.5


def test_a_skipped_step_changes_nothing_but_that_step():
    """At one rank, in this process: skipping step 3 leaves exactly the parameters of two clean steps."""
    from allreduce_kit.train.trainer import Config, NonFiniteError, Trainer

    def params(steps, **extra):
        trainer = Trainer(Config(hidden=(16,), batch_size=16, max_steps=steps, **extra))
        trainer.run()
        trainer.close()
        return trainer.model.params.copy(), trainer.optimizer.velocity.copy(), trainer

    two, two_v, _ = params(2)
    skipped, skipped_v, trainer = params(3, inject_nan=(0, 3), on_nonfinite="skip")
    assert trainer.skipped_steps == [3] and trainer.step == 3
    assert np.array_equal(two, skipped) and np.array_equal(two_v, skipped_v)
    with pytest.raises(NonFiniteError, match="at step 3"):
        params(3, inject_nan=(0, 3))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_finiteness_check_sees_nan_and_both_infinities_but_not_large_values(dtype):
    from allreduce_kit.train.trainer import all_finite

    big = np.full(1000, np.finfo(dtype).max / 2, dtype=dtype)       # in float64 its sum overflows
    assert all_finite(big) and all_finite(np.zeros(0, dtype)) and all_finite(-big)
    for bad in (np.nan, np.inf, -np.inf):
        for where in (0, 500, 999):
            buf = np.ones(1000, dtype=dtype)
            buf[where] = bad
            assert not all_finite(buf), (bad, where)
    both = np.ones(10, dtype=dtype)
    both[[2, 7]] = np.inf, -np.inf
    assert not all_finite(both)


# -- every option with an impossible value ---------------------------------------------------------
DIGITS_TRAIN = 1437          # 1797 digits minus 20 % held out


def _bad_cases(tmp: Path):
    """(id, argv, the message rank 0 must print once); the files they refer to are made here."""
    afile = tmp / "a-file"
    afile.write_text("not a directory")
    empty = tmp / "empty"
    empty.mkdir()
    locked = unwritable_folder(tmp)
    quick = ["--max-steps", "2", "--hidden", "8"]   # without the check these would train, then lose the results
    return [
        ("epochs-0", ["--epochs", "0"], "argument --epochs: must be >= 1, got '0'"),
        ("epochs-text", ["--epochs", "many"], "argument --epochs: expected an integer, got 'many'"),
        ("batch-0", ["--batch-size", "0"], "argument --batch-size: must be >= 1, got '0'"),
        ("batch-negative", ["--batch-size", "-4"], "argument --batch-size: must be >= 1, got '-4'"),
        ("lr-0", ["--lr", "0"], "argument --lr: must be > 0.0, got '0'"),
        ("lr-nan", ["--lr", "nan"], "argument --lr: must be > 0.0, got 'nan'"),
        ("lr-scaling", ["--lr-scaling", "square"], "argument --lr-scaling: invalid choice: 'square'"),
        ("warmup-negative", ["--warmup-epochs", "-1"], "argument --warmup-epochs: must be >= 0.0, got '-1'"),
        ("momentum-1", ["--momentum", "1"], "argument --momentum: must be < 1, got 1.0"),
        ("momentum-negative", ["--momentum", "-0.5"], "argument --momentum: must be >= 0.0, got '-0.5'"),
        ("weight-decay", ["--weight-decay", "-0.001"], "argument --weight-decay: must be >= 0.0, got '-0.001'"),
        ("hidden-0", ["--hidden", "32,0"], "argument --hidden: layer widths must be >= 1, got '32,0'"),
        ("hidden-text", ["--hidden", "12,x"], "argument --hidden: expected comma-separated layer widths"),
        ("dtype", ["--dtype", "float16"], "argument --dtype: invalid choice: 'float16'"),
        ("seed", ["--seed", "1.5"], "argument --seed: invalid int value: '1.5'"),
        ("max-steps", ["--max-steps", "-1"], "argument --max-steps: must be >= 0, got '-1'"),
        ("dataset", ["--dataset", "imagenet"], "argument --dataset: invalid choice: 'imagenet'"),
        ("samples-1", ["--dataset", "synthetic", "--samples", "1"], "argument --samples: must be >= 2, got '1'"),
        ("more-ranks-than-samples", ["--dataset", "synthetic", "--samples", "2", "--test-fraction", "0.5"],
         "argument --samples: 1 training sample cannot give each of 2 ranks a shard"),
        ("features-0", ["--dataset", "synthetic", "--features", "0"], "argument --features: must be >= 1, got '0'"),
        ("classes-1", ["--dataset", "synthetic", "--classes", "1"], "argument --classes: must be >= 2, got '1'"),
        ("test-fraction-0", ["--test-fraction", "0"], "argument --test-fraction: must be > 0.0, got '0'"),
        ("test-fraction-1", ["--test-fraction", "1"], "argument --test-fraction: must be < 1, got 1.0"),
        ("test-fraction-tiny", ["--test-fraction", "0.0001"],
         "argument --test-fraction: 0.0001 of 1797 samples leaves no test sample"),
        ("algorithm", ["--algorithm", "carrier-pigeon"], "argument --algorithm: invalid choice: 'carrier-pigeon'"),
        ("bucket-mb", ["--bucket-mb", "-1"], "argument --bucket-mb: must be >= 0.0, got '-1'"),
        ("straggler-rank", ["--straggler", "2:10"], "argument --straggler: rank 2 does not exist in a job of 2 ranks"),
        ("straggler-ms", ["--straggler", "1:-5"], "argument --straggler: expected RANK:MS"),
        ("straggler-text", ["--straggler", "slow"], "argument --straggler: expected RANK:MS"),
        ("jitter", ["--jitter-ms", "-2"], "argument --jitter-ms: must be >= 0.0, got '-2'"),
        ("gather-every", ["--gather-every", "0"], "argument --gather-every: must be >= 1, got '0'"),
        ("bench-allreduce", ["--bench-allreduce", "-1"], "argument --bench-allreduce: must be >= 0, got '-1'"),
        ("progress", ["--progress", "fancy"], "argument --progress: invalid choice: 'fancy'"),
        ("json-dir", ["--json", "/no/such/dir/run.json"], "argument --json: directory /no/such/dir does not exist"),
        ("plot-dir", ["--plot", "/no/such/dir/run.png"], "argument --plot: directory /no/such/dir does not exist"),
        ("json-is-a-directory", ["--json", str(empty)] + quick, f"argument --json: {empty} is a directory"),
        ("json-ends-in-a-separator", ["--json", str(tmp / "out") + os.sep] + quick,
         f"argument --json: {tmp / 'out'}{os.sep} ends in a separator, naming a directory"),
        ("json-unwritable", ["--json", str(locked / "run.json")] + quick,
         f"argument --json: cannot write {locked / 'run.json'}: Permission denied"),
        ("json-under-a-file", ["--json", str(afile / "run.json")] + quick,
         f"argument --json: cannot write {afile / 'run.json'}: {afile} is not a directory"),
        ("plot-is-a-directory", ["--plot", str(empty)] + quick, f"argument --plot: {empty} is a directory"),
        ("plot-without-png", ["--plot", str(tmp / "curves")] + quick,
         f"argument --plot: {tmp / 'curves'} does not end in .png (the file is written as PNG to exactly the path "
         f"given)"),
        ("json-and-plot-one-file", ["--json", str(tmp / "both.png"), "--plot", str(tmp / "both.png")] + quick,
         f"argument --plot: {tmp / 'both.png'} is also the path of --json"),
        ("checkpoint-dir-file", ["--checkpoint-dir", str(afile)],
         f"argument --checkpoint-dir: {afile} exists and is not a directory"),
        ("checkpoint-dir-under-file", ["--checkpoint-dir", str(afile / "sub")],
         f"argument --checkpoint-dir: cannot create {afile / 'sub'}: {afile} is not a directory"),
        ("checkpoint-dir-empty", ["--checkpoint-dir", ""], "argument --checkpoint-dir: expected a directory"),
        ("checkpoint-every", ["--checkpoint-every", "-1"], "argument --checkpoint-every: must be >= 0, got '-1'"),
        ("checkpoint-every-no-dir", ["--checkpoint-every", "5"], "argument --checkpoint-every: needs --checkpoint-dir"),
        ("resume-no-dir", ["--resume"], "argument --resume: needs --checkpoint-dir"),
        ("resume-empty-dir", ["--resume", "--checkpoint-dir", str(empty)], f"--resume: no checkpoint in {empty}"),
        ("stall-timeout", ["--stall-timeout", "-1"], "argument --stall-timeout: must be >= 0.0, got '-1'"),
        ("stall-timeout-text", ["--stall-timeout", "soon"], "argument --stall-timeout: expected a number, got 'soon'"),
        ("keep-checkpoints", ["--keep-checkpoints", "0"], "argument --keep-checkpoints: must be >= 1, got '0'"),
        ("on-nonfinite", ["--on-nonfinite", "ignore"], "argument --on-nonfinite: invalid choice: 'ignore'"),
        ("inject-nan-rank", ["--inject-nan", "2:1"], "argument --inject-nan: rank 2 does not exist in a job of 2 ranks"),
        ("inject-nan-step", ["--inject-nan", "0:0"], "argument --inject-nan: expected RANK:STEP"),
        ("unknown-option", ["--epoch", "3", "--learning-rate", "1"], "unrecognized arguments: --learning-rate 1"),
    ]


BAD_CHECKPOINTS = ("resume-truncated", "resume-flipped-byte", "resume-other-model",
                   "resume-other-seed", "resume-other-test-fraction", "resume-other-dataset",
                   "resume-other-synthetic-samples", "resume-async-ps-checkpoint", "async-ps-into-sync-checkpoints",
                   "sync-into-async-ps-checkpoints")


def _bad_checkpoints(tmp: Path, good: Path, synthetic: Path, ps: Path):
    """Copies of a good checkpoint directory with the newest file spoiled in each way, and their cases;
    and runs that do not fit the checkpoints in ``good``, ``synthetic`` (``--dataset synthetic
    --samples 600``) and ``ps`` (an async-ps run's), both written at step 4 by the job that runs the cases."""
    newest = Path(checkpoint.latest(str(good)))
    older = Path(checkpoint.listing(str(good))[0][1]).name
    cases = []

    def spoiled(name):
        directory = tmp / name
        shutil.copytree(good, directory)
        return directory, directory / newest.name

    directory, path = spoiled("truncated")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    cases.append(("resume-truncated", ["--resume", "--checkpoint-dir", str(directory)] + SMALL,
                  f"--resume: {path} is truncated or corrupted"))
    directory, path = spoiled("flipped")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(data)
    cases.append(("resume-flipped-byte", ["--resume", "--checkpoint-dir", str(directory)] + SMALL,
                  f"move it away to resume from the previous one, {directory / older}"))
    directory, path = spoiled("shape")
    cases.append(("resume-other-model", ["--resume", "--checkpoint-dir", str(directory), "--hidden", "16",
                                         "--batch-size", "16"],
                  f"--resume: {path} holds a 64-32-10 float32 model, this run builds 64-16-10 float32"))
    # What changes the data is refused, naming both values (the good run had the defaults).
    resume = ["--resume", "--checkpoint-dir", str(good)] + SMALL
    newest_good = checkpoint.latest(str(good))
    for case, option, was, now in (("resume-other-seed", "--seed", "0", "7"),
                                   ("resume-other-test-fraction", "--test-fraction", "0.2", "0.5"),
                                   ("resume-other-dataset", "--dataset", "digits", "synthetic")):
        cases.append((case, resume + [option, now],
                      f"--resume: {newest_good} was written by a run with {option} {was}; this run has {option} {now}"))
    cases.append(("resume-other-synthetic-samples",
                  ["--resume", "--checkpoint-dir", str(synthetic), "--dataset", "synthetic", "--samples", "800"] + SMALL,
                  f"--resume: {synthetic / checkpoint.name_for(4)} was written by a run with --samples 600; this run "
                  f"has --samples 800"))
    # A checkpoint of the other mode: named as such, at --resume and before mixing checkpoints.
    cases.append(("resume-async-ps-checkpoint", ["--resume", "--checkpoint-dir", str(ps)] + SMALL,
                  f"--resume: {ps / checkpoint.name_for(4)} was written by a --mode async-ps run"))
    cases.append(("async-ps-into-sync-checkpoints", ["--mode", "async-ps", "--checkpoint-dir", str(good), "--max-steps",
                                                     "2"] + SMALL,
                  f"argument --checkpoint-dir: {good} holds checkpoints of a --mode sync run "
                  f"({os.path.basename(newest_good)}); this --mode async-ps run would mix its own in"))
    cases.append(("sync-into-async-ps-checkpoints", ["--checkpoint-dir", str(ps), "--max-steps", "2"] + SMALL,
                  f"argument --checkpoint-dir: {ps} holds checkpoints of a --mode async-ps run"))
    return cases


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory):
    """Every bad case run in one 2-rank job: {id: (message, [record of rank 0, record of rank 1])}."""
    tmp = tmp_path_factory.mktemp("bad")
    good, synthetic, ps = tmp / "good", tmp / "synthetic", tmp / "ps"
    _ok(run_mpi(2, TRAIN + SMALL + ["--max-steps", "8", "--checkpoint-dir", good, "--checkpoint-every", "4"],
                timeout=120))
    # The checkpoints the other cases need, made in the same job as the cases (each must succeed).
    setup = [SMALL + ["--max-steps", "4", "--checkpoint-dir", str(synthetic), "--dataset", "synthetic", "--samples",
                      "600"],
             SMALL + ["--max-steps", "4", "--checkpoint-dir", str(ps), "--mode", "async-ps"]]
    cases = _bad_cases(tmp) + _bad_checkpoints(tmp, good, synthetic, ps)
    (tmp / "cases.json").write_text(json.dumps(setup + [argv for _, argv, _ in cases]))
    result = run_mpi(2, [TESTS / "bad_options_driver.py", tmp / "cases.json", tmp / "out.json"], timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = json.loads((tmp / "out.json").read_text())
    for argv, ranks in zip(setup, records):
        assert [r["status"] for r in ranks] == [0, 0] and not any(r["raised"] for r in ranks), (argv, ranks)
    return {case[0]: (case[2], ranks) for case, ranks in zip(cases, records[len(setup):])}


def _ids():
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        return [c[0] for c in _bad_cases(Path(tmp))] + list(BAD_CHECKPOINTS)


@pytest.mark.parametrize("case", _ids())
def test_an_impossible_value_gives_one_message_from_rank_0_and_status_2(bad_runs, case):
    message, ranks = bad_runs[case]
    for rank, record in enumerate(ranks):
        assert record["raised"] is None, f"rank {rank} raised {record['raised']}"
        assert record["status"] == 2, f"rank {rank} exit status {record['status']}\n{record['stderr']}"
        assert "Traceback" not in record["stderr"] + record["stdout"]
        assert record["stdout"] == ""
    assert ranks[0]["stderr"].count(message) == 1, ranks[0]["stderr"]
    assert ranks[0]["stderr"].count("error:") == 1
    assert all(record["stderr"] == "" for record in ranks[1:])


@pytest.mark.parametrize("args,message", [
    (["--stall-timeout", "-1"], "argument --stall-timeout: must be >= 0.0"),
    (["--inject-nan", "3:1"], "argument --inject-nan: rank 3 does not exist in a job of 3 ranks"),
])
def test_bad_reliability_options_exit_2_as_a_process(mpirun, args, message):
    result = mpirun(3, TRAIN + args, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.count(message) == 1, result.stderr
    assert "Traceback" not in result.stderr + result.stdout


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_bench_refuses_a_bad_stall_timeout(mpirun, value):
    result = mpirun(2, ["-m", "allreduce_kit.bench", "-b", "4", "-e", "4", f"--stall-timeout={value}"], timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.count(f"--stall-timeout must be >= 0 seconds (0: off), got {float(value)}") == 1
    assert "Traceback" not in result.stderr + result.stdout
