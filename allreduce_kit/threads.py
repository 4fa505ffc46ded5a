"""Give each rank its share of the node's cores, so p ranks do not start p x cores threads."""
from typing import Optional

from mpi4py import MPI

from .comm import library_comm


def limit_threads(comm: Optional[MPI.Intracomm] = None) -> int:
    """Limit numba's and the BLAS/OpenMP pools to this rank's share of its node's cores
    (``Topology.threads``; collective the first time ``comm`` is used); return the share."""
    import numba

    share = library_comm(comm).threads
    numba.set_num_threads(max(1, min(share, numba.config.NUMBA_NUM_THREADS)))
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        pass
    else:
        threadpool_limits(share)
    return share
