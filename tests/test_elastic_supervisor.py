"""The supervisor's decisions (``train --elastic``), with a stand-in for ``mpiexec``: quick, no MPI.

The stand-in starts P sleeping processes that report in as the ranks do (pid, host; rank 0's
step), then plays the launch's part of a scenario: finish, or have one rank die at a step, before
or after reaching it. The supervisor sees real processes die.
"""
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from allreduce_kit.train import checkpoint, elastic

FAKE = textwrap.dedent(r'''
    import json, os, socket, subprocess, sys, threading, time
    args = sys.argv[1:]
    if args == ["--version"]:
        print("HYDRA build details: (stand-in)")
        sys.exit(0)
    report = os.environ["ALLREDUCE_KIT_ELASTIC_DIR"]
    log = os.environ["FAKE_LOG"]
    with open(log, "a") as f:
        f.write(json.dumps(args) + "\n")
    launch = sum(1 for _ in open(log)) - 1
    plan = json.loads(os.environ["FAKE_PLAN"])[launch]
    if "-n" in args:
        ranks = int(args[args.index("-n") + 1])
    else:                                    # the stand-in for srun
        ranks = int(next(a for a in args if a.startswith("--ntasks="))[9:])
    here = socket.gethostname()
    hosts = plan.get("hosts") or [here] * ranks
    if plan.get("refused_by"):               # srun cannot start the step on a node whose slurmd is gone
        print(f"srun: error: Task launch for StepId=77.{launch} failed on node {plan['refused_by']}: "
              "Communication connection failure", file=sys.stderr, flush=True)
        sys.exit(1)
    start = 0
    if "--resume" in args:
        d = args[args.index("--checkpoint-dir") + 1]
        start = max(int(n[11:20]) for n in os.listdir(d) if n.endswith(".npz"))
    kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]) for _ in range(ranks)]
    for rank, kid in enumerate(kids):
        with open(os.path.join(report, f"rank-{rank}"), "w") as f:
            f.write(f"{kid.pid} {hosts[rank]}{' 77.' + str(launch) if plan.get('hosts') else ''}\n")
    if os.environ.get("FAKE_RUN"):          # rank 0 says which run this is
        with open(os.path.join(report, "run"), "w") as f:
            f.write(os.environ["FAKE_RUN"] + "\n")
    def progress(step):
        with open(os.path.join(report, "progress"), "w") as f:
            f.write(f"{step:012d}\n")
    progress(start)
    if plan.get("abort"):                    # a rank's uncaught error: the abort hook ends every rank
        time.sleep(0.3)
        print("allreduce_kit: uncaught ValueError on rank 1; aborting the job", flush=True)
        for kid in kids:
            kid.kill()
            kid.wait()
        sys.exit(1)
    far = [rank for rank in range(ranks) if hosts[rank] != here]
    beating = set(far)
    def beat():                              # the ranks on other hosts beat (report_in)
        count = 0
        while True:
            count += 1
            for rank in list(beating):
                with open(os.path.join(report, f"rank-{rank}.beat"), "w") as f:
                    f.write(f"{count}\n")
            time.sleep(0.05)
    threading.Thread(target=beat, daemon=True).start()
    if plan.get("silent_at") is not None:    # then the ranks of one of those hosts fall silent
        time.sleep(0.3)
        progress(plan["silent_at"])
        time.sleep(0.3)
        dying = [rank for rank in far if hosts[rank] == plan["silent_host"]]
        beating.difference_update(dying)
        for rank in dying:
            kids[rank].kill()
        if plan.get("then_dies") is not None:  # a rank here dies of it (MPI over TCP can crash so)
            time.sleep(0.1)
            kids[plan["then_dies"]].kill()
        for rank, kid in enumerate(kids):
            if rank not in far:
                kid.wait()                  # the supervisor kills the ones on its host
        for kid in kids:                    # and cancels the job step, which ends the rest
            kid.kill()
            kid.wait()
        sys.exit(137)
    if plan.get("die_at") is not None:
        if plan["die_at"] > start:
            time.sleep(0.3)
            progress(plan["die_at"])
        time.sleep(0.3)
        kids[plan["rank"]].kill()
        for kid in kids:
            kid.wait()                      # the supervisor kills the others
        print("YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Killed (signal 9)")
        sys.exit(9)
    time.sleep(0.3)
    progress(start + 5)
    for rank in range(ranks):                # the ranks end by themselves, and say so
        open(os.path.join(report, f"rank-{rank}.exited"), "w").close()
    for kid in kids:
        kid.kill()
        kid.wait()
    print("stand-in training finished")
    sys.exit(plan.get("status", 0))
''')


def _arrays():
    return {"params": np.arange(10, dtype=np.float32), "velocity": np.zeros(10, np.float32)}


@pytest.fixture
def supervise(tmp_path):
    fake = tmp_path / "mpiexec"
    fake.write_text(f"#!{sys.executable}\n" + FAKE)
    fake.chmod(0o755)
    ckpt = tmp_path / "ckpt"

    def run(plan, ranks=4, min_ranks=2, steps=(10, 20), options=None, **extra):
        ckpt.mkdir(exist_ok=True)
        for step in steps:
            checkpoint.save(str(ckpt), step, _arrays(), {"ranks": ranks}, keep=5)
        log = tmp_path / "launches.log"
        if log.exists():
            log.unlink()
        env = dict(os.environ, FAKE_PLAN=json.dumps(plan), FAKE_LOG=str(log), **extra)
        options = ["--mpiexec", str(fake)] if options is None else options
        result = subprocess.run([sys.executable, "-m", "allreduce_kit.train", "--elastic", "-n", str(ranks),
                                 "--min-ranks", str(min_ranks), *options, "--checkpoint-dir", str(ckpt),
                                 "--epochs", "3"], capture_output=True, text=True, timeout=120, env=env,
                                cwd=str(tmp_path))
        launches = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        return result, launches
    run.ckpt = ckpt
    run.fake = fake
    return run


def test_a_dead_rank_is_named_and_training_goes_on_on_the_survivors(supervise):
    result, launches = supervise([{"die_at": 27, "rank": 2}, {}])
    assert result.returncode == 0, result.stdout + result.stderr
    assert [l[l.index("-n") + 1] for l in launches] == ["4", "3"]
    assert "--resume" not in launches[0] and launches[1][-1] == "--resume"
    assert "-disable-auto-cleanup" in launches[0]
    assert "--checkpoint-every" in launches[0], "the supervisor saves every N steps by default"
    out = result.stdout
    assert "rank 2 (pid" in out and "lost after step 27, died; 4 -> 3 ranks" in out, out
    assert "resumed from step 20 (7 steps redone)" in out and "recovered: first step on 3 ranks" in out, out


def test_ranks_elsewhere_that_fall_silent_are_lost_and_their_node_with_them(supervise):
    """Ranks 2 and 3 on another host stop beating: after ALLREDUCE_KIT_ELASTIC_TIMEOUT they are
    taken for dead, the supervisor ends the job and goes on on the 2 ranks of its own host."""
    far = ["here", "here", "far-node", "far-node"]
    result, launches = supervise([{"silent_at": 27, "silent_host": "far-node",
                                   "hosts": [socket.gethostname()] * 2 + far[2:]}, {}],
                                 ALLREDUCE_KIT_ELASTIC_TIMEOUT="1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert [l[l.index("-n") + 1] for l in launches] == ["4", "2"]
    out = result.stdout
    assert "node far-node (ranks 2, 3) lost after step 27, no heartbeat for 1 s; 4 -> 2 ranks" in out, out
    assert "resumed from step 20 (7 steps redone)" in out


def test_a_rank_that_dies_here_after_a_node_went_silent_is_not_taken_for_the_loss(supervise):
    """The ranks of another host stop beating, then rank 0 here dies of it: the loss is that
    host's two ranks (4 -> 2), and rank 0's slot is relaunched with the survivors, not counted lost."""
    here = socket.gethostname()
    result, launches = supervise([{"silent_at": 27, "silent_host": "far-node", "then_dies": 0,
                                   "hosts": [here, here, "far-node", "far-node"]}, {}],
                                 ALLREDUCE_KIT_ELASTIC_TIMEOUT="1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert [l[l.index("-n") + 1] for l in launches] == ["4", "2"]
    out = result.stdout
    assert "node far-node (ranks 2, 3) lost after step 27, no heartbeat for 1 s; 4 -> 2 ranks" in out, out
    assert "rank 0 (pid" not in out, out


def test_under_srun_a_dead_node_is_left_out_of_the_relaunch(supervise, tmp_path):
    """--launcher srun in an allocation of nodes a, b, c: b's ranks fall silent; the job step is
    cancelled and the relaunch asks srun for the 4 survivors on a and c, without b."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").symlink_to(supervise.fake)
    cancelled = tmp_path / "scancel.args"
    for name, body in (("scontrol", 'echo node-a; echo node-b; echo node-c'),
                       ("scancel", f'echo "$@" >> {cancelled}')):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    here = socket.gethostname()
    plan = [{"silent_at": 27, "silent_host": "node-b", "hosts": [here, here, "node-b", "node-b", "node-c", "node-c"]},
            {"hosts": [here] * 2 + ["node-c"] * 2}]
    env = dict(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="77", SLURM_JOB_NODELIST="node-[a-c]",
               ALLREDUCE_KIT_ELASTIC_TIMEOUT="1")
    result, launches = supervise(plan, ranks=6, options=["--launcher", "srun"], **env)
    assert result.returncode == 0, result.stdout + result.stderr
    first, second = launches
    assert "--ntasks=6" in first and "--nodes=3" in first and not any(a.startswith("--exclude") for a in first)
    assert "--ntasks=4" in second and "--nodes=2" in second and "--exclude=node-b" in second, second
    assert "--kill-on-bad-exit=0" in second and "--overlap" in second and second[-1] == "--resume"
    out = result.stdout
    assert "node node-b (ranks 2, 3) lost after step 27" in out and "6 -> 4 ranks" in out, out
    assert "relaunching on 4 ranks, without node node-b" in out
    assert cancelled.read_text().split() == ["--quiet", "--signal=KILL", "77.0"]


def test_under_srun_a_node_whose_slurmd_is_gone_is_left_out_when_the_relaunch_fails_there(supervise, tmp_path):
    """Rank 1 dies on the supervisor's host; the relaunch fails because node-b's slurmd does not
    answer: node-b is left out with the 2 ranks it held, and the next relaunch runs on the rest."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").symlink_to(supervise.fake)
    for name, body in (("scontrol", 'echo node-a; echo node-b; echo node-c'), ("scancel", "true")):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    here = socket.gethostname()
    plan = [{"die_at": 27, "rank": 1, "hosts": [here, here, "node-b", "node-b", "node-c", "node-c"]},
            {"refused_by": "node-b"},
            {"hosts": [here] * 2 + ["node-c"]}]
    env = dict(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="77", SLURM_JOB_NODELIST="node-[a-c]")
    result, launches = supervise(plan, ranks=6, options=["--launcher", "srun"], **env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert [[a for a in launch if a.startswith(("--ntasks=", "--exclude="))] for launch in launches] == [
        ["--ntasks=6"], ["--ntasks=5"], ["--ntasks=3", "--exclude=node-b"]]
    out = result.stdout
    assert "rank 1 (pid" in out and "6 -> 5 ranks" in out, out
    assert f"node node-b (ranks 2, 3) lost after step 20, {elastic.REFUSED}; 5 -> 3 ranks" in out, out
    assert "3 ranks lost during the run" in out


def test_srun_outside_an_allocation_is_refused(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    result = subprocess.run([sys.executable, "-m", "allreduce_kit.train", "--elastic", "-n", "2", "--launcher", "srun",
                             "--checkpoint-dir", "x"], capture_output=True, text=True, timeout=60, cwd=str(tmp_path),
                            env=env)
    assert result.returncode == 2 and "--launcher srun starts the ranks inside a Slurm allocation" in result.stderr
    assert "Traceback" not in result.stderr


def _meta(**changed):
    """A checkpoint record with a run identity, as the trainer writes it."""
    config = {"dataset": "digits", "seed": 0, "test_fraction": 0.2, "hidden": [32], "dtype": "float32", **changed}
    settings = checkpoint.run_settings(config, "sync")
    return {"ranks": 4, "mode": "sync", "config": config, "run": checkpoint.run_identity(settings),
            "run_settings": settings}


def test_the_relaunch_resumes_the_runs_own_checkpoint_never_another_runs(supervise):
    """The directory holds this run's checkpoints at steps 10 and 20 and another run's (--seed 1) at
    240, newer and corrupt: after rank 2 dies at step 27 the relaunch resumes from step 20, says from
    which file, and leaves the other run's file as it was."""
    ckpt = supervise.ckpt
    ckpt.mkdir()
    mine = _meta()
    for step in (10, 20):
        checkpoint.save(str(ckpt), step, _arrays(), mine)
    theirs = Path(checkpoint.save(str(ckpt), 240, _arrays(), _meta(seed=1)))
    spoiled = bytearray(theirs.read_bytes())
    spoiled[bytes(spoiled).index(_arrays()["params"].tobytes()) + 5] ^= 1   # its data spoiled, its record readable
    theirs.write_bytes(spoiled)
    result, launches = supervise([{"die_at": 27, "rank": 2}, {}], steps=(), FAKE_RUN=mine["run"])
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert launches[1][-1] == "--resume"
    assert f"[elastic] resuming from {ckpt / checkpoint.name_for(20)} (step 20), the newest checkpoint of this run" in out
    assert "resumed from step 20 (7 steps redone)" in out, out
    assert theirs.read_bytes() == spoiled and "corrupt" not in out


def test_a_corrupt_newest_checkpoint_is_moved_aside_and_the_one_before_used(supervise):
    ckpt = supervise.ckpt
    ckpt.mkdir()
    checkpoint.save(str(ckpt), 30, _arrays(), {"ranks": 4})
    newest = ckpt / checkpoint.name_for(30)
    newest.write_bytes(newest.read_bytes()[:100])
    result, launches = supervise([{"die_at": 33, "rank": 0}, {}])
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{newest} is truncated or corrupted" in result.stdout
    assert f"moved aside to {newest.name}.corrupt; falling back to the one before" in result.stdout
    assert (ckpt / f"{newest.name}.corrupt").exists() and not newest.exists()
    assert "resumed from step 20 (13 steps redone)" in result.stdout


def test_every_checkpoint_corrupt_fails_with_a_message(supervise):
    ckpt = supervise.ckpt
    ckpt.mkdir()
    for step in (10, 20):
        path = Path(checkpoint.save(str(ckpt), step, _arrays(), {"ranks": 4}))
    result, launches = supervise([{"die_at": 25, "rank": 1}, {}], steps=())
    assert result.returncode == 0, "intact checkpoints: recovered"
    for _, path in checkpoint.listing(str(ckpt)):
        Path(path).write_bytes(b"garbage")
    result, launches = supervise([{"die_at": 25, "rank": 1}, {}], steps=())
    assert result.returncode == elastic.FAILED, result.stdout
    assert "recovery failed: no checkpoint in" in result.stdout and len(launches) == 1


def test_fewer_survivors_than_min_ranks_fail_with_a_message(supervise):
    result, launches = supervise([{"die_at": 25, "rank": 1}], ranks=3, min_ranks=3)
    assert result.returncode == elastic.FAILED
    assert "recovery failed: 2 ranks left, fewer than --min-ranks 3" in result.stdout
    assert len(launches) == 1


def test_a_second_death_during_recovery_fails_with_a_message(supervise):
    result, launches = supervise([{"die_at": 25, "rank": 1}, {"die_at": 0, "rank": 0}])
    assert result.returncode == elastic.FAILED, result.stdout
    assert "recovery failed: rank 0" in result.stdout and "before the relaunched job's first step" in result.stdout
    assert len(launches) == 2


def test_a_job_that_fails_without_a_death_is_not_relaunched(supervise):
    result, launches = supervise([{"status": 2}])
    assert result.returncode == 2 and len(launches) == 1
    assert "no rank was killed: not relaunched" in result.stdout
    result, launches = supervise([{"abort": True}, {}])       # the ranks vanish, but on an error of their own
    assert result.returncode == 1 and len(launches) == 1, result.stdout
    assert "no rank was killed: not relaunched" in result.stdout


@pytest.mark.parametrize("args,message", [
    ([], "--elastic needs -n P"),
    (["-n", "4", "--min-ranks", "5", "--checkpoint-dir", "x"], "argument --min-ranks: must be between 1 and -n 4"),
    (["-n", "4"], "--elastic needs --checkpoint-dir"),
])
def test_bad_supervisor_options_exit_2_with_one_message(args, message, tmp_path):
    result = subprocess.run([sys.executable, "-m", "allreduce_kit.train", "--elastic", *args], capture_output=True,
                            text=True, timeout=60, cwd=str(tmp_path))
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr, result.stderr


@pytest.mark.parametrize("args", [[], ["-n", "2"], ["-n", "2", "--checkpoint-dir", "x"]])
@pytest.mark.parametrize("variable", ["PMI_RANK", "OMPI_COMM_WORLD_RANK"])
def test_under_mpirun_the_supervisor_says_so_first_and_only_on_rank_0(args, variable, monkeypatch, capsys):
    """Whatever else is wrong with the command line, being started by mpirun is the thing to fix
    first (the other messages would each be followed by this one); every copy exits 2, one speaks."""
    for rank, says in (("0", True), ("1", False), ("3", False)):
        monkeypatch.setenv(variable, rank)
        assert elastic.main(["--elastic", *args]) == 2
        err = capsys.readouterr().err
        assert ("not under mpirun" in err) == says and "needs" not in err and err.count("error:") == int(says), err


def test_elastic_under_mpirun_exits_2_with_one_message(mpirun, tmp_path):
    result = mpirun(3, ["-m", "allreduce_kit.train", "--elastic"], timeout=120, cwd=str(tmp_path), via_mpi4py=False)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.count("not under mpirun") == 1 and "needs -n" not in result.stderr, result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_ranks_found_dead_together_are_told_apart_by_what_mpiexec_names():
    """When a look finds several ranks dead at once (the launcher ended the others before the
    look), the first is the one MPICH's mpiexec names as the bad termination, however late the
    line comes while the launcher runs; a launcher that names none of them leaves it unknown,
    known as soon as it has ended and all it printed is read."""
    import threading
    import time

    class Launcher:
        code = None

        def poll(self):
            return self.code

    job = object.__new__(elastic.Job)
    job.proc, job.readers = Launcher(), []
    job.text = ["epoch  2/10  loss 0.58\n", "\n", "=" * 83 + "\n",
                "=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES\n", "=   PID 4242 RUNNING AT vm\n",
                "=   EXIT CODE: 9\n"]
    assert job._named_by_launcher([4241, 4242, 4243], wait=0) == 4242
    assert job._named_by_launcher([4241, 4243], wait=0) is None
    job.text = ["nothing from the launcher\n"]
    assert job._named_by_launcher([4241, 4242], wait=0.05) is None
    late = threading.Timer(0.3, lambda: job.text.append("=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES\n"
                                                        "=   PID 4241 RUNNING AT vm\n"))
    late.start()
    assert job._named_by_launcher([4241, 4242], wait=10) == 4241, "the line came 0.3 s late, the launcher running"
    job.text, job.proc.code = ["nothing from the launcher\n"], 0
    start = time.monotonic()
    assert job._named_by_launcher([4241, 4242], wait=10) is None and time.monotonic() - start < 1, "ended, all read"


def test_the_supervisor_wakes_when_a_rank_ends_not_at_its_next_look():
    """``_Exits.wait`` returns as soon as one of the processes ends (where the kernel has
    ``pidfd``), and says which: the ranks that mpiexec kills after it may have ended too by the
    look that follows, but the one whose end woke the wait went first. A process that has ended
    is not waited on again (no busy loop)."""
    import threading
    import time

    if not hasattr(os, "pidfd_open"):
        pytest.skip("no pidfd_open here: the wait is a plain sleep")
    sleepers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    exits = elastic._Exits()
    try:
        threading.Timer(0.3, sleepers[1].kill).start()
        start = time.monotonic()
        assert exits.wait([p.pid for p in sleepers], 20) == [sleepers[1].pid]
        assert 0.25 < time.monotonic() - start < 5, "woken by the death, not by the timeout"
        sleepers[1].wait()
        start = time.monotonic()
        assert exits.wait([p.pid for p in sleepers], 0.2) == []
        assert time.monotonic() - start >= 0.19, "an ended process woke the wait again"
        assert exits.fds[sleepers[1].pid] is None and exits.fds[sleepers[0].pid] is not None
    finally:
        exits.close()
        for p in sleepers:
            p.kill()
            p.wait()
