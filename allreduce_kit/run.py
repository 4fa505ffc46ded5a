"""``python -m allreduce_kit.run script.py [args]``: run a script the way the CLIs run themselves.

Importing ``allreduce_kit`` changes nothing in the process. Two behaviours that a multi-rank job
wants are asked for instead, by the CLIs (``python -m allreduce_kit.train``, ``.bench``,
``.launch``) and by this launcher, which applies them and then runs the script as ``__main__``
(in the spirit of ``python -m mpi4py script.py``):

- **abort on error**: an uncaught exception on one rank prints its traceback and aborts the whole
  job (``MPI_Abort``), instead of leaving the other ranks waiting in a collective forever
  (``ALLREDUCE_KIT_ABORT_ON_ERROR=0`` leaves Python's default);
- **heavy yield**: when the launcher put more ranks on a node than it has cores, waiting MPICH
  (and Open MPI: ``OPEN_MPI_YIELD``) ranks poll at full speed and steal the cores computing ranks need.
  ``MPIR_CVAR_ENABLE_HEAVY_YIELD=1`` makes them yield, but MPICH reads it once, when MPI starts
  (``from mpi4py import MPI``), so it must be set before that: here, or in the environment
  (``mpirun -genv MPIR_CVAR_ENABLE_HEAVY_YIELD 1``). A value the user set is never changed
  (``ALLREDUCE_KIT_YIELD=0`` leaves it alone too). Not set for a job whose ranks span nodes:
  MPICH's heavy yield sleeps (a timer's slack, about 50 us on Linux) between polls, and a rank
  waiting for a message from another node pays it on every one (on the emulated cluster, 2
  nodes x 4 ranks on 2 cores: MPI's own 8 B ``Allreduce`` 0.9-1.2 ms with it, 0.11-0.17 ms
  without; the trainer's default run 1.4x as long with it; docs/multinode.md).

Inside a script of your own, ``allreduce_kit.install_abort_hook()`` turns on the first; the
second comes from the environment, this launcher, or ``allreduce_kit.torch.init()`` when it is
called before anything has imported ``mpi4py.MPI``.
"""
import os
import runpy
import sys
from typing import List, Mapping, MutableMapping, Optional

from . import config
from .topology import oversubscribed_from_launcher, spans_nodes_from_launcher

HEAVY_YIELD = "MPIR_CVAR_ENABLE_HEAVY_YIELD"
#: Open MPI's switch for the same (read when MPI starts): its waiting ranks call ``sched_yield``
#: between polls, which costs a message from another node nothing, so it is set for a job that
#: spans nodes too. Without it, 2 nodes x 4 ranks on 2 cores (the emulated cluster), MPI's own 8 B
#: ``Allreduce`` took 64 ms instead of 0.14 ms (one bench run each).
OPEN_MPI_YIELD = "OMPI_MCA_mpi_yield_when_idle"

#: Whether ``prepare`` set ``HEAVY_YIELD`` in this process (for the CLIs' reports).
yield_set_here = False


def yield_wanted(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The yield variable (``yield_variable``) this process should have set to 1 before MPI
    started, or None: None unless the launcher put more ranks on this node than it has cores, the
    user has not set the variable, ``ALLREDUCE_KIT_YIELD`` allows and, for MPICH's, the job runs
    on this node alone."""
    env = os.environ if environ is None else environ
    if not config.read(config.YIELD, env) or not oversubscribed_from_launcher(env):
        return None
    name = yield_variable(env)
    if name in env or (name == HEAVY_YIELD and spans_nodes_from_launcher(env)):
        return None
    return name


def enable_heavy_yield(environ: Optional[MutableMapping[str, str]] = None) -> bool:
    """Set ``MPIR_CVAR_ENABLE_HEAVY_YIELD=1`` (MPICH; only if the job runs on this node alone) or,
    under Open MPI's ``mpirun``, ``OMPI_MCA_mpi_yield_when_idle=1`` in ``environ`` (default
    ``os.environ``) where ``yield_wanted`` says so; return whether it was set here. Takes effect
    only if MPI has not started yet."""
    env = os.environ if environ is None else environ
    name = yield_wanted(env)
    if name is None:
        return False
    env[name] = "1"
    return True


def yield_variable(environ: Mapping[str, str] = os.environ) -> str:
    """The variable that makes waiting ranks yield under the MPI whose launcher started this process."""
    return OPEN_MPI_YIELD if "OMPI_COMM_WORLD_SIZE" in environ else HEAVY_YIELD


def heavy_yield_state() -> str:
    """The yield variable (``yield_variable``) as this process has it, and who set it."""
    name = yield_variable()
    value = os.environ.get(name, "unset")
    return f"{name}={value}" + (" (set by allreduce_kit: more ranks than cores)" if yield_set_here else "")


#: ``mpirun`` options (Open MPI) that turn on its fault tolerance and failure detector, for
#: ``train --elastic`` to recover in the job (docs/elastic.md). The detector runs in a thread of
#: its own, so that a rank busy outside MPI (compiling kernels, loading data) still sends its
#: heartbeats and is not declared dead.
ULFM_MPIRUN_OPTIONS = ("--with-ft", "ulfm", "--mca", "mpi_ft_detector", "true", "--mca", "mpi_ft_detector_thread",
                       "true", "--mca", "mpi_ft_detector_period", "0.5", "--mca", "mpi_ft_detector_timeout", "3")


def ulfm_launched(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether Open MPI's ``mpirun --with-ft ulfm`` started this process (its fault tolerance on:
    a dead rank becomes an error, ``faults.py``); read from the environment, before MPI starts."""
    env = os.environ if environ is None else environ
    return "OMPI_COMM_WORLD_RANK" in env and env.get("OMPI_MCA_mpi_ft_enable", "").lower() in ("1", "true", "yes", "on")


def prepare() -> None:
    """Apply abort-on-error and heavy yield as the settings ask; call before MPI starts."""
    global yield_set_here
    if "mpi4py.MPI" not in sys.modules:
        yield_set_here = enable_heavy_yield() or yield_set_here
    if config.read(config.ABORT_ON_ERROR):
        from .abort import install_abort_hook

        install_abort_hook()


USAGE = """usage: python -m allreduce_kit.run script.py [args ...]
       python -m allreduce_kit.run -m module [args ...]

Run a Python script or module under MPI with abort-on-error and MPICH's heavy yield applied
before MPI starts (see docs/settings.md)."""


def main(argv: Optional[List[str]] = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        raise SystemExit(0 if args else 2)
    if args[0] == "--version":
        from . import __version__

        print(f"allreduce_kit {__version__}")
        raise SystemExit(0)
    module = args[0] == "-m"
    if module:
        if len(args) < 2:
            sys.stderr.write("python -m allreduce_kit.run: error: -m needs a module name\n" + USAGE + "\n")
            raise SystemExit(2)
        target, rest = args[1], args[2:]
    else:
        target, rest = args[0], args[1:]
        if not os.path.isfile(target):
            sys.stderr.write(f"python -m allreduce_kit.run: error: {target}: no such file\n")
            raise SystemExit(2)
    prepare()
    sys.argv = [target, *rest]
    if module:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main()
