"""``python -m allreduce_kit.train --mode async-ps`` under mpiexec: correctness, bounded
staleness, clean shutdown, failures; and ``python -m allreduce_kit.compare``.

Small model (one hidden layer of 32), two or three epochs of the digits, at most 4 ranks. The
trade-off with sync (throughput under a straggler, accuracy at equal samples) is measured by
``benchmarks/async_tradeoff.py``, not asserted here.
"""
import json
import subprocess
import sys

import pytest

from conftest import TESTS

TRAIN = ["-m", "allreduce_kit.train", "--progress", "lines"]
SMALL = ["--hidden", "32"]
SUMMARY_KEYS = {"mode", "ranks", "workers", "wall_seconds", "train_seconds", "samples", "samples_per_second",
                "updates_applied", "gradients_rejected", "staleness_mean", "staleness_max", "train_accuracy",
                "test_accuracy", "loss_per_epoch", "epoch_numbers", "curve"}


def _ok(result):
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result


def _run(mpirun, n, tmp_path, name, args):
    path = tmp_path / f"{name}.json"
    result = _ok(mpirun(n, TRAIN + SMALL + args + ["--json", path], timeout=150))
    return json.loads(path.read_text()), result.stdout


def _python(args, cwd=TESTS):
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=90, cwd=cwd)


def test_one_worker_is_the_synchronous_trainer_bitwise_and_shuts_down_cleanly(mpirun, tmp_path):
    """With one worker nothing is stale: two sharded servers + one worker = sync on one rank, bit for bit."""
    sync, _ = _run(mpirun, 1, tmp_path, "sync", ["--epochs", "2"])
    ckpt = tmp_path / "final"
    ps, text = _run(mpirun, 3, tmp_path, "async", ["--epochs", "2", "--mode", "async-ps", "--servers", "2",
                                                   "--checkpoint-dir", ckpt])
    assert ps["params_digest"] == sync["params_digest"]
    assert ps["summary"]["loss_per_epoch"] == sync["summary"]["loss_per_epoch"]
    assert set(ps["summary"]) == set(sync["summary"]) == SUMMARY_KEYS            # the same report, both modes
    assert ps["summary"]["samples"] == sync["summary"]["samples"] == 2 * 1438
    assert ps["summary"]["updates_applied"] == sync["summary"]["updates_applied"] == 2 * 45
    assert ps["staleness"]["overall"]["max"] == 0 and ps["staleness"]["applied_per_server"] == [90, 90]
    assert sync["summary"]["staleness_max"] == 0 and sync["summary"]["gradients_rejected"] == 0
    # Clean shutdown: the worker stopped, nothing left in flight, the final parameters on disk.
    from allreduce_kit.train import checkpoint
    final = checkpoint.latest(str(ckpt))                                          # checkpoint-<updates>.npz
    assert ps["shutdown"] == {"workers_stopped": 1, "workers": 1, "messages_in_flight": 0, "saved": final}
    assert "messages left in flight: 0" in text and text.count("summary (async-ps") == 1
    arrays, _ = checkpoint.load(final)                                            # checksum verified
    params = arrays["params"]
    from allreduce_kit.train.trainer import digest
    assert digest(params) == sync["params_digest"]
    # compare: side by side, and the plot of loss against time and samples.
    png = tmp_path / "cmp.png"
    out = _ok(_python(["-m", "allreduce_kit.compare", tmp_path / "sync.json", tmp_path / "async.json", "--plot", png]))
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["sync", "async"]
    for row in ("wall seconds", "samples per second", "updates applied", "train accuracy", "test accuracy",
                "loss epoch 1", "loss epoch 2", "staleness mean", "gradients rejected"):
        assert any(line.startswith(row) for line in lines), row
    assert png.stat().st_size > 10_000


def test_bounded_staleness_rejects_older_gradients_and_counts_them(mpirun, tmp_path):
    """Worker 2 is made 20 ms slower per gradient, so worker 3 pushes several updates between
    its pull and its push: its gradients are staler than the bound of 1 (without a straggler a
    quiet machine may happen to keep both workers in step and reject nothing)."""
    ps, text = _run(mpirun, 4, tmp_path, "ssp", ["--epochs", "2", "--mode", "async-ps", "--max-staleness", "1",
                                                 "--servers", "2", "--straggler", "2:20"])
    s = ps["staleness"]
    assert s["overall"]["max"] <= 1 and all(w["staleness"]["max"] <= 1 for w in s["workers"])
    rejected = sum(w["rejected"] for w in s["workers"])
    assert rejected > 0 and rejected == s["rejected_per_server"][0] == ps["summary"]["gradients_rejected"]
    assert sum(w["pushed"] for w in s["workers"]) == ps["summary"]["updates_applied"] + rejected
    assert sorted(w["rank"] for w in s["workers"]) == [2, 3], "ranks 0 and 1 serve, 2 and 3 work"
    for w in s["workers"]:
        assert set(w["staleness"]) == {"mean", "p50", "p95", "max"}
    assert "bound 1: rejected per server" in text


@pytest.mark.parametrize("fault,message", [
    ("2:5:crash", "worker rank 2 failed"),
    ("1:5:hang", "worker rank 1 has sent nothing for"),
])
def test_a_dead_worker_is_named_by_the_server_not_waited_for(mpirun, fault, message):
    result = mpirun(3, TRAIN + SMALL + ["--mode", "async-ps", "--epochs", "20", "--inject-fault", fault,
                                        "--worker-timeout", "2"], timeout=90)
    assert result.returncode != 0
    assert result.stderr.count(message) == 1 and "after 5 gradients" in result.stderr, result.stderr[-3000:]


@pytest.mark.parametrize("n,args,message", [
    (1, ["--mode", "async-ps"], "argument --servers: 1 server(s) leave no worker in a job of 1 ranks"),
    (1, ["--max-staleness", "2"], "argument --max-staleness: only with --mode async-ps"),
    (2, ["--mode", "async-ps", "--straggler", "0:5"], "argument --straggler: rank 0 is not a worker"),
])
def test_bad_mode_options_give_one_message_and_exit_2(mpirun, n, args, message):
    result = _python(TRAIN + args) if n == 1 else mpirun(n, TRAIN + args, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.count(message) == 1, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
