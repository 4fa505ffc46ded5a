"""Where the ranks of a communicator sit: nodes, local ranks, cores per node, oversubscription.

Known in one place: the threads a rank's kernels use, the yield setting, the one-node fast paths
and node-aware schedules all read a ``Topology``, never the environment or ``os`` directly.

Cores of a node are the cores its ranks may run on: the union of their affinity masks, capped
by Slurm's allocation for the whole node (``SLURM_CPUS_ON_NODE``) when Slurm launched the job.
So 8 tasks x 1 CPU on an 8-core node, each bound to its own core, is 8 ranks on 8 cores, not
oversubscribed; 8 ranks on a 2-core laptop are.

Nodes are not always machines of their own: containers or network namespaces on one host (the
emulated cluster of ``allreduce_kit.cluster``) are nodes to MPI, with hosts and memory of their
own, yet their ranks share the host's cores. Nodes whose ranks run on one kernel (the same
``boot_id``) are one machine, whose cores are the union of their cores; ranks are
oversubscribed, and get their share of threads, by their machine as well as by their node, and
by every rank of the job found there, not only the communicator's: the communicator of one
node's ranks, or of a few ranks, still shares the cores with the rest of the job.

Before MPI starts (the yield setting must be decided then) only the launcher's environment is
known: ``local_size_from_launcher``, ``spans_nodes_from_launcher`` and ``cores_from_environment``
answer from it.
"""
import os
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Sequence, Tuple

#: Launcher variables holding the number of ranks on this node, in the order they are tried.
_LOCAL_SIZE = ("MPI_LOCALNRANKS",              # MPICH's hydra
               "OMPI_COMM_WORLD_LOCAL_SIZE",   # Open MPI
               "SLURM_NTASKS_PER_NODE")        # Slurm (srun), when given as one number
#: Launcher variables holding the job's number of ranks, in the order they are tried.
_WORLD_SIZE = ("PMI_SIZE",                     # MPICH's hydra
               "OMPI_COMM_WORLD_SIZE",         # Open MPI
               "SLURM_NTASKS")                 # Slurm (srun)
#: The most ranks of this job that a communicator's topology (``Topology.of``) has found on this
#: process's machine so far: a communicator of a few of them still shares the cores with the rest.
_job_ranks_here = 0
#: The running kernel's identity, the same in every container and namespace on one machine.
_BOOT_ID = "/proc/sys/kernel/random/boot_id"
#: Variables in which a user sets the threads a process may use; they win over the share.
_USER_THREADS = ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS")


def affinity(pid: int = 0) -> Tuple[int, ...]:
    """The cores this process may run on (all of the machine's where affinity is unknown)."""
    try:
        return tuple(sorted(os.sched_getaffinity(pid)))
    except (AttributeError, OSError):  # not Linux
        return tuple(range(os.cpu_count() or 1))


def machine_id() -> str:
    """The identity of the machine (the running kernel) this process runs on; empty where
    unknown (then every node counts as a machine of its own)."""
    try:
        with open(_BOOT_ID) as handle:
            return handle.read().strip()
    except OSError:
        return ""


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


def spans_nodes_from_launcher(environ: Mapping[str, str] = os.environ) -> bool:
    """True if the launcher says the job has more ranks than it put on this node: some run on
    other nodes."""
    local = local_size_from_launcher(environ)
    for name in _WORLD_SIZE:
        world = _positive(environ.get(name))
        if world:
            return local is not None and world > local
    return False


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
    #: machine index of each node, cores of each machine and ranks of the job on each (this
    #: communicator's, or more where an earlier communicator counted more; module docstring);
    #: empty: every node is a machine of its own
    machine_of: Tuple[int, ...] = ()
    cores_per_machine: Tuple[int, ...] = ()
    ranks_per_machine: Tuple[int, ...] = ()

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
        """Some node, or some machine that holds several nodes, has more ranks than cores (the
        same answer on every rank)."""
        return (any(r > c for r, c in zip(self.ranks_per_node, self.cores_per_node))
                or any(r > c for r, c in zip(self.ranks_per_machine, self.cores_per_machine)))

    def threads(self, environ: Mapping[str, str] = os.environ) -> int:
        """Threads this rank's kernels may use: the user's setting, else its share of its node's
        cores, ``max(1, cores // ranks on the node)``, and no more than its share of its machine's."""
        share = self.cores_per_node[self.node] // self.local_size
        if self.cores_per_machine:
            machine = self.machine_of[self.node]
            share = min(share, self.cores_per_machine[machine] // self.ranks_per_machine[machine])
        return user_threads(environ) or max(1, share)

    @classmethod
    def from_parts(cls, rank: int, node_of: Sequence[int], cores_per_node: Sequence[int],
                   hosts: Sequence[str] = (), machine_of: Sequence[int] = (),
                   cores_per_machine: Sequence[int] = (), ranks_per_machine: Sequence[int] = ()) -> "Topology":
        """A topology from what each rank reported (what ``of`` gathers); for tests and tools.
        ``ranks_per_machine`` defaults to the ranks of this communicator on each machine."""
        if sorted(set(node_of)) != list(range(len(cores_per_node))):
            raise ValueError(f"node_of {tuple(node_of)} must number the {len(cores_per_node)} nodes 0, 1, ...")
        if (machine_of or cores_per_machine) and (len(machine_of) != len(cores_per_node)
                                                  or sorted(set(machine_of)) != list(range(len(cores_per_machine)))):
            raise ValueError(f"machine_of {tuple(machine_of)} must give each of the {len(cores_per_node)} nodes one of "
                             f"the {len(cores_per_machine)} machines 0, 1, ...")
        if ranks_per_machine and len(ranks_per_machine) != len(cores_per_machine):
            raise ValueError(f"ranks_per_machine {tuple(ranks_per_machine)} must count the ranks of each of the "
                             f"{len(cores_per_machine)} machines")
        here = [sum(1 for n in node_of if machine_of[n] == m) for m in range(len(cores_per_machine))]
        return cls(rank, tuple(int(n) for n in node_of), tuple(int(c) for c in cores_per_node), tuple(hosts),
                   tuple(int(m) for m in machine_of), tuple(int(c) for c in cores_per_machine),
                   tuple(max(int(a), b) for a, b in zip(ranks_per_machine or here, here)))

    @classmethod
    def of(cls, comm, environ: Mapping[str, str] = os.environ) -> "Topology":
        """``comm``'s topology (collective over ``comm``)."""
        global _job_ranks_here
        from mpi4py import MPI

        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        try:
            masks = node.allgather(affinity())
            cores = node_cores(masks, environ)
            leader = node.allreduce(comm.Get_rank(), op=MPI.MIN)
        finally:
            node.Free()
        union = sum(1 << core for core in set().union(*masks))  # the node's cores as one bit mask
        reports = comm.allgather((leader, cores, MPI.Get_processor_name(), machine_id() or f"node {leader}", union,
                                  _job_ranks_here))
        leaders = sorted({report[0] for report in reports})
        index = {lead: i for i, lead in enumerate(leaders)}
        machines = list(dict.fromkeys(reports[lead][3] for lead in leaders))
        machine_of = [machines.index(reports[lead][3]) for lead in leaders]
        cores_per_machine, ranks_per_machine = [], []
        for name in machines:
            nodes = [reports[lead] for lead in leaders if reports[lead][3] == name]
            mask = 0
            for report in nodes:
                mask |= report[4]
            cores_per_machine.append(min(bin(mask).count("1"), sum(report[1] for report in nodes)))
            ranks_per_machine.append(max(report[5] for report in reports if report[3] == name))
        layout = cls.from_parts(comm.Get_rank(), [index[report[0]] for report in reports],
                                [reports[lead][1] for lead in leaders], [reports[lead][2] for lead in leaders],
                                machine_of, cores_per_machine, ranks_per_machine)
        _job_ranks_here = max(_job_ranks_here, layout.ranks_per_machine[machine_of[layout.node]])
        return layout
