"""Nonblocking calls at the edges of a job: a handle never waited for does not keep the job
from ending, and a call on the progress thread is watched by the stall inspector."""
import pytest

UNWAITED = """
import atexit
import os
import numpy as np
from mpi4py import MPI
from allreduce_kit import iallreduce
rank = MPI.COMM_WORLD.Get_rank()
handles = []
atexit.register(lambda: os.write(1, f"finished at exit: {all(h.done for h in handles)}\\n".encode()))  # runs last; one write
handles += [iallreduce(np.ones(1 << 20, np.float32)) for _ in range(3)]
failing = iallreduce(np.ones(5 + rank), check=True)   # raises at wait(), which never comes
os.write(1, f"leaving on rank {rank}\\n".encode())
"""

LATE = """
import sys, time
import numpy as np
from mpi4py import MPI
from allreduce_kit import allreduce, iallreduce
allreduce(np.ones(10))                     # every rank takes part in a first call
if MPI.COMM_WORLD.Get_rank() == 1:
    time.sleep(120)                        # this rank is late for the nonblocking one
handle = iallreduce(np.ones(10))
print("computing while it runs", flush=True)
handle.wait()
print("finished on rank", MPI.COMM_WORLD.Get_rank(), flush=True)
"""


def test_handles_never_waited_for_do_not_keep_the_job_from_ending(mpirun, tmp_path):
    """At exit the calls in flight finish (every rank started them) before MPI finalizes."""
    path = tmp_path / "unwaited.py"
    path.write_text(UNWAITED)
    result = mpirun(2, [path], timeout=120, via_mpi4py=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("leaving on rank") == 2
    assert result.stdout.count("finished at exit: True") == 2, "MPI finalized with calls in flight"


def test_a_late_rank_is_named_when_the_call_runs_on_the_progress_thread(mpirun, tmp_path):
    path = tmp_path / "late.py"
    path.write_text(LATE)
    result = mpirun(2, [path], timeout=90, via_mpi4py=False, env={"ALLREDUCE_KIT_STALL_TIMEOUT": "2"})
    assert result.returncode != 0
    assert "missing ranks (have not reached this call): [1]" in result.stderr, result.stderr[-3000:]
    assert "computing while it runs" in result.stdout and "finished" not in result.stdout
