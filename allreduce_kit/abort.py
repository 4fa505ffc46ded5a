"""Turn an uncaught exception on one rank into the end of the whole job, not a hang.

Without this, a rank that raises exits while the others wait in a collective forever
(``python -m mpi4py`` does the same for scripts launched through it). Nothing here runs on
import: the CLIs and ``python -m allreduce_kit.run`` install the hook (``run.prepare``), and a
script of your own can call ``install_abort_hook()``.
"""
import os
import sys
import time
from typing import NoReturn, Optional

#: Seconds between a rank's last words and its ``Abort``: MPICH's launcher can tear the job
#: down before it forwards the last lines the aborting rank wrote to stderr.
FORWARD_SECONDS = 1.0


def flush_for_launcher() -> None:
    """Flush stdout and stderr, then give the launcher time to forward them."""
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(FORWARD_SECONDS)


def end_job(code: int = 1) -> NoReturn:
    """``MPI.COMM_WORLD.Abort(code)``, and never return.

    MPICH's ``MPI_Abort`` can return before the launcher has killed this process (seen here:
    about one call in three returned at once), and the caller would then carry on, for example
    to report the same failure again. So the process exits right there if it does.
    """
    try:
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(code)
    finally:
        os._exit(code)


def abort_job(message: Optional[str] = None, code: int = 1) -> NoReturn:
    """Write ``message`` (one line) to stderr if given, let it reach the launcher, then end
    every rank of the job (``end_job``)."""
    try:
        if message:
            sys.stderr.write(message.rstrip("\n") + "\n")
        flush_for_launcher()
    finally:
        end_job(code)


def install_abort_hook() -> bool:
    """Chain ``sys.excepthook`` to print the traceback, then ``MPI.COMM_WORLD.Abort(1)`` when
    the job has more than one rank. Returns True (the hook is installed, now or before).

    Safe to call before MPI starts: the hook looks MPI up only when an exception reaches it.
    """
    if getattr(sys.excepthook, "_allreduce_kit_abort", False):
        return True
    previous = sys.excepthook

    def hook(kind, value, traceback):
        MPI = sys.modules.get("mpi4py.MPI")  # never start MPI just to report an error
        if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized() or MPI.COMM_WORLD.Get_size() == 1:
            previous(kind, value, traceback)
            return
        try:
            rank = MPI.COMM_WORLD.Get_rank()
            sys.stderr.write(f"allreduce_kit: uncaught {kind.__name__} on rank {rank}; aborting the job\n")
            previous(kind, value, traceback)
        finally:
            abort_job()

    hook._allreduce_kit_abort = True
    sys.excepthook = hook
    return True
