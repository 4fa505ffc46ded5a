"""Stop at a step boundary on SIGTERM, SIGUSR1 or SIGINT, on every rank at the same step.

A time limit or a preemption (Slurm sends SIGTERM, or the signal asked with ``--signal``), or a
Ctrl-C at the terminal (``mpiexec`` passes SIGINT on to every rank), reaches the ranks at
slightly different moments, perhaps a step apart. Each rank's handler only sets a
flag. At every step boundary each rank starts a one-integer ``Iallreduce(MAX)`` of its flag on a
communicator of its own, and at the next boundary waits for the previous one: by then every rank
has taken part in a whole gradient average since starting it, so the wait costs nothing, and
every rank gets the same answer at the same boundary. There is no extra round per step; the
stop comes at most one step after the last rank saw the signal.

MPICH's ``mpiexec`` forwards SIGTERM, SIGUSR1 and SIGUSR2 to every rank and returns the ranks'
exit status; Slurm signals every task of a step (``scancel --signal``, time limits, preemption).
"""
import os
import signal
from typing import Dict, Optional, Sequence

import numpy as np
from mpi4py import MPI

from . import checkpoint

__all__ = ["STOPPED_STATUS", "StopSignals", "Stopped", "stop_if_asked"]

#: The exit status of a run that stopped on a signal after saving a checkpoint (``EX_TEMPFAIL``:
#: "try again later"); ``--resume`` continues it.
STOPPED_STATUS = 75
#: The signals that ask for a stop at the next step boundary (a second one ends the process at once).
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class Stopped(Exception):
    """Every rank stopped at the same step boundary on a signal (after saving a checkpoint if it could)."""

    def __init__(self, signum: int, step: int, saved: Optional[str]):
        self.signum, self.step, self.saved = signum, step, saved
        name = signal.Signals(signum).name
        where = (f"checkpoint {saved} written; --resume continues from it" if saved
                 else "no --checkpoint-dir, so nothing was saved")
        super().__init__(f"stopped on {name} after step {step}: {where}")


class StopSignals:
    """The ranks' agreement to stop: install on every rank (collective), ``poll`` once per step."""

    def __init__(self, comm: MPI.Intracomm, signals: Sequence[int] = SIGNALS):
        self.comm = comm.Dup()
        self.caught = np.zeros(1, np.int64)        # the signal this rank caught, 0 if none
        self.sending = np.zeros(1, np.int64)       # what the check in flight sent (kept alive until it ends)
        self.agreed = np.zeros(1, np.int64)
        self.request: Optional[MPI.Request] = None
        self.previous: Dict[int, object] = {}
        for signum in signals:
            if signum == signal.SIGINT and signal.getsignal(signum) == signal.SIG_IGN:
                continue                           # started to ignore Ctrl-C (``nohup``, a shell's ``&``): it still does
            self.previous[signum] = signal.signal(signum, self._handler)

    def _handler(self, signum: int, frame) -> None:
        if self.caught[0]:                         # a second signal: the default action (end now)
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
        self.caught[0] = signum

    def poll(self) -> int:
        """At a step boundary, on every rank: the signal all ranks agree to stop on now, or 0."""
        if self.request is not None:
            self.request.Wait()
            self.request = None
            if self.agreed[0]:
                return int(self.agreed[0])
        self.sending[0] = self.caught[0]
        self.request = self.comm.Iallreduce(self.sending, self.agreed, op=MPI.MAX)
        return 0

    def close(self) -> None:
        """Finish the check in flight, give the signals back their previous handlers, free the communicator."""
        if self.request is not None:
            self.request.Wait()
            self.request = None
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous.clear()
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()


def stop_if_asked(trainer) -> None:
    """At a step boundary of ``trainer`` (every rank): if the ranks agree to stop, save a checkpoint
    (unless this step's is saved) and raise ``Stopped``. Nothing if it has no ``stop`` or is done."""
    stop = trainer.stop
    if stop is None or trainer.step >= trainer.total_steps():
        return
    signum = stop.poll()
    if not signum:
        return
    saved = None
    directory = trainer.config.checkpoint_dir
    if directory:
        if trainer.saved_step != trainer.step:
            trainer.save_checkpoint()
        saved = os.path.join(directory, checkpoint.name_for(trainer.step))
    raise Stopped(signum, trainer.step, saved)
