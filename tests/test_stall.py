"""The stall inspector: a collective that waits too long for a rank names that rank and ends
the job instead of hanging forever.
"""

import pytest

SCRIPT = """
import sys, time
import numpy as np
from mpi4py import MPI
from allreduce_kit import allreduce
late, sleep = int(sys.argv[1]), float(sys.argv[2])
allreduce(np.ones(10))                     # every rank takes part in a first call
if MPI.COMM_WORLD.Get_rank() == late:
    print("late from", time.time(), flush=True)
    time.sleep(sleep)                      # this rank is late for the second
allreduce(np.ones(10), algorithm="ring")
print("finished on rank", MPI.COMM_WORLD.Get_rank(), flush=True)
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "late_rank.py"
    path.write_text(SCRIPT)
    return path


def test_a_late_rank_is_named_and_the_job_ends_before_it_would_arrive(mpirun, script):
    """Rank 2 is 120 s late; the job must end within the 90 s ``mpirun`` allows it, so it cannot
    have waited for that rank. (How soon after the timeout it ends: benchmarks/fault_latency.py.)"""
    result = mpirun(4, [script, 2, 120], timeout=90, via_mpi4py=False, env={"ALLREDUCE_KIT_STALL_TIMEOUT": "2"})
    assert result.returncode != 0
    assert "missing ranks (have not reached this call): [2]" in result.stderr
    assert "late from" in result.stdout and "finished" not in result.stdout


def test_a_rank_late_by_less_than_the_timeout_is_only_waited_for(mpirun, script):
    result = mpirun(3, [script, 1, 1.5], timeout=90, via_mpi4py=False,
                    env={"ALLREDUCE_KIT_STALL_TIMEOUT": "30"})  # generous: a loaded machine is slow too
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("finished on rank") == 3
    assert "stall" not in result.stderr


def test_timeout_zero_turns_the_inspector_off(mpirun, script):
    result = mpirun(2, [script, 1, 3], timeout=60, via_mpi4py=False,
                    env={"ALLREDUCE_KIT_STALL_TIMEOUT": "0.0"})
    assert result.returncode == 0, result.stderr
    assert "stall" not in result.stderr


def test_a_bad_timeout_setting_is_refused_by_name(mpirun, script):
    result = mpirun(2, [script, 1, 0], timeout=60, env={"ALLREDUCE_KIT_STALL_TIMEOUT": "soon"})
    assert result.returncode != 0
    assert "ALLREDUCE_KIT_STALL_TIMEOUT must be a number of seconds, got 'soon'" in result.stderr


def test_a_negative_timeout_is_refused_by_name():
    from allreduce_kit import set_stall_timeout

    with pytest.raises(ValueError, match="stall_timeout must be >= 0 seconds"):
        set_stall_timeout(-1)
