"""``broadcast``: the root's buffer copied into every rank's, in place."""
from threading import get_ident as _ident
from typing import Optional

import numpy as np
from mpi4py import MPI

from ..algorithms import broadcast as registry
from ..algorithms import direct as transport
from ..algorithms.broadcast import shared_memory
from ..algorithms.shared_memory import window_of
from .. import online
from ..comm import library_comm
from ..progress import IN_FLIGHT
from ..stall import INSPECTOR
from ..trace.recorder import ACTIVE as _TRACING
from .common import (Again, agree_unchecked, algorithm_name, checking_locally, comm_shape, input_array, keeps,
                     rank_argument, repeated, settle, stall_argument, watched)

_COMM_WORLD = MPI.COMM_WORLD
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
    algorithm (``auto`` too, unless the lengths fall on both sides of its split): by messages the
    ranks first agree on them in one ``Allreduce`` of a few int64
    (the data flows from the root only, so nothing the algorithm sends could tell every rank, and
    ranks that name different roots would run different schedules); ``direct`` on one node
    compares what each rank publishes beside its buffer instead, at no cost.
    ``stall_timeout`` as for ``allreduce``.
    """
    tracer = _TRACING[0]
    if tracer is not None and _ident() not in tracer.busy:  # tracing (allreduce_kit/trace): recorded
        return tracer.broadcast(broadcast, buf, root, algorithm, comm, check, stall_timeout)
    again = _LAST[0]
    if (again is not None and again.first() is buf and again.key == (algorithm, root)
            and (comm is None or comm is _COMM_WORLD) and check is None and stall_timeout is None
            and not IN_FLIGHT[0] and buf.shape == again.shapes[0] and buf.dtype is again.dtype and buf.flags.carray):
        if again.left:  # ``Again.__call__`` inline while the class is quiet: a frame is a share of a small call
            again.left -= 1
            told = again.watched
            told[0].calls += 1
            INSPECTOR.current = told
            try:
                again.run(buf, None)
            finally:
                INSPECTOR.current = None
        else:
            again(buf, None)
        return buf
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
    what = f"{CALLER}(algorithm={algorithm!r}, root={root}, {array.size if error is None else '?'} x " \
           f"{array.dtype if error is None else '?'})"
    with watched(lib, what, timeout):
        settle(lib, CALLER, fields, error, check)
        if lib.nranks == 1:
            return buf
        checked = check or (check is None and lib.check_default)
        fields = [("buf length", array.size), ("buf dtype", array.dtype.name), ("root", root),
                  ("algorithm", algorithm)]

        def runner(name: str) -> None:
            # by messages every call agrees first; the window and direct reads find differences themselves
            if not checked and not _finds_differences(lib, name):
                agree_unchecked(lib, CALLER, fields, "buf")
            if array.size:
                registry.ALGORITHMS[name](lib, array, root)

        # chosen once the ranks are known to agree: the first choice on a communicator may set up
        # its window or direct reads, collectively
        tuner = online.tuner_for(lib, SPEC) if algorithm == "auto" and array.size else None
        runs = None
        if tuner is not None:
            tuner.run(lib, tuner.class_for(array.nbytes), runner)
        else:
            runs = registry.choose(lib, array.nbytes) if algorithm == "auto" else algorithm
            runner(runs)
        if array.size and keeps(lib, comm, check, stall_timeout) and type(buf) is np.ndarray and buf.ndim == 1:
            # untuned, a call by messages is not kept (each goes the full way, agreeing first)
            agreeing = fields if tuner is not None else None
            run, tuning = repeated(lib, tuner, runs, array.nbytes,
                                   lambda name: _kept(lib, name, array.dtype, root, agreeing))
            if run is not None or tuning is not None:
                _LAST[0] = Again(lib, buf, None, (algorithm, root), run, what, tuning)
    return buf


#: ``auto``'s online tuning (``online.py``) for broadcast.
SPEC = online.Spec(CALLER, registry.ALGORITHMS, registry.CANDIDATES, table=registry.choose)


def _kept(lib, runs: str, dtype, root: int, fields: Optional[list] = None):
    """The call of ``runs`` from ``root`` that ``Again`` repeats. By messages every call agrees
    first (``fields``): ``None`` without them (the full path then)."""
    fast = shared_memory.binding(lib, dtype, root) if runs == "shared_memory" else None
    if fast is not None:
        return fast
    algorithm = registry.ALGORITHMS[runs]
    if not _finds_differences(lib, runs):
        if fields is None:
            return None

        def agreed(buf, _) -> None:
            agree_unchecked(lib, CALLER, fields, "buf")
            algorithm(lib, buf, root)
        return agreed
    return lambda buf, _: algorithm(lib, buf, root)


#: ``[the call kept last]`` (``Again``) or ``None``.
_LAST: list = [None]


def _finds_differences(lib, runs: str) -> bool:
    """Whether ``runs`` finds for itself, on ``lib``, a call whose length, dtype or root differs
    between ranks: ``direct`` reads the root's buffer straight out of its memory, and
    ``shared_memory`` goes through the node's window, each comparing what every rank publishes
    beside its buffer (``algorithms/broadcast/direct.py``, ``shared_memory.py``)."""
    if runs == "direct":
        return transport.peers_for(lib) is not None
    return runs == "shared_memory" and window_of(lib) is not None
