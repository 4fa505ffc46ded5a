"""``python -m allreduce_kit.train`` refuses what cannot work before training starts, and says what it used.

An unusable checkpoint directory is found by trying it; an option of the other ``--mode`` is
refused (only options typed on the command line count); a ``--batch-size`` larger than a rank's
shard is lowered to the shard and the header and ``--json`` say so. Every bad command line gets
one message from rank 0 and exit status 2 on every rank, no traceback. The command lines run
under mpiexec with a timeout; most share one 2-rank job (``bad_options_driver.py``).
"""
import json
import os
from pathlib import Path
from typing import Optional

import numpy as np
import pytest

from allreduce_kit.train import async_main, checkpoint
from allreduce_kit.train.__main__ import build_parser, given_options
from conftest import TESTS, run_mpi

TRAIN = ["-m", "allreduce_kit.train"]
QUICK = ["--hidden", "16", "--max-steps", "2", "--progress", "lines"]   # short, were a bad line accepted
ROOT = os.geteuid() == 0


def _unwritable_directory(tmp_path: Path) -> Optional[str]:
    """A directory this user cannot create files in (read-only; for root, a sysfs one), or None."""
    if not ROOT:
        locked = tmp_path / "locked"
        locked.mkdir(exist_ok=True)
        locked.chmod(0o500)
        return str(locked)
    if os.path.isdir("/sys/kernel") and checkpoint.directory_problem("/sys/kernel") is not None:
        return "/sys/kernel"
    return None


# -- the checkpoint directory, tried rather than guessed -----------------------------------------------
def test_a_directory_that_cannot_be_created_is_refused_with_one_message_and_status_2():
    """As root, ``os.access`` calls /proc writable, yet /proc/x cannot be made: only trying tells."""
    result = run_mpi(2, TRAIN + QUICK + ["--checkpoint-dir", "/proc/x", "--checkpoint-every", "1"], timeout=120)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    assert result.stderr.count("argument --checkpoint-dir: cannot create /proc/x: ") == 1, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert "epoch 1/" not in result.stdout


def test_the_probe_reports_each_way_a_directory_is_unusable(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert checkpoint.directory_problem(str(afile)) == f"{afile} exists and is not a directory"
    assert checkpoint.directory_problem(str(afile / "sub")) == f"cannot create {afile / 'sub'}: {afile} is not a directory"
    assert checkpoint.directory_problem("/proc/x/y").startswith("cannot create /proc/x/y: ")
    locked = _unwritable_directory(tmp_path)
    if locked is None:
        pytest.skip("no directory here refuses files to root")
    assert checkpoint.directory_problem(locked).startswith(f"cannot write a file in {locked}: ")
    if not ROOT:
        assert checkpoint.directory_problem(os.path.join(locked, "new")).startswith("cannot create ")


def test_the_probe_leaves_nothing_behind(tmp_path):
    nested = tmp_path / "a" / "b" / "c"
    assert checkpoint.directory_problem(str(nested)) is None
    assert list(tmp_path.iterdir()) == []                    # the directories it made are gone again
    existing = tmp_path / "ckpt"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    assert checkpoint.directory_problem(str(existing)) is None
    assert sorted(p.name for p in existing.iterdir()) == ["keep.txt"]


# -- options of the other mode ---------------------------------------------------------------------
def test_only_typed_options_count_as_given():
    parser = build_parser()
    for argv, typed in (([], set()),
                        (["--epochs", "3", "--worker-t", "5", "--resume"], {"epochs", "worker_timeout", "resume"}),
                        (["--mode=sync", "--servers", "1", "--lr-scaling", "none"], {"mode", "servers", "lr_scaling"})):
        args = parser.parse_args(argv)
        assert given_options(parser, args, argv) == typed, argv


def test_every_mode_specific_option_exists_and_belongs_to_one_mode():
    dests = set(vars(build_parser().parse_args([])))
    assert set(async_main.ASYNC_ONLY) <= dests and set(async_main.SYNC_ONLY) <= dests
    assert not set(async_main.ASYNC_ONLY) & set(async_main.SYNC_ONLY)
    assert "mode" not in async_main.ASYNC_ONLY + async_main.SYNC_ONLY


def _cases(tmp_path: Path):
    """(id, argv, the message rank 0 prints once)."""
    locked = _unwritable_directory(tmp_path)
    async_ps = ["--mode", "async-ps"]
    cases = [("checkpoint-dir-uncreatable", ["--checkpoint-dir", "/proc/x/ckpt"],
              "argument --checkpoint-dir: cannot create /proc/x/ckpt: ")]
    # A directory holding checkpoints: another run's (--hidden 32, not QUICK's 16), or this async-ps
    # run's own, which it cannot resume (their records hold only the configuration, as older ones do).
    for mode, hidden in (("sync", [32]), ("async-ps", [16])):
        held = tmp_path / f"held-{mode}"
        config = {"dataset": "digits", "seed": 0, "test_fraction": 0.2, "hidden": hidden, "dtype": "float32"}
        checkpoint.save(str(held), 5, {"params": np.zeros(3)}, {"mode": mode, "config": config})
    cases.append(("checkpoint-dir-of-another-run", ["--checkpoint-dir", str(tmp_path / "held-sync")],
                  f"argument --checkpoint-dir: {tmp_path / 'held-sync'} holds checkpoints of another run "
                  f"(checkpoint-000000005.npz, step 5: --hidden 32 where this run has --hidden 16)"))
    cases.append(("checkpoint-dir-of-this-async-ps-run", async_ps + ["--checkpoint-dir", str(tmp_path / "held-async-ps")],
                  f"argument --checkpoint-dir: {tmp_path / 'held-async-ps'} holds checkpoints of this run (the same "
                  f"--mode, data, --seed and model; newest checkpoint-000000005.npz, step 5); a fresh run would mix "
                  f"its own in with them: a --mode async-ps run does not resume; to start over, give it another "
                  f"directory"))
    if locked is not None:
        cases.append(("checkpoint-dir-unwritable", ["--checkpoint-dir", locked],
                      f"argument --checkpoint-dir: cannot write a file in {locked}: "))
    for option, value in (("--worker-timeout", "5"), ("--servers", "1"), ("--max-staleness", "0"),
                          ("--inject-fault", "1:1:crash")):
        cases.append((f"sync{option}", [option, value], f"argument {option}: only with --mode async-ps"))
    cases.append(("sync-abbreviated", ["--worker-t", "5"], "argument --worker-timeout: only with --mode async-ps"))
    for option, value in (("--algorithm", "ring"), ("--bucket-mb", "1"), ("--gather-every", "5"),
                          ("--warmup-epochs", "1"), ("--lr-scaling", "none"), ("--on-nonfinite", "skip"),
                          ("--inject-nan", "1:1"), ("--checkpoint-every", "0"), ("--bench-allreduce", "0"),
                          ("--accum-steps", "2"), ("--on-resize", "rescale-lr")):
        cases.append((f"async{option}", async_ps + [option, value], f"argument {option}: only with --mode sync"))
    cases.append(("async--resume", async_ps + ["--resume"], "argument --resume: only with --mode sync"))
    cases.append(("async--trace", async_ps + ["--trace", str(tmp_path / "t.json")],
                  "argument --trace: only with --mode sync"))
    cases.append(("trace-unwritable", ["--trace", "/proc/x/t.json"], "argument --trace: "))
    cases.append(("trace-directory", ["--trace", str(tmp_path)], f"argument --trace: {tmp_path} is a directory"))
    cases.append(("trace-steps-empty", ["--trace", str(tmp_path / "t.json"), "--trace-steps", "5:5"],
                  "argument --trace-steps: the window '5:5' is empty"))
    cases.append(("trace-steps-inverted", ["--trace", str(tmp_path / "t.json"), "--trace-steps", "9:3"],
                  "argument --trace-steps: the window '9:3' is inverted"))
    cases.append(("trace-steps-alone", ["--trace-steps", "0:5"], "argument --trace-steps: needs --trace"))
    for name, argv, message in (
            ("compression-rank-without-powersgd", ["--compression-rank", "2"],
             "argument --compression-rank: only with --compression powersgd"),
            ("compression-start-without-powersgd", ["--compression", "fp16", "--compression-start", "5"],
             "argument --compression-start: only with --compression powersgd"),
            ("compression-rank-above-every-matrix", ["--compression", "powersgd", "--compression-rank", "17"],
             "argument --compression-rank: 17 is above the smaller side of every weight matrix of this model "
             "(at most 16)"),
            ("compression-fp16-float64", ["--compression", "fp16", "--dtype", "float64"],
             "argument --compression: fp16 sends float32 values as 16 bits, not --dtype float64"),
            ("compression-bf16-algorithm", ["--compression", "bf16", "--algorithm", "tree"],
             "argument --compression: bf16 runs with --algorithm auto, ring or hierarchical, not tree"),
            ("compression-local-sgd", ["--compression", "powersgd", "--local-sgd", "2"],
             "argument --compression: powersgd compresses plain sync steps only, not with --local-sgd 2"),
            ("compression-pipeline", ["--compression", "fp16", "--pipeline", "2"],
             "argument --compression: fp16 compresses sync steps (plain or --zero) only, not with --pipeline 2"),
            ("trace-pipeline", ["--pipeline", "2", "--trace", str(tmp_path / "t.json")],
             "argument --trace: not with --pipeline"),
            ("compression-async", async_ps + ["--compression", "fp16"],
             "argument --compression: fp16 compresses sync steps (plain or --zero) only, not with --mode async-ps"),
            ("compression-powersgd-zero", ["--compression", "powersgd", "--zero", "1"],
             "argument --compression: powersgd compresses plain sync steps only, not with --zero 1")):
        cases.append((name, argv, message))
    return [(name, QUICK + argv, message) for name, argv, message in cases]


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory):
    """Every case in one 2-rank job: {id: (message, [rank 0's record, rank 1's record])}."""
    tmp = tmp_path_factory.mktemp("bad_input")
    cases = _cases(tmp)
    (tmp / "cases.json").write_text(json.dumps([argv for _, argv, _ in cases]))
    result = run_mpi(2, [TESTS / "bad_options_driver.py", tmp / "cases.json", tmp / "out.json"], timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = json.loads((tmp / "out.json").read_text())
    return {name: (message, ranks) for (name, _, message), ranks in zip(cases, records)}


def _ids():
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        return [name for name, _, _ in _cases(Path(tmp))]


@pytest.mark.parametrize("case", _ids())
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


# -- a batch larger than the shard ---------------------------------------------------------------------
@pytest.mark.parametrize("ranks,mode,per,shard", [
    (2, "sync", "/rank (1438 global", 719),                 # 1438 training samples over 2 ranks
    (3, "async-ps", " per gradient", 719),                  # over the 2 workers of 3 ranks
])
def test_a_batch_larger_than_the_shard_is_lowered_to_it_and_reported(tmp_path, ranks, mode, per, shard):
    out = tmp_path / "run.json"
    result = run_mpi(ranks, TRAIN + ["--mode", mode, "--hidden", "16", "--epochs", "1", "--progress", "lines",
                                     "--batch-size", "100000", "--json", out], timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"{shard}{per}" in result.stdout and "--batch-size 100000 is more than a" in result.stdout, result.stdout
    assert "100000/rank" not in result.stdout and "100000 per gradient" not in result.stdout
    config = json.loads(out.read_text())["config"]
    assert config["batch_size"] == shard and config["batch_size_requested"] == 100000
