"""Refuse to run as N unconnected copies when a launcher started N tasks without wiring MPI.

``srun --mpi=none -n 8 python -m allreduce_kit.train`` (or an MPI library that does not speak
the PMI that srun offers) starts 8 processes that each see an MPI world of size 1: eight
independent single-rank jobs that all "succeed" and all write the same output files. The CLIs
call :func:`check_launch` first thing, so such a job stops at once with an error saying how
to launch it instead.

Which number to trust: ``SLURM_STEP_NUM_TASKS`` is set by ``srun`` for the tasks of the step
it starts, and only there. ``SLURM_NTASKS`` is also set in the batch script itself (the job's
``--ntasks``), where a single process is legitimate (the batch script, or ``python`` run in it
by hand), so it is deliberately not used. Under ``mpiexec`` inside an allocation, MPICH's
launcher starts one proxy per node with ``srun``, so its ranks see a step of as many tasks as
nodes, never more than the world's size: fine.

``python -m allreduce_kit.launch`` runs the check and prints where the ranks landed: a quick
test of a site's ``srun`` or ``mpiexec`` before a long job.
"""
if __name__ == "__main__":  # abort-on-error and heavy yield, asked for before MPI starts
    from .run import prepare

    prepare()

import os  # noqa: E402
import sys  # noqa: E402
from typing import Mapping, Optional  # noqa: E402

from mpi4py import MPI  # noqa: E402

__all__ = ["launched_tasks", "launch_problem", "check_launch", "placement"]


def launched_tasks(environ: Mapping[str, str] = os.environ) -> Optional[int]:
    """Tasks of the Slurm step this process belongs to (``SLURM_STEP_NUM_TASKS``), else None."""
    value = environ.get("SLURM_STEP_NUM_TASKS", "").strip()
    return int(value) if value.isdigit() else None


def launch_problem(world_size: int, environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """An error message if the launcher started more tasks than MPI connected, else None."""
    tasks = launched_tasks(environ)
    if tasks is None or tasks <= world_size:
        return None
    return (
        f"Slurm started {tasks} tasks (SLURM_STEP_NUM_TASKS={tasks}) but MPI reports a world of "
        f"{world_size} rank{'s' if world_size != 1 else ''}: the tasks are not connected to each "
        f"other, and would run as {tasks} independent copies of the job.\n"
        "This is what 'srun --mpi=none' does, or an MPI library that does not speak the PMI "
        "that srun offers. Launch with 'srun --mpi=pmi2' (the MPICH wheel's PMI; see "
        "'srun --mpi=list' for what your Slurm offers), or with the MPI library's own "
        "'mpiexec -n N' inside the allocation (LAUNCHER=mpiexec in jobs/*.sbatch). "
        "See docs/slurm.md."
    )


def check_launch(comm: Optional[MPI.Comm] = None, prog: str = "allreduce_kit") -> None:
    """Exit with status 2 and one clear message if the tasks of this launch are not connected.

    Call at the very start of a CLI, before any output. Every unconnected copy reaches the same
    verdict on its own (no communication is involved), so all of them exit; only the task with
    ``SLURM_PROCID=0`` prints, so the message appears once in the job's log.
    """
    world = (comm or MPI.COMM_WORLD).Get_size()
    problem = launch_problem(world)
    if problem is None:
        return
    if os.environ.get("SLURM_PROCID", "0") == "0":
        sys.stderr.write(f"{prog}: error: {problem}\n")
        sys.stderr.flush()
    raise SystemExit(2)


def placement(comm: Optional[MPI.Comm] = None) -> str:
    """One line naming the world's size and how many ranks sit on each host (collective)."""
    comm = comm or MPI.COMM_WORLD
    hosts = comm.allgather(MPI.Get_processor_name())
    counts: dict = {}
    for host in hosts:
        counts[host] = counts.get(host, 0) + 1
    per_host = ", ".join(f"{host}: {n}" for host, n in counts.items())
    from .cli import plural

    return f"MPI world of {plural(comm.Get_size(), 'rank')} on {plural(len(counts), 'host')} ({per_host})"


def main(argv: Optional[list] = None) -> None:
    """``python -m allreduce_kit.launch``: check the launch, then print the placement on rank 0."""
    from .cli import RankZeroParser, plural

    parser = RankZeroParser(prog="python -m allreduce_kit.launch",
                            description="Check that the ranks of this launch are connected (not N unconnected "
                                        "copies), then print on rank 0 how many ranks sit on each host, the "
                                        "Slurm step and the MPI library. Takes no options.")
    parser.parse_args(argv)
    check_launch(prog="python -m allreduce_kit.launch")
    line = placement()
    if MPI.COMM_WORLD.Get_rank() == 0:
        tasks = launched_tasks()
        step = f"; Slurm step of {plural(tasks, 'task')}" if tasks is not None else ""
        print(f"{line}{step}; {MPI.Get_library_version().splitlines()[0].strip()}", flush=True)


if __name__ == "__main__":
    main()
