"""``allgather``: every rank's block, in rank order, on every rank (``Allgatherv`` when the
blocks' lengths are not the block rule's)."""
from threading import get_ident as _ident
from typing import Optional, Sequence

import numpy as np
from mpi4py import MPI

from ..algorithms import allgather as registry
from ..algorithms.allgather import shared_memory
from ..blocks import counts as rule_counts
from .. import online
from ..comm import library_comm
from ..progress import IN_FLIGHT
from ..trace.recorder import ACTIVE as _TRACING
from .common import (Again, algorithm_name, checking_locally, comm_shape, counts_argument, dispatch, input_array,
                     keeps, output_array, repeated, settle, stall_argument, watched)

_COMM_WORLD = MPI.COMM_WORLD
CALLER = "allgather"


def _local(block, out, counts, algorithm, comm, caller: str):
    """This rank's call checked locally (``TypeError``/``ValueError`` naming the argument, from
    ``caller``): ``block`` as a 1-D array, the blocks' lengths (``None``: to be exchanged) and
    ``out``'s 1-D view (``None`` if not given)."""
    lengths, result = None, None
    p, rank = comm_shape(comm, caller)
    mine = input_array(block, caller, "block")
    algorithm_name(algorithm, registry.ALGORITHMS, caller)
    if counts is not None:
        lengths = counts_argument(counts, p, caller)
        if lengths[rank] != mine.size:
            raise ValueError(f"{caller}: block has {mine.size} elements, but counts[{rank}] is {lengths[rank]}")
    if out is not None:
        result = input_array(out, caller, "out", writable=True)
        if lengths is None:
            lengths = rule_counts(result.size, p)
            if lengths[rank] != mine.size:
                raise ValueError(f"{caller}: block has {mine.size} elements, but rank {rank}'s block of out's "
                                 f"{result.size} over {p} ranks (allreduce_kit.shard_bounds) has "
                                 f"{lengths[rank]}; pass counts= for blocks of other lengths")
        result = output_array(out, caller, mine.dtype, sum(lengths), "the blocks together (sum of counts)")
    return mine, lengths, result


def allgather(block: np.ndarray, out: Optional[np.ndarray] = None, *, counts: Optional[Sequence[int]] = None,
              algorithm: str = "auto", comm: Optional[MPI.Intracomm] = None, check: Optional[bool] = None,
              stall_timeout: Optional[float] = None) -> np.ndarray:
    """Gather every rank's ``block`` into ``out`` on every rank, in rank order; return ``out``.

    Collective: every rank of ``comm`` (default ``COMM_WORLD``) calls it with a C-contiguous
    numpy array ``block`` of one dtype (float32, float64, int32 or int64) and the same
    ``algorithm`` (``auto`` or a name in ``allreduce_kit.algorithms.allgather.ALGORITHMS``).
    ``block`` is not modified (it may be ``out``'s own slot, then nothing is copied). Where each
    rank's block goes:

    - ``out`` given, ``counts`` not: ``out`` has the total length n on every rank and rank r's
      block is block r of the block rule (``allreduce_kit.shard_bounds(n, p)``), the inverse of
      ``reduce_scatter``; a ``block`` of another length raises ``ValueError``;
    - ``counts`` given: rank r's block has ``counts[r]`` elements (the same list on every rank;
      any lengths, 0 too); ``out``, if given, has ``sum(counts)``;
    - neither: the ranks tell each other their blocks' lengths first (one small ``Allgather``),
      and ``out`` is a new array of the total length.

    A malformed call raises ``TypeError`` or ``ValueError`` on the rank that made it, before it
    sends anything. ``check=True`` (or ``ALLREDUCE_KIT_CHECK=1``) adds one small agreement step
    so that a call that differs between ranks (dtype, block lengths, algorithm), or is malformed
    on any rank, raises the same error on every rank. Without it, blocks (``out``'s length, or
    ``counts``) or a dtype that differ between ranks still raise the same ``ValueError`` on every
    rank (``allgather: block lengths differs between ranks (...); ...``), at no cost to a
    well-formed call, with every algorithm but ``mpi`` (MPI's own: MPICH ends the job), as
    ``allreduce`` does (``algorithms/signature.py``; ``counts`` that differ with the same total
    are told apart by a hash, but for one chance in 2**27). Another algorithm, or lengths to be
    exchanged on some ranks (neither ``out`` nor ``counts``) and not on others, are undefined.
    ``stall_timeout`` as for ``allreduce``.
    """
    tracer = _TRACING[0]
    if tracer is not None and _ident() not in tracer.busy:  # tracing (allreduce_kit/trace): recorded
        return tracer.allgather(allgather, block, out, counts, algorithm, comm, check, stall_timeout)
    again = _LAST[0]
    if (again is not None and again.first() is block and again.second() is out and again.key is algorithm
            and counts is None and (comm is None or comm is _COMM_WORLD) and check is None and stall_timeout is None
            and not IN_FLIGHT[0]
            and block.shape == again.shapes[0] and out.shape == again.shapes[1] and block.dtype is again.dtype
            and out.dtype is again.dtype and block.flags.carray and out.flags.carray):
        again(block, out)
        return out
    error = None
    lengths = None
    try:
        mine, lengths, result = _local(block, out, counts, algorithm, comm, CALLER)
    except (TypeError, ValueError) as malformed:  # raised here, before anything is sent, unless checked
        if not checking_locally(check):
            raise
        error = malformed
    timeout = stall_argument(stall_timeout, CALLER)
    lib = library_comm(comm)
    rank = lib.myrank
    if error is None:
        fields = [("block dtype", mine.dtype.str), ("algorithm", algorithm),
                  ("block lengths", "exchanged" if lengths is None else tuple(lengths))]
    else:
        fields = [("block dtype", None), ("algorithm", None), ("block lengths", None)]
    what = f"{CALLER}(algorithm={algorithm!r}, {mine.size if error is None else '?'} x " \
           f"{mine.dtype if error is None else '?'} on this rank)"
    with watched(lib, what, timeout):
        settle(lib, CALLER, fields, error, check)
        if lengths is None:  # neither out nor counts: the lengths are exchanged
            exchanged = np.empty(lib.nranks, np.int64)
            lib.Allgather(np.array([mine.size], np.int64), exchanged)
            lengths = [int(n) for n in exchanged]
        if out is None:
            out = result = np.empty(sum(lengths), mine.dtype)
        bounds = [0]
        for length in lengths:
            bounds.append(bounds[-1] + length)
        slot = result[bounds[rank]:bounds[rank + 1]]
        if slot.ctypes.data != mine.ctypes.data or slot.size != mine.size:
            if np.may_share_memory(slot, mine) or np.may_share_memory(result, mine):
                raise ValueError(f"{CALLER}: block overlaps out other than as out's own block {rank}")
            slot[:] = mine
        if lib.nranks == 1 or result.size == 0:
            return out
        tuner, runs = dispatch(lib, SPEC, algorithm, result.nbytes, result, bounds)
    if (counts is None and keeps(lib, comm, check, stall_timeout) and type(block) is np.ndarray and block.ndim == 1
            and type(out) is np.ndarray and out.ndim == 1):
        copies = slot.ctypes.data != mine.ctypes.data
        run, tuning = repeated(lib, tuner, runs, result.nbytes,
                               lambda name: _kept(lib, name, result.dtype, bounds, copies))
        _LAST[0] = Again(lib, block, out, algorithm, run, what, tuning)
    return out


#: ``auto``'s online tuning (``online.py``) for allgather.
SPEC = online.Spec(CALLER, registry.ALGORITHMS, registry.CANDIDATES, table=registry.choose)


def _kept(lib, runs: str, dtype, bounds, copies: bool):
    """The call of ``runs`` with ``bounds`` that ``Again`` repeats: copy the block into ``out``
    (unless it is ``out``'s own slot), then gather."""
    fast = shared_memory.binding(lib, dtype, bounds) if runs == "shared_memory" else None
    if fast is not None:
        return fast  # the compiled entry copies the block in itself
    lo, hi = bounds[lib.myrank], bounds[lib.myrank + 1]
    algorithm = registry.ALGORITHMS[runs]

    def run(block, out):
        if copies:
            out[lo:hi] = block
        algorithm(lib, out, bounds)
    return run


#: ``[the call kept last]`` (``Again``) or ``None``.
_LAST: list = [None]
