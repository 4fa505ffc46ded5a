"""``reduce_scatter``: every rank's buffer reduced, rank r keeping block r of the result."""
from threading import get_ident as _ident
from typing import Callable, Optional, Sequence

import numpy as np
from mpi4py import MPI

from ..algorithms import reduce_scatter as registry
from ..algorithms.reduce_scatter import shared_memory
from ..blocks import block as block_of
from .. import compression as _compression
from ..collective import op_name, validate_compression
from .. import online
from ..comm import library_comm
from ..progress import IN_FLIGHT
from ..trace.recorder import ACTIVE as _TRACING
from .common import (Again, algorithm_name, checking_locally, comm_shape, dispatch, input_array, keeps,
                     output_array, repeated, settle, stall_argument, watched)

_COMM_WORLD = MPI.COMM_WORLD
CALLER = "reduce_scatter"
#: Scratch slot for the result when ``out`` is ``buf``'s own block.
_ALIASED = 44


def _local(buf, out, op, algorithm, comm, caller: str):
    """This rank's call checked locally (``TypeError``/``ValueError`` naming the argument, from
    ``caller``): the array, the op's name, ``out`` (made if ``None``), its 1-D view, and whether it is
    ``buf``'s own block."""
    p, rank = comm_shape(comm, caller)
    array = input_array(buf, caller)
    name = op_name(op, caller)
    algorithm_name(algorithm, registry.ALGORITHMS, caller)
    lo, hi = block_of(array.size, p, rank)
    why = f"rank {rank}'s block of buf's {array.size} elements over {p} ranks (allreduce_kit.shard_bounds)"
    if out is None:
        out = np.empty(hi - lo, array.dtype)
    result = output_array(out, caller, array.dtype, hi - lo, why)
    aliased = np.may_share_memory(result, array)
    if aliased and not (result.ctypes.data == array.ctypes.data + lo * array.itemsize):
        raise ValueError(f"{caller}: out overlaps buf other than as buf's own block {rank} (elements {lo}:{hi})")
    return array, name, out, result, aliased


def reduce_scatter(buf: np.ndarray, out: Optional[np.ndarray] = None, *, op: str = "sum", algorithm: str = "auto",
                   comm: Optional[MPI.Intracomm] = None, check: Optional[bool] = None,
                   stall_timeout: Optional[float] = None, compression: str = "none") -> np.ndarray:
    """Reduce ``buf`` across the ranks of ``comm`` and leave block r of the result in ``out`` on
    rank r; return ``out``.

    Collective: every rank of ``comm`` (default ``COMM_WORLD``) calls it with a C-contiguous
    numpy array ``buf`` of the same length n and dtype (float32, float64, int32 or int64), and the
    same ``op`` (sum, mean, max, min, prod) and ``algorithm`` (``auto`` or a name in
    ``allreduce_kit.algorithms.reduce_scatter.ALGORITHMS``). Block r is
    ``buf.reshape(-1)[lo:hi]`` with ``(lo, hi) = allreduce_kit.blocks.block(n, p, r)``
    (``shard_bounds``): any n works, and some blocks are empty when n < p. ``buf`` is not
    modified. ``out`` (default: a new array) has block r's length and ``buf``'s dtype; it may be
    ``buf``'s own block r (the reduced block then replaces it), no other part of ``buf``. Every
    block is reduced by one rank: integers are exact, floats may differ from ``allreduce``'s in
    the last bits.

    A malformed call raises ``TypeError`` or ``ValueError`` on the rank that made it, before it
    sends anything. ``check=True`` (or ``ALLREDUCE_KIT_CHECK=1``) adds one small agreement step
    so that a call that differs between ranks (length, dtype, op, algorithm), or is malformed on
    any rank, raises the same error on every rank. Without it, a ``buf`` whose length or dtype
    differs between ranks still raises the same ``ValueError`` on every rank
    (``reduce_scatter: buf length differs between ranks (rank 0: 8, rank 1: 9); ...``), at no
    cost to a well-formed call, with every algorithm but ``mpi`` (MPI's own: MPICH ends the job),
    as ``allreduce`` does (``algorithms/signature.py``); another op or algorithm is undefined.
    ``stall_timeout`` as for ``allreduce``.

    ``compression="fp16"`` or ``"bf16"`` (float32 buffers; ops sum, mean, max, min; ``auto`` or an
    algorithm in ``compression.REDUCE_SCATTER``) sends 16-bit values and folds in float32, as
    ``allreduce`` does: ``out`` is made of 16-bit values (docs/compression.md).
    """
    tracer = _TRACING[0]
    if tracer is not None and _ident() not in tracer.busy:  # tracing (allreduce_kit/trace): recorded
        return tracer.reduce_scatter(reduce_scatter, buf, out, op, algorithm, comm, check, stall_timeout, compression)
    again = _LAST[0]
    if (again is not None and again.first() is buf and again.second() is out
            and again.key == (op, algorithm, compression)
            and (comm is None or comm is _COMM_WORLD) and check is None and stall_timeout is None and not IN_FLIGHT[0]
            and buf.shape == again.shapes[0] and out.shape == again.shapes[1] and buf.dtype is again.dtype
            and out.dtype is again.dtype and buf.flags.carray and out.flags.carray):
        again(buf, out)
        return out
    error = None
    given = out
    try:
        array, name, out, result, aliased = _local(buf, out, op, algorithm, comm, CALLER)
        validate_compression(array, name, algorithm, compression, CALLER, _compression.REDUCE_SCATTER)
    except (TypeError, ValueError) as malformed:  # raised here, before anything is sent, unless checked
        if not checking_locally(check):
            raise
        error = malformed
    timeout = stall_argument(stall_timeout, CALLER)
    lib = library_comm(comm)
    if error is None:
        fields = [("buf length", array.size), ("buf dtype", array.dtype.str), ("op", name), ("algorithm", algorithm),
                  ("compression", compression)]
    else:
        fields = [("buf length", None), ("buf dtype", None), ("op", None), ("algorithm", None), ("compression", None)]
    what = f"{CALLER}(algorithm={algorithm!r}, {array.size if error is None else '?'} x " \
           f"{array.dtype if error is None else '?'}{'' if compression == 'none' else f', compression={compression!r}'})"
    with watched(lib, what, timeout):
        settle(lib, CALLER, fields, error, check)
        wire = None if compression == "none" else _compression.WIRES[compression]
        if lib.nranks == 1:
            if not aliased:
                result[:] = array
            if wire is not None:
                wire.round(result)
            return out
        if array.size == 0:
            return out
        target = lib.scratch(result.size, result.dtype, _ALIASED) if aliased else result
        reduction = lib.reductions[name]
        if wire is not None:
            runs = _compression.choose(lib, array.nbytes) if algorithm == "auto" else algorithm
            _compression.REDUCE_SCATTER[runs](lib, array, target, reduction, wire)
            if aliased:
                result[:] = target
            return out
        # chosen once the ranks are known to agree: the first choice on a communicator may set up
        # its window or direct reads, collectively
        tuner, runs = dispatch(lib, SPEC, algorithm, array.nbytes, array, target, reduction)
        if aliased:
            result[:] = target
        elif (given is not None and keeps(lib, comm, check, stall_timeout) and type(buf) is np.ndarray
              and buf.ndim == 1 and type(out) is np.ndarray and out.ndim == 1):
            run, tuning = repeated(lib, tuner, runs, array.nbytes, lambda name: _kept(lib, name, array, reduction))
            _LAST[0] = Again(lib, buf, out, (op, algorithm, compression), run, what, tuning)
    return out


#: ``auto``'s online tuning (``online.py``) for reduce-scatter.
SPEC = online.Spec(CALLER, registry.ALGORITHMS, registry.CANDIDATES, table=registry.choose)


def _kept(lib, runs: str, buf: np.ndarray, reduction):
    """The call of ``runs`` on a buffer like ``buf`` with ``reduction`` that ``Again`` repeats."""
    fast = shared_memory.binding(lib, buf.dtype, buf.size, reduction) if runs == "shared_memory" else None
    if fast is not None:
        return fast
    algorithm = registry.ALGORITHMS[runs]
    return lambda buf, out: algorithm(lib, buf, out, reduction)


#: ``[the call kept last]`` (``Again``) or ``None``.
_LAST: list = [None]


def reduce_scatter_parts(parts: Sequence[np.ndarray], out: np.ndarray, buffer: Callable[[int], np.ndarray], *,
                         op: str = "sum", comm: Optional[MPI.Intracomm] = None) -> np.ndarray:
    """``reduce_scatter`` of ``parts`` laid end to end, into ``out``, for a caller that keeps its
    data in several arrays (a model's gradients): where ``auto``'s table runs ``pairwise`` with
    direct reads (one node, 64 KiB and more), ``pairwise`` reads every rank's parts where they
    are and nothing is copied into one buffer first, bitwise what it gives on the parts laid end
    to end; elsewhere the parts are copied into ``buffer(n)`` (an array of n elements) and
    ``reduce_scatter`` runs as usual.

    For callers that have made sure of the call on every rank (the parts' lengths and dtype, the
    op): ``parts`` are 1-D C-contiguous arrays of one dtype, ``out`` this rank's block
    (``shard_bounds``) of their total length. Collective."""
    lib = library_comm(comm)
    n = sum(part.size for part in parts)
    what = f"{CALLER}({len(parts)} parts, {n} x {out.dtype})"
    with watched(lib, what, None):
        if (lib.nranks > 1 and n and lib.layout.single_node
                and registry.choose(lib, n * out.itemsize) == "pairwise"
                and registry.pairwise.parts(lib, parts, out, lib.reductions[op])):
            return out
    flat, at = buffer(n), 0
    for part in parts:
        np.copyto(flat[at:at + part.size], part)
        at += part.size
    return reduce_scatter(flat, out, op=op, comm=comm, check=False)
