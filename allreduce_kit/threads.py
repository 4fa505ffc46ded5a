"""Give each rank its share of the node's cores, so p ranks do not start p x cores threads."""
import os
from typing import Optional

from mpi4py import MPI

_USER_SET = ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS")


def ranks_on_this_node(comm: Optional[MPI.Intracomm] = None) -> int:
    """How many ranks of ``comm`` share this rank's node (collective)."""
    node = (comm or MPI.COMM_WORLD).Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_size()
    finally:
        node.Free()


def cores_available() -> int:
    """Cores this process may run on: Slurm's ``--cpus-per-task`` when set, else its affinity mask."""
    per_task = os.environ.get("SLURM_CPUS_PER_TASK")
    if per_task and per_task.isdigit():
        return int(per_task)
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def thread_share(comm: Optional[MPI.Intracomm] = None, ranks: Optional[int] = None) -> int:
    """Threads this rank should use: the user's setting, else cores / ranks on the node (>= 1).

    Collective (counts the ranks on the node) unless ``ranks``, the count, is given. Under
    Slurm, ``--cpus-per-task`` already is this task's share and is used as it is.
    """
    for name in _USER_SET:
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    if ranks is None:
        ranks = ranks_on_this_node(comm)
    if os.environ.get("SLURM_CPUS_PER_TASK", "").isdigit():
        return cores_available()
    return max(1, cores_available() // ranks)


def limit_threads(comm: Optional[MPI.Intracomm] = None) -> int:
    """Limit numba's and the BLAS/OpenMP pools to ``thread_share(comm)`` threads; return it."""
    import numba

    share = thread_share(comm)
    numba.set_num_threads(max(1, min(share, numba.config.NUMBA_NUM_THREADS)))
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        pass
    else:
        threadpool_limits(share)
    return share
