"""Training that outlives its interruptions: a signal stops it with a checkpoint, a resume goes on.

Every test launches ``python -m allreduce_kit.train`` under mpiexec on the bundled digits with a
small model; the launches' timeouts separate "ends" from "hangs".
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from allreduce_kit.train import checkpoint
from allreduce_kit.train.signals import STOPPED_STATUS
from conftest import TESTS, mpiexec
from test_reliability import _rank_process

TRAIN = ["-m", "allreduce_kit.train"]
SMALL = ["--hidden", "32", "--batch-size", "16", "--progress", "lines"]

pytestmark = pytest.mark.slow


def _ok(result, status=0):
    assert result.returncode == status, f"exit {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result


class Job:
    """``mpiexec -n RANKS python -m mpi4py ARGS`` in the background, its output read as it comes."""

    def __init__(self, ranks: int, args, command=None, session: bool = False):
        """``session``: in a process group of its own, as a command typed at a terminal is."""
        command = command or [mpiexec(), "-n", str(ranks), sys.executable, "-m", "mpi4py", *map(str, args)]
        self.proc = subprocess.Popen(command, cwd=TESTS, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     stdin=subprocess.DEVNULL, start_new_session=session)
        self.session = session
        self.out: list = []
        self.err: list = []
        self.readers = [threading.Thread(target=self._read, args=(stream, into), daemon=True)
                        for stream, into in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for reader in self.readers:
            reader.start()

    @staticmethod
    def _read(stream, into) -> None:
        for line in stream:
            into.append(line)

    def wait_for_line(self, text: str, timeout: float = 150) -> None:
        """Wait until the job has printed a line holding ``text``."""
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.out):
            assert self.proc.poll() is None, f"the run ended first:\n{''.join(self.out)[-2000:]}{''.join(self.err)[-3000:]}"
            assert time.monotonic() < deadline, f"no line with {text!r} after {timeout} s"
            time.sleep(0.05)

    def finish(self, timeout: float = 120) -> subprocess.CompletedProcess:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"the job did not end within {timeout} s (a hang?)\n{''.join(self.err)[-3000:]}")
        finally:
            for reader in self.readers:
                reader.join(timeout=10)
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, "".join(self.out), "".join(self.err))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.session:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _final_params(directory: Path) -> np.ndarray:
    arrays, _ = checkpoint.load(checkpoint.latest(str(directory)))
    return arrays["params"]


# -- signals: a time limit or a preemption ------------------------------------------------------
def test_a_signal_stops_every_rank_at_one_step_with_a_checkpoint_and_resume_loses_nothing(mpirun, tmp_path):
    """3 ranks. SIGUSR1 to rank 1 alone (the others must agree to stop with it), resume; SIGINT to
    mpiexec (a Ctrl-C: it passes it on to every rank), resume: the parameters are bitwise those of
    a run never interrupted, and each stop saved the step it stopped at and exited 75."""
    whole = _stopped_twice_then_resumed(mpirun, tmp_path, 3, TRAIN + SMALL + ["--epochs", "4", "--seed", "5"],
                                        to_mpiexec=signal.SIGINT)
    assert np.array_equal(_final_params(tmp_path / "ckpt"), _final_params(whole))


def test_a_signal_stops_a_pipeline_run_with_its_checkpoint_and_resume_loses_nothing(mpirun, tmp_path):
    """4 ranks as 2 stages x 2 replicas: SIGUSR1 to one rank of the last stage, resume; SIGTERM to
    mpiexec, resume: the parameters (every stage's file) are bitwise those of a run never
    interrupted."""
    _stopped_twice_then_resumed(mpirun, tmp_path, 4, TRAIN + ["--hidden", "32,32", "--batch-size", "16",
                                                              "--progress", "lines", "--pipeline", "2",
                                                              "--micro-batches", "2", "--epochs", "4", "--seed", "5"],
                                target_rank=3)


def _stopped_twice_then_resumed(mpirun, tmp_path, ranks, common, target_rank=1, to_mpiexec=signal.SIGTERM) -> Path:
    """Run ``common`` whole; then stop it with SIGUSR1 to one rank, resume and stop it with
    ``to_mpiexec`` to mpiexec, resume to the end; check each stop and that the end is the whole
    run's. Returns the whole run's checkpoint directory."""
    whole = tmp_path / "whole"
    _ok(mpirun(ranks, common + ["--checkpoint-dir", whole, "--json", tmp_path / "whole.json"], timeout=180))
    reference = json.loads((tmp_path / "whole.json").read_text())

    ckpt = tmp_path / "ckpt"
    slowed = ["--straggler", "0:15", "--checkpoint-dir", ckpt, "--checkpoint-every", "1000"]
    stops = []
    for n, (resume, target) in enumerate(((False, "one rank"), (True, "mpiexec"))):
        job = Job(ranks, common + slowed + (["--resume"] if resume else []))
        try:
            job.wait_for_line(f"epoch {n + 1}/4")        # training is under way (and past the resume point)
            if target == "one rank":
                os.kill(_rank_process(job.proc.pid, target_rank), signal.SIGUSR1)
            else:
                job.proc.send_signal(to_mpiexec)
            result = job.finish()
        finally:
            job.kill()
        _ok(result, STOPPED_STATUS)
        name = "SIGUSR1" if target == "one rank" else signal.Signals(to_mpiexec).name
        assert f"stopped on {name} after step " in result.stderr, result.stderr[-3000:]
        assert result.stderr.count("stopped on") == 1, "one message, from rank 0"
        step = int(result.stderr.split(f"stopped on {name} after step ")[1].split(":")[0])
        assert 0 < step < reference["steps"]
        assert checkpoint.load(checkpoint.latest(str(ckpt)))[1]["step"] == step
        assert "test accuracy" not in result.stdout
        stops.append(step)
    assert stops[0] < stops[1]
    resumed = _ok(mpirun(ranks, common + ["--checkpoint-dir", ckpt, "--resume", "--json", tmp_path / "r.json"],
                         timeout=180))
    assert any("resumed" in line and f"at step {stops[1]}" in line for line in resumed.stdout.splitlines()), \
        resumed.stdout[-2000:]
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["params_digest"] == reference["params_digest"]
    assert [e["loss"] for e in report["epochs"]] == [e["loss"] for e in reference["epochs"]]
    return whole


def test_ctrl_c_at_the_terminal_stops_an_elastic_run_with_a_checkpoint(tmp_path):
    """``train --elastic -n 3`` and a Ctrl-C at its terminal (SIGINT to its whole process group:
    the supervisor, the launcher, the ranks): every rank stops at one step with that step's
    checkpoint, the supervisor exits 75 with one message and no traceback, and relaunches nothing."""
    ckpt = tmp_path / "ckpt"
    command = [sys.executable, *TRAIN, *SMALL, "--epochs", "8", "--seed", "2", "--straggler", "0:15", "--elastic", "-n",
               "3", "--checkpoint-dir", ckpt, "--checkpoint-every", "1000"]
    job = Job(3, None, command=[str(a) for a in command], session=True)
    try:
        job.wait_for_line(" 2/8  loss")
        os.killpg(job.proc.pid, signal.SIGINT)
        result = _ok(job.finish(timeout=120), STOPPED_STATUS)
    finally:
        job.kill()
    text = result.stdout + result.stderr
    assert text.count("stopped on SIGINT after step ") == 1, text[-3000:]
    assert "Traceback" not in text and "relaunching" not in text, text[-3000:]
    step = int(text.split("stopped on SIGINT after step ")[1].split(":")[0])
    assert checkpoint.load(checkpoint.latest(str(ckpt)))[1]["step"] == step > 0


# -- resume at another rank count -----------------------------------------------------------------
SYNTHETIC = ["--dataset", "synthetic", "--samples", "1280", "--features", "16", "--classes", "4", "--seed", "3"]


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for _, path in checkpoint.listing(str(src)):
        (dst / Path(path).name).write_bytes(Path(path).read_bytes())
    return dst


def test_a_resume_at_another_rank_count_continues_from_the_same_sample(mpirun, tmp_path):
    """A checkpoint at step 25 of 4 ranks (inside epoch 2 of 3; 1024 training samples, 16 steps per
    epoch). Resumed at 2 ranks with keep-batch (2 accumulation steps: the same 64-sample global
    batch), the run ends within float tolerance of the 4-rank continuation, epoch by epoch; and a
    2-rank run stopped at step 30, inside the resized epoch, then resumed at 2 ranks again, ends with
    bitwise the parameters of the 2-rank run that went through."""
    common = TRAIN + SMALL + SYNTHETIC + ["--epochs", "3"]
    start = tmp_path / "start"
    _ok(mpirun(4, common + ["--checkpoint-dir", start, "--max-steps", "25"], timeout=180))
    four, two, split = (_copy(start, tmp_path / name) for name in ("four", "two", "split"))
    _ok(mpirun(4, common + ["--checkpoint-dir", four, "--resume", "--json", tmp_path / "four.json"], timeout=180))
    went = _ok(mpirun(2, common + ["--checkpoint-dir", two, "--resume", "--json", tmp_path / "two.json"], timeout=180))
    assert ("checkpoint of 4 ranks resumed at 2 (--on-resize keep-batch): batch 16/rank x 2 accumulation steps, "
            "global batch 64 (kept)") in went.stdout, went.stdout
    a, b = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("four", "two"))
    assert a["steps"] == b["steps"] == 48 and [e["epoch"] for e in b["epochs"]] == [1, 2, 3]
    assert [e["samples"] for e in a["epochs"]] == [e["samples"] for e in b["epochs"]] == [1024] * 3
    assert np.allclose([e["loss"] for e in a["epochs"]], [e["loss"] for e in b["epochs"]], rtol=1e-4)
    pa, pb = _final_params(four), _final_params(two)
    assert not np.array_equal(pa, pb)              # other sums of the same samples...
    assert np.allclose(pa, pb, rtol=1e-3, atol=1e-4), np.abs(pa - pb).max()    # ...of the same value
    # 4 -> 2 at step 25, stopped at 30 (in the resized epoch), 2 -> 2: bitwise the run that went through.
    _ok(mpirun(2, common + ["--checkpoint-dir", split, "--resume", "--max-steps", "30"], timeout=180))
    assert checkpoint.load(checkpoint.latest(str(split)))[1]["position"] == {"epoch": 1, "offset": 30 * 64 - 1024,
                                                                              "steps": 14}
    _ok(mpirun(2, common + ["--checkpoint-dir", split, "--resume", "--json", tmp_path / "split.json"], timeout=180))
    c = json.loads((tmp_path / "split.json").read_text())
    assert c["params_digest"] == b["params_digest"]
    assert [e["loss"] for e in c["epochs"]] == [e["loss"] for e in b["epochs"]]


# -- a dead rank: the supervisor ------------------------------------------------------------------
def test_the_supervisor_does_not_start_a_fresh_run_among_another_runs_checkpoints(tmp_path):
    """``train --elastic -n 2`` into a directory holding another run's checkpoint-000000240.npz: the
    launch is refused up front (one message, status 2) and not relaunched; nothing is written there."""
    ckpt = tmp_path / "ckpt"
    config = {"dataset": "digits", "seed": 1, "test_fraction": 0.2, "hidden": [32], "dtype": "float32"}
    checkpoint.save(str(ckpt), 240, {"params": np.zeros(3)}, {"mode": "sync", "config": config})   # its run: from config
    result = subprocess.run([sys.executable, *TRAIN, *SMALL, "--elastic", "-n", "2", "--checkpoint-dir", str(ckpt),
                             "--checkpoint-every", "10", "--max-steps", "30"],
                            capture_output=True, text=True, timeout=180, cwd=TESTS)
    _ok(result, 2)
    message = f"{ckpt} holds checkpoints of another run (checkpoint-000000240.npz, step 240: --seed 1 where this run has --seed 0)"
    assert result.stderr.count(message) == 1 and result.stderr.count("error:") == 1, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert "not relaunched" in result.stdout and "relaunching" not in result.stdout
    assert sorted(os.listdir(ckpt)) == ["checkpoint-000000240.npz"]


def test_kill_9_of_one_rank_of_4_and_the_run_completes_on_3(mpirun, tmp_path):
    """``train --elastic -n 4``; rank 1 is killed with SIGKILL inside epoch 3 of 10. The run ends on 3
    ranks with the final test accuracy of an uninterrupted 4-rank run within 1 point; the report
    names the rank, the step, the steps redone (at most the checkpoint interval) and the recovery time."""
    common = TRAIN + SMALL + ["--epochs", "10", "--seed", "1"]
    _ok(mpirun(4, common + ["--json", tmp_path / "whole.json"], timeout=240))
    whole = json.loads((tmp_path / "whole.json").read_text())
    elastic = [sys.executable, *common, "--straggler", "0:30",                # slower, so that it can be hit
               "--elastic", "-n", "4", "--min-ranks", "3", "--checkpoint-dir",
               tmp_path / "ckpt", "--checkpoint-every", "10", "--json", tmp_path / "elastic.json"]
    job = Job(4, None, command=[str(a) for a in elastic])
    try:
        job.wait_for_line(" 2/10  loss")
        os.kill(_rank_process(job.proc.pid, 1), signal.SIGKILL)
        result = _ok(job.finish(timeout=300))
    finally:
        job.kill()
    out = result.stdout
    assert "[elastic] rank 1 (pid" in out and "4 -> 3 ranks" in out, out[-3000:]
    assert "replicas bitwise identical on all 3 ranks: yes" in out
    report = json.loads((tmp_path / "elastic.json").read_text())
    (loss,) = report["elastic"]["losses"]
    assert loss["rank"] == 1 and loss["ranks_before"] == 4 and loss["ranks_after"] == 3
    assert 0 <= loss["steps_redone"] <= 10 and loss["resumed_from"] % 10 == 0
    assert loss["step"] == loss["resumed_from"] + loss["steps_redone"]
    assert 0 < loss["recovery_seconds"] < 120
    assert f"first step {loss['recovery_seconds']:.1f} s after the death" in out
    assert report["ranks"] == 3 and [e["epoch"] for e in report["epochs"]] == list(range(1, 11))
    assert abs(report["test_accuracy"] - whole["test_accuracy"]) <= 0.01, (report["test_accuracy"],
                                                                           whole["test_accuracy"])
