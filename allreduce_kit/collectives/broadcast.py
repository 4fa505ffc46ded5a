"""``broadcast``: the root's buffer copied into every rank's, in place."""
from typing import Optional

import numpy as np
from mpi4py import MPI

from ..algorithms import broadcast as registry
from ..algorithms import direct as transport
from ..comm import library_comm
from .common import (agree_unchecked, algorithm_name, checking_locally, comm_shape, input_array,
                     rank_argument, settle, stall_argument, watched)

CALLER = "broadcast"


def _local(buf, root, algorithm, comm, caller: str):
    """This rank's call checked locally (``TypeError``/``ValueError`` naming the argument, from
    ``caller``): ``buf`` as a 1-D array and ``root`` as an int."""
    p, rank = comm_shape(comm, caller)
    root = rank_argument(root, p, caller, "root")
    array = input_array(buf, caller, writable=rank != root)
    algorithm_name(algorithm, registry.ALGORITHMS, caller)
    return array, root


def broadcast(buf: np.ndarray, root: int = 0, *, algorithm: str = "auto", comm: Optional[MPI.Intracomm] = None,
              check: Optional[bool] = None, stall_timeout: Optional[float] = None) -> np.ndarray:
    """Copy rank ``root``'s ``buf`` into ``buf`` on every other rank of ``comm``; return ``buf``.

    Collective: every rank of ``comm`` (default ``COMM_WORLD``) calls it with a C-contiguous
    numpy array of the same length and dtype (float32, float64, int32 or int64), the same
    ``root`` and the same ``algorithm`` (``auto`` or a name in
    ``allreduce_kit.algorithms.broadcast.ALGORITHMS``). The root's ``buf`` is only read (it may be
    read-only); every other rank's must be writable.

    A malformed call raises ``TypeError`` or ``ValueError`` on the rank that made it, before it
    sends anything. ``check=True`` (or ``ALLREDUCE_KIT_CHECK=1``) adds one small agreement step
    so that a call that differs between ranks (length, dtype, root, algorithm), or is malformed on
    any rank, raises the same error on every rank. Without it, a length, dtype or root that
    differs between ranks still raises the same ``ValueError`` on every rank
    (``broadcast: root differs between ranks (rank 0: 0, rank 1: 1); ...``), with every
    algorithm (``auto`` too, unless the lengths fall on both sides of its split): by messages the ranks first agree on them in one ``Allreduce`` of a few int64
    (the data flows from the root only, so nothing the algorithm sends could tell every rank, and
    ranks that name different roots would run different schedules); ``direct`` on one node
    compares what each rank publishes beside its buffer instead, at no cost.
    ``stall_timeout`` as for ``allreduce``.
    """
    error = None
    try:
        array, root = _local(buf, root, algorithm, comm, CALLER)
    except (TypeError, ValueError) as malformed:  # raised here, before anything is sent, unless checked
        if not checking_locally(check):
            raise
        error = malformed
    timeout = stall_argument(stall_timeout, CALLER)
    lib = library_comm(comm)
    if error is None:
        fields = [("buf length", array.size), ("buf dtype", array.dtype.str), ("root", root),
                  ("algorithm", algorithm)]
    else:
        fields = [("buf length", None), ("buf dtype", None), ("root", None), ("algorithm", None)]
    runs = algorithm
    if error is None and algorithm == "auto":
        runs = registry.choose(lib, array.nbytes)
    what = f"{CALLER}(algorithm={runs!r}, root={root}, {array.size if error is None else '?'} x " \
           f"{array.dtype if error is None else '?'})"
    with watched(lib, what, timeout):
        settle(lib, CALLER, fields, error, check)
        if lib.nranks == 1:
            return buf
        if not (check or (check is None and lib.check_default)) and not _direct(lib, runs):
            agree_unchecked(lib, CALLER, [("buf length", array.size), ("buf dtype", array.dtype.name),
                                          ("root", root), ("algorithm", algorithm)], "buf")
        if array.size:
            registry.ALGORITHMS[runs](lib, array, root)
    return buf


def _direct(lib, runs: str) -> bool:
    """Whether ``runs`` reads the root's buffer straight out of its memory on ``lib``, and so
    finds for itself a call that differs between ranks (``algorithms/broadcast/direct.py``)."""
    return runs == "direct" and transport.peers_for(lib) is not None
