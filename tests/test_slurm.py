"""``jobs/*.sbatch`` on a real Slurm: the scripts as users submit them, with ``sbatch --wait``.

The module makes an emulated cluster of two nodes (``python -m allreduce_kit.cluster up``: own
network, host name, PIDs, IPC and ``/dev/shm`` each, shaped links to a bridge), then
``tests/slurm/start-slurm.sh --on-cluster`` installs Debian's Slurm if needed and starts munged
and slurmctld on the host and one slurmd inside each node, so a step's ranks on two nodes talk
over the links; ``stop-slurm.sh`` and ``cluster down`` remove it all at the end of the module. Jobs run one at a time (waiting MPI ranks spin, so
concurrent jobs on 2 cores slow each other down far more than they overlap). Each is submitted
from a directory of its own, so the installed package is imported, and activates the virtual
environment of the interpreter running the tests (``VENV``).

Skipped, with the reason, only where Slurm cannot be run: not root, no Slurm and no apt-get to
install it, no emulated cluster possible (namespaces, ``ip``, ``tc``), not in a virtual
environment, or ``ALLREDUCE_KIT_SLURM_TESTS=0``.
"""
import csv
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from allreduce_kit import cluster as emulated

REPO = Path(__file__).resolve().parent.parent
JOBS = REPO / "jobs"
START = REPO / "tests" / "slurm" / "start-slurm.sh"
STOP = REPO / "tests" / "slurm" / "stop-slurm.sh"
STATE = os.environ.get("ALLREDUCE_KIT_SLURM_DIR", "/tmp/allreduce_kit-slurm")
JOB_TIMEOUT = 300  # seconds from submission to the end of one job
#: The emulated cluster's nodes and link: the CPU, not this link, bounds these small jobs.
NODES = 2
LINK = "1gbit"

# Small runs: the point is the plumbing, not the numbers. At 4 and 8 ranks a small synthetic
# problem: the digits need scikit-learn, whose import on 8 ranks sharing 2 cores doubled the
# job's time here; the two-node job trains on the digits, as the scripts do by default.
TRAIN_ARGS = ["--epochs", "1", "--dataset", "synthetic", "--samples", "2048", "--features", "32", "--classes", "4"]
DIGITS_ARGS = ["--epochs", "1"]
BENCH_ARGS = ["-b", "8", "-e", "32K", "-f", "64", "-n", "3", "-w", "1", "--batch", "2"]

pytestmark = pytest.mark.slow


def why_no_slurm() -> Optional[str]:
    """The reason Slurm cannot be run here, or None."""
    if os.environ.get("ALLREDUCE_KIT_SLURM_TESTS", "1") == "0":
        return "ALLREDUCE_KIT_SLURM_TESTS=0 in the environment"
    if not sys.platform.startswith("linux"):
        return "Slurm's daemons are started on Linux only"
    if os.geteuid() != 0:
        return "starting Slurm's daemons (SlurmUser=root) and installing them with apt-get needs root"
    if not (shutil.which("slurmctld") and shutil.which("sbatch")) and not shutil.which("apt-get"):
        return "Slurm is not installed and there is no apt-get to install it"
    if sys.prefix == sys.base_prefix:
        return "the job scripts activate a virtual environment: run pytest from one (see README)"
    problem = emulated.why_not_here()
    return f"the nodes are those of the emulated cluster, and {problem}" if problem else None


@dataclass
class Cluster:
    """The running test cluster: the environment a submitting user would have."""

    conf: str
    #: the node names, as Slurm and the ranks see them
    nodes: List[str]

    def env(self, **extra: str) -> Dict[str, str]:
        # A suite that itself runs inside a Slurm job must not leak that job's SLURM_* into ours.
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env.update(SLURM_CONF=self.conf, VENV=sys.prefix, PYTHONUNBUFFERED="1")
        env.pop("VIRTUAL_ENV", None)
        env.update(extra)
        return env

    def run(self, command: List[str], cwd: Path, timeout: float = 120, **extra: str) -> subprocess.CompletedProcess:
        try:
            return subprocess.run(command, cwd=cwd, env=self.env(**extra), capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{' '.join(command)} did not finish within {timeout} s")


def cluster_command(*args: str) -> subprocess.CompletedProcess:
    """``python -m allreduce_kit.cluster ARGS``."""
    return subprocess.run([sys.executable, "-m", "allreduce_kit.cluster", *args], capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL, cwd=REPO / "tests")


@pytest.fixture(scope="module")
def slurm_cluster():
    """Make the emulated cluster and start Slurm on it (installing it if needed) once for the
    module; stop and remove both at its end."""
    reason = why_no_slurm()
    if reason:
        pytest.skip(f"no Slurm cluster: {reason}")
    env = dict(os.environ, ALLREDUCE_KIT_SLURM_DIR=STATE, ALLREDUCE_KIT_SLURM_NODES=str(NODES),
               ALLREDUCE_KIT_SLURM_CPUS="8")
    started = time.monotonic()
    subprocess.run(["bash", str(STOP)], env=env, capture_output=True, timeout=120)  # what an earlier run left
    cluster_command("down")
    made = cluster_command("up", "--nodes", str(NODES), "--link", LINK, "--no-measure")
    if made.returncode != 0:
        pytest.fail(f"cluster up failed ({made.returncode}):\n{made.stdout}\n{made.stderr}")
    try:
        try:
            result = subprocess.run(["bash", str(START), "--on-cluster"], env=env, capture_output=True, text=True,
                                    timeout=900)
        except subprocess.TimeoutExpired:
            pytest.fail("tests/slurm/start-slurm.sh did not finish within 900 s")
        if result.returncode != 0:
            pytest.fail(f"tests/slurm/start-slurm.sh failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
        print(f"\nSlurm up in {time.monotonic() - started:.0f} s:\n{made.stdout}{result.stdout}", end="")
        yield Cluster(conf=f"{STATE}/slurm.conf", nodes=[node.host for node in emulated.require().nodes])
    finally:
        stopped = subprocess.run(["bash", str(STOP)], env=env, capture_output=True, text=True, timeout=120)
        gone = cluster_command("down")
        print(stopped.stdout + gone.stdout, end="")


@dataclass
class Job:
    """What a finished ``sbatch --wait`` left: its status, Slurm's log, its run directory."""

    name: str
    cwd: Path
    tasks: int
    job_id: str
    returncode: int
    slurm_out: str

    def run_dir(self, program: str) -> Path:
        return self.cwd / "runs" / f"{program}-{self.job_id}"

    def expect_success(self, program: str) -> Path:
        """Assert the job succeeded and left its run directory; return that directory."""
        assert self.returncode == 0, f"job {self.name} failed ({self.returncode}):\n{self.slurm_out}"
        run = self.run_dir(program)
        assert run.is_dir(), f"no run directory {run}:\n{self.slurm_out}"
        log = (run / f"{program}.log").read_text()
        assert log == self.slurm_out, (f"the run directory's {program}.log should hold all that Slurm's output "
                                       f"file holds:\n{log}\n---\n{self.slurm_out}")
        return run


def slurm_log(cwd: Path, job_id: str) -> str:
    outs = sorted(cwd.glob(f"*-{job_id}.out")) if job_id else []
    return outs[0].read_text(errors="replace") if outs else "(no Slurm output file)"


def submit(cluster: Cluster, cwd: Path, script: str, options: List[str], launcher: str, tasks: int,
           args: List[str]) -> Job:
    """``sbatch --wait`` a job script from ``cwd`` and return what it left (one job at a time:
    MPI ranks that wait spin, so two jobs on the same 2 cores slow each other down badly)."""
    name = f"{script} {' '.join(options)} LAUNCHER={launcher} {' '.join(args)}"
    command = ["sbatch", "--parsable", "--wait", *options, str(JOBS / script), *args]
    started = time.monotonic()
    # The test machine runs 8 ranks on 2 cores: waiting ranks should yield (docs/slurm.md).
    proc = subprocess.Popen(command, cwd=cwd, env=cluster.env(LAUNCHER=launcher, MPIR_CVAR_ENABLE_HEAVY_YIELD="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=JOB_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        job_id = stdout.split(";")[0].strip()
        if job_id:
            subprocess.run(["scancel", job_id], env=cluster.env())
        pytest.fail(f"job {name} did not end within {JOB_TIMEOUT} s; its log so far:\n{slurm_log(cwd, job_id)}")
    job_id = stdout.split(";")[0].strip()
    assert re.fullmatch(r"\d+", job_id), f"sbatch --parsable printed no job id: {stdout!r} {stderr!r}"
    print(f"\n[{name}] job {job_id}: exit {proc.returncode} after {time.monotonic() - started:.0f} s", end=" ")
    return Job(name=name, cwd=cwd, tasks=tasks, job_id=job_id, returncode=proc.returncode,
               slurm_out=slurm_log(cwd, job_id))


def check_training(job: Job, launcher: str, hosts: int = 1, cpus: int = 1) -> None:
    run = job.expect_success("train")
    out = job.slurm_out
    assert f"{job.tasks} tasks, {cpus} CPU(s) per task; launcher: {launcher}" in out, out
    # --cpus-per-task reaches every rank as its thread count (OMP_NUM_THREADS, NUMBA_NUM_THREADS)
    assert f"{cpus} thread{'' if cpus == 1 else 's'} per rank" in out, out
    assert re.search(r"test accuracy [\d.]+% after \d+ steps", out), out          # the training summary
    assert f"replicas bitwise identical on all {job.tasks} ranks: yes" in out, out
    assert "straggler report over" in out, out                                      # the straggler report
    table = out[out.index("straggler report over"):]
    assert len(re.findall(r"^\s+\d+\s+\S+\s+[\d.]+ ms", table, re.M)) == job.tasks, table  # a row per rank
    results = json.loads((run / "results.json").read_text())
    assert results["ranks"] == job.tasks
    assert len(results["straggler"]["ranks"]) == job.tasks
    assert len({row["host"] for row in results["straggler"]["ranks"]}) == hosts
    assert 0 <= results["test_accuracy"] <= 1
    assert results["threads_per_rank"] == cpus
    assert (run / "steps.png").stat().st_size > 0


def test_train_at_8_tasks_with_srun(slurm_cluster, tmp_path):
    check_training(submit(slurm_cluster, tmp_path, "train.sbatch", ["--ntasks-per-node=8"], "srun", 8, TRAIN_ARGS),
                   "srun")


def test_train_at_4_tasks_with_mpiexec(slurm_cluster, tmp_path):
    """Also with 2 CPUs per task: every rank must use 2 threads, not the node's 8."""
    check_training(submit(slurm_cluster, tmp_path, "train.sbatch", ["--ntasks-per-node=4", "--cpus-per-task=2"],
                          "mpiexec", 4, TRAIN_ARGS), "mpiexec", cpus=2)


def test_train_across_two_nodes(slurm_cluster, tmp_path):
    """train-multinode.sbatch: ranks on both nodes, which MPI sees as two hosts (one rank each:
    the rank counts are covered above, and every rank costs seconds of start-up on 2 cores)."""
    job = submit(slurm_cluster, tmp_path, "train-multinode.sbatch", ["--ntasks-per-node=1", "--cpus-per-task=2"],
                 "srun", 2, DIGITS_ARGS)
    check_training(job, "srun", hosts=2, cpus=2)
    assert "on 2 node(s)" in job.slurm_out


def link_bytes(node: str) -> int:
    """Bytes that have crossed ``node``'s link, both ways (its host-side end's counters)."""
    device = Path("/sys/class/net") / emulated.namespace(node) / "statistics"
    return int((device / "rx_bytes").read_text()) + int((device / "tx_bytes").read_text())


def test_a_step_across_two_nodes_runs_on_separate_hosts_and_crosses_the_link(slurm_cluster, tmp_path):
    """``srun`` over both nodes, 2 tasks each: the ranks see two host names, cannot read each
    other's memory or ``/dev/shm`` across nodes (``cluster/isolation_check.py``), and reducing a
    message moves at least its size each way over the first node's link: every element of the
    sum needs the other node's value and goes back to it."""
    first = slurm_cluster.nodes[0]
    before = link_bytes(first)
    result = slurm_cluster.run(["srun", f"--nodes={NODES}", "--ntasks-per-node=2", sys.executable, "-m", "mpi4py",
                                str(REPO / "tests" / "cluster" / "slurm_step_check.py"), str(NODES), "8"],
                               cwd=tmp_path, timeout=JOB_TIMEOUT, MPIR_CVAR_ENABLE_HEAVY_YIELD="1")
    crossed = link_bytes(first) - before
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert f"isolated: {NODES} nodes" in out, out + result.stderr
    hosts = re.search(r"^hosts: (.*)$", out, re.M).group(1).split()
    assert sorted(set(hosts)) == sorted(slurm_cluster.nodes) and len(hosts) == 2 * NODES, out
    assert "wrong: 0" in out, out
    reduced = int(re.search(r"^reduced: (\d+)$", out, re.M).group(1))
    print(f"\n[link] {crossed} bytes crossed {first}'s link for {reduced} bytes reduced", end=" ")
    assert crossed >= 2 * reduced, f"only {crossed} bytes crossed {first}'s link for {reduced} bytes reduced"


def check_bench(job: Job, launcher: str) -> None:
    run = job.expect_success("bench")
    out = job.slurm_out
    assert f"launcher: {launcher}" in out
    assert re.search(r"algorithm \| +time\(us\).*busbw\(GB/s\) \| +#wrong", out), out    # the table's header
    results = json.loads((run / "results.json").read_text())
    with open(run / "results.csv", newline="") as table:
        rows = list(csv.DictReader(table))
    assert rows and len(rows) == len(results["rows"]), "--csv and --json should hold the same rows"
    assert {"mpi", "ring", "tree", "auto"} <= {row["algorithm"] for row in rows}
    assert {int(row["ranks"]) for row in rows} == {job.tasks}
    assert all(int(row["wrong"]) == 0 for row in rows), [row for row in rows if row["wrong"] != "0"]
    assert (run / "busbw.png").stat().st_size > 0


def test_bench_at_4_tasks_with_srun(slurm_cluster, tmp_path):
    check_bench(submit(slurm_cluster, tmp_path, "bench.sbatch", ["--ntasks-per-node=4"], "srun", 4, BENCH_ARGS),
                "srun")


def test_bench_at_8_tasks_with_mpiexec(slurm_cluster, tmp_path):
    check_bench(submit(slurm_cluster, tmp_path, "bench.sbatch", ["--ntasks-per-node=8"], "mpiexec", 8, BENCH_ARGS),
                "mpiexec")


def test_a_bad_option_fails_the_job_with_a_readable_error(slurm_cluster, tmp_path):
    job = submit(slurm_cluster, tmp_path, "train.sbatch", ["--ntasks-per-node=2"], "srun", 2, ["--epochs", "0"])
    assert job.returncode == 2, job.slurm_out  # the trainer's status for a bad argument, through srun and sbatch
    assert "error: argument --epochs" in job.slurm_out, job.slurm_out
    assert job.slurm_out.count("error: argument --epochs") == 1, "the error should be printed once, by rank 0"
    assert "Traceback" not in job.slurm_out, job.slurm_out
    log = (job.run_dir("train") / "train.log").read_text()
    assert "error: argument --epochs" in log and "exited with status 2" in log, log


def test_an_unknown_launcher_fails_at_once(slurm_cluster, tmp_path):
    result = slurm_cluster.run(["sbatch", "--parsable", "--wait", "--ntasks=1", str(JOBS / "train.sbatch")],
                               cwd=tmp_path, LAUNCHER="mpirunn")
    assert result.returncode == 2, result
    out = next(tmp_path.glob("*.out")).read_text()
    assert "LAUNCHER must be srun or mpiexec, not 'mpirunn'" in out, out


def test_a_missing_environment_fails_with_its_path(slurm_cluster, tmp_path):
    result = slurm_cluster.run(["sbatch", "--parsable", "--wait", "--ntasks=1", str(JOBS / "train.sbatch")],
                               cwd=tmp_path, VENV=str(tmp_path / "no-such-venv"))
    assert result.returncode == 2, result
    out = next(tmp_path.glob("*.out")).read_text()
    assert f"no Python environment at VENV={tmp_path / 'no-such-venv'}" in out, out


def test_an_impossible_request_is_rejected_at_submission(slurm_cluster, tmp_path):
    """EnforcePartLimits=ALL: more tasks per node than any node has fails now, not pending forever."""
    result = slurm_cluster.run(["sbatch", "--parsable", "--wait", "--ntasks-per-node=64", str(JOBS / "train.sbatch")],
                               cwd=tmp_path, timeout=60)
    assert result.returncode != 0
    assert "Batch job submission failed" in result.stderr, result.stderr
    assert not list(tmp_path.glob("*.out")), "no job should have run"


def test_srun_without_mpi_is_stopped_by_the_guard(slurm_cluster, tmp_path):
    """``srun --mpi=none`` starts unconnected copies: the guard stops them, once, with status 2.

    (tests/test_slurm_guard.py shows that the CLIs call the same guard first thing.)
    """
    result = slurm_cluster.run(["srun", "--mpi=none", "--nodes=2", "--ntasks=2", sys.executable, "-m",
                                "allreduce_kit.launch"], cwd=tmp_path)
    assert result.returncode == 2, result
    assert result.stderr.count("Slurm started 2 tasks") == 1, result.stderr
    assert "MPI reports a world of 1 rank" in result.stderr
    assert "MPI world of" not in result.stdout, "no copy may go on"


# -- a node dies under the elastic job ----------------------------------------------------------
NODE = emulated.node_name(2)


def node_processes(node: str) -> List[int]:
    """Every process of an emulated node (those in its PID namespace) but its first, which holds
    the node's namespaces."""
    holder = emulated.require().node(node).pid
    namespace = os.readlink(f"/proc/{holder}/ns/pid")
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int(entry.name) != holder and os.readlink(entry / "ns" / "pid") == namespace:
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def kill_node(node: str) -> List[str]:
    """The node dies: SIGKILL to its slurmd, its job steps' slurmstepd and ranks, all at once."""
    killed = []
    for pid in node_processes(node):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            if Path(f"/proc/{pid}/status").read_text().count("State:\tZ"):
                continue  # already ended, not reaped by the node's first process
            os.kill(pid, 9)
            killed.append(name)
        except OSError:
            continue
    return killed


def restart_node(cluster: Cluster, node: str) -> None:
    """Start the node's slurmd again as start-slurm.sh does, and wait until the cluster is idle."""
    subprocess.run(emulated.on_node(emulated.require().node(node), ["slurmd", "-f", cluster.conf, "-N", node]),
                   env=cluster.env(), check=True, timeout=60)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        jobs = cluster.run(["squeue", "-h"], cwd=Path("/")).stdout.strip()
        states = cluster.run(["sinfo", "-h", "-N", "-o", "%T"], cwd=Path("/")).stdout.split()
        if not jobs and states and all(state == "idle" for state in states):
            return
        time.sleep(1)
    pytest.fail(f"the cluster is not idle 180 s after {node}'s slurmd was restarted: {jobs} {states}")


def test_elastic_training_finishes_on_one_node_when_the_other_dies(slurm_cluster, tmp_path):
    """``jobs/train-elastic.sbatch`` on 2 nodes x 2 tasks. In epoch 3 of 10 the second node dies: its
    slurmd, its job step's slurmstepd and its two ranks are killed. The supervisor finds that
    node's ranks without a heartbeat, relaunches on the first node alone (srun --exclude) from
    the newest checkpoint, and the job succeeds there; the report names the node and its ranks."""
    args = ["--hidden", "32", "--batch-size", "16", "--progress", "lines", "--epochs", "10", "--straggler", "0:100",
            "--checkpoint-every", "10", "--min-ranks", "2"]
    command = ["sbatch", "--parsable", "--wait", "--ntasks-per-node=2", str(JOBS / "train-elastic.sbatch"), *args]
    env = slurm_cluster.env(MPIR_CVAR_ENABLE_HEAVY_YIELD="1", ALLREDUCE_KIT_ELASTIC_TIMEOUT="5")
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed: List[str] = []
    try:
        deadline = time.monotonic() + JOB_TIMEOUT
        while not killed:
            logs = list(tmp_path.glob("runs/train-*/train.log"))
            if logs and " 3/10  loss" in logs[0].read_text():
                killed = kill_node(NODE)
            else:
                assert proc.poll() is None, f"the job ended before it could be hit:\n{slurm_log(tmp_path, '')}"
                assert time.monotonic() < deadline, "training did not reach epoch 3 in time"
                time.sleep(0.2)
        stdout, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, _ = proc.communicate()
        pytest.fail(f"the elastic job did not end within {JOB_TIMEOUT} s")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        restart_node(slurm_cluster, NODE)
    assert "slurmd" in killed and "slurmstepd" in killed and killed.count("python") == 2, killed
    job_id = stdout.split(";")[0].strip()
    job = Job(name="train-elastic.sbatch", cwd=tmp_path, tasks=2, job_id=job_id, returncode=proc.returncode,
              slurm_out=slurm_log(tmp_path, job_id))
    run = job.expect_success("train")
    out = job.slurm_out
    assert f"[elastic] node {NODE} (ranks 2, 3) lost after step" in out, out
    assert f"relaunching on 2 ranks, without node {NODE}: " in out and f"--exclude={NODE}" in out, out
    assert "replicas bitwise identical on all 2 ranks: yes" in out, out
    results = json.loads((run / "results.json").read_text())
    assert results["ranks"] == 2 and [e["epoch"] for e in results["epochs"]] == list(range(1, 11))
    assert {row["host"] for row in results["straggler"]["ranks"]} == {emulated.node_name(1)}
    (loss,) = results["elastic"]["losses"]
    assert loss["nodes_lost"] == [NODE] and loss["lost_ranks"] == [2, 3]
    assert loss["ranks_before"] == 4 and loss["ranks_after"] == 2
    assert 0 <= loss["steps_redone"] <= 10 and loss["step"] == loss["resumed_from"] + loss["steps_redone"]
    assert 0 < loss["recovery_seconds"] < JOB_TIMEOUT
    print(f"\n[node lost] {[line for line in out.splitlines() if 'lost after step' in line][-1]}", end=" ")
    assert not list((run / "checkpoints").glob(".elastic-*")), "the supervisor's directory is removed at the end"
