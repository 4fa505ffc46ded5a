"""``python -m allreduce_kit.train --elastic -n P --min-ranks M ...``: training that outlives a dead rank.

The supervisor is one ordinary process (no MPI in it). It launches ``mpiexec -n P python -m
allreduce_kit.train ...`` with ``--checkpoint-every N`` and watches it. Each rank reports its pid
and host, and rank 0 the step it has finished, in a directory of the supervisor's
(``ALLREDUCE_KIT_ELASTIC_DIR``). When a rank dies, MPICH's ``mpiexec`` ends the job and names the
dead process's pid; the supervisor looks the pid up, and relaunches training on the survivors'
count (P - 1) with ``--resume`` from the newest checkpoint of its own run (rank 0 reports the run's
identity, checkpoint.py; other runs' checkpoints are left alone), which re-shards the data from
the checkpoint's sample (``--on-resize``). It repeats that while at least ``--min-ranks`` ranks are
left, and at the end reports every loss: which rank, at which step, the recovery time (from the
end of the broken job to the first step of the new one), the steps redone, the rank count after.

Recovery fails cleanly, with a message and status 1, never a hang: fewer survivors than
``--min-ranks``; a rank dying again before the relaunched job's first step; no checkpoint it can
read (a corrupt newest checkpoint is moved aside, ``.corrupt``, and the one before is used, with
a message saying so). A job that ends without a rank dying (a bad option, a non-finite gradient,
a stop on a signal) is not relaunched: its status is the supervisor's. SIGTERM or SIGUSR1 to the
supervisor is passed to the job as SIGUSR1 (MPICH's ``mpiexec`` forwards it to every rank): the
ranks stop at a step boundary with a checkpoint and the supervisor exits 75. A Ctrl-C reaches the
launcher from the terminal as well, which passes it on: the supervisor only waits for that stop.
"""
import argparse
import atexit
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from .. import config
from . import checkpoint

__all__ = ["main", "add_arguments", "report_in", "Loss"]

#: The status of a failed recovery (fewer survivors than --min-ranks, a death during recovery, no usable checkpoint).
FAILED = 1
STOPPED = 75
DEFAULT_CHECKPOINT_EVERY = 20
PROG = "python -m allreduce_kit.train --elastic"
LAUNCHERS = ("mpiexec", "srun")


@dataclass
class Loss:
    """One loss (a rank, or the ranks of a node) and the recovery from it."""
    rank: Optional[int]
    pid: Optional[int]
    host: str
    how: str                  # "killed by signal 9", ...
    step: Optional[int]       # the last step the job finished
    ranks_before: int
    ranks_after: int
    resumed_from: Optional[int] = None      # the checkpoint's step (None: from the start)
    steps_redone: Optional[int] = None
    recovery_seconds: Optional[float] = None   # from the death (or the job's end) to the first step after it
    died_at: float = 0.0
    lost_ranks: List[int] = field(default_factory=list)   # every rank lost, where known
    nodes_lost: List[str] = field(default_factory=list)   # hosts all of whose ranks were lost (left out after)

    def line(self) -> str:
        ranks = ", ".join(map(str, self.lost_ranks))
        if self.nodes_lost:
            plural = "s" if len(self.lost_ranks) != 1 else ""
            who, where = f"node {', '.join(self.nodes_lost)}", f" (rank{plural} {ranks})" if ranks else ""
        elif len(self.lost_ranks) > 1:
            who, where = f"ranks {ranks}", f" (on {self.host})"
        else:
            who = f"rank {self.rank}" if self.rank is not None else "a rank"
            where = f" (pid {self.pid} on {self.host})" if self.pid is not None else ""
        head = (f"{who}{where} lost after step {self.step}, {self.how}; "
                f"{self.ranks_before} -> {self.ranks_after} ranks")
        if self.recovery_seconds is None:
            return head
        return (head + f"; resumed from {'step ' + str(self.resumed_from) if self.resumed_from else 'the start'} "
                f"({self.steps_redone} step{'s' if self.steps_redone != 1 else ''} redone), first step "
                f"{self.recovery_seconds:.1f} s after the death")


# -- the ranks' side --------------------------------------------------------------------------------
def ignore_exit_notices() -> None:
    """Under the supervisor, before any handler of the stop signals is installed: ignore SIGUSR1
    for the rest of the process. MPICH's ``mpiexec -disable-auto-cleanup`` sends it to the ranks
    still running when one rank ends, also when that rank simply finished first; by default it
    would kill a rank that is still writing its results. A stop asked for by SIGUSR1 during
    training still works (``signals.StopSignals`` installs its own handler, and gives this back)."""
    if config.read(config.ELASTIC_DIR):
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def report_in(trainer) -> Optional[callable]:
    """Under the supervisor: write this rank's pid and host, and return rank 0's per-step hook
    (writes the step finished); None when not supervised or not rank 0."""
    directory = config.read(config.ELASTIC_DIR)
    if not directory:
        return None
    rank = trainer.comm.Get_rank()
    mine = os.path.join(directory, f"rank-{rank}")
    if rank == 0:                                # which run this is: the supervisor resumes only its checkpoints
        _write(os.path.join(directory, RUN), f"{trainer.run_identity}\n")
    # Under srun, the job step too: the supervisor cancels it when a node is lost.
    step = (f" {os.environ['SLURM_JOB_ID']}.{os.environ['SLURM_STEP_ID']}"
            if os.environ.get("SLURM_JOB_ID") and os.environ.get("SLURM_STEP_ID") else "")
    _write(mine, f"{os.getpid()} {socket.gethostname()}{step}\n")
    # A rank that ends by itself says so: one that vanishes without this died (or was killed).
    atexit.register(_write, mine + EXITED, "")
    # A rank on another host than the supervisor's cannot be watched as a process: it shows it is
    # alive by a count that a thread of its own advances, whatever the training does meanwhile.
    if config.read(config.ELASTIC_TIMEOUT) > 0:
        threading.Thread(target=_beat, args=(mine + BEAT, _beat_period()), name="allreduce_kit-heartbeat",
                         daemon=True).start()
    if rank != 0:
        return None
    fd = os.open(os.path.join(directory, "progress"), os.O_WRONLY | os.O_CREAT, 0o644)

    def progress(_: int) -> None:
        os.pwrite(fd, f"{trainer.step:012d}\n".encode(), 0)
    progress(0)
    return progress


BEAT = ".beat"
RUN = "run"


def _beat_period() -> float:
    return max(0.05, config.read(config.ELASTIC_TIMEOUT) / 10)


def _beat(path: str, period: float) -> None:
    count = 0
    while True:
        count += 1
        try:
            _write(path, f"{count}\n")
        except OSError:
            pass
        time.sleep(period)


def _write(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as out:
        out.write(text)
    os.replace(tmp, path)


# -- the supervisor ---------------------------------------------------------------------------------
def add_arguments(parser) -> None:
    """The supervisor's options, shown in the trainer's --help."""
    g = parser.add_argument_group("elastic training (docs/elastic.md)")
    g.add_argument("--elastic", action="store_true",
                   help="run as the supervisor (one process, not under mpirun): launch -n ranks with mpiexec, "
                        "and when a rank dies relaunch on the survivors from the newest checkpoint; under Open "
                        "MPI's mpirun --with-ft ulfm, go on in the same job on the survivors instead")
    g.add_argument("-n", "--ranks", type=int, default=None, metavar="P", help="--elastic: ranks to start with")
    g.add_argument("--min-ranks", type=int, default=None, metavar="M",
                   help="--elastic: give up (status 1) when fewer than M ranks would be left (default 1)")
    g.add_argument("--mpiexec", default=None, metavar="PATH",
                   help="--elastic: the MPI launcher (default: the mpiexec beside this Python, else on PATH)")
    g.add_argument("--launcher", choices=LAUNCHERS, default=None,
                   help="--elastic: start the ranks with mpiexec (default), or with srun inside a Slurm allocation, "
                        "leaving a dead node out of every relaunch")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, add_help=False)
    p.add_argument("--elastic", action="store_true")
    p.add_argument("-n", "--ranks", type=int)
    p.add_argument("--min-ranks", type=int, default=1)
    p.add_argument("--mpiexec", default=None)
    p.add_argument("--launcher", choices=LAUNCHERS, default="mpiexec")
    return p


def _value(rest: List[str], option: str) -> Optional[str]:
    """The last value of ``option`` among the trainer's arguments (``--opt V`` or ``--opt=V``)."""
    found = None
    for i, arg in enumerate(rest):
        if arg == option and i + 1 < len(rest):
            found = rest[i + 1]
        elif arg.startswith(option + "="):
            found = arg.split("=", 1)[1]
    return found


def _error(message: str, status: int = 2) -> int:
    sys.stderr.write(f"{PROG}: error: {message}\n")
    return status


def _say(message: str) -> None:
    sys.stdout.write(f"[elastic] {message}\n")
    sys.stdout.flush()


def usable_checkpoint(directory: str, run: Optional[str] = None) -> Tuple[Optional[int], List[str]]:
    """The newest checkpoint of run ``run`` in ``directory`` that loads, as its step (None: there is
    none), and a message for each corrupt one met on the way, which is moved aside (``NAME.corrupt``).
    Checkpoints of other runs are passed over and left as they are; one whose run cannot be told
    counts as this run's (the relaunch's --resume then says what is wrong with it). ``run`` None
    (the job never said which run it is): every checkpoint counts."""
    notes = []
    if not os.path.isdir(directory):
        return None, notes
    for found in reversed(checkpoint.survey(directory)):
        step, path = found.step, found.path
        if run is not None and found.run not in (run, None):
            continue
        try:
            checkpoint.load(path)
            return step, notes
        except checkpoint.CheckpointError as bad:
            os.replace(path, path + ".corrupt")
            notes.append(f"{bad}: moved aside to {os.path.basename(path)}.corrupt; falling back to the one before")
    return None, notes


HYDRA_DEATH = re.compile(r"BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES\s*=\s*PID (\d+) RUNNING AT (\S+)")
HYDRA_SIGNAL = re.compile(r"EXIT STRING: .*\(signal (\d+)\)")
#: srun's word for a node whose slurmd does not answer (it died, alone or with the node).
SRUN_REFUSED = re.compile(r"Task launch for \S+ failed on node ([^\s:]+)")
REFUSED = "its slurmd did not start the job step there"


class Heartbeats:
    """The ranks on other hosts than the supervisor's, watched by their heartbeats (``report_in``)."""

    def __init__(self, report: str, timeout: float):
        self.report, self.timeout, self.here = report, timeout, socket.gethostname()
        self.period = max(0.05, timeout / 10)
        self.seen: Dict[int, Tuple[str, float]] = {}   # rank -> (its count, when it last changed, our clock)
        self.due = 0.0

    def silent(self) -> Tuple[Dict[int, Tuple[int, str]], float]:
        """pid -> (rank, host) of the ranks elsewhere whose count has not changed for the timeout (looked
        at once a period), and when the last of them beat; ({}, 0) while none has gone silent. The
        other ranks of a dead node, which stopped at the same moment, are counted with it when they
        have been silent for all but two periods of the timeout."""
        now = time.monotonic()
        if self.timeout <= 0 or now < self.due:
            return {}, 0.0
        self.due = now + self.period
        ranks = {pid: entry for pid, entry in _registry(self.report).items() if entry[1] != self.here}
        for pid, (rank, host) in ranks.items():
            try:
                with open(os.path.join(self.report, f"rank-{rank}{BEAT}")) as f:
                    count = f.read()
            except OSError:
                count = ""
            if rank not in self.seen or self.seen[rank][0] != count:
                self.seen[rank] = (count, now)
        if not any(now - self.seen[rank][1] > self.timeout for rank, _ in ranks.values()):
            return {}, 0.0
        found = {pid: (rank, host) for pid, (rank, host) in ranks.items()
                 if now - self.seen[rank][1] > self.timeout - 2 * self.period}
        return found, max(self.seen[rank][1] for rank, _ in found.values())

    def beaten_since(self, moment: float) -> bool:
        """Every rank elsewhere has beaten after ``moment`` (our clock), as ``silent`` last looked: a
        change seen more than a period after it (a beat from before it is seen within a period)."""
        ranks = [rank for rank, host in _registry(self.report).values() if host != self.here]
        return all(rank in self.seen and self.seen[rank][1] > moment + self.period for rank in ranks)


class Job:
    """One launch: ``mpiexec -n P python -m allreduce_kit.train ...`` (or ``srun``), its output passed
    through and kept."""

    def __init__(self, command: List[str], env: Dict[str, str], srun: bool = False):
        self.proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     stdin=subprocess.DEVNULL, text=True, errors="replace")
        self.srun = srun
        self.text: List[str] = []
        #: (pid or None, when, rank 0's last step) of the first rank seen dead on this host.
        self.first_dead: Optional[Tuple[Optional[int], float, Optional[int]]] = None
        #: pid -> (rank, host) of the ranks on other hosts that went silent; when the last of them
        #: beat; rank 0's last step then.
        self.silent: Dict[int, Tuple[int, str]] = {}
        self.silent_since, self.silent_step = 0.0, None
        self.cancel: Optional[subprocess.Popen] = None
        self.readers = [threading.Thread(target=self._pass, args=(src, dst), daemon=True)
                        for src, dst in ((self.proc.stdout, sys.stdout), (self.proc.stderr, sys.stderr))]
        for reader in self.readers:
            reader.start()

    def _pass(self, src, dst) -> None:
        for line in src:
            self.text.append(line)
            dst.write(line)
            dst.flush()

    def watch(self, report: str, loss: Optional["Loss"], timeout: float = 0.0) -> Optional[int]:
        """Until the job ends, look at the ranks on this host every 10 ms and whenever one ends
        (``_Exits``): the one found dead alone, or whose end woke the wait, is the one whose death
        ends the job (``mpiexec`` kills the others a little later); and at the heartbeats of the ranks on other hosts
        (``timeout``: see ``Heartbeats``). After a relaunch (``loss``), also wait for the first
        step past the checkpoint and time the recovery.
        Returns the first step seen, or None if the job ended before it."""
        here, first = socket.gethostname(), None
        start = (loss.resumed_from or 0) if loss is not None else -1
        beats = Heartbeats(report, timeout)
        exits = _Exits()
        ended: List[int] = []                      # the ranks whose end woke the last wait
        try:
            while self.proc.poll() is None and self.first_dead is None and not self.silent:
                step = _progress(report)
                if first is None and step is not None and step > start:
                    first = step
                    if loss is not None:
                        loss.recovery_seconds = time.monotonic() - loss.died_at
                        _say(f"recovered: first step on {loss.ranks_after} ranks {loss.recovery_seconds:.1f} s after "
                             f"the death")
                local = [pid for pid, (rank, host) in _registry(report).items() if host == here]
                dead = [pid for pid in local if not _alive(pid)]
                if dead:                           # read again: a rank that ended by itself said so before it ended
                    dead = [pid for pid in dead if pid in _registry(report)]
                woke = [pid for pid in ended if pid in dead]
                if len(dead) == 1 or len(woke) == 1:   # the others ended after the one whose end woke the wait
                    self.first_dead = ((woke or dead)[0], time.monotonic(), step)
                elif dead:                         # seen too late to tell which went first, unless the launcher says
                    when = time.monotonic()
                    self.first_dead = (self._named_by_launcher(dead, 1.0 if self.srun else 30.0), when, step)
                if self.first_dead is None:
                    self.silent, self.silent_since = beats.silent()
                    self.silent_step = step
                if self.first_dead is None and not self.silent:
                    ended = exits.wait(local, 0.01)
        finally:
            exits.close()
        if self.first_dead is not None and timeout > 0:
            self._node_died_first(beats)
        if first is None and self.first_dead is None and not self.silent and loss is not None:
            step = _progress(report)          # a job that ended between two looks may have made its first step
            if step is not None and step > start:
                first = step
                loss.recovery_seconds = time.monotonic() - loss.died_at
                _say(f"recovered: first step on {loss.ranks_after} ranks {loss.recovery_seconds:.1f} s after "
                     f"the death")
        return first

    def _named_by_launcher(self, dead: List[int], wait: float = 30.0) -> Optional[int]:
        """The one of ``dead`` that MPICH's ``mpiexec`` names as the first bad termination
        (``HYDRA_DEATH``; it says so before it ends), waiting for that line until the launcher
        has ended and all it printed is read, at most ``wait`` seconds; None if it names none of
        them (another launcher, or a rank elsewhere)."""
        until = time.monotonic() + wait
        while True:
            said_all = self.proc.poll() is not None and not any(reader.is_alive() for reader in self.readers)
            found = HYDRA_DEATH.search("".join(self.text))
            if found and int(found.group(1)) in dead:
                return int(found.group(1))
            if found or said_all or time.monotonic() > until:
                return None
            time.sleep(0.01)

    def _node_died_first(self, beats: Heartbeats) -> None:
        """A rank found dead here may have died of a node that died first: MPI over TCP can end a
        rank whose peer vanished (a segmentation fault in MPICH). Until every rank elsewhere has
        beaten since the death (they live: the death here is the loss) or the timeout has passed,
        look at the heartbeats; ranks elsewhere that went silent are then the loss, and the rank
        here is relaunched with the survivors."""
        died_at, step = self.first_dead[1], self.first_dead[2]
        deadline = died_at + beats.timeout + 2 * beats.period
        while time.monotonic() < deadline:
            silent, since = beats.silent()
            if silent:
                self.first_dead, self.silent, self.silent_since, self.silent_step = None, silent, since, step
                return
            if beats.beaten_since(died_at):
                return
            time.sleep(0.01)

    def wait(self) -> int:
        status = self.proc.wait()
        for reader in self.readers:
            reader.join(timeout=10)
        return status

    def end_survivors(self, report: str) -> None:
        """After a rank's death: kill the ranks left on this host; under srun, cancel the job step (its
        ranks on other hosts); then end the launcher if it lingers (srun waits for an answer from
        the tasks of a dead node until Slurm declares the node down)."""
        here, steps = socket.gethostname(), set()
        for pid, (_, host, step) in _entries(report).items():
            if step:
                steps.add(step)
            if host != here:
                continue
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if self.srun and steps:
            self.cancel = subprocess.Popen(["scancel", "--quiet", "--signal=KILL", *sorted(steps)],
                                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                           stderr=subprocess.DEVNULL)
        try:
            self.proc.wait(timeout=3 if self.srun else 10)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def dead(self) -> Optional[Tuple[Optional[int], str, str]]:
        """(pid, host, how) of the process whose death ended the job: the one seen dead on this host;
        else, if ranks were found dead together or ``mpiexec`` reports one killed by a signal, the
        pid ``mpiexec`` names (None if it names none). None if no rank died."""
        if self.first_dead is not None and self.first_dead[0] is not None:
            return self.first_dead[0], socket.gethostname(), "died"
        text = "".join(self.text)
        death, killed = HYDRA_DEATH.search(text), HYDRA_SIGNAL.search(text)
        if self.first_dead is None and not killed:
            return None
        how = "found dead with others (which went first could not be seen)" if self.first_dead else \
            f"killed by signal {killed.group(1)}"
        return (int(death.group(1)), death.group(2), how) if death else (None, "?", how)


class _Exits:
    """Wait up to a time for a process of this host to end, woken by the kernel the moment it
    does (a ``pidfd`` per process, Linux 5.3 and later; elsewhere the wait is a plain sleep), and
    say which ended by then. MPICH's ``mpiexec``, even with ``-disable-auto-cleanup``, can kill
    the ranks left about 1.5 ms after one dies (measured: a SIGUSR1 to each, then SIGKILL): a look
    every 10 ms alone found them dead together, and a look right after the wait, behind busy ranks
    on a loaded node, still did one time in eight. The one whose end woke the wait went first."""

    def __init__(self):
        self.fds: Dict[int, Optional[int]] = {}   # pid -> its pidfd; None once ended or if it has none

    def wait(self, pids: Sequence[int], seconds: float) -> List[int]:
        """Wait until one of ``pids`` ends, at most ``seconds``; return those whose end was seen in
        this wait (all that had ended by the time it woke; none after a timeout or without pidfds)."""
        for pid in pids:
            if pid not in self.fds:
                try:
                    self.fds[pid] = os.pidfd_open(pid)
                except (AttributeError, OSError):
                    self.fds[pid] = None
        fds = [fd for fd in self.fds.values() if fd is not None]
        if not fds:
            time.sleep(seconds)
            return []
        ended, _, _ = select.select(fds, [], [], seconds)
        seen = []
        for pid, fd in self.fds.items():
            if fd in ended:                        # stays readable: wait on it no more
                os.close(fd)
                self.fds[pid] = None
                seen.append(pid)
        return seen

    def close(self) -> None:
        for fd in self.fds.values():
            if fd is not None:
                os.close(fd)
        self.fds.clear()


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True


EXITED = ".exited"


def _registry(directory: str) -> Dict[int, Tuple[int, str]]:
    """pid -> (rank, host) of the ranks of the last launch that reported in and have not ended by themselves."""
    return {pid: (rank, host) for pid, (rank, host, _) in _entries(directory).items()}


def _entries(directory: str) -> Dict[int, Tuple[int, str, str]]:
    """pid -> (rank, host, Slurm job step or "") of the ranks of ``_registry``."""
    found = {}
    names = set(os.listdir(directory))
    for name in names:
        if name.startswith("rank-") and name[5:].isdigit() and name + EXITED not in names:
            try:
                pid, host, *step = open(os.path.join(directory, name)).read().split()
                found[int(pid)] = (int(name[5:]), host, step[0] if step else "")
            except (OSError, ValueError, IndexError):
                continue
    return found


def _placement(directory: str) -> Dict[str, List[int]]:
    """host -> the ranks of the last launch that reported in there (ended or not)."""
    placed: Dict[str, List[int]] = {}
    for name in sorted(os.listdir(directory)):
        if name.startswith("rank-") and name[5:].isdigit():
            try:
                host = open(os.path.join(directory, name)).read().split()[1]
            except (OSError, IndexError):
                continue
            placed.setdefault(host, []).append(int(name[5:]))
    return {host: sorted(ranks) for host, ranks in placed.items()}


def _run(directory: str) -> Optional[str]:
    """The run identity rank 0 reported in ``directory`` (``report_in``), or None."""
    try:
        return open(os.path.join(directory, RUN)).read().strip() or None
    except OSError:
        return None


def _progress(directory: str) -> Optional[int]:
    try:
        return int(open(os.path.join(directory, "progress")).read().strip() or "x")
    except (OSError, ValueError):
        return None


def _launched_rank() -> Optional[str]:
    """This process's rank when an MPI launcher started it (MPICH's ``PMI_RANK``, Open MPI's
    ``OMPI_COMM_WORLD_RANK``), read from the environment; None for a process started on its own."""
    for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        value = os.environ.get(name)
        if value is not None:
            return value.strip()
    return None


def main(argv: Sequence[str]) -> int:
    """Run the supervisor; returns the exit status."""
    launched = _launched_rank()
    if launched is not None:        # first: under mpirun every other fix of the command line is beside the point
        if launched == "0":         # every copy stops; rank 0 alone says why, so the message appears once
            _error("--elastic starts the ranks itself: run it as one process, not under mpirun/mpiexec (or under "
                   "Open MPI's mpirun --with-ft ulfm, where the job itself goes on: docs/elastic.md)")
        return 2
    known, rest = _parser().parse_known_args(list(argv))
    if known.ranks is None or known.ranks < 1:
        return _error("--elastic needs -n P (the ranks to start with), P >= 1")
    if not 1 <= known.min_ranks <= known.ranks:
        return _error(f"argument --min-ranks: must be between 1 and -n {known.ranks}, got {known.min_ranks}")
    directory = _value(rest, "--checkpoint-dir")
    if not directory:
        return _error("--elastic needs --checkpoint-dir (it resumes from the newest checkpoint there)")
    try:
        timeout = config.read(config.ELASTIC_TIMEOUT)
    except ValueError as bad:
        return _error(f"{config.ELASTIC_TIMEOUT.name}: {bad}")
    nodes: List[str] = []
    if known.launcher == "srun":
        mpiexec = shutil.which("srun")
        if not os.environ.get("SLURM_JOB_ID") or not mpiexec:
            return _error("--launcher srun starts the ranks inside a Slurm allocation: run it in a batch script "
                          "(sbatch) or under salloc")
        nodes = _allocation()
        if not nodes:
            return _error("--launcher srun: cannot read the allocation's nodes (SLURM_JOB_NODELIST, scontrol)")
    else:
        mpiexec = known.mpiexec or next((p for p in (os.path.join(os.path.dirname(sys.executable), "mpiexec"),
                                                     shutil.which("mpiexec")) if p and os.path.exists(p)), None)
        if not mpiexec:
            return _error("no mpiexec beside this Python or on PATH: give --mpiexec PATH")
    if _value(rest, "--checkpoint-every") is None:
        rest += ["--checkpoint-every", str(DEFAULT_CHECKPOINT_EVERY)]
    json_path = _value(rest, "--json")
    # Where the ranks report in: beside the checkpoints, which every rank's host must see anyway.
    try:
        os.makedirs(directory, exist_ok=True)
        report = os.path.abspath(tempfile.mkdtemp(prefix=".elastic-", dir=directory))
    except OSError as bad:
        return _error(f"argument --checkpoint-dir: cannot create {directory}: {bad.strerror}")
    env = dict(os.environ, **{config.ELASTIC_DIR.name: report})
    try:
        return _supervise(known, rest, directory, mpiexec, report, env, json_path, timeout, nodes)
    finally:
        shutil.rmtree(report, ignore_errors=True)


def _allocation() -> List[str]:
    """The host names of the Slurm allocation this runs in ([] if they cannot be read)."""
    listed = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST") or ""
    try:
        names = subprocess.run(["scontrol", "show", "hostnames", listed], capture_output=True, text=True,
                               timeout=60).stdout.split() if listed else []
    except (OSError, subprocess.TimeoutExpired):
        names = []
    return names


def _srun(srun: str, ranks: int, nodes: List[str], excluded: List[str]) -> List[str]:
    """srun's options for a launch of ``ranks`` on the allocation's nodes less ``excluded``. A task of a
    step lost with its node stays in Slurm's books until Slurm declares the node down: --overlap
    lets the relaunch use the CPUs that step still holds on the live nodes."""
    live = [n for n in nodes if n not in excluded]
    return [srun, "--kill-on-bad-exit=0", "--overlap", f"--nodes={min(len(live), ranks)}", f"--ntasks={ranks}",
            *([f"--exclude={','.join(excluded)}"] if excluded else [])]


def _supervise(known, rest: List[str], directory: str, mpiexec: str, report: str, env: Dict[str, str],
               json_path: Optional[str], timeout: float = 0.0, nodes: Sequence[str] = ()) -> int:
    ranks, losses, excluded = known.ranks, [], []
    srun = known.launcher == "srun"
    # MPICH's mpiexec ends every rank when one dies, so fast that which died first cannot be seen;
    # without it the survivors wait (in a collective, on the dead rank) until the supervisor, which
    # has seen which rank is gone, ends them. srun is told so with --kill-on-bad-exit=0.
    cleanup = []
    if not srun:
        version = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=60).stdout
        cleanup = ["-disable-auto-cleanup"] if "HYDRA" in version else []
    resume = "--resume" in rest
    rest = [a for a in rest if a != "--resume"]
    run: Optional[str] = None                  # the run's identity, once its rank 0 has reported it
    job: Optional[Job] = None
    stopping = []

    def forward(signum, frame) -> None:        # a time limit or preemption: the ranks save and stop
        stopping.append(signum)
        if job is not None and job.proc.poll() is None:
            job.proc.send_signal(signal.SIGUSR1)

    def interrupted(signum, frame) -> None:    # Ctrl-C: the terminal sent it to the launcher too, which
        if stopping:                           # passes it on; the ranks save and stop. A second: end now
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
        stopping.append(signum)
    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGUSR1)}
    if signal.getsignal(signal.SIGINT) != signal.SIG_IGN:
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, interrupted)
    try:
        while True:
            placed = _placement(report)        # host -> the ranks of the launch before
            for name in os.listdir(report):
                os.unlink(os.path.join(report, name))
            launcher = _srun(mpiexec, ranks, list(nodes), excluded) if srun else [mpiexec, *cleanup, "-n", str(ranks)]
            command = [*launcher, sys.executable, "-m", "allreduce_kit.train", *rest,
                       *(["--resume"] if resume else [])]
            if losses:
                plural = "s" if len(excluded) != 1 else ""
                left_out = f", without node{plural} {', '.join(excluded)}" if excluded else ""
                _say(f"relaunching on {ranks} ranks{left_out}: {' '.join(command)}")
            job = Job(command, env, srun=srun)
            first_step = job.watch(report, losses[-1] if losses else None, timeout)
            if job.first_dead is not None or job.silent:
                job.end_survivors(report)
            status = job.wait()
            run = _run(report) or run          # the same for every launch: written by rank 0 of each
            ended = job.first_dead[1] if job.first_dead else job.silent_since if job.silent else time.monotonic()
            if stopping or status == STOPPED or (status == 0 and not job.silent):
                return _finish(status, losses, json_path)
            if job.silent:
                loss = _silent_loss(job, report, ranks, timeout)
            else:
                dead = job.dead()
                text = "".join(job.text)
                if dead is not None and ("; aborting the job" in text or "Aborting the job." in text):
                    dead = None                    # a rank ended the job on an error: running it again would repeat it
                refused = [n for n in SRUN_REFUSED.findall(text) if n not in excluded] if srun else []
                if dead is None and refused and first_step is None:
                    # A node whose slurmd is gone: leave it out too, with the ranks it held before.
                    host = refused[0]
                    step = losses[-1].resumed_from if losses else _progress(report)
                    held = placed.get(host, [])
                    loss = Loss(None, None, host, REFUSED, step, ranks, ranks - len(held), lost_ranks=held,
                                nodes_lost=[host])
                elif dead is None:
                    _say(f"the job ended with status {status} and no rank was killed: not relaunched")
                    return _finish(status, losses, json_path)
                else:
                    pid, host, how = dead
                    rank, _ = _registry(report).get(pid, (None, host)) if pid is not None else (None, host)
                    last = job.first_dead[2] if job.first_dead and job.first_dead[2] is not None else _progress(report)
                    loss = Loss(rank, pid, host, how, last, ranks, ranks - 1, lost_ranks=[] if rank is None else [rank])
            if losses and first_step is None and loss.how != REFUSED:
                _say(f"recovery failed: {loss.line()}, before the relaunched job's first step")
                return _finish(FAILED, losses + [loss], json_path)
            losses.append(loss)
            _say(loss.line())
            if loss.ranks_after < known.min_ranks:
                _say(f"recovery failed: {loss.ranks_after} rank{'s' if loss.ranks_after != 1 else ''} left, fewer "
                     f"than --min-ranks {known.min_ranks}")
                return _finish(FAILED, losses, json_path)
            step, notes = usable_checkpoint(directory, run)
            for note in notes:
                _say(note)
            if step is None and notes:
                _say(f"recovery failed: no checkpoint in {directory} can be read")
                return _finish(FAILED, losses, json_path)
            if step is not None:
                _say(f"resuming from {os.path.join(directory, checkpoint.name_for(step))} (step {step}), the newest "
                     f"checkpoint of this run")
            loss.resumed_from, loss.steps_redone = step, (loss.step or 0) - (step or 0)
            loss.died_at = ended
            resume = step is not None
            ranks = loss.ranks_after
            if srun:
                excluded += [n for n in loss.nodes_lost if n not in excluded]
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if job is not None and job.proc.poll() is None:
            job.proc.kill()
            job.wait()


def _silent_loss(job: Job, report: str, ranks: int, timeout: float) -> Loss:
    """The loss of the ranks on other hosts that went silent; a host all of whose ranks did is a dead node."""
    hosts: Dict[str, set] = {}
    for pid, (_, host) in _registry(report).items():
        hosts.setdefault(host, set()).add(pid)
    silent = sorted(job.silent.items(), key=lambda item: item[1][0])
    where = sorted({host for _, (_, host) in silent})
    nodes = [host for host in where if hosts.get(host, set()) <= set(job.silent)]
    pid, (rank, _) = silent[0]
    return Loss(rank if len(silent) == 1 else None, pid if len(silent) == 1 else None, ", ".join(where),
                f"no heartbeat for {timeout:g} s", job.silent_step, ranks, ranks - len(silent),
                lost_ranks=[r for _, (r, _) in silent], nodes_lost=nodes)


def _finish(status: int, losses: List[Loss], json_path: Optional[str]) -> int:
    if losses:
        lost = sum(max(1, len(loss.lost_ranks)) for loss in losses)
        _say(f"{lost} rank{'s' if lost != 1 else ''} lost during the run:")
        for loss in losses:
            _say("  " + loss.line())
    if json_path and status == 0 and os.path.isfile(json_path):
        with open(json_path) as f:
            payload = json.load(f)
        payload["elastic"] = {"losses": [{k: v for k, v in asdict(loss).items() if k != "died_at"} for loss in losses]}
        with open(json_path, "w") as f:
            json.dump(payload, f, indent=1)
    return status
