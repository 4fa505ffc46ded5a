"""Before MPI starts: let waiting MPICH ranks yield the CPU when a node has more ranks than cores.

MPICH's waiting ranks poll at 100% CPU. With more ranks than cores on a node (``mpirun -n 8``
on a 2-core laptop) the pollers steal the cores that computing ranks need.
``MPIR_CVAR_ENABLE_HEAVY_YIELD=1`` makes them yield instead, but MPICH reads it once, at MPI
initialisation (``from mpi4py import MPI``), so this module must run before anything imports
mpi4py: ``allreduce_kit/__init__.py`` imports it first. It only reads the launcher's
environment (no MPI calls), and changes nothing when the user has set the variable or when
the node is not oversubscribed. Measured effect: docs/training.md.
"""
import os
from typing import Optional

VARIABLE = "MPIR_CVAR_ENABLE_HEAVY_YIELD"

#: Launcher variables that hold the number of ranks on this node, in the order they are tried.
_LOCAL_SIZE = ("MPI_LOCALNRANKS",              # MPICH's hydra
               "OMPI_COMM_WORLD_LOCAL_SIZE",   # Open MPI
               "SLURM_NTASKS_PER_NODE")        # Slurm (srun), when given as one number


def local_ranks_from_launcher(env=os.environ) -> Optional[int]:
    """Ranks on this node according to the launcher's environment, or None if it does not say."""
    for name in _LOCAL_SIZE:
        value = env.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    tasks = env.get("SLURM_TASKS_PER_NODE", "")       # e.g. "8" or "8(x2),4"
    head = tasks.split(",")[0].split("(")[0]
    if head.isdigit() and int(head) > 0:
        return int(head)
    return None


def cores_here() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def oversubscribed(env=os.environ) -> bool:
    """True if the launcher put more ranks on this node than this process has cores."""
    ranks = local_ranks_from_launcher(env)
    return ranks is not None and ranks > cores_here()


def enable_heavy_yield(env=os.environ) -> bool:
    """Set ``MPIR_CVAR_ENABLE_HEAVY_YIELD=1`` if oversubscribed and unset; return whether set by us.

    ``ALLREDUCE_KIT_YIELD=0`` turns this off (to measure without it).
    """
    if VARIABLE in env or env.get("ALLREDUCE_KIT_YIELD", "1") == "0" or not oversubscribed(env):
        return False
    env[VARIABLE] = "1"
    return True


SET_BY_US = enable_heavy_yield()
