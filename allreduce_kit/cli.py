"""What every ``python -m allreduce_kit.X`` command shares: rank-0 output and clean exits.

Every rank parses the same command line, so every rank reaches the same verdict; only rank 0
prints help and errors, and every rank exits with the same status (2 for a bad argument), so
nothing hangs and the message appears once.
"""
import argparse
import json
import os
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
    """Says each option's default, except where there is none to say (``None``) or the help
    says it in its own words ("(default: ...)")."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or "(default:" in (action.help or ""):
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


def plural(count: int, word: str, words: Optional[str] = None) -> str:
    """``1 rank``, ``3 ranks``: the count and the noun in agreement (``words``: an irregular plural)."""
    return f"{count:,} {word if count == 1 else (words or word + 's')}"


def output_problem(option: str, path: Optional[str], suffix: Optional[str] = None,
                   make_parents: bool = False) -> Optional[str]:
    """Why ``path`` cannot be written as ``option``'s output, found by trying now; None if it can.

    Refused: an empty path, a directory (or a path ending in a separator), a path without
    ``suffix`` (such as ``.png``) when one is required, a folder that does not exist (unless
    ``make_parents``: the writer creates it; then its nearest existing ancestor must take a new
    folder), and a place where this process cannot create or overwrite the file. The check
    creates and removes a probe file if ``path`` does not exist yet, opens it for appending (and
    writes nothing) if it does: it leaves nothing behind. The message names ``option`` and
    ``path``. Call it on the rank that will write (rank 0), before any work, so that a run never
    ends by losing its results.
    """
    if path is None:
        return None
    where = f"argument {option}"
    if not path:
        return f"{where}: expected a file path, got an empty string"
    if path.endswith(os.sep) or os.path.isdir(path):
        what = "is a directory" if os.path.isdir(path) else "ends in a separator, naming a directory"
        return f"{where}: {path} {what}; give a file path such as {os.path.join(path, 'out' + (suffix or '.json'))}"
    if suffix and not path.lower().endswith(suffix):
        return f"{where}: {path} does not end in {suffix} (the file is written as {suffix[1:].upper()} to exactly the path given)"
    folder = os.path.dirname(os.path.abspath(path))
    probe_in = folder
    if not os.path.isdir(folder):
        if os.path.lexists(folder):
            return f"{where}: cannot write {path}: {folder} is not a directory"
        if not make_parents:
            return f"{where}: directory {folder} does not exist"
        while not os.path.lexists(probe_in):
            probe_in = os.path.dirname(probe_in)
        if not os.path.isdir(probe_in):
            return f"{where}: cannot create the directory of {path}: {probe_in} is not a directory"
    try:
        if probe_in == folder and os.path.lexists(path):
            with open(path, "ab"):
                pass
        else:
            probe = os.path.join(probe_in, f".allreduce_kit-probe-{os.getpid()}")
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.close(fd)
            os.unlink(probe)
    except OSError as error:
        return f"{where}: cannot write {path}: {error.strerror or error}"
    return None


def outputs_problem(outputs) -> Optional[str]:
    """``output_problem`` over ``(option, path[, suffix])`` tuples, and no path given to two options."""
    seen = {}
    for option, path, *suffix in outputs:
        problem = output_problem(option, path, *suffix)
        if problem:
            return problem
        if path:
            same = seen.setdefault(os.path.realpath(path), option)
            if same != option:
                return f"argument {option}: {path} is also the path of {same}; give each output its own file"
    return None
