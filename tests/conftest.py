"""Shared test plumbing.

Tests in ``tests/mpi/`` run inside an MPI job (every rank runs the same test and checks its own
result); the plain run skips them and ``test_mpi_suite.py`` launches them under ``mpiexec`` at
each rank count. Everything else runs in one ordinary process.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def pytest_ignore_collect(collection_path, config):
    if collection_path.name == "mpi" and collection_path.parent == TESTS:
        return not config.getoption("--with-mpi", default=False)
    return None


def mpiexec() -> str:
    """The ``mpiexec`` beside this Python (the mpich wheel's), else the one on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    found = str(here) if here.exists() else shutil.which("mpiexec")
    if not found:
        pytest.fail("no mpiexec found beside the interpreter or on PATH: pip install mpich")
    return found


def run_mpi(n: int, args, timeout: float, env=None, cwd=TESTS, via_mpi4py=True) -> subprocess.CompletedProcess:
    """Run ``mpiexec -n n python -m mpi4py ARGS`` and return it; a hang fails the test.

    ``python -m mpi4py`` aborts the whole job when one rank raises (``via_mpi4py=False`` runs
    ``python ARGS`` instead). The working directory is ``tests/`` so that the installed
    package is imported, not the source tree.
    """
    launcher = ["-m", "mpi4py"] if via_mpi4py else []
    command = [mpiexec(), "-n", str(n), sys.executable, *launcher, *map(str, args)]
    full_env = dict(os.environ, **(env or {}))
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd)
    except subprocess.TimeoutExpired as expired:
        out = (expired.stdout or b"").decode(errors="replace") if isinstance(expired.stdout, bytes) else (expired.stdout or "")
        pytest.fail(f"{' '.join(command)} did not finish within {timeout} s (a hang?)\n{out[-5000:]}")


def unwritable_folder(tmp: Path) -> Path:
    """A folder this process cannot create files in: a read-only one of ours, or /sys for root
    (root writes through permission bits, but not into sysfs)."""
    if os.geteuid() == 0:
        return Path("/sys")
    locked = tmp / "locked"
    locked.mkdir(exist_ok=True)
    locked.chmod(0o555)
    return locked


@pytest.fixture
def mpirun():
    """``mpirun(n, args, timeout=..., env=...)``: launch an MPI job as a subprocess."""
    return run_mpi
