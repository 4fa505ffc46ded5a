"""The launch guard: N tasks started by Slurm but a world of 1 (``srun --mpi=none``) is an error.

The rule is checked here without Slurm (the variables are what srun sets); tests/test_slurm.py
shows the same on a real cluster.
"""
import sys

import pytest

from allreduce_kit.launch import launch_problem, launched_tasks

from conftest import TESTS, run_mpi


def test_no_slurm_no_problem():
    assert launched_tasks({}) is None
    assert launch_problem(1, {}) is None


def test_the_batch_script_itself_is_not_a_launch():
    """In the batch step only SLURM_NTASKS is set (the job's size); one process there is fine."""
    assert launch_problem(1, {"SLURM_NTASKS": "8", "SLURM_JOB_ID": "12"}) is None


@pytest.mark.parametrize("tasks", [1, 2, 8])
def test_srun_with_pmi_connects_every_task(tasks):
    assert launch_problem(tasks, {"SLURM_STEP_NUM_TASKS": str(tasks), "SLURM_NTASKS": str(tasks)}) is None


def test_mpiexec_inside_an_allocation_is_fine():
    """MPICH's mpiexec starts one proxy per node with srun: a step of 2 tasks, a world of 8."""
    assert launch_problem(8, {"SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "8"}) is None


@pytest.mark.parametrize("tasks", [2, 3, 8])
def test_unconnected_tasks_are_named(tasks):
    message = launch_problem(1, {"SLURM_STEP_NUM_TASKS": str(tasks), "SLURM_NTASKS": str(tasks)})
    assert message is not None
    assert f"Slurm started {tasks} tasks" in message and "world of 1 rank" in message
    assert "srun --mpi=pmi2" in message and "mpiexec" in message


def test_garbage_in_the_variable_is_ignored():
    assert launch_problem(1, {"SLURM_STEP_NUM_TASKS": "lots"}) is None


def run(args, env):
    import os
    import subprocess
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, cwd=TESTS,
                          env=dict(os.environ, **env))


@pytest.mark.parametrize("module", ["allreduce_kit.train", "allreduce_kit.bench"])
def test_a_cli_refuses_to_run_as_one_of_several_unconnected_copies(module):
    result = run(["-m", module], {"SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "0"})
    assert result.returncode == 2, result
    assert f"python -m {module}: error: Slurm started 4 tasks" in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_only_the_first_copy_prints():
    result = run(["-m", "allreduce_kit.bench"], {"SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "3"})
    assert result.returncode == 2 and result.stderr == ""


def test_a_connected_world_passes_and_reports_its_placement():
    result = run_mpi(3, ["-m", "allreduce_kit.launch"], timeout=120, env={"SLURM_STEP_NUM_TASKS": "3"},
                     via_mpi4py=False)
    assert result.returncode == 0, result
    assert "MPI world of 3 ranks on 1 host" in result.stdout and "Slurm step of 3 tasks" in result.stdout
    assert result.stdout.count("MPI world") == 1, "rank 0 only"
