"""A job launched the documented ways ends, with a non-zero exit, when one rank raises:
``python -m allreduce_kit.run script.py``, or a script that calls ``install_abort_hook()``.

Without the abort hook the other ranks would wait in their collective forever.
"""
import pytest

SCRIPT = """
import numpy as np
from mpi4py import MPI
import allreduce_kit
from allreduce_kit import allreduce
{setup}
if MPI.COMM_WORLD.Get_rank() == 1:
    raise RuntimeError("rank 1 failed on purpose")
allreduce(np.ones(10))  # the other ranks wait here for rank 1
"""


@pytest.mark.parametrize("how", ["launcher", "install_abort_hook"])
def test_an_exception_on_one_rank_aborts_the_whole_job(mpirun, tmp_path, how):
    script = tmp_path / "fail_on_rank_1.py"
    script.write_text(SCRIPT.format(setup="allreduce_kit.install_abort_hook()" if how != "launcher" else ""))
    args = ["-m", "allreduce_kit.run", script] if how == "launcher" else [script]
    result = mpirun(3, args, timeout=60, via_mpi4py=False)
    assert result.returncode != 0
    assert "uncaught RuntimeError on rank 1" in result.stderr
    assert "rank 1 failed on purpose" in result.stderr


def test_the_same_under_python_dash_m_mpi4py(mpirun, tmp_path):
    script = tmp_path / "fail_on_rank_1.py"
    script.write_text(SCRIPT.format(setup=""))
    result = mpirun(3, [script], timeout=60)
    assert result.returncode != 0
    assert "rank 1 failed on purpose" in result.stderr
