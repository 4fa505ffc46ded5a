"""The emulated cluster (``python -m allreduce_kit.cluster``): isolated nodes, and the library on them.

One cluster of three nodes is made for the module and removed at the end. On it:

- each node's commands run on the machine's cores (``up --own-cores``: its share of them);
- the nodes are separate hosts: a direct read from a rank on another node fails, ``/dev/shm``
  is the node's own, the topology sees the nodes, the node-local paths are not taken across
  nodes (``cluster/isolation_check.py``);
- every algorithm, op, dtype and awkward length matches MPI's own ``Allreduce`` (the cases of the
  MPI suite's ``test_allreduce.py``, ``cluster/allreduce_check.py``), and every algorithm of
  ``reduce_scatter``, ``allgather`` and ``broadcast`` their MPI calls (``cluster/registries_check.py``,
  in the same job), on 2 nodes x 2 ranks and on 3 nodes with uneven ranks, with block and
  round-robin placement; and under Open MPI (``run --mpirun``) on 3 nodes, uneven, round-robin;
- the bench names the nodes, the ranks on each and the link, adds "link %", and ``auto`` tunes
  online: ``hierarchical`` against MPI's own for a large message, the few-round ones for a small one;
- the trainer runs across the nodes and its straggler report names them;
- a trace finds an offset given to one node's clock and takes it out (``cluster/trace_check.py``).

Skipped, with the reason, where the cluster cannot be made: not root, no ``ip``/``tc``/
``unshare``/``nsenter``, not in a virtual environment (the ranks run this one's Python).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from allreduce_kit import cluster, multinode
from allreduce_kit.cluster import __main__ as cli
from test_cli_contract import says_a_default_twice
from test_openmpi_suite import openmpi  # noqa: F401  (the fixture: Open MPI beside the venv's MPICH)

TESTS = Path(__file__).resolve().parent
PYTHON = sys.executable
#: Fast enough that the CPU, not the link, bounds the correctness runs; still shaped.
LINK = "4gbit"
NODES = 3
#: Every algorithm x op x dtype x awkward length against MPI's own Allreduce.
SUITE = ["-m", "mpi4py", str(TESTS / "cluster" / "allreduce_check.py")]


def why_no_cluster():
    problem = cluster.why_not_here()
    if problem is None and sys.prefix == sys.base_prefix:
        problem = "the nodes run the virtual environment's mpiexec and Python: run pytest from one (see README)"
    return problem


needs_cluster = pytest.mark.skipif(why_no_cluster() is not None, reason=str(why_no_cluster()))


def command(*args: str, timeout: float = 120, env=None) -> subprocess.CompletedProcess:
    """``python -m allreduce_kit.cluster ARGS`` from the tests directory (the installed package)."""
    try:
        return subprocess.run([PYTHON, "-m", "allreduce_kit.cluster", *args], cwd=TESTS, capture_output=True,
                              text=True, timeout=timeout, stdin=subprocess.DEVNULL, env=env)
    except subprocess.TimeoutExpired:
        command("down")
        pytest.fail(f"cluster {' '.join(args)} did not finish within {timeout} s")


@pytest.fixture(scope="module")
def nodes():
    command("down")  # whatever an earlier run left
    made = command("up", "--nodes", str(NODES), "--link", LINK, "--no-measure")
    assert made.returncode == 0, made.stderr
    yield cluster.require()
    gone = command("down")
    assert gone.returncode == 0, gone.stderr
    assert not cluster.leftovers() and not cluster.STATE_DIR.exists()


def run(*args: str, timeout: float = 600, env=None) -> subprocess.CompletedProcess:
    return command("run", "--timeout", str(timeout), *args, timeout=timeout + 30, env=env)


def test_not_root_is_one_message_and_status_2(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert cli.main(["status"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs root" in err and "Traceback" not in err


def test_help_version_and_bad_options():
    assert command("--help").returncode == 0 and "usage:" in command("up", "--help").stdout
    for sub in ("up", "run", "down", "status"):
        assert not says_a_default_twice(command(sub, "--help").stdout), sub
    from allreduce_kit import __version__

    assert command("--version").stdout.strip() == f"allreduce_kit {__version__}"
    for args, message in ((["status", "--bogus"], "unrecognized arguments: --bogus"),
                          (["up", "--link", "fast"], "link rate 'fast'"),
                          (["up", "--nodes", "0"], "expected an integer >= 1"),
                          (["run", "-n", "2"], "give the command after --")):
        done = command(*args)
        assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, args


def test_bad_rate_is_rejected():
    with pytest.raises(ValueError, match="link rate"):
        cluster.link.parse_rate("fast")
    assert cluster.link.parse_rate("250mbit") == 250_000_000
    assert cluster.link.tbf("eth0", 10 ** 9)[-6:-4] == ["rate", "1000000000bit"]


def test_a_link_may_send_4_ms_late_without_losing_its_time():
    """The bucket's burst is 4 ms at the rate, so that a bucket the kernel empties late on busy
    cores catches up instead of losing link time (docs/multinode.md, what the emulation costs)."""
    command = cluster.link.tbf("eth0", 250 * 10 ** 6)
    assert command[command.index("burst") + 1] == str(250 * 10 ** 6 // 8 * 4 // 1000)
    command = cluster.link.tbf("eth0", 10 ** 9)
    assert command[command.index("burst") + 1] == str(10 ** 9 // 8 * 4 // 1000)


def test_placements():
    state = cluster.State([cluster.Node(f"node{i}", f"10.0.0.{i}", 0) for i in (1, 2, 3)], 10 ** 9, "1gbit")
    assert cluster.hosts_argument(state, 8, "block") == "node1:3,node2:3,node3:2"
    assert cluster.hosts_argument(state, 8, "block", [3, 5]) == "node1:3,node2:5"
    assert cluster.hosts_argument(state, 2, "round-robin") == "node1:1,node2:1"
    assert cluster.hosts_argument(state, 4, "round-robin", nodes=2) == "node1:1,node2:1"
    assert cluster.hosts_argument(state, 5, "block", nodes=2) == "node1:3,node2:2"
    with pytest.raises(ValueError, match="add up"):
        cluster.hosts_argument(state, 8, "block", [3, 4])
    assert cluster.rank_hosts(state, 5, "block", [1, 2, 2]) == ["node1", "node2", "node2", "node3", "node3"]
    assert cluster.rank_hosts(state, 5, "round-robin") == ["node1", "node2", "node3", "node1", "node2"]
    assert cluster.rank_hosts(state, 3, "round-robin", nodes=2) == ["node1", "node2", "node1"]


def test_cores_are_shared_out():
    assert cluster.share_cores(2, [0, 1]) == [[0], [1]]
    assert cluster.share_cores(3, range(8)) == [[0, 1], [2, 3, 4], [5, 6, 7]]
    assert cluster.share_cores(1, [3, 1]) == [[1, 3]]
    assert cluster.share_cores(5, [0, 1]) == [[0], [1], [0], [1], [0]]  # more nodes than cores: dealt in turn


@needs_cluster
def test_ranks_run_on_their_nodes_cores(nodes):
    assert all(n.cores == [] for n in nodes.nodes)  # made without --own-cores: every node on all cores
    machine = sorted(os.sched_getaffinity(0))
    done = run("-n", str(NODES), "--placement", "round-robin", "--", PYTHON, "-c",
               "import os, socket; cores = ' '.join(map(str, sorted(os.sched_getaffinity(0))));"
               "os.write(1, f'{socket.gethostname()} {cores}\\n'.encode())",  # one write: lines of ranks never mix
               timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    seen = {line.split()[0]: [int(c) for c in line.split()[1:]] for line in done.stdout.splitlines()}
    assert seen == {n.host: machine for n in nodes.nodes}


@needs_cluster
def test_nodes_are_isolated(nodes):
    for layout in (["-n", "4", "--nodes", "2"], ["-n", "5", "--placement", "round-robin"]):
        expected = 2 if "--nodes" in layout else NODES
        done = run(*layout, "--", PYTHON, "-m", "mpi4py", str(TESTS / "cluster" / "isolation_check.py"), str(expected))
        assert done.returncode == 0, done.stdout + done.stderr
        assert done.stdout.startswith(f"isolated: {expected} nodes"), done.stdout + done.stderr


@needs_cluster
@pytest.mark.parametrize("layout, cover", [
    (["-n", "4", "--nodes", "2"], []),
    (["-n", "4", "--nodes", "2", "--placement", "round-robin"], ["--cover"]),
    (["-n", "5", "--ranks-per-node", "1,2,2"], ["--cover"]),
    (["-n", "5", "--placement", "round-robin"], ["--cover"]),
], ids=["2x2-block", "2x2-round-robin", "1+2+2-block", "2+2+1-round-robin"])
def test_every_algorithm_across_nodes(nodes, layout, cover):
    """Every case on the first layout; on the others every algorithm with every dtype, op and
    length in turn (``allreduce_check.py``'s ``--cover``)."""
    done = run(*layout, "--", PYTHON, *SUITE, *cover)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert done.stdout.startswith("passed: "), done.stdout + done.stderr


@needs_cluster
def test_open_mpi_runs_across_the_nodes_too(nodes, openmpi):
    """``cluster run --mpirun`` with Open MPI's ``mpirun``: ranks placed as asked (uneven, round-robin),
    the nodes isolated under it too, and every algorithm matches MPI's own call with every op, dtype
    and length in turn."""
    env = openmpi.environment()
    layout = ["-n", "5", "--placement", "round-robin", "--mpirun", openmpi.mpirun]
    where = run(*layout, "--", PYTHON, "-c", "from mpi4py import MPI; import os, socket; "
                "print(MPI.COMM_WORLD.Get_rank(), socket.gethostname(), MPI.Get_library_version()[:8], "
                "os.environ.get('OMPI_MCA_mpi_yield_when_idle'))", env=env)
    assert where.returncode == 0, where.stdout + where.stderr
    placed = sorted(line.split()[:3] for line in where.stdout.splitlines() if line[:1].isdigit())
    assert placed == [[str(r), f"node{r % NODES + 1}", "Open"] for r in range(5)], where.stdout
    # the nodes share this machine's cores: with more ranks than cores, waiting ranks yield
    shared = 5 > len(os.sched_getaffinity(0))
    assert all(line.split()[-1] == ("1" if shared else "None") for line in where.stdout.splitlines()
               if line[:1].isdigit()), where.stdout
    done = run(*layout, "--", PYTHON, "-m", "mpi4py", str(TESTS / "cluster" / "isolation_check.py"), str(NODES),
               env=env)
    assert done.returncode == 0 and done.stdout.startswith(f"isolated: {NODES} nodes"), done.stdout + done.stderr
    done = run(*layout, "--", PYTHON, *SUITE, "--cover", env=env)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert done.stdout.startswith("passed: ") and "ranks per node (2, 2, 1)" in done.stdout, done.stdout + done.stderr
    assert not list(cluster.STATE_DIR.glob("ranks.*")), "the hostfile of each run is removed"


def test_a_launcher_that_is_neither_mpi_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--mpirun .* neither MPICH's mpiexec"):
        cluster.launcher_kind(sys.executable)
    with pytest.raises(ValueError, match="--mpirun .*: cannot run it"):
        cluster.launcher_kind(str(tmp_path / "no-such-mpirun"))


@needs_cluster
def test_bench_shows_the_network(nodes, tmp_path):
    out = tmp_path / "bench.json"
    done = run("-n", "4", "--nodes", "2", "--", PYTHON, "-m", "allreduce_kit.bench", "-b", "1K", "-e", "1M", "-f", "1024",
               "-n", "2", "-w", "1", "--batch", "1", "-a", "auto,mpi", "--json", str(out))
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    assert "# nodes: 2 (node1, node2), ranks per node: 2, 2" in done.stdout
    assert "link % = 2(N-1)/N x size / time / link bandwidth, N = 2 nodes" in done.stdout
    assert "auto's table: node-aware cost model (2 nodes" in done.stdout
    rows = json.loads(out.read_text())["rows"]
    auto = {r["size"]: r for r in rows if r["algorithm"] == "auto"}
    # 2 x 2 ranks: from 64 KiB (512 KiB on fewer cores) the cost model's hierarchical, timed against MPI's own only
    large = auto[1 << 20]
    assert large["explored"] > 0 and set(large["trials"]["times_us"]) == {"hierarchical", "mpi"}
    assert large["chosen"] == large["trials"]["algorithm"] in ("hierarchical", "mpi")
    # below it, online tuning timed the model's MPI against the other candidates, and kept one
    assert auto[1024]["explored"] > 0 and set(auto[1024]["trials"]["times_us"]) == set(multinode.CANDIDATES)
    assert auto[1024]["chosen"] == auto[1024]["trials"]["algorithm"] in multinode.CANDIDATES
    for row in rows:  # 4 Gbit/s, the rate the cluster shapes to (not measured here)
        assert row["link_pct"] == pytest.approx(100 * row["size"] * 8 / (row["time_us"] * 1e-6) / 4e9)


@needs_cluster
def test_trainer_reports_nodes(nodes, tmp_path):
    out = tmp_path / "train.json"
    done = run("-n", "4", "--nodes", "2", "--", "python", "-m", "allreduce_kit.train", "--epochs", "1",  # this Python
               "--dataset", "synthetic", "--samples", "1024", "--features", "16", "--classes", "4",
               "--json", str(out))
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["hosts"] == ["node1", "node2"]
    hosts = {row["host"] for row in report["straggler"]["ranks"]}
    assert hosts == {"node1", "node2"}
    assert "node1" in done.stdout and "node2" in done.stdout


@needs_cluster
def test_a_trace_finds_an_offset_given_to_one_nodes_clock_and_takes_it_out(nodes, tmp_path):
    """``ALLREDUCE_KIT_TRACE_CLOCK_SKEW_US`` puts node2's clock 5 ms ahead: the trace finds node2's
    ranks 5 ms ahead within 50 us (node1's within 20 us of zero), and in the merged file every
    8-byte allreduce ends within 50 us of when it truly ended: the nodes share one real clock, so
    the truth is known (``cluster/trace_check.py``). One node's clock alone is
    ``tests/mpi/test_trace.py``'s."""
    env = dict(os.environ, ALLREDUCE_KIT_TRACE_CLOCK_SKEW_US="node2:5000")
    done = run("-n", "4", "--nodes", "2", "--", PYTHON, "-m", "mpi4py", str(TESTS / "cluster" / "trace_check.py"),
               str(tmp_path / "t.json"), "node2", "5000", env=env, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("aligned: "), done.stdout + done.stderr[-3000:]


@needs_cluster
def test_status_measures_one_pair_and_every_link_at_once(nodes):
    measured = cli.measure(nodes, 0.5)  # not saved: the bench above reads the shaped rate
    assert set(measured) == {"1 flow", "4 flows", cli.EVERY_LINK}
    for name, bits in measured.items():  # plain TCP gets a real share of the 4 Gbit/s, never more than it
        assert 0.05 * nodes.link_bits < bits < 1.1 * nodes.link_bits, (name, bits)
