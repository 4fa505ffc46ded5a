"""The MPI test suite (``tests/mpi/``) passes at 1, 2, 3, 4, 5 and 8 ranks.

Each rank count is its own MPI job under ``python -m mpi4py`` with a timeout, so a rank that
fails ends the job instead of hanging the others.
"""
import pytest

from conftest import TESTS

RANK_COUNTS = (1, 2, 3, 4, 5, 8)


@pytest.mark.parametrize("ranks", RANK_COUNTS)
def test_mpi_suite_passes(mpirun, ranks):
    result = mpirun(ranks, ["-m", "pytest", "--with-mpi", "-q", "-x", "-p", "no:cacheprovider", TESTS / "mpi"],
                    timeout=600)
    assert result.returncode == 0, f"MPI suite failed at {ranks} ranks:\n{result.stdout[-8000:]}\n{result.stderr[-4000:]}"
    assert " passed" in result.stdout
