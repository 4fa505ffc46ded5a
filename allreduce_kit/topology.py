"""Where the ranks of a communicator sit: nodes, local ranks, cores per node, oversubscription.

Known in one place: the threads a rank's kernels use, the yield setting, the one-node fast paths
and node-aware schedules all read a ``Topology``, never the environment or ``os`` directly.

Cores of a node are the cores its ranks may run on: the union of their affinity masks, capped
by Slurm's allocation for the whole node (``SLURM_CPUS_ON_NODE``) when Slurm launched the job.
So 8 tasks x 1 CPU on an 8-core node, each bound to its own core, is 8 ranks on 8 cores, not
oversubscribed; 8 ranks on a 2-core laptop are.

Before MPI starts (the yield setting must be decided then) only the launcher's environment is
known: ``local_size_from_launcher`` and ``cores_from_environment`` answer from it.
"""
import os
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Sequence, Tuple

#: Launcher variables holding the number of ranks on this node, in the order they are tried.
_LOCAL_SIZE = ("MPI_LOCALNRANKS",              # MPICH's hydra
               "OMPI_COMM_WORLD_LOCAL_SIZE",   # Open MPI
               "SLURM_NTASKS_PER_NODE")        # Slurm (srun), when given as one number
#: Variables in which a user sets the threads a process may use; they win over the share.
_USER_THREADS = ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS")


def affinity(pid: int = 0) -> Tuple[int, ...]:
    """The cores this process may run on (all of the machine's where affinity is unknown)."""
    try:
        return tuple(sorted(os.sched_getaffinity(pid)))
    except (AttributeError, OSError):  # not Linux
        return tuple(range(os.cpu_count() or 1))


def _positive(text: Optional[str]) -> Optional[int]:
    text = (text or "").strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


def slurm_node_cpus(environ: Mapping[str, str] = os.environ) -> Optional[int]:
    """CPUs Slurm allocated to this job on this node (``SLURM_CPUS_ON_NODE``), or None."""
    return _positive(environ.get("SLURM_CPUS_ON_NODE"))


def node_cores(affinities: Iterable[Sequence[int]], environ: Mapping[str, str] = os.environ) -> int:
    """Cores of a node whose ranks have these affinity masks: their union, capped by Slurm's
    allocation on the node when there is one."""
    union = set()
    for mask in affinities:
        union.update(mask)
    cores = max(1, len(union))
    allocated = slurm_node_cpus(environ)
    return min(cores, allocated) if allocated else cores


def local_size_from_launcher(environ: Mapping[str, str] = os.environ) -> Optional[int]:
    """Ranks on this node according to the launcher's environment, or None if it does not say."""
    for name in _LOCAL_SIZE:
        value = _positive(environ.get(name))
        if value:
            return value
    tasks = environ.get("SLURM_TASKS_PER_NODE", "")   # e.g. "8" or "8(x2),4"
    return _positive(tasks.split(",")[0].split("(")[0])


def cores_from_environment(environ: Mapping[str, str] = os.environ) -> int:
    """This node's cores as far as one process can tell before MPI starts: Slurm's allocation
    on the node, else this process's affinity mask."""
    return slurm_node_cpus(environ) or len(affinity())


def oversubscribed_from_launcher(environ: Mapping[str, str] = os.environ) -> bool:
    """True if the launcher says it put more ranks on this node than the node has cores."""
    ranks = local_size_from_launcher(environ)
    return ranks is not None and ranks > cores_from_environment(environ)


def user_threads(environ: Mapping[str, str] = os.environ) -> Optional[int]:
    """The thread count the user set (``NUMBA_NUM_THREADS``, else ``OMP_NUM_THREADS``), or None."""
    for name in _USER_THREADS:
        value = _positive(environ.get(name))
        if value:
            return value
    return None


@dataclass(frozen=True)
class Topology:
    """One communicator's ranks on nodes, seen from one of its ranks.

    Nodes are numbered 0, 1, ... in the order of their lowest rank, the same on every rank.
    """

    rank: int
    #: node index of each rank of the communicator
    node_of: Tuple[int, ...]
    #: cores of each node (see the module docstring)
    cores_per_node: Tuple[int, ...]
    #: each node's host name, as MPI reports it
    hosts: Tuple[str, ...] = ()

    @property
    def size(self) -> int:
        return len(self.node_of)

    @property
    def nodes(self) -> int:
        return len(self.cores_per_node)

    @property
    def node(self) -> int:
        """This rank's node."""
        return self.node_of[self.rank]

    @property
    def ranks_per_node(self) -> Tuple[int, ...]:
        return tuple(self.node_of.count(n) for n in range(self.nodes))

    @property
    def node_ranks(self) -> Tuple[int, ...]:
        """The ranks on this rank's node, in order."""
        return tuple(r for r, n in enumerate(self.node_of) if n == self.node)

    @property
    def local_rank(self) -> int:
        return self.node_ranks.index(self.rank)

    @property
    def local_size(self) -> int:
        return len(self.node_ranks)

    @property
    def single_node(self) -> bool:
        return self.nodes == 1

    @property
    def oversubscribed(self) -> bool:
        """Some node has more ranks than cores (the same answer on every rank)."""
        return any(r > c for r, c in zip(self.ranks_per_node, self.cores_per_node))

    def threads(self, environ: Mapping[str, str] = os.environ) -> int:
        """Threads this rank's kernels may use: the user's setting, else its share of its node's
        cores, ``max(1, cores // ranks on the node)``."""
        return user_threads(environ) or max(1, self.cores_per_node[self.node] // self.local_size)

    @classmethod
    def from_parts(cls, rank: int, node_of: Sequence[int], cores_per_node: Sequence[int],
                   hosts: Sequence[str] = ()) -> "Topology":
        """A topology from what each rank reported (what ``of`` gathers); for tests and tools."""
        if sorted(set(node_of)) != list(range(len(cores_per_node))):
            raise ValueError(f"node_of {tuple(node_of)} must number the {len(cores_per_node)} nodes 0, 1, ...")
        return cls(rank, tuple(int(n) for n in node_of), tuple(int(c) for c in cores_per_node), tuple(hosts))

    @classmethod
    def of(cls, comm, environ: Mapping[str, str] = os.environ) -> "Topology":
        """``comm``'s topology (collective over ``comm``)."""
        from mpi4py import MPI

        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        try:
            cores = node_cores(node.allgather(affinity()), environ)
            leader = node.allreduce(comm.Get_rank(), op=MPI.MIN)
        finally:
            node.Free()
        reports = comm.allgather((leader, cores, MPI.Get_processor_name()))
        leaders = sorted({lead for lead, _, _ in reports})
        index = {lead: i for i, lead in enumerate(leaders)}
        return cls.from_parts(comm.Get_rank(), [index[lead] for lead, _, _ in reports],
                              [reports[lead][1] for lead in leaders], [reports[lead][2] for lead in leaders])
