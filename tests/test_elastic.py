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

    def __init__(self, ranks: int, args, command=None):
        command = command or [mpiexec(), "-n", str(ranks), sys.executable, "-m", "mpi4py", *map(str, args)]
        self.proc = subprocess.Popen(command, cwd=TESTS, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     stdin=subprocess.DEVNULL)
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


def _final_params(directory: Path) -> np.ndarray:
    arrays, _ = checkpoint.load(checkpoint.latest(str(directory)))
    return arrays["params"]


# -- signals: a time limit or a preemption ------------------------------------------------------
def test_a_signal_stops_every_rank_at_one_step_with_a_checkpoint_and_resume_loses_nothing(mpirun, tmp_path):
    """3 ranks. SIGUSR1 to rank 1 alone (the others must agree to stop with it), resume; SIGTERM to
    mpiexec (which forwards it to every rank), resume: the parameters are bitwise those of a run
    never interrupted, and each stop saved the step it stopped at and exited 75."""
    ranks = 3
    common = TRAIN + SMALL + ["--epochs", "4", "--seed", "5"]
    whole = tmp_path / "whole"
    _ok(mpirun(ranks, common + ["--checkpoint-dir", whole, "--json", tmp_path / "whole.json"], timeout=180))
    reference = json.loads((tmp_path / "whole.json").read_text())

    ckpt = tmp_path / "ckpt"
    slowed = ["--straggler", "0:15", "--checkpoint-dir", ckpt, "--checkpoint-every", "1000"]
    stops = []
    for n, (resume, target) in enumerate(((False, "rank 1"), (True, "mpiexec"))):
        job = Job(ranks, common + slowed + (["--resume"] if resume else []))
        try:
            job.wait_for_line(f"epoch {n + 1}/4")        # training is under way (and past the resume point)
            if target == "rank 1":
                os.kill(_rank_process(job.proc.pid, 1), signal.SIGUSR1)
            else:
                job.proc.send_signal(signal.SIGTERM)
            result = job.finish()
        finally:
            job.kill()
        _ok(result, STOPPED_STATUS)
        name = "SIGUSR1" if target == "rank 1" else "SIGTERM"
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
    assert f"resumed at step {stops[1]}" in resumed.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["params_digest"] == reference["params_digest"]
    assert [e["loss"] for e in report["epochs"]] == [e["loss"] for e in reference["epochs"]]
    assert np.array_equal(_final_params(ckpt), _final_params(whole))
