"""An emulated cluster on one Linux machine: isolated nodes joined by rate-shaped links.

``python -m allreduce_kit.cluster up --nodes 2 --link 1gbit`` (as root) makes nodes ``node1``,
``node2``, ... Each node is

- a network namespace (``akc-node1``, ...) whose ``eth0`` is one end of a veth pair; the other
  end (``akc-node1`` on the host) is a port of the bridge ``akc-br``, which has the address
  ``10.213.0.254``; node i has ``10.213.0.i``;
- a long-lived process in that namespace, started by ``unshare --pid --fork --uts --ipc --mount
  --mount-proc``: its own host name, process IDs, System V IPC, a fresh tmpfs on ``/dev/shm``
  and an ``/etc/hosts`` naming every node. A command runs on the node by entering all of that
  process's namespaces (``nsenter -t PID -a``);
- with ``up --own-cores``, its share of the machine's cores (``cores``): every command on the
  node runs bound to them (``taskset``), so a node's ranks see the cores a host of their own
  would have. Nodes get disjoint cores while there are enough; beyond that, nodes share cores,
  dealt in turn. By default every node runs on all of the machine's cores. Either way the
  toolkit sees that the nodes run on one kernel and counts their ranks together against the
  machine's cores (``topology.py``): "more ranks than cores" (yielding instead of spinning
  while waiting) follows what the machine really has.

Only with all of that is a node a separate host to MPI and to the toolkit: with the network
alone separated, ranks of two "nodes" still read each other's memory (``process_vm_readv``) and
share ``/dev/shm``, so a single-copy path or MPI's shared-memory transport crosses no link at
all (docs/multinode.md).

Each direction of each node's link is shaped by ``tc`` (``link.py``). ``cluster run`` starts
MPICH's ``mpiexec`` (the one beside this Python; or, with ``--mpirun``, MPICH's or Open MPI's)
with its ``ssh`` launcher pointed at ``STATE_DIR/enter``, a script that takes ssh's arguments and
runs the command on the named node.
What ``up`` made is recorded in ``STATE_DIR/state.json``; ``down`` removes it, and also anything
named ``akc-*`` that an interrupted ``up`` left behind.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from . import link
from .. import config, run

#: Where the cluster's state, the launcher script and each node's hosts file live.
STATE_DIR = Path("/run/allreduce_kit-cluster")
STATE_FILE = STATE_DIR / "state.json"
#: Prefix of every name the cluster gives to a namespace or a network device.
PREFIX = "akc-"
BRIDGE = PREFIX + "br"
SUBNET = "10.213.0"
BRIDGE_ADDRESS = f"{SUBNET}.254"
#: At most this many nodes (addresses 1..MAX_NODES, names that fit a device name).
MAX_NODES = 64
#: Commands the cluster needs, besides Python.
TOOLS = ("ip", "tc", "unshare", "nsenter", "mount")


class ClusterError(RuntimeError):
    """Something the cluster cannot do here; the message says what and why."""


def node_name(index: int) -> str:
    """The host name of node ``index`` (1-based)."""
    return f"node{index}"


def namespace(host: str) -> str:
    """The network namespace, and the host-side device, of node ``host``."""
    return PREFIX + host


def why_not_here() -> Optional[str]:
    """Why a cluster cannot be made on this machine (not root, a missing tool), or None."""
    if not sys.platform.startswith("linux"):
        return "the emulated cluster needs Linux namespaces"
    if os.geteuid() != 0:
        return "the emulated cluster needs root (network namespaces, veth, tc, unshare); run it with sudo"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"the emulated cluster needs {', '.join(missing)} (iproute2, util-linux), not found on PATH"
    if not os.path.exists("/proc/self/ns/net") or not os.path.exists("/proc/self/ns/pid"):
        return "this kernel has no network or PID namespaces"
    probe = subprocess.run(["unshare", "--net", "--pid", "--fork", "--uts", "--ipc", "--mount", "true"],
                           capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if probe.returncode != 0:
        return f"new namespaces are not allowed here ({probe.stderr.strip() or 'unshare failed'})"
    return None


@dataclass
class Node:
    host: str
    address: str
    #: the process whose namespaces are the node (PID 1 inside it), as the host sees it
    pid: int
    #: the machine's cores the node's commands run on (empty: all)
    cores: List[int] = field(default_factory=list)


@dataclass
class State:
    nodes: List[Node]
    link_bits: int
    link: str
    #: bandwidth measured by ``status``, bits per second: {"1 flow": ..., "4 flows": ...}
    measured: Dict[str, float] = field(default_factory=dict)

    def save(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        tmp = STATE_FILE.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        tmp.replace(STATE_FILE)

    @classmethod
    def load(cls) -> Optional["State"]:
        try:
            data = json.loads(STATE_FILE.read_text())
            return cls([Node(**n) for n in data["nodes"]], int(data["link_bits"]), data["link"],
                       dict(data.get("measured") or {}))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def node(self, host: str) -> Node:
        for node in self.nodes:
            if node.host == host:
                return node
        raise ClusterError(f"no node {host!r} in the cluster (nodes: {', '.join(n.host for n in self.nodes)})")


def _run(command: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(list(command), capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if check and result.returncode != 0:
        raise ClusterError(f"{' '.join(command)} failed: {(result.stderr or result.stdout).strip()}")
    return result


def on_node(node: Node, command: Sequence[str]) -> List[str]:
    """``command`` run on ``node``: inside all of its namespaces, on its cores."""
    bind = ["taskset", "-c", ",".join(map(str, node.cores))] if node.cores else []
    return [*bind, "nsenter", "-t", str(node.pid), "-a", "--", *command]


def share_cores(nodes: int, cores: Sequence[int]) -> List[List[int]]:
    """Each node's cores: ``cores`` cut into ``nodes`` disjoint runs, as even as possible, while
    there are at least as many cores as nodes; else one core each, dealt in turn."""
    cores = sorted(cores)
    if nodes <= len(cores):
        cuts = [(i * len(cores)) // nodes for i in range(nodes + 1)]
        return [cores[cuts[i]:cuts[i + 1]] for i in range(nodes)]
    return [[cores[i % len(cores)]] for i in range(nodes)]


#: What ``enter`` does with the arguments MPICH's ssh launcher gives it: ssh's options (skipped),
#: the host, then the command, which ssh would hand to the remote shell as one line.
ENTER_SCRIPT = """#!/bin/sh
# Runs a command on a node of the emulated cluster, taking the arguments ssh would get.
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done
host=$1
shift
pid=$(cat "%(dir)s/$host.pid" 2>/dev/null) || { echo "no node $host in the cluster" >&2; exit 255; }
cores=$(cat "%(dir)s/$host.cores" 2>/dev/null)
exec taskset -c "${cores:-%(all)s}" nsenter -t "$pid" -a -- /bin/sh -c "cd '$PWD' 2>/dev/null; $*"
"""


def _start_node(host: str, hosts_file: Path) -> int:
    """Start the process that holds node ``host``'s namespaces; its PID once the node is ready."""
    ready = STATE_DIR / f"{host}.ready"
    ready.unlink(missing_ok=True)
    setup = (f"hostname {host} && mount -t tmpfs -o mode=1777 tmpfs /dev/shm && "
             f"mount --bind {hosts_file} /etc/hosts && ip link set lo up && touch {ready} && exec sleep infinity")
    process = subprocess.Popen(["ip", "netns", "exec", namespace(host), "unshare", "--pid", "--fork", "--uts",
                                "--ipc", "--mount", "--mount-proc", "--propagation", "private", "/bin/sh", "-c", setup],
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               start_new_session=True)
    deadline = time.monotonic() + 10
    while not ready.exists():
        if process.poll() is not None:
            raise ClusterError(f"starting node {host} failed: {process.stderr.read().decode().strip()}")
        if time.monotonic() > deadline:
            raise ClusterError(f"node {host} did not come up within 10 s")
        time.sleep(0.02)
    children = Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()
    if not children:
        raise ClusterError(f"node {host}: its first process is gone")
    return int(children[0])


def up(nodes: int, rate: str, own_cores: bool = False) -> State:
    """Make a cluster of ``nodes`` isolated nodes, each link shaped to ``rate`` both ways, each
    node on all of this machine's cores or (``own_cores``) on its share of them (``share_cores``)."""
    if not 1 <= nodes <= MAX_NODES:
        raise ValueError(f"--nodes must be between 1 and {MAX_NODES}, got {nodes}")
    bits = link.parse_rate(rate)
    if State.load() is not None or leftovers():
        raise ClusterError("a cluster is already up (or an earlier one left pieces behind): "
                           "run 'python -m allreduce_kit.cluster down' first")
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    hosts = [node_name(i) for i in range(1, nodes + 1)]
    hosts_file = STATE_DIR / "hosts"
    hosts_file.write_text("127.0.0.1 localhost\n" + f"{BRIDGE_ADDRESS} {BRIDGE}\n"
                          + "".join(f"{SUBNET}.{i} {h}\n" for i, h in enumerate(hosts, 1)))
    enter = STATE_DIR / "enter"
    machine = sorted(os.sched_getaffinity(0))
    enter.write_text(ENTER_SCRIPT % {"dir": STATE_DIR, "all": ",".join(map(str, machine))})
    enter.chmod(0o755)
    state = State([], bits, rate)
    shares = share_cores(nodes, machine) if own_cores else [[] for _ in range(nodes)]
    try:
        _run(["ip", "link", "add", BRIDGE, "type", "bridge"])
        _run(["ip", "addr", "add", f"{BRIDGE_ADDRESS}/24", "dev", BRIDGE])
        _run(["ip", "link", "set", BRIDGE, "up"])
        for i, host in enumerate(hosts, 1):
            ns, address = namespace(host), f"{SUBNET}.{i}"
            _run(["ip", "netns", "add", ns])
            _run(["ip", "link", "add", ns, "type", "veth", "peer", "name", "eth0", "netns", ns])
            _run(["ip", "link", "set", ns, "master", BRIDGE])
            _run(["ip", "link", "set", ns, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(link.tbf(ns, bits))                                 # into the node
            _run(["ip", "netns", "exec", ns, *link.tbf("eth0", bits)])  # out of the node
            node = Node(host, address, _start_node(host, hosts_file), shares[i - 1])
            (STATE_DIR / f"{host}.pid").write_text(f"{node.pid}\n")
            (STATE_DIR / f"{host}.cores").write_text(",".join(map(str, node.cores)) + "\n")
            state.nodes.append(node)
        state.save()
    except BaseException:
        down()
        raise
    return state


def leftovers() -> List[str]:
    """Names of namespaces and devices of this cluster's that exist now."""
    found = [ns for ns in _run(["ip", "netns", "list"], check=False).stdout.split() if ns.startswith(PREFIX)]
    for line in _run(["ip", "-o", "link", "show"], check=False).stdout.splitlines():
        parts = line.split(":")
        if len(parts) > 1:
            name = parts[1].strip().split("@")[0]
            if name.startswith(PREFIX):
                found.append(name)
    return sorted(set(found))


def down() -> List[str]:
    """Remove the cluster: its processes, namespaces, devices and state. Returns what it removed.

    Works from what exists, not only from the state file, so it also clears what an
    interrupted ``up`` left."""
    removed = []
    namespaces = [ns for ns in _run(["ip", "netns", "list"], check=False).stdout.split() if ns.startswith(PREFIX)]
    for ns in namespaces:
        pids = [int(p) for p in _run(["ip", "netns", "pids", ns], check=False).stdout.split() if p.isdigit()]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _run(["ip", "netns", "del", ns], check=False)
        removed.append(f"namespace {ns}" + (f" ({len(pids)} processes)" if pids else ""))
    for name in leftovers():
        if _run(["ip", "link", "del", name], check=False).returncode == 0:
            removed.append(f"device {name}")
    if STATE_DIR.exists():
        shutil.rmtree(STATE_DIR, ignore_errors=True)
        removed.append(f"state {STATE_DIR}")
    return removed


def require() -> State:
    """The running cluster's state; ``ClusterError`` if none is up or a node has gone."""
    state = State.load()
    if state is None:
        raise ClusterError("no cluster is up: run 'python -m allreduce_kit.cluster up --nodes N --link RATE'")
    for node in state.nodes:
        if not Path(f"/proc/{node.pid}").exists():
            raise ClusterError(f"node {node.host} is gone (its process {node.pid} ended): "
                               "run 'python -m allreduce_kit.cluster down', then 'up' again")
    return state


def rank_counts(ranks: int, nodes: int, per_node: Optional[Sequence[int]] = None) -> List[int]:
    """Ranks on each node for ``ranks`` ranks on ``nodes`` nodes: as even as possible, the first
    nodes taking one more, unless ``per_node`` gives them."""
    if per_node:
        if len(per_node) > nodes or any(c < 1 for c in per_node) or sum(per_node) != ranks:
            raise ValueError(f"--ranks-per-node {','.join(map(str, per_node))}: needs at most {nodes} counts "
                             f">= 1 that add up to -n {ranks}")
        return list(per_node)
    return [ranks // nodes + (i < ranks % nodes) for i in range(min(nodes, ranks))]


def _slots(state: State, ranks: int, placement: str, per_node: Optional[Sequence[int]] = None,
           nodes: Optional[int] = None) -> List[Tuple[str, int]]:
    """(host, ranks in a row) over the first ``nodes`` nodes (default all): ``block`` fills node
    after node with its share, ``round-robin`` deals ranks to the nodes in turn, one at a time."""
    if nodes is not None and not 1 <= nodes <= len(state.nodes):
        raise ValueError(f"--nodes must be between 1 and the cluster's {len(state.nodes)}, got {nodes}")
    counts = rank_counts(ranks, nodes or len(state.nodes), per_node)
    used = state.nodes[:len(counts)]
    if placement == "block":
        return [(n.host, c) for n, c in zip(used, counts)]
    if placement == "round-robin":
        if per_node:
            raise ValueError("--ranks-per-node goes with --placement block")
        return [(n.host, 1) for n in used]
    raise ValueError(f"--placement must be block or round-robin, got {placement!r}")


def hosts_argument(state: State, ranks: int, placement: str, per_node: Optional[Sequence[int]] = None,
                   nodes: Optional[int] = None) -> str:
    """MPICH's ``-hosts`` for the placement (``_slots``; round-robin: rank r on node r mod N)."""
    return ",".join(f"{host}:{count}" for host, count in _slots(state, ranks, placement, per_node, nodes))


def rank_hosts(state: State, ranks: int, placement: str, per_node: Optional[Sequence[int]] = None,
               nodes: Optional[int] = None) -> List[str]:
    """The node of each rank, in rank order, for the placement (what ``hosts_argument`` tells MPICH)."""
    slots = _slots(state, ranks, placement, per_node, nodes)
    if placement == "block":
        return [host for host, count in slots for _ in range(count)]
    return [slots[r % len(slots)][0] for r in range(ranks)]


def launcher_kind(mpirun: str) -> str:
    """``"mpich"`` for MPICH's ``mpiexec`` (Hydra), ``"openmpi"`` for Open MPI's ``mpirun``, read
    from ``mpirun --version``; ``ValueError`` naming ``--mpirun`` for anything else."""
    try:
        said = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise ValueError(f"--mpirun {mpirun}: cannot run it: {error}") from None
    text = said.stdout + said.stderr
    if "HYDRA" in text:
        return "mpich"
    if "Open MPI" in text or "PRRTE" in text:
        return "openmpi"
    first = text.strip().splitlines()[0] if text.strip() else "it printed no version"
    raise ValueError(f"--mpirun {mpirun} is neither MPICH's mpiexec (Hydra) nor Open MPI's mpirun ({first})")


def mpiexec_command(state: State, ranks: int, command: Sequence[str], placement: str = "block",
                    per_node: Optional[Sequence[int]] = None, nodes: Optional[int] = None,
                    mpirun: Optional[str] = None, hostfile: Optional[Path] = None,
                    kind: Optional[str] = None) -> List[str]:
    """The launch line that runs ``command`` as ``ranks`` ranks across the cluster: with MPICH's
    ``mpiexec`` (``mpirun`` None: the one beside this Python), or with ``mpirun`` (MPICH's or Open
    MPI's: ``kind``, else ``launcher_kind``). Open MPI places rank r on line r of ``hostfile``
    (``--map-by seq``), which this writes; its daemons start through ``enter`` as MPICH's proxies do."""
    if mpirun is None:
        found = Path(sys.executable).parent / "mpiexec"
        if not found.exists():
            found = shutil.which("mpiexec")
            if found is None:
                raise ClusterError(f"no mpiexec beside {sys.executable} or on PATH (pip install mpich)")
        mpirun, kind = str(found), "mpich"
    elif kind is None:
        kind = launcher_kind(mpirun)
    if kind == "mpich":
        return [mpirun, "-launcher", "ssh", "-launcher-exec", str(STATE_DIR / "enter"),
                "-hosts", hosts_argument(state, ranks, placement, per_node, nodes), "-iface", BRIDGE, "-n", str(ranks),
                *command]
    if hostfile is None:
        raise ValueError("Open MPI's mpirun places the ranks from a hostfile: pass hostfile")
    hostfile.write_text("".join(f"{host}\n" for host in rank_hosts(state, ranks, placement, per_node, nodes)))
    return [mpirun, "--oversubscribe", "--prtemca", "plm_ssh_agent", str(STATE_DIR / "enter"),
            "--hostfile", str(hostfile), "--map-by", "seq", "-n", str(ranks), *command]


def run_environment(ranks: int = 0, open_mpi: bool = False) -> Dict[str, str]:
    """The environment ranks run with: MPI's traffic between nodes on each node's ``eth0``, and
    this Python's directory first on ``PATH``, so that ``python`` in the command is this one.
    Under Open MPI (``open_mpi``) with more ``ranks`` than this machine has cores, waiting ranks
    yield (``OMPI_MCA_mpi_yield_when_idle=1``, unless set): the nodes share the machine's cores,
    which a rank cannot see before MPI starts (``run.enable_heavy_yield`` sees only its node)."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("FI_TCP_IFACE", "eth0")
    env.setdefault("FI_PROVIDER", "tcp")
    env.setdefault("UCX_NET_DEVICES", "eth0")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")           # the cluster runs as root; Open MPI asks for both
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    if open_mpi and ranks > len(os.sched_getaffinity(0)) and config.read(config.YIELD, env):
        env.setdefault(run.OPEN_MPI_YIELD, "1")
    return env
