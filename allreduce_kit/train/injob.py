"""``mpirun --with-ft ulfm ... python -m allreduce_kit.train --elastic``: go on in the same job when a rank dies.

Under Open MPI with its fault tolerance on (ULFM), a collective that needs a dead rank fails
with ``MPI_ERR_PROC_FAILED`` once Open MPI knows of the death (its node's daemon reports a rank
killed by a signal at once; the heartbeats, after ``mpi_ft_detector_timeout``, one that is not),
on the ranks that talk to it; each rank that sees an error revokes the trainer's communicators,
so that the others, wherever they wait, fail too (``MPI_ERR_REVOKED``). Then every survivor:

1. shrinks the job's communicator to the live ranks (``MPI_Comm_shrink``) and names the lost ones;
2. agrees on the step to go on from: every ``--checkpoint-every`` steps each rank keeps, in its
   own memory, the parameters and optimizer state (the same on every rank in synchronous
   training) and every rank's share of the open epoch's sums; the survivors take the newest
   step they all hold (``MPI_Comm_agree`` checks they do);
3. builds a new trainer on the shrunken communicator from that copy, as ``--resume`` does at
   another rank count: the data are re-sharded from the copy's sample (``--on-resize``), and the
   library's communicator (topology, ``auto``'s state) is made anew for it;

and goes on. The report at the end lists every loss as the supervisor does (elastic.py): which
rank, after which step, the steps redone, the time from the last step finished before the loss
to the first step after it, the rank count from then on. Fewer survivors than ``--min-ranks``,
a death during the recovery, or an MPI error with no rank lost end the job with a message and
status 1 (``MPI_Abort``), never a hang.

While this runs, the library keeps to messages (``faults.keep_to_messages``): its shared-window
and direct-read paths wait on flags in peers' memory, where a death is never noticed.
"""
import copy
import os
import signal
import sys
import time
from dataclasses import asdict
from typing import Any, Callable, Dict, List, Optional, Tuple

from mpi4py import MPI

from .. import faults
from ..cli import plural
from .elastic import DEFAULT_CHECKPOINT_EVERY, Loss
from .signals import StopSignals

__all__ = ["Recovery", "RecoveryFailed", "available", "problems", "ended"]

_made: List["Recovery"] = []


class RecoveryFailed(Exception):
    """The survivors cannot go on (too few, another death during recovery, an error with no death);
    ``comm``: the survivors' communicator, if they got that far (then its rank 0 alone says so)."""

    def __init__(self, message: str, comm: Optional[MPI.Intracomm] = None):
        super().__init__(message)
        self.comm = comm


def available() -> bool:
    """Whether this process runs under an MPI that can recover in the job (Open MPI with ULFM on)."""
    return faults.ulfm_launched() and "Open MPI" in MPI.Get_library_version() and hasattr(MPI.Comm, "Shrink")


def problems(args, ranks: int) -> Optional[str]:
    """Why ``--elastic`` cannot run in this job with these options, or None (rank 0's verdict is used)."""
    launched = {"-n": args.ranks, "--mpiexec": args.mpiexec, "--launcher": getattr(args, "launcher", None)}
    option = next((name for name, value in launched.items() if value is not None), None)
    if option is not None:
        return f"argument {option}: the job is already launched (under mpirun with ULFM, --elastic recovers in the job)"
    if args.min_ranks is not None and not 1 <= args.min_ranks <= ranks:
        return f"argument --min-ranks: must be between 1 and the job's {ranks} ranks, got {args.min_ranks}"
    if args.mode != "sync" or args.backup_workers or args.local_sgd > 1:
        return ("argument --elastic: recovery in the job continues plain synchronous training (--mode sync without "
                "--backup-workers or --local-sgd); for those, run the supervisor: python -m allreduce_kit.train "
                "--elastic -n P ...")
    return None


class Snapshot:
    """A step's parameters, optimizer state and checkpoint record, held in this rank's memory."""

    def __init__(self, trainer):
        now = trainer._open_epoch()
        gathered = trainer.comm.allgather((trainer.jitter_rng.bit_generator.state, None if now is None else now[0]))
        self.step = trainer.step
        self.arrays = {"params": trainer.model.params.copy(),
                       **{name: state.copy() for name, state in trainer.optimizer.state().items()}}
        self.meta = copy.deepcopy(trainer.checkpoint_meta(gathered, now))


class Recovery:
    """Train on ``comm``'s ranks, and on the survivors of each loss (one per rank, collective)."""

    def __init__(self, comm: MPI.Intracomm, config, min_ranks: Optional[int], every: int):
        faults.keep_to_messages()                     # before the first library communicator is made
        _made.append(self)
        self.comm = comm.Dup()
        self.comm.Set_errhandler(MPI.ERRORS_RETURN)
        self.config = config
        self.min_ranks = min_ranks or 1
        self.every = every or DEFAULT_CHECKPOINT_EVERY
        self.losses: List[Loss] = []
        self.snapshots: List[Snapshot] = []
        self.last_step_at = time.time()
        self.pending: List[Loss] = []                 # losses waiting for their first step after
        self.phases: List[Dict[str, float]] = []      # per loss: when each part of its recovery ended (PHASES)
        self.epochs_said = 0                          # the last epoch whose line went out

    def header(self, trainer) -> str:
        return (f"elastic in the job (ULFM): a lost rank is survived while at least {plural(self.min_ranks, 'rank')} "
                f"remain; the survivors go on from an in-memory copy taken every {plural(self.every, 'step')}; "
                f"the library keeps to messages")

    # -- the hooks the trainer calls on every rank ------------------------------------------------
    def _hooks(self, trainer, on_step, on_epoch) -> Tuple[Callable, Callable]:
        def step_hook(i: int) -> None:
            self.last_step_at = time.time()
            if self.pending:
                self._recovered(trainer)
            if trainer.step % self.every == 0 and trainer.plan.position(trainer.step)[1] != 0:
                self._keep(trainer)                  # inside an epoch; at its end, after its record
            if on_step:
                on_step(i)

        def epoch_hook(metrics: Dict[str, Any]) -> None:
            if on_epoch:                             # an epoch redone after a loss is said to be so
                again = metrics["epoch"] <= self.epochs_said
                on_epoch(dict(metrics, note=f"redone on {trainer.ranks} ranks, in place of the line above") if again
                         else metrics)
            self.epochs_said = max(self.epochs_said, metrics["epoch"])
            if trainer.step % self.every == 0 and trainer.plan.position(trainer.step)[1] == 0:
                self._keep(trainer)
        return step_hook, epoch_hook

    def _keep(self, trainer) -> None:
        """Keep this step's snapshot and the one before (a loss during the snapshot's own
        exchange may leave some ranks with the newer one and some without)."""
        self.snapshots = [*self.snapshots[-1:], Snapshot(trainer)]

    def _recovered(self, trainer) -> None:
        """At the first step after a recovery: time it, and say so (rank 0)."""
        now = time.time()
        for loss in self.pending:
            loss.recovery_seconds = now - loss.died_at
            phases = self.phases[self.losses.index(loss)]
            phases["first_step_at"] = now
            _say(trainer, f"recovered: first step on {loss.ranks_after} ranks {loss.recovery_seconds:.1f} s after "
                          f"the last step before the loss ({breakdown(phases)})")
        self.pending = []

    # -- the loop ---------------------------------------------------------------------------------
    def run(self, trainer, make: Callable[[MPI.Intracomm, Snapshot], Any], on_step=None, on_epoch=None):
        """Run ``trainer`` (made on ``self.comm``) to the end; after a loss, go on with
        ``make(survivors, snapshot)``'s trainer. Returns (the last trainer, its results). A failed
        recovery ends the job (``fail``)."""
        self._keep(trainer)                          # step 0 (or the --resume checkpoint's step)
        while True:
            step_hook, epoch_hook = self._hooks(trainer, on_step, on_epoch)
            try:
                return trainer, trainer.run(on_step=step_hook, on_epoch=epoch_hook)
            except MPI.Exception as error:
                try:
                    trainer = self._recover(trainer, error, make)
                except RecoveryFailed as failed:
                    fail(failed)

    def _recover(self, trainer, error: MPI.Exception, make):
        seen = time.time()
        stop = trainer.stop
        faults.revoke(trainer.comm, self.comm, stop.comm if stop is not None else None)
        if stop is not None:                         # its check was on a revoked communicator: drop it
            for signum, handler in stop.previous.items():
                signal.signal(signum, handler)
            stop.previous.clear()
        old = self.comm
        try:
            survivors = faults.shrink(old)
            lost = faults.lost_ranks(old, survivors)
            where = survivors.allgather((trainer.step, self.last_step_at, seen))
            newest = survivors.allreduce(self.snapshots[-1].step, op=MPI.MIN)
            held = next((s for s in self.snapshots if s.step == newest), None)
            agreed = survivors.Agree(int(held is not None))
            agreed_at = time.time()
        except MPI.Exception as again:
            raise RecoveryFailed(f"recovery failed: {_what(again)} while the survivors of {_what(error)} were "
                                 f"agreeing how to go on (a second loss during recovery)") from None
        if not lost:
            raise RecoveryFailed(f"{_what(error)}, but no rank of the job was lost: not a loss this can recover from")
        ranks_after = survivors.Get_size()
        last = max(step for step, _, _ in where)     # the newest step finished, and when it first was
        started = min(at for step, at, _ in where if step == last)
        first_seen = min(at for _, _, at in where)   # the first survivor to get the error
        world = faults.translate(old, lost)
        for rank, world_rank in zip(lost, world):
            loss = Loss(world_rank, None, trainer.hosts[rank] if rank < len(trainer.hosts) else "?",
                        "lost in the job (MPI_ERR_PROC_FAILED)", last, old.Get_size(), ranks_after,
                        resumed_from=newest, steps_redone=last - newest, died_at=started)
            self.losses.append(loss)
            self.pending.append(loss)
            self.phases.append({"last_step_at": started, "seen_at": first_seen, "agreed_at": agreed_at})
            _say(survivors, loss.line() + f" (seen {first_seen - started:.1f} s after the last step)")
        if ranks_after < self.min_ranks:
            raise RecoveryFailed(f"recovery failed: {plural(ranks_after, 'rank')} left, fewer than --min-ranks "
                                 f"{self.min_ranks}", survivors)
        if not agreed:
            raise RecoveryFailed("recovery failed: the survivors hold no snapshot of a common step", survivors)
        self.comm = survivors
        try:
            rebuilt = make(survivors, held)
            rebuilt.stop = StopSignals(rebuilt.comm) if stop is not None else None
            rebuilt_at = time.time()
            for phases in self.phases[len(self.phases) - len(lost):]:
                phases["rebuilt_at"] = rebuilt_at
        except MPI.Exception as again:
            raise RecoveryFailed(f"recovery failed: {_what(again)} while the trainer was rebuilt on "
                                 f"{plural(ranks_after, 'rank')} (a second loss during recovery)") from None
        if rebuilt.resize_note:
            _say(survivors, rebuilt.resize_note)
        self.snapshots = [held]
        return rebuilt

    def report(self, comm: MPI.Intracomm) -> Optional[Dict[str, Any]]:
        """Print the losses (rank 0) and return them for --json, or None if none happened."""
        if not self.losses:
            return None
        _say(comm, f"{plural(len(self.losses), 'rank')} lost during the run, recovered in the job (ULFM):")
        for loss in self.losses:
            _say(comm, "  " + loss.line())
        return {"path": "in-job (ULFM)",
                "losses": [dict({k: v for k, v in asdict(loss).items() if k != "died_at"}, phases=phases)
                           for loss, phases in zip(self.losses, self.phases)]}


#: The parts of a recovery, each as the time (``time.time()``, rank 0's clock except ``seen_at``)
#: it ended: the last step every survivor had finished before the loss, the first survivor's
#: error, the survivors' communicator made and the step agreed (revoke, shrink, agree), the new
#: trainer built on it (data re-sharded, library communicator and warm-up average), its first step.
PHASES = ("last_step_at", "seen_at", "agreed_at", "rebuilt_at", "first_step_at")


def breakdown(phases: Dict[str, float], death: Optional[float] = None) -> str:
    """``detect 0.1 s, revoke+shrink+agree 0.2 s, ...``: the time each part of a recovery took
    (detection counted from ``death`` if given, else from the last step before the loss)."""
    names = ("detect", "revoke+shrink+agree", "re-shard+rebuild", "first step")
    start = phases["last_step_at"] if death is None else death
    ends = [phases.get(key) for key in PHASES[1:]]
    parts, before = [], start
    for name, end in zip(names, ends):
        if end is None:
            break
        parts.append(f"{name} {end - before:.2f} s")
        before = end
    return ", ".join(parts)


def _what(error: MPI.Exception) -> str:
    return error.Get_error_string().split(":")[0] if isinstance(error, MPI.Exception) else str(error)


def _say(where, message: str) -> None:
    comm = where if isinstance(where, MPI.Comm) else where.comm
    if comm.Get_rank() == 0:
        sys.stdout.write(f"[elastic] {message}\n")
        sys.stdout.flush()


def ended(status: int) -> int:
    """``status``; but in a process that ran a ``Recovery``, end it here with ``status`` after
    flushing its output, without ``MPI_Finalize``: Open MPI 5.0's ``MPI_Finalize`` does not return
    once its threaded failure detector runs (``mpirun`` then reports 0, or 9 after a loss)."""
    if _made:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


def fail(error: RecoveryFailed) -> None:
    """End the whole job after a failed recovery: the message, then ``MPI_Abort`` with status 1."""
    speaks = error.comm is None or error.comm.Get_rank() == 0
    if speaks:
        sys.stderr.write(f"python -m allreduce_kit.train --elastic: {error}\n")
        sys.stderr.flush()
    time.sleep(0.5 if speaks else 1.0)               # the message out before the job ends
    MPI.COMM_WORLD.Abort(1)

