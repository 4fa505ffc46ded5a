"""The job scripts (``jobs/*.sbatch``) without a cluster: what sbatch reads from them, and what
they run.

- bash parses them and shellcheck finds nothing (shellcheck is installed from Debian when
  missing, as root with apt-get; where it cannot be, that check is skipped with the reason);
- sbatch itself reads every ``#SBATCH`` line and accepts it: ``sbatch -v`` against a controller
  address that refuses connections lists the options it took, then fails to submit;
- run with stub ``srun``/``mpiexec``/``python`` in a fake Slurm environment, each script starts
  the program of its virtual environment with the documented command line, thread settings,
  run directory and exit status.

``test_slurm.py`` submits the same scripts to a real Slurm and checks what the jobs print.
"""
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import time
from pathlib import Path
from typing import Dict, List

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((REPO / "jobs").glob("*.sbatch"))
HELPERS = sorted((REPO / "tests" / "slurm").glob("*.sh"))
#: script -> (the program it runs, its result files besides --json, its plot's file name)
PROGRAMS = {
    "train.sbatch": ("train", [], "steps.png"),
    "train-multinode.sbatch": ("train", [], "steps.png"),
    "bench.sbatch": ("bench", ["--csv", "results.csv"], "busbw.png"),
}
#: scripts that run the elastic supervisor, which starts the ranks itself (with srun)
SUPERVISED = {"train-elastic.sbatch"}
RESOURCES = ("nodes", "ntasks-per-node", "cpus-per-task", "time", "job-name", "output")


def test_every_script_is_described_here():
    assert {p.name for p in SCRIPTS} == set(PROGRAMS) | SUPERVISED


# -- bash and shellcheck -----------------------------------------------------------------------
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


# -- what sbatch reads -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sbatch(tmp_path_factory):
    """``sbatch(script, *options) -> (options sbatch took, its stderr)``, never submitting.

    Slurm's configuration here names a controller on a port bound but not listening, so every
    submission fails at once with "Unable to contact slurm controller", after sbatch has parsed
    the script and printed (``-v``) the options it took."""
    program = shutil.which("sbatch")
    if not program:
        pytest.skip("sbatch is not installed (Debian: apt-get install slurm-client)")
    closed = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    closed.bind(("127.0.0.1", 0))
    conf = tmp_path_factory.mktemp("slurm") / "slurm.conf"
    conf.write_text(f"ClusterName=check\nSlurmctldHost=localhost(127.0.0.1)\nSlurmctldPort={closed.getsockname()[1]}\n"
                    "MessageTimeout=2\nNodeName=localhost CPUs=8\nPartitionName=check Nodes=localhost Default=YES\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
    env["SLURM_CONF"] = str(conf)

    def read(script: Path, *options: str):
        result = subprocess.run([program, "-v", *options, str(script)], capture_output=True, text=True,
                                timeout=60, env=env, cwd=conf.parent)
        table = re.search(r"defined options\n.*?\n(.*?)\n[^\n]*end of defined options", result.stderr, re.S)
        took = dict(_option(line) for line in (table.group(1).splitlines() if table else []))
        took.pop("verbose", None)
        return took, result.stderr

    yield read
    closed.close()


def _option(line: str):
    """``sbatch: ntasks-per-node     : 8`` -> (``ntasks-per-node``, ``'8'``)."""
    name, _, value = line.split(":", 1)[1].partition(":")
    return name.strip(), value.strip()


def directives(script: Path) -> Dict[str, str]:
    """Every ``#SBATCH --name=value`` line in the file, wherever it is."""
    return {m.group(1): m.group(2) or "" for m in re.finditer(r"^#SBATCH\s+--([\w-]+)(?:=(\S+))?", script.read_text(), re.M)}


#: How ``sbatch -v`` shows a directive's value where it is not as written.
SHOWN_AS = {
    "signal": lambda value: value.split("@")[0],      # B:USR1@60 -> B:USR1 (the time is not shown)
    "open-mode": lambda value: value[:1],             # append -> a
    "requeue": lambda value: value or "requeue",      # a flag
    "no-kill": lambda value: value or "set",           # a flag
}


def problems_sbatch_finds(sbatch, script: Path) -> List[str]:
    took, err = sbatch(script)
    found = [line for line in err.splitlines() if "unrecognized option" in line or "error: Invalid" in line]
    if "Unable to contact slurm controller" not in err:
        found.append(f"sbatch stopped before submitting: {err.strip()[-500:]}")
    wanted = directives(script)
    if "output" in took:
        took["output"] = os.path.basename(took["output"])  # sbatch makes it absolute
    for name, value in wanted.items():
        value = SHOWN_AS.get(name, lambda v: v)(value)
        if took.get(name) != value:
            found.append(f"#SBATCH --{name}={value}: sbatch took {took.get(name)!r}")
    return found


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_sbatch_takes_every_directive_as_written(sbatch, script):
    assert problems_sbatch_finds(sbatch, script) == []
    took = directives(script)
    missing = [name for name in RESOURCES if name not in took]
    assert not missing, f"{script.name}: no '#SBATCH --{missing[0]}=' line"
    assert "%j" in took["output"], "Slurm's log should be named after the job id"


def test_the_directive_check_finds_misspelled_bad_and_misplaced_lines(sbatch, tmp_path):
    """The verdict above means something: a misspelt option, a bad value, and a directive after
    the first command (which sbatch ignores) are each found."""
    text = (REPO / "jobs" / "train.sbatch").read_text()
    spoilt = {
        "misspelt": text.replace("#SBATCH --cpus-per-task=1", "#SBATCH --cpu-per-task=1"),
        "bad value": text.replace("#SBATCH --time=00:15:00", "#SBATCH --time=quarter-hour"),
        "misplaced": text.replace("set -uo pipefail\n", "set -uo pipefail\n#SBATCH --mem=1G\n"),
    }
    for what, changed in spoilt.items():
        assert changed != text, what
        copy = tmp_path / f"{what.replace(' ', '-')}.sbatch"
        copy.write_text(changed)
        assert problems_sbatch_finds(sbatch, copy), f"a {what} directive went unnoticed"


def test_the_multinode_example_asks_for_two_nodes(sbatch):
    took, _ = sbatch(REPO / "jobs" / "train-multinode.sbatch")
    assert took["nodes"] == "2"


# -- what the scripts run ----------------------------------------------------------------------
RECORD = r'''#!/bin/bash
# Records how it was called ($0, then every argument, NUL-separated) and the thread settings.
name=$(basename "$0")
printf '%s\0' "$0" "$@" > "$STUB_RECORD/$name.args"
printf '%s\0' "${OMP_NUM_THREADS-unset}" "${NUMBA_NUM_THREADS-unset}" > "$STUB_RECORD/$name.env"
printf '%s\0' "${SLURM_MPI_TYPE-unset}" "${SRUN_CPUS_PER_TASK-unset}" > "$STUB_RECORD/$name.srun"
'''
LAUNCHER = RECORD + r'''# Starts the command that follows its own options (as srun and mpiexec do).
while [[ $# -gt 0 && $1 != python* ]]; do shift; done
[[ $# -gt 0 ]] || { echo "stub $name: no command to start" >&2; exit 97; }
exec "$@"
'''
PYTHON = r'''#!/bin/bash
if [[ $1 == -c ]]; then [[ ${STUB_MATPLOTLIB:-1} == 1 ]]; exit; fi   # "import matplotlib"
''' + RECORD.split("\n", 1)[1] + r'''echo "stub program output"
if [[ ${STUB_WAIT_USR1:-0} == 1 ]]; then      # a trainer that stops on SIGUSR1 with status 75
    trap 'echo "stub got SIGUSR1"; exit 75' USR1
    while :; do sleep 0.05; done
fi
exit "${STUB_STATUS:-0}"
'''
DECOY = "#!/bin/bash\necho \"the system's $(basename \"$0\") ran, not the environment's\" >&2\nexit 99\n"


def _executable(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def fake_venv(where: Path) -> Path:
    """A virtual environment whose python and mpiexec (the mpich wheel puts one there) are stubs."""
    (where / "bin").mkdir(parents=True)
    (where / "bin" / "activate").write_text(f'export VIRTUAL_ENV={where}\nexport PATH="$VIRTUAL_ENV/bin:$PATH"\n')
    _executable(where / "bin" / "python", PYTHON)
    _executable(where / "bin" / "mpiexec", LAUNCHER)
    return where


class Job:
    """One run of a job script in a fake allocation: 6 tasks, 2 CPUs each, job 4242."""

    def __init__(self, tmp: Path):
        self.submit = tmp / "submit"
        self.submit.mkdir()
        self.record = tmp / "record"
        self.record.mkdir()
        self.venv = fake_venv(tmp / "venv")
        stubs = tmp / "stubs"
        _executable(stubs / "srun", LAUNCHER)
        _executable(stubs / "mpiexec", DECOY)  # found only if the environment's is not
        _executable(stubs / "python", DECOY)
        self.env = {"PATH": f"{stubs}:/usr/bin:/bin", "HOME": str(tmp), "STUB_RECORD": str(self.record),
                    "SLURM_JOB_ID": "4242", "SLURM_SUBMIT_DIR": str(self.submit), "SLURM_NTASKS": "6",
                    "SLURM_CPUS_PER_TASK": "2", "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "node1",
                    "VENV": str(self.venv)}

    def run(self, script: str, args=(), **env) -> subprocess.CompletedProcess:
        full = {**self.env, **env}
        full = {k: v for k, v in full.items() if v is not None}
        return subprocess.run(["bash", str(REPO / "jobs" / script), *args], cwd=self.submit, env=full,
                              capture_output=True, text=True, timeout=60)

    def called(self, stub: str) -> List[str]:
        """How ``stub`` was called: its path, then its arguments ([] if it was not)."""
        path = self.record / f"{stub}.args"
        return path.read_text().split("\0")[:-1] if path.exists() else []

    def threads(self, stub: str) -> List[str]:
        return (self.record / f"{stub}.env").read_text().split("\0")[:-1]

    def srun_settings(self, stub: str) -> List[str]:
        """SLURM_MPI_TYPE and SRUN_CPUS_PER_TASK as ``stub`` saw them."""
        return (self.record / f"{stub}.srun").read_text().split("\0")[:-1]


@pytest.fixture
def job(tmp_path):
    return Job(tmp_path)


def expected_program_args(script: str, out: Path, plot: bool = True) -> List[str]:
    program, extra, plot_name = PROGRAMS[script]
    files = ["--json", str(out / "results.json")]
    files += [extra[0], str(out / extra[1])] if extra else []
    files += ["--plot", str(out / plot_name)] if plot else []
    files += ["--checkpoint-dir", str(out / "checkpoints")] if script == "train.sbatch" else []
    return ["-m", f"allreduce_kit.{program}", *files]


def _usr1_mid_run(job, script: str, *args: str):
    """Run ``jobs/SCRIPT ARGS`` with the stubs, send it SIGUSR1 once the trainer has started;
    returns the process and its output."""
    _executable(job.submit.parent / "stubs" / "scontrol", RECORD)
    proc = subprocess.Popen(["bash", str(REPO / "jobs" / script), *args], cwd=job.submit,
                            env={**job.env, "STUB_WAIT_USR1": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 30
        while not job.called("python"):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        time.sleep(0.3)
        proc.send_signal(signal.SIGUSR1)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc, out, err


@pytest.mark.parametrize("launcher", ["srun", "mpiexec"])
@pytest.mark.parametrize("script", sorted(PROGRAMS))
def test_the_job_runs_the_environments_program_as_documented(job, script, launcher):
    result = job.run(script, ["--epochs", "3", "two words"], LAUNCHER=launcher)
    assert result.returncode == 0, result.stdout + result.stderr
    program = PROGRAMS[script][0]
    out = job.submit / "runs" / f"{program}-4242"
    command = ["python", *expected_program_args(script, out), "--epochs", "3", "two words"]
    if launcher == "srun":
        assert job.called("srun")[1:] == ["--mpi=pmi2", "--kill-on-bad-exit=1", "--cpus-per-task=2", *command]
        assert not job.called("mpiexec")
    else:
        assert job.called("mpiexec") == [str(job.venv / "bin" / "mpiexec"), "-n", "6", *command]
        assert not job.called("srun")
    assert job.called("python") == [str(job.venv / "bin" / "python"), *command[1:]]
    assert job.threads("python") == ["2", "2"], "OMP_NUM_THREADS and NUMBA_NUM_THREADS: the task's CPUs"
    log = (out / f"{program}.log").read_text()
    assert "stub program output" in log and f"allreduce_kit.{program} exited with status 0" in log
    assert f"+ {launcher}" in log, "the log shows the command it ran"
    assert "stub program output" in result.stdout


@pytest.mark.parametrize("script", sorted(PROGRAMS))
def test_the_programs_exit_status_is_the_jobs(job, script):
    result = job.run(script, STUB_STATUS="3")
    assert result.returncode == 3
    program = PROGRAMS[script][0]
    assert f"allreduce_kit.{program} exited with status 3" in (job.submit / "runs" / f"{program}-4242" / f"{program}.log").read_text()


def test_without_cpus_per_task_each_rank_gets_one_thread(job):
    assert job.run("train.sbatch", SLURM_CPUS_PER_TASK=None).returncode == 0
    assert "--cpus-per-task=1" in job.called("srun")
    assert job.threads("python") == ["1", "1"]


def test_without_matplotlib_there_is_no_plot_and_a_note_says_why(job):
    result = job.run("bench.sbatch", STUB_MATPLOTLIB="0")
    assert result.returncode == 0, result.stderr
    out = job.submit / "runs" / "bench-4242"
    assert job.called("python")[1:] == expected_program_args("bench.sbatch", out, plot=False)
    assert "note: matplotlib is not installed" in result.stdout


def test_the_environment_defaults_to_the_submitting_shells_then_the_submit_directorys(job):
    elsewhere = fake_venv(job.submit.parent / "active")
    assert job.run("train.sbatch", VENV=None, VIRTUAL_ENV=str(elsewhere)).returncode == 0
    assert job.called("python")[0] == str(elsewhere / "bin" / "python")
    local = fake_venv(job.submit / ".venv")
    assert job.run("train.sbatch", VENV=None).returncode == 0
    assert job.called("python")[0] == str(local / "bin" / "python")


def test_runs_dir_chooses_where_run_directories_go(job):
    runs = job.submit.parent / "elsewhere"
    assert job.run("train.sbatch", RUNS_DIR=str(runs)).returncode == 0
    assert job.called("python")[1:] == expected_program_args("train.sbatch", runs / "train-4242")
    assert (runs / "train-4242" / "train.log").is_file()


def test_outside_an_allocation_the_script_stops_before_launching(job):
    result = job.run("train.sbatch", SLURM_JOB_ID=None)
    assert result.returncode != 0
    assert "SLURM_JOB_ID: is not set: submit this script with sbatch" in result.stderr
    assert not job.called("srun") and not job.called("python")
    assert not (job.submit / "runs").exists()


def test_a_warning_signal_reaches_the_ranks_and_a_stopped_run_is_requeued_then_resumed(job):
    """SIGUSR1 to the batch shell (``--signal=B:USR1@60``) reaches the program through the launcher;
    its status 75 (stopped with a checkpoint) requeues the job; the requeued job passes --resume."""
    proc, out, err = _usr1_mid_run(job, "train.sbatch", "--epochs", "3")
    assert proc.returncode == 75, out + err
    assert "stub got SIGUSR1" in out
    assert job.called("scontrol")[1:] == ["requeue", "4242"]
    out_dir = job.submit / "runs" / "train-4242"
    log = (out_dir / "train.log").read_text()
    assert "stub got SIGUSR1" in log and "exited with status 75" in log and "requeueing job 4242" in log
    assert "--resume" not in job.called("python")
    # The requeued job (same id, same run directory) finds the checkpoint and resumes from it.
    (out_dir / "checkpoints").mkdir(exist_ok=True)
    (out_dir / "checkpoints" / "checkpoint-000000040.npz").write_bytes(b"")
    (job.record / "scontrol.args").unlink()
    again = job.run("train.sbatch", ["--epochs", "3"], SLURM_RESTART_COUNT="1")
    assert again.returncode == 0, again.stdout + again.stderr
    assert job.called("python")[1:] == [*expected_program_args("train.sbatch", out_dir), "--resume", "--epochs", "3"]
    assert not job.called("scontrol")
    assert "restart 1 of job 4242: resuming" in (out_dir / "train.log").read_text()


# -- the elastic job: the supervisor runs in the batch script and starts the ranks itself ---------
def elastic_args(out: Path, tasks: str = "6") -> List[str]:
    return ["-m", "allreduce_kit.train", "--elastic", "-n", tasks, "--launcher", "srun", "--json",
            str(out / "results.json"), "--plot", str(out / "steps.png"), "--checkpoint-dir", str(out / "checkpoints")]


def test_the_elastic_job_runs_the_supervisor_with_srun_settings_for_its_launches(job):
    """The supervisor runs in the batch script (no launcher around it), for the job's task count;
    the srun it runs for each launch gets PMI-2 and the task's CPUs from the environment."""
    result = job.run("train-elastic.sbatch", ["--min-ranks", "3", "two words"])
    assert result.returncode == 0, result.stdout + result.stderr
    out = job.submit / "runs" / "train-4242"
    assert job.called("python") == [str(job.venv / "bin" / "python"), *elastic_args(out), "--min-ranks", "3",
                                    "two words"]
    assert not job.called("srun") and not job.called("mpiexec"), "the supervisor starts the ranks itself"
    assert job.threads("python") == ["2", "2"]
    assert job.srun_settings("python") == ["pmi2", "2"]
    log = (out / "train.log").read_text()
    assert "stub program output" in log and "allreduce_kit.train exited with status 0" in log
    assert "+ python -m allreduce_kit.train --elastic -n 6 --launcher srun" in log


def test_a_warning_signal_reaches_the_supervisor_and_a_stopped_elastic_run_is_requeued_then_resumed(job):
    proc, out, err = _usr1_mid_run(job, "train-elastic.sbatch")
    assert proc.returncode == 75, out + err
    assert "stub got SIGUSR1" in out
    assert job.called("scontrol")[1:] == ["requeue", "4242"]
    out_dir = job.submit / "runs" / "train-4242"
    (out_dir / "checkpoints" / "checkpoint-000000040.npz").parent.mkdir(parents=True, exist_ok=True)
    (out_dir / "checkpoints" / "checkpoint-000000040.npz").write_bytes(b"")
    (job.record / "scontrol.args").unlink()
    again = job.run("train-elastic.sbatch", SLURM_RESTART_COUNT="1")
    assert again.returncode == 0, again.stdout + again.stderr
    assert job.called("python")[1:] == [*elastic_args(out_dir), "--resume"]
    assert not job.called("scontrol")
    assert "restart 1 of job 4242: resuming" in (out_dir / "train.log").read_text()
