"""The job scripts as files: valid bash, clean under shellcheck, and shaped as cluster users expect.

shellcheck is installed from Debian when missing (root and apt-get needed); where it cannot be,
that check is skipped with the reason, and ``bash -n`` still runs.
"""
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((REPO / "jobs").glob("*.sbatch"))
HELPERS = sorted((REPO / "tests" / "slurm").glob("*.sh"))


def test_the_three_job_scripts_exist():
    assert {p.name for p in SCRIPTS} >= {"train.sbatch", "bench.sbatch", "train-multinode.sbatch"}


@pytest.fixture(scope="session")
def shellcheck() -> str:
    found = shutil.which("shellcheck")
    if found:
        return found
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("shellcheck is not installed and cannot be (needs root and apt-get): apt-get install shellcheck")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "shellcheck"]
    result = subprocess.run(install, env=env, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:  # package lists missing or stale: fetch them once, then retry
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=600)
        result = subprocess.run(install, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{' '.join(install)} failed:\n{result.stdout}\n{result.stderr}"
    return shutil.which("shellcheck") or pytest.fail("apt-get installed shellcheck but it is not on PATH")


@pytest.mark.parametrize("script", SCRIPTS + HELPERS, ids=lambda p: p.name)
def test_bash_parses_it(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("script", SCRIPTS + HELPERS, ids=lambda p: p.name)
def test_shellcheck_is_clean(shellcheck, script):
    result = subprocess.run([shellcheck, "--shell=bash", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_shellcheck_does_catch_mistakes(shellcheck, tmp_path):
    """The clean verdicts above mean something: the same call flags an unquoted expansion."""
    bad = tmp_path / "bad.sbatch"
    bad.write_text("#!/bin/bash\n#SBATCH --nodes=1\nout=$1\nmkdir $out\n")
    result = subprocess.run([shellcheck, "--shell=bash", str(bad)], capture_output=True, text=True)
    assert result.returncode != 0 and "SC2086" in result.stdout


def sbatch_options(script: Path) -> dict:
    """The #SBATCH options of a script, as sbatch reads them (until the first command line)."""
    options = {}
    for line in script.read_text().splitlines()[1:]:
        if line and not line.startswith("#"):
            break
        match = re.match(r"#SBATCH\s+--([\w-]+)(?:=(\S+))?", line)
        if match:
            options[match.group(1)] = match.group(2)
    return options


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_resources_are_sbatch_lines_at_the_top(script):
    options = sbatch_options(script)
    for name in ("nodes", "ntasks-per-node", "cpus-per-task", "time", "job-name", "output"):
        assert name in options, f"{script.name}: no '#SBATCH --{name}=' line before the first command"
    assert "%j" in options["output"], "Slurm's log should be named after the job id"


def test_the_multinode_example_asks_for_two_nodes():
    assert sbatch_options(REPO / "jobs" / "train-multinode.sbatch")["nodes"] == "2"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_conventions(script):
    text = script.read_text()
    assert text.count("EDIT HERE") == 1, "the software environment is set up in one clearly marked place"
    assert 'export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK' in text
    assert "export NUMBA_NUM_THREADS=$OMP_NUM_THREADS" in text
    assert "LAUNCHER=${LAUNCHER:-srun}" in text
    assert "srun --mpi=pmi2" in text and "mpiexec -n" in text
    assert "$SLURM_JOB_ID" in text and "--json" in text
