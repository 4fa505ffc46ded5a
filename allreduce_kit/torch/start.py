"""``init``: start ``allreduce_kit.torch``, first setting what MPI reads when it starts, if it has not.

Importing ``allreduce_kit.torch`` does not start MPI: ``mpi4py.MPI`` is imported on the first
use of a name that needs it (``__init__.py``). So ``init()``, called first as a Horovod script
calls it, comes before MPI starts, and sets what MPI reads only then, as
``python -m allreduce_kit.run`` does (``run.enable_heavy_yield``): where the launcher put more
ranks on this node than it has cores, the variable that makes ranks waiting in MPI give their
core to the ranks that compute (MPICH's ``MPIR_CVAR_ENABLE_HEAVY_YIELD=1`` where the job runs on
this node alone, Open MPI's ``OMPI_MCA_mpi_yield_when_idle=1``). A value the user set is left
alone, and with ``ALLREDUCE_KIT_YIELD=0`` nothing is set. A job with a core for every rank is
left alone too: nothing in the process changes.

If something imported ``mpi4py.MPI`` before ``init()`` (the script itself, another library, or
a name of this package used before ``init``), MPI has read its settings already and nothing set
now reaches it: ``init`` then warns (``RuntimeWarning``, once, on the lowest rank of each node
where the variable was wanted), naming the variable and the ways to get it.
"""
import sys
import warnings
from typing import TYPE_CHECKING, Optional

from .. import run

if TYPE_CHECKING:
    from mpi4py import MPI

#: Whether ``init`` has warned in this process (once is enough: an ``init`` after ``shutdown``
#: finds MPI started, by the first ``init``).
_warned = False


def init(comm: Optional["MPI.Intracomm"] = None) -> None:
    """Start: every later call works over the ranks of ``comm`` (default ``COMM_WORLD``).

    Collective over ``comm``. Calling it again is a no-op; to change communicator, call
    ``shutdown()`` first. Called before MPI has started, it first sets MPI's yield variable where
    the launcher put more ranks on a node than it has cores (module docstring); MPI started
    earlier, it warns instead where that variable was wanted. Where the node's ranks would ask
    torch for more threads than the node has cores, lowers torch's threads to this rank's share.
    """
    started = "mpi4py.MPI" in sys.modules
    if not started:
        run.yield_set_here = run.enable_heavy_yield() or run.yield_set_here
    from . import mpi_ops

    first = not mpi_ops.is_initialized()
    mpi_ops.init(comm)
    global _warned
    if started and first and not _warned:
        missing = run.yield_wanted()
        if missing is not None and mpi_ops.local_rank() == 0:
            _warned = True
            warnings.warn(unset_yield_message(missing), RuntimeWarning, stacklevel=2)


def unset_yield_message(name: str) -> str:
    """What ``init`` says when MPI started before it, without ``name`` set where it was wanted."""
    how = ("mpirun --mca mpi_yield_when_idle 1 ..." if name == run.OPEN_MPI_YIELD
           else f"mpirun -genv {name} 1 ...")
    return (f"allreduce_kit.torch.init: MPI started before init() (mpi4py.MPI was imported first), so {name}=1 "
            f"could not be set: this node has more ranks than cores, and ranks waiting in MPI poll at full speed on "
            f"cores that ranks computing need. Call hvd.init() before anything imports mpi4py.MPI, launch with "
            f"python -m allreduce_kit.run script.py, or set it in the launcher ({how}); "
            f"ALLREDUCE_KIT_YIELD=0 silences this")


def is_initialized() -> bool:
    """Whether ``init`` has been called (and ``shutdown`` not since); never starts MPI."""
    mpi_ops = sys.modules.get(f"{__package__}.mpi_ops")
    return mpi_ops is not None and mpi_ops.is_initialized()
