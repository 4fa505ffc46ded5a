"""``init``, the rank queries and the collectives on CPU tensors, with Horovod's names and contracts.

Every collective here runs on one communicator of its own (a ``Dup`` of the one given to
``init``, and the library's clone of that), so its messages never meet the caller's or those of
``allreduce_kit.allreduce`` on the same ranks. A call on the main thread first waits for the
gradient reductions a ``DistributedOptimizer`` handed to the background thread (``worker.py``):
calls reach the communicator in program order, one at a time.

Reductions: float32, float64, int32 and int64 tensors are reduced in place by the library's
``allreduce`` on a numpy array over the tensor's memory (no copy); float16 and bfloat16 are
sent as 2 bytes and summed in float32 by the rank that owns each segment (``reduce_half``);
uint8, int8 and int16 are reduced as int32 and cast back.
"""
import atexit
import math
import threading
import zlib
from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch
from mpi4py import MPI

from ..collective import allreduce as allreduce_array
from ..collective import op_name
from ..comm import LibraryComm, library_comm
from ..reduction import OPS
from ..stall import INSPECTOR
from ..topology import Topology, user_threads
from . import joining, tensors
from .compression import Compression, check_compression
from .ops import Adasum, Average, Max, Min, Product, Sum
from .scaling import scale_
from .tensors import as_bytes, as_numpy, check_tensor
from .worker import Worker, available

_HOROVOD_NAMES = {"average": "mean", "product": "prod"}


class _State:
    """What ``init`` sets up: the communicator, its ranks and where they sit, the worker."""

    def __init__(self, comm: MPI.Intracomm):
        self.comm = comm
        #: collectives of this module run on ``dup`` (the library's clone of it, ``lib``)
        self.dup = comm.Dup()
        self.lib: LibraryComm = library_comm(self.dup)
        self.rank, self.size = self.lib.myrank, self.lib.nranks
        self.layout = self.lib.layout
        self.threaded = available()
        self._worker: Optional[Worker] = None
        self._on_shutdown: List[Callable[[], None]] = []

    def on_shutdown(self, release: Callable[[], None]) -> None:
        """Call ``release()`` (collective, in the order registered) when ``shutdown()`` frees the communicators."""
        self._on_shutdown.append(release)

    def worker(self) -> Optional[Worker]:
        """The background thread (started on first use), or None where MPI does not allow one."""
        if self._worker is None and self.threaded and self.size > 1:
            self._worker = Worker()
        return self._worker

    def drain(self) -> None:
        """Wait for every reduction handed to the worker (re-raises one that failed)."""
        if self._worker is not None:
            self._worker.drain()

    def stop(self) -> None:
        if self._worker is not None:
            self._worker.stop()
            self._worker = None


_state: Optional[_State] = None
_exit_registered = False


#: A process set's state in place of the global one, on the thread that runs a call on the set
#: (``process_sets.running_on``).
_on_set = threading.local()


def state() -> _State:
    """The state ``init`` made (or, inside a call on a process set, the set's); ``ValueError`` before ``init``."""
    override = getattr(_on_set, "state", None)
    if override is not None:
        return override
    if _state is None:
        raise ValueError("allreduce_kit.torch has not been initialized; call init() first "
                         "(hvd.init() after import allreduce_kit.torch as hvd)")
    return _state


def init(comm: Optional[MPI.Intracomm] = None) -> None:
    """Start: every later call works over the ranks of ``comm`` (default ``COMM_WORLD``).

    Collective over ``comm``. Calling it again is a no-op; to change communicator, call
    ``shutdown()`` first. Where the node's ranks would ask torch for more threads than the node
    has cores, lowers torch's threads to this rank's share (``share_cores``).
    """
    global _state, _exit_registered
    if comm is not None:
        if not isinstance(comm, MPI.Comm):
            raise TypeError(f"init: comm must be an mpi4py intracommunicator, got {type(comm).__name__} "
                            f"(lists of ranks and process sets are not supported)")
        if comm == MPI.COMM_NULL:
            raise ValueError("init: comm is MPI.COMM_NULL")
        if comm.Is_inter():
            raise TypeError("init: comm must be an intracommunicator, got an intercommunicator")
    if _state is not None:
        if comm is None or MPI.Comm.Compare(comm, _state.comm) in (MPI.IDENT, MPI.CONGRUENT):
            return
        raise ValueError("init: already initialized over another communicator; call shutdown() first")
    _state = _State(MPI.COMM_WORLD if comm is None else comm)
    share_cores(_state.layout)
    if not _exit_registered:
        atexit.register(_stop_worker)  # before mpi4py finalizes MPI: it registered first
        _exit_registered = True


def share_cores(layout: Topology) -> int:
    """Lower torch's intra-op threads to this rank's share of its node's cores (``layout.threads()``:
    cores // ranks on the node, at least one, and no more than its share of its machine's) where
    it would otherwise ask for more; never raise them. ``OMP_NUM_THREADS`` or
    ``NUMBA_NUM_THREADS``, if set, is the user's choice and left alone. Returns the threads."""
    threads = torch.get_num_threads()
    if user_threads() is None and threads > layout.threads():
        threads = layout.threads()
        torch.set_num_threads(threads)
    return threads


def shutdown() -> None:
    """Finish the reductions in flight, stop the worker and free the communicators (collective)."""
    global _state
    if _state is None:
        return
    done, _state = _state, None
    done.stop()
    if not MPI.Is_finalized():
        for release in done._on_shutdown:
            release()
        done.dup.Free()  # frees the library's clone of it too


def _stop_worker() -> None:
    if _state is not None:
        _state.stop()


def is_initialized() -> bool:
    return _state is not None


def rank() -> int:
    """This process's rank."""
    return state().rank


def size() -> int:
    """The number of ranks."""
    return state().size


def local_rank() -> int:
    """This process's rank among the ranks on its node."""
    return state().layout.local_rank


def local_size() -> int:
    """The number of ranks on this process's node."""
    return state().layout.local_size


def cross_rank() -> int:
    """This process's node, numbered 0, 1, ... in the order of the nodes' lowest ranks."""
    return state().layout.node


def cross_size() -> int:
    """The number of nodes."""
    return state().layout.nodes


def is_homogeneous() -> bool:
    """Whether every node has the same number of ranks."""
    return len(set(state().layout.ranks_per_node)) == 1


def mpi_threads_supported() -> bool:
    """Whether MPI gave ``MPI_THREAD_MULTIPLE`` (gradients are then reduced on a background thread)."""
    state()
    return available()


def mpi_built() -> bool:
    return True


def mpi_enabled() -> bool:
    return True


def gloo_built() -> bool:
    return False


def gloo_enabled() -> bool:
    return False


def nccl_built() -> bool:
    return False


def cuda_built() -> bool:
    return False


def rocm_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def ddl_built() -> bool:
    return False


# -- arguments --------------------------------------------------------------------------------

def reduce_op(op: Any, average: Optional[bool], caller: str) -> str:
    """The library's name for ``op`` (``Average``, ``Sum``, ... or ``MPI.SUM``, ...); ``average``
    is Horovod's older spelling (True: ``Average``, False: ``Sum``)."""
    if average is not None:
        if op is not None:
            raise ValueError(f"{caller}: give op or average, not both")
        if not isinstance(average, bool):
            raise TypeError(f"{caller}: average must be True or False, got {type(average).__name__}")
        return Average if average else Sum
    if op is None:
        return Average
    if isinstance(op, str):
        lowered = _HOROVOD_NAMES.get(op.lower(), op.lower())
        if lowered == Adasum:
            raise ValueError(f"{caller}: op Adasum is not supported; use Average or Sum")
        if lowered not in OPS:
            raise ValueError(f"{caller}: unknown op {op!r}; choose Average, Sum, Min, Max or Product")
        return lowered
    return op_name(op, caller)


def factor(value: Any, caller: str, arg: str) -> float:
    """A finite number (a scale factor), else ``TypeError``/``ValueError`` naming ``arg``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{caller}: {arg} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{caller}: {arg} must be finite, got {value}")
    return float(value)


def root(root_rank: Any, caller: str) -> int:
    """``root_rank`` if it is a rank, else ``TypeError``/``ValueError``."""
    if isinstance(root_rank, bool) or not isinstance(root_rank, (int, np.integer)):
        raise TypeError(f"{caller}: root_rank must be an int, got {type(root_rank).__name__}")
    count = state().size
    if not 0 <= root_rank < count:
        raise ValueError(f"{caller}: root_rank {root_rank} is not a rank (size {count})")
    return int(root_rank)


def checking(check: Optional[bool], caller: str) -> bool:
    """Whether a call compares itself across ranks: ``check``, else ``ALLREDUCE_KIT_CHECK``."""
    if check is None:
        return state().lib.check_default
    if not isinstance(check, bool):
        raise TypeError(f"{caller}: check must be True, False or None, got {type(check).__name__}")
    return check


# -- agreement across ranks ---------------------------------------------------------------------

def _difference(values: Sequence[Any]) -> str:
    """Where per-rank values differ, briefly: each rank's value, or for long lists of equal
    length, their first differing item."""
    if any(len(repr(v)) > 80 for v in values) and all(isinstance(v, (list, tuple)) for v in values):
        lengths = {len(v) for v in values}
        if len(lengths) > 1:
            return ", ".join(f"rank {r}: {len(v)} items" for r, v in enumerate(values))
        for i in range(len(values[0])):
            items = [v[i] for v in values]
            if any(x != items[0] for x in items):
                return f"item {i}: " + ", ".join(f"rank {r}: {x!r}" for r, x in enumerate(items))
    return ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))


def agree(caller: str, mine: Any, zeros: Optional["joining.Zeros"] = None) -> None:
    """Raise on every rank unless every rank's ``mine`` (a dict of fields) is the same.

    ``mine`` may be the exception this rank's call raised: then every rank raises, this one
    its own error, the others naming the rank. Collective: one pickled ``allgather`` of a few
    small values. Ranks in ``join()`` take part in it (``joining``): the call then goes on only
    if it says what they contribute (``zeros``, the same on every rank still in it), and raises
    ``CollectiveError`` on every rank that made it otherwise.
    """
    lib = state().lib
    failed = isinstance(mine, BaseException)
    entry = ("error", type(mine).__name__, str(mine)) if failed else ("ok", mine, zeros)
    with INSPECTOR.watching(lib.watch, f"{caller}: comparing the call across ranks"):
        entries = lib.allgather(entry)
    joined = joining.joined_ranks(entries)
    live = [e for e in entries if not isinstance(e, joining.Joined)]
    if failed:
        raise mine
    elsewhere = [r for r, e in enumerate(entries) if r not in joined and not (
        isinstance(e, tuple) and len(e) == 3 and e[0] in ("ok", "error"))]
    if elsewhere:
        raise ValueError(f"{caller}: rank {elsewhere[0]} is in another call (every rank must make the same "
                         f"calls in the same order)")
    errors = [(r, e) for r, e in enumerate(entries) if r not in joined and e[0] == "error"]
    if errors:
        r, (_, kind, message) = errors[0]
        raise (TypeError if kind == "TypeError" else ValueError)(f"{caller}: rank {r} failed: {message}")
    for field in mine:
        values = [e[1].get(field) for e in live]
        if any(v != values[0] for v in values):
            ranks = [r for r in range(len(entries)) if r not in joined]
            shown = _difference(values) if not joined else ", ".join(f"rank {r}: {v!r}" for r, v in zip(ranks, values))
            raise ValueError(f"{caller}: {field} differs between ranks ({shown})")
    if joined and joining.contribution(entries) is None:
        joining.refuse(caller, entries)


def agree_cheaply(lib: LibraryComm, caller: str, mine: dict) -> None:
    """Raise the same ``ValueError`` on every rank unless every rank's ``mine`` (a dict of a few
    fields: ints, or anything with a ``repr``) is the same. For calls that cannot find a
    difference on their own without ``check`` (``reduce_half``, ``broadcast``).

    Collective, in the caller's watched call. One ``Allreduce`` (MAX) of two int64 per field on
    ``lib``: each field as an int (a checksum of its ``repr`` where it is not one) and its
    negation, whose maxima agree only where every rank's field does. Only when something
    differs does a pickled ``allgather`` collect the values to name them.
    """
    codes = [v if type(v) is int else zlib.crc32(repr(v).encode()) for v in mine.values()]
    signature = np.array(codes + [-c for c in codes], np.int64)
    lib.Allreduce(MPI.IN_PLACE, signature, op=MPI.MAX)
    if np.array_equal(signature[:len(codes)], -signature[len(codes):]):
        return
    entries = lib.allgather(mine)
    found = []
    for field in mine:
        values = [e[field] for e in entries]
        if any(v != values[0] for v in values):
            found.append(f"{field} differs between ranks ({_difference(values)})")
    raise ValueError(f"{caller}: {'; '.join(found) or 'the ranks passed different calls'}")


def begin(caller: str, check: Optional[bool], validate: Callable[[], Any], describe: Callable[[Any], dict],
          zeros: Optional[Callable[[Any], Optional["joining.Zeros"]]] = None) -> Any:
    """Validate a call (``validate()``, which raises ``TypeError``/``ValueError``), wait for the
    worker, and with ``check`` compare ``describe(validated)`` across ranks; return ``validate()``'s
    value. Without ``check`` a malformed call raises before anything is sent. ``zeros(validated)``:
    what a rank in ``join()`` contributes to the call (``agree``); without it the call raises
    while a rank has joined."""
    checked = checking(check, caller)
    s = state()
    try:
        value, error = validate(), None
    except (TypeError, ValueError) as malformed:
        if not checked or s.size == 1:
            raise
        value, error = None, malformed
    s.drain()
    if checked and s.size > 1:
        agree(caller, error if error is not None else describe(value),
              zeros(value) if zeros is not None and error is None else None)
    return value


# -- reductions ---------------------------------------------------------------------------------

def reduce_half(lib: LibraryComm, tensor: torch.Tensor, op: str, what: str, agreed: bool = False) -> None:
    """Reduce a contiguous float16 or bfloat16 tensor in place over ``lib``'s ranks.

    A reduce-scatter then an allgather, both of 2-byte words: rank r receives every rank's
    r-th segment (``Alltoallv``), reduces it in float32 in rank order and rounds it once to the
    tensor's dtype, then every rank receives every reduced segment (``Allgatherv``). Each
    segment is reduced by one rank only, so every rank ends with bitwise the same result.

    The segments are counted from the length, so the ranks first agree on length, dtype and op
    (``agree_cheaply``: one ``Allreduce`` of six int64): where they differ, every rank raises
    the same ``ValueError``, as the other dtypes' reductions do, and ``tensor`` is untouched.
    ``agreed``: the caller knows every rank passes the same length, dtype and op (a
    ``DistributedOptimizer``'s bucket, whose parameters were compared when it was made), and
    the step is left out.
    """
    p, n = lib.nranks, tensor.numel()
    if p == 1:
        return
    dtype = str(tensor.dtype).replace("torch.", "")
    with INSPECTOR.watching(lib.watch, f"{what} ({n} x {dtype})"):
        if not agreed:
            agree_cheaply(lib, what, {"buf length": n, "buf dtype": dtype, "op": op})
        if n == 0:
            return
        words = tensor.view(-1).view(torch.int16).numpy()
        counts = np.array([n // p + (r < n % p) for r in range(p)], dtype=np.int64)
        displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        mine = int(counts[lib.myrank])
        parts = np.empty(p * mine, np.int16)
        lib.Alltoallv([words, (counts, displs)], [parts, ([mine] * p, [mine * r for r in range(p)])])
        rows = torch.from_numpy(parts).view(tensor.dtype).view(p, mine).float()
        if op in (Sum, Average):
            segment = rows.sum(0)
            if op == Average:
                segment /= p
        elif op == Max:
            segment = rows.amax(0)
        elif op == Min:
            segment = rows.amin(0)
        else:
            segment = rows.prod(0)
        lib.Allgatherv(segment.to(tensor.dtype).view(torch.int16).numpy(), [words, (counts, displs)])


def reduce_(tensor: torch.Tensor, op: str, what: str = "allreduce", agreed: bool = False) -> None:
    """Reduce a contiguous CPU tensor of a dtype in ``tensors.REDUCIBLE`` in place (no checks;
    the caller runs on the worker, or on the main thread after ``drain``). ``agreed``: see
    ``reduce_half``."""
    s = state()
    if s.size == 1:
        return
    if tensor.dtype in tensors.NATIVE:
        allreduce_array(as_numpy(tensor), op=op, comm=s.dup, check=False)
    elif tensor.dtype in tensors.HALF:
        reduce_half(s.lib, tensor, op, what, agreed)
    else:
        wide = tensor.to(torch.int32)
        allreduce_array(wide.numpy(), op=op, comm=s.dup, check=False)
        tensor.copy_(wide)


class _Reduce(NamedTuple):
    """One allreduce call's arguments, checked."""

    op: str
    compression: Any
    prescale: float
    postscale: float
    name: Optional[str]


def _reduce_call(caller: str, tensor, average, op, compression, prescale_factor, postscale_factor,
                 name) -> _Reduce:
    check_tensor(tensor, caller, dtypes=tensors.REDUCIBLE)
    call = _Reduce(reduce_op(op, average, caller), check_compression(compression, caller),
                   factor(prescale_factor, caller, "prescale_factor"), factor(postscale_factor, caller, "postscale_factor"),
                   name)
    if name is not None and not isinstance(name, str):
        raise TypeError(f"{caller}: name must be a str, got {type(name).__name__}")
    return call


def _describe(caller: str, tensor: torch.Tensor, call: _Reduce) -> dict:
    shape, dtype = tensors.signature(tensor)
    return {"shape": shape, "dtype": dtype, "op": call.op, "prescale_factor": call.prescale,
            "postscale_factor": call.postscale}


def _what(caller: str, name: Optional[str]) -> str:
    return f"{caller}({name!r})" if name else caller


def _zeros(caller: str, tensor: torch.Tensor, call: _Reduce) -> Optional["joining.Zeros"]:
    """What a rank in ``join()`` contributes to this reduction: zeros of the compressed tensor's
    shape and dtype (``_reduced_copy``)."""
    dtype = call.compression.compress(torch.empty(0, dtype=tensor.dtype))[0].dtype
    return joining.zeros_for(tuple(tensor.shape), dtype, call.op, _what(caller, call.name))


def _reduced_copy(tensor: torch.Tensor, call: _Reduce, caller: str) -> torch.Tensor:
    """A new tensor: ``tensor`` compressed, scaled, reduced, scaled and decompressed."""
    compressed, ctx = call.compression.compress(tensor.detach())
    check_tensor(compressed, caller, "the compressed tensor", dtypes=tensors.REDUCIBLE, contiguous=False)
    out = tensors.empty(compressed.shape, compressed.dtype).copy_(compressed)
    scale_(out, call.prescale)
    state().drain()
    reduce_(out, call.op, _what(caller, call.name))
    scale_(out, call.postscale)
    return call.compression.decompress(out, ctx)


class _AllreduceFunction(torch.autograd.Function):
    """``allreduce`` with a gradient: the same reduction of the output's gradient (Sum, Average)."""

    @staticmethod
    def forward(ctx, tensor, call):
        ctx.call = call
        return _reduced_copy(tensor, call, "allreduce")

    @staticmethod
    def backward(ctx, grad):
        call = ctx.call
        if call.op not in (Sum, Average):
            raise RuntimeError(f"allreduce: no gradient is defined for op {call.op!r}; only Sum and Average")
        return _reduced_copy(grad.contiguous(), call, "allreduce (gradient)"), None


def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression=Compression.none, op=None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, *, check: Optional[bool] = None) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks into a new tensor; ``tensor`` itself is not modified.

    Collective: every rank passes a contiguous CPU tensor of the same shape and dtype (float32,
    float64, int32, int64, float16, bfloat16, uint8, int8, int16) and the same ``op``
    (``Average`` by default, ``Sum``, ``Min``, ``Max``, ``Product``). Every rank gets bitwise
    the same result. ``prescale_factor`` multiplies each rank's tensor before the reduction,
    ``postscale_factor`` the result (an integer tensor is scaled in float64 and cast back, as Horovod
    does: ``scaling.py``). Differentiable for Sum and Average. ``check=True`` (or
    ``ALLREDUCE_KIT_CHECK=1``) compares shape, dtype and op across ranks first, so that a
    difference raises ``ValueError`` on every rank.
    """
    call = begin("allreduce", check,
                 lambda: _reduce_call("allreduce", tensor, average, op, compression, prescale_factor, postscale_factor,
                                      name),
                 lambda c: _describe("allreduce", tensor, c), lambda c: _zeros("allreduce", tensor, c))
    if tensor.requires_grad and torch.is_grad_enabled():
        return _AllreduceFunction.apply(tensor, call)
    return _reduced_copy(tensor, call, "allreduce")


def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None, op=None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0, *,
               check: Optional[bool] = None) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks in place and return it (``allreduce``'s contract; not
    differentiable). Its memory is handed to the library as it is: nothing is copied."""
    call = begin("allreduce_", check,
                 lambda: _reduce_call("allreduce_", tensor, average, op, Compression.none, prescale_factor,
                                      postscale_factor, name),
                 lambda c: _describe("allreduce_", tensor, c), lambda c: _zeros("allreduce_", tensor, c))
    data = tensor.detach()
    scale_(data, call.prescale)
    reduce_(data, call.op, _what("allreduce_", name))
    scale_(data, call.postscale)
    return tensor


# -- allgather ------------------------------------------------------------------------------------

def _gathered(tensor: torch.Tensor, caller: str, name: Optional[str], check: bool) -> Tuple[torch.Tensor, List[int]]:
    """Every rank's ``tensor`` concatenated along dimension 0, and each rank's number of rows
    (the shapes are exchanged first)."""
    s = state()
    error = None
    try:
        check_tensor(tensor, caller)
        if tensor.dim() == 0:
            raise ValueError(f"{caller}: tensor must have at least one dimension (it is concatenated along the first)")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"{caller}: name must be a str, got {type(name).__name__}")
    except (TypeError, ValueError) as malformed:
        if not check or s.size == 1:
            raise
        error = malformed
    s.drain()
    lib = s.lib
    entry = ("error", type(error).__name__, str(error)) if error else \
        ("ok", int(tensor.shape[0]), tuple(tensor.shape[1:]), str(tensor.dtype).replace("torch.", ""))
    with INSPECTOR.watching(lib.watch, f"{_what(caller, name)}: exchanging shapes"):
        entries = lib.allgather(entry)
    if error is not None:
        raise error
    joining.refuse(caller, entries)
    errors = [(r, e) for r, e in enumerate(entries) if e[0] == "error"]
    if errors:
        r, (_, kind, message) = errors[0]
        raise (TypeError if kind == "TypeError" else ValueError)(f"{caller}: rank {r} failed: {message}")
    for index, field in ((2, "shape after the first dimension"), (3, "dtype")):
        values = [e[index] for e in entries]
        if any(v != values[0] for v in values):
            raise ValueError(f"{caller}: {field} differs between ranks ({_difference(values)})")
    rows = [e[1] for e in entries]
    out = tensors.empty((sum(rows), *tensor.shape[1:]), tensor.dtype)
    row_bytes = out[0].numel() * out.element_size() if len(out) else 0
    counts = [r * row_bytes for r in rows]
    displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64).tolist()
    with INSPECTOR.watching(lib.watch, f"{_what(caller, name)} ({sum(counts)} bytes)"):
        lib.Allgatherv(as_bytes(tensor), [as_bytes(out), (counts, displs)])
    return out, rows


#: The reduction of an output's gradient in ``allgather``'s and ``broadcast``'s backward: the
#: average over ranks, as Horovod's (whose tests expect, for the same gradient of the output on
#: every rank, that gradient back, not ``size`` times it).
_GRADIENT = _Reduce(Average, Compression.none, 1.0, 1.0, None)


class _AllgatherFunction(torch.autograd.Function):
    """``allgather`` with a gradient: this rank's rows of the output's gradient averaged over
    the ranks (Horovod's)."""

    @staticmethod
    def forward(ctx, tensor, name, check):
        out, rows = _gathered(tensor, "allgather", name, check)
        me = state().rank
        ctx.start, ctx.rows = sum(rows[:me]), rows[me]
        return out

    @staticmethod
    def backward(ctx, grad):
        averaged = _reduced_copy(grad.contiguous(), _GRADIENT, "allgather (gradient)")
        return averaged.narrow(0, ctx.start, ctx.rows), None, None


def allgather(tensor: torch.Tensor, name: Optional[str] = None, *, check: Optional[bool] = None) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along the first dimension, in rank order, into a new tensor.

    Collective: the tensors may differ in their first dimension only; the other dimensions and
    the dtype (any) must be the same on every rank. Shapes are exchanged first, so a difference
    raises ``ValueError`` on every rank. Differentiable, as Horovod's: a rank's gradient is its
    rows of the output's gradient averaged over the ranks (collective in backward too).
    """
    checked = checking(check, "allgather")
    if isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled():
        return _AllgatherFunction.apply(tensor, name, checked)
    return _gathered(tensor, "allgather", name, checked)[0]


# -- broadcast ------------------------------------------------------------------------------------

def _broadcast_checked(caller: str, tensor, root_rank, name, check) -> Tuple[int, bool]:
    """The root, validated (compared across ranks with ``check``), and whether it was checked."""
    checked = checking(check, caller)

    def validate() -> int:
        check_tensor(tensor, caller)
        if name is not None and not isinstance(name, str):
            raise TypeError(f"{caller}: name must be a str, got {type(name).__name__}")
        return root(root_rank, caller)

    def describe(r: int) -> dict:
        shape, dtype = tensors.signature(tensor)
        return {"shape": shape, "dtype": dtype, "root_rank": r}

    return begin(caller, checked, validate, describe), checked


def _broadcast_into(tensor: torch.Tensor, r: int, caller: str, name: Optional[str], checked: bool) -> None:
    """Broadcast ``tensor`` from rank ``r`` in place. Unless the call was ``checked``, the ranks
    first agree on shape, dtype and root (``agree_cheaply``): a ``Bcast`` whose sizes or roots
    differ between ranks would fail on some ranks only, or block every one."""
    lib = state().lib
    if lib.nranks > 1:
        with INSPECTOR.watching(lib.watch, f"{_what(caller, name)}(root_rank={r}, {tensor.numel()} x {tensor.dtype})"):
            if not checked:
                shape, dtype = tensors.signature(tensor)
                agree_cheaply(lib, caller, {"shape": shape, "dtype": dtype, "root_rank": r})
            if tensor.numel():
                lib.Bcast(as_bytes(tensor), root=r)


class _BroadcastFunction(torch.autograd.Function):
    """``broadcast`` with a gradient: the outputs' gradient averaged over the ranks, on the root;
    zero elsewhere (Horovod's)."""

    @staticmethod
    def forward(ctx, tensor, r, name, checked):
        ctx.root = r
        out = tensors.empty(tensor.shape, tensor.dtype).copy_(tensor.detach())
        _broadcast_into(out, r, "broadcast", name, checked)
        return out

    @staticmethod
    def backward(ctx, grad):
        averaged = _reduced_copy(grad.contiguous(), _GRADIENT, "broadcast (gradient)")
        if state().rank != ctx.root:
            averaged.zero_()
        return averaged, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None, *,
              check: Optional[bool] = None) -> torch.Tensor:
    """A new tensor holding ``root_rank``'s ``tensor``, on every rank; ``tensor`` is not modified.

    Collective: every rank passes a contiguous CPU tensor of the same shape and dtype (any);
    ``check=True`` compares them across ranks first. Differentiable, as Horovod's: the root's
    gradient is the output's gradient averaged over the ranks, every other rank's is zero
    (collective in backward too).
    """
    r, checked = _broadcast_checked("broadcast", tensor, root_rank, name, check)
    if tensor.requires_grad and torch.is_grad_enabled():
        return _BroadcastFunction.apply(tensor, r, name, checked)
    out = tensors.empty(tensor.shape, tensor.dtype).copy_(tensor.detach())
    _broadcast_into(out, r, "broadcast", name, checked)
    return out


def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None, *,
               check: Optional[bool] = None) -> torch.Tensor:
    """Overwrite ``tensor`` in place with ``root_rank``'s and return it (``broadcast``'s contract)."""
    r, checked = _broadcast_checked("broadcast_", tensor, root_rank, name, check)
    _broadcast_into(tensor.detach(), r, "broadcast_", name, checked)
    return tensor


# -- Python objects and synchronisation -------------------------------------------------------------

def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None) -> Any:
    """``root_rank``'s ``obj`` (any picklable object), on every rank (collective)."""
    r = root(root_rank, "broadcast_object")
    s = state()
    s.drain()
    with INSPECTOR.watching(s.lib.watch, f"{_what('broadcast_object', name)}(root_rank={r})"):
        if s.size > 1:  # a root that differs between ranks would block every rank
            agree_cheaply(s.lib, "broadcast_object", {"root_rank": r})
        return s.lib.bcast(obj, root=r)


def allgather_object(obj: Any, name: Optional[str] = None) -> List[Any]:
    """Every rank's ``obj`` (any picklable object), in rank order, on every rank (collective)."""
    s = state()
    s.drain()
    with INSPECTOR.watching(s.lib.watch, _what("allgather_object", name)):
        gathered = s.lib.allgather(obj)
    joining.refuse("allgather_object", gathered)
    return gathered


def barrier() -> None:
    """Wait until every rank has called ``barrier`` (collective)."""
    s = state()
    s.drain()
    with INSPECTOR.watching(s.lib.watch, "barrier"):
        s.lib.Barrier()
