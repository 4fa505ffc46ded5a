"""Turn an uncaught exception on one rank into the end of the whole job, not a hang.

Without this, a rank that raises exits while the others wait in a collective forever
(``python -m mpi4py`` does the same for scripts launched through it).
"""
import os
import sys

from mpi4py import MPI


def install_abort_hook() -> bool:
    """Chain ``sys.excepthook`` to print the traceback, then ``MPI.COMM_WORLD.Abort(1)``.

    Installed on import of ``allreduce_kit`` when the world has more than one rank, unless
    ``ALLREDUCE_KIT_ABORT_ON_ERROR=0``. Returns whether the hook is now installed.
    """
    if getattr(sys.excepthook, "_allreduce_kit_abort", False):
        return True
    previous = sys.excepthook

    def hook(kind, value, traceback):
        try:
            rank = MPI.COMM_WORLD.Get_rank()
            sys.stderr.write(f"allreduce_kit: uncaught {kind.__name__} on rank {rank}; aborting the job\n")
            previous(kind, value, traceback)
            sys.stderr.flush()
            sys.stdout.flush()
        finally:
            MPI.COMM_WORLD.Abort(1)

    hook._allreduce_kit_abort = True
    sys.excepthook = hook
    return True


def abort_hook_wanted() -> bool:
    """Whether importing the package should install the hook."""
    return (os.environ.get("ALLREDUCE_KIT_ABORT_ON_ERROR", "1") != "0"
            and MPI.COMM_WORLD.Get_size() > 1)
