"""What every ``python -m allreduce_kit.X`` command shares: rank-0 output and clean exits.

Every rank parses the same command line, so every rank reaches the same verdict; only rank 0
prints help and errors, and every rank exits with the same status (2 for a bad argument), so
nothing hangs and the message appears once.
"""
import argparse
import json
import sys
from typing import Any, Optional

from . import config


def _mpi():
    """mpi4py's MPI module if this process has started MPI, else None (a CLI such as ``compare``
    runs without it, and must not start it just to print)."""
    return sys.modules.get("mpi4py.MPI")


def is_root(comm: Any = None) -> bool:
    if comm is None:
        MPI = _mpi()
        if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized():
            return True
        comm = MPI.COMM_WORLD
    return comm.Get_rank() == 0


def say(*args: Any, comm: Any = None, **kwargs: Any) -> None:
    """``print`` on rank 0 only, flushed at once (a job's log should show progress as it goes)."""
    if is_root(comm):
        print(*args, **kwargs, flush=True)


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Says each option's default, except where there is none to say (``None``)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None:
            return action.help or ""
        return super()._get_help_string(action)


class RankZeroParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that prints help and errors on rank 0 only."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)
        from . import __version__

        self.add_argument("--version", action="version", version=f"allreduce_kit {__version__}")

    def exit(self, status: int = 0, message: Optional[str] = None) -> None:
        """Exit on every rank, but only once rank 0 has printed (every rank parses the same line).

        Without the barrier a rank that leaves first can end the job (``python -m mpi4py`` aborts
        on a non-zero exit) before rank 0's message is out.
        """
        if message:
            self._print_message(message, sys.stderr)
        MPI = _mpi()
        if MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.COMM_WORLD.Barrier()
        sys.exit(status)

    def _print_message(self, message: str, file=None) -> None:
        if is_root() and message:
            (file or sys.stderr).write(message)
            (file or sys.stderr).flush()


def settings_problem() -> Optional[str]:
    """Why an ``ALLREDUCE_KIT_*`` setting in the environment cannot be used, or None.

    The CLIs check every setting up front, so a typo is one message and exit 2, not a traceback
    from the first collective."""
    for setting in config.SETTINGS:
        try:
            config.read(setting)
        except ValueError as error:
            return f"environment: {error}"
    return None


def write_json(path: str, payload: Any) -> None:
    """Write ``payload`` as indented JSON to ``path`` (call on one rank)."""
    with open(path, "w", encoding="utf-8") as out:
        json.dump(payload, out, indent=2, sort_keys=False, default=float)
        out.write("\n")
