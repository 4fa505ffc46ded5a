"""A job launched the documented way ends, with a non-zero exit, when one rank raises.

Without the abort hook the other ranks would wait in their collective forever.
"""
SCRIPT = """
import numpy as np
from mpi4py import MPI
from allreduce_kit import allreduce
if MPI.COMM_WORLD.Get_rank() == 1:
    raise RuntimeError("rank 1 failed on purpose")
allreduce(np.ones(10))  # the other ranks wait here for rank 1
"""


def test_an_exception_on_one_rank_aborts_the_whole_job(mpirun, tmp_path):
    script = tmp_path / "fail_on_rank_1.py"
    script.write_text(SCRIPT)
    result = mpirun(3, [script], timeout=60, via_mpi4py=False)  # plain "python script.py"
    assert result.returncode != 0
    assert "uncaught RuntimeError on rank 1" in result.stderr
    assert "rank 1 failed on purpose" in result.stderr


def test_the_same_under_python_dash_m_mpi4py(mpirun, tmp_path):
    script = tmp_path / "fail_on_rank_1.py"
    script.write_text(SCRIPT)
    result = mpirun(3, [script], timeout=60)
    assert result.returncode != 0
    assert "rank 1 failed on purpose" in result.stderr
