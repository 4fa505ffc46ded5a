"""``DistributedOptimizer``: gradients averaged over the ranks while backward is still running.

The parameters are split into buckets of at most ``bucket_mb`` MB, in reverse order (the last
layers first, as backward produces their gradients). A hook on each parameter counts its
gradient in; when a bucket's gradients are all in, the bucket is handed to the background
thread (``worker.py``), which copies them into the bucket's flat buffer, averages it in place
(where the ranks share one node, in a window they all map: ``shared_buckets``; else with the
library's ``allreduce``) and makes each ``.grad`` a view of its slice of the result
(no copy back; a ``.grad`` zeroed in place stays that view and is not copied in again), while
backward goes on computing the gradients of the earlier layers. Buckets are handed over in
bucket order only, so every rank issues the same reductions in the same order. The last
bucket (the first layers, whose gradients come last) is reduced by ``step()`` itself, on the
calling thread: nothing is left to overlap with it, and a hand-over would only add latency.

The background thread is used where it can hide something: by default where every node has a
core to spare beyond its ranks' torch threads, or where the gradients fill more than one
bucket of ``BUCKET_MB`` (``overlap_choice``); elsewhere every bucket is reduced in
``step()``, by default as one bucket. ``step()`` (or ``synchronize()``)
hands over what is left, waits only for what is still in flight, then runs the wrapped
optimizer's update. Every step's timing is kept for ``report()``: the straggler report, and
the share of the reduction time hidden behind backward.
"""
import functools
import math
import sys
import time
import warnings
import weakref
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Sequence, TextIO, Tuple

import torch
from mpi4py import MPI

from ..stall import INSPECTOR
from . import mpi_ops, shared_buckets, tensors
from .compression import Compression, PowerSGDCompressor, check_compression
from .process_sets import ProcessSet, check_process_set, global_process_set
from .timing import Timing

#: Default bucket size in MB (10^6 bytes) when buckets are reduced during backward, DDP's: a
#: model smaller than this is one bucket, reduced in ``step()`` without a hand-over. Without
#: the background thread the default is one bucket for the whole model.
BUCKET_MB = 25.0


def overlap_choice(overlap: Optional[bool], nbytes: int = 0) -> Tuple[bool, str]:
    """Whether this rank would reduce buckets on the background thread, and why.

    ``None`` (the default) decides from where the ranks sit and from ``nbytes``, the size of
    the gradients: yes if this node has a core left for the thread beyond its ranks' torch
    threads; else only if the gradients fill more than one bucket of ``BUCKET_MB``. On cores
    that backward keeps busy the thread takes its time from backward, which can pay only where
    there is much to reduce: measured on 2 cores (docs/pytorch.md), a 42 MB gradient in 25 MB
    buckets during backward added 0.93x-1.0x the overhead of one bucket reduced in ``step()``
    at 2, 4 and 8 ranks, while a model of one bucket has nothing to overlap.
    """
    s = mpi_ops.state()
    if s.size == 1:
        return False, "one rank: nothing to reduce"
    if not s.threaded:
        if s is not mpi_ops._state:
            return False, "a process set's gradients are reduced in step()"
        return False, "MPI did not give MPI_THREAD_MULTIPLE"
    if overlap is not None:
        return overlap, "overlap=True" if overlap else "overlap=False"
    layout, threads = s.layout, torch.get_num_threads()
    cores = layout.cores_per_node[layout.node]
    where = f"{layout.local_size} ranks x {threads} torch thread{'s' if threads > 1 else ''} on {cores} cores"
    if core_to_spare(s):
        return True, f"a core to spare for it ({where})"
    if nbytes > BUCKET_MB * 1e6:
        return True, f"{nbytes / 1e6:.1f} MB of gradients, more than one {BUCKET_MB:g} MB bucket ({where})"
    return False, (f"no core to spare for it ({where}) and {nbytes / 1e6:.1f} MB of gradients, one {BUCKET_MB:g} MB "
                   f"bucket at most; overlap=True forces it")


def core_to_spare(s) -> bool:
    """Whether this node (and machine) has a core for a background thread beyond its ranks' torch
    threads: this rank's share of the cores (``Topology.threads``, the user's setting aside) has one."""
    return s.layout.threads({}) >= torch.get_num_threads() + 1


class _Bucket:
    """Consecutive parameters of one dtype and their gradients' place in one flat buffer."""

    __slots__ = ("params", "names", "bounds", "flat", "views", "seconds", "shared", "spent")

    def __init__(self, named: Sequence[Tuple[str, torch.Tensor]]):
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.bounds: List[Tuple[int, int]] = []
        start = 0
        for p in self.params:
            self.bounds.append((start, start + p.numel()))
            start += p.numel()
        self.use(tensors.empty((start,), self.params[0].dtype))   # numpy's memory: see tensors.empty
        self.seconds = 0.0  # how long its last reduction took (pack, reduce, unpack)
        #: the node's window that holds ``flat`` (``shared_buckets``), or None: ``flat`` is private
        self.shared = None
        #: the gradients backward last produced, copied into ``flat``: kept until ``zero_grad``
        #: (or the next reduction), as long as a plain optimizer keeps them, so that the next
        #: backward's gradients take their memory again instead of memory the allocator may
        #: have handed back to the system (measured: 10 k page faults per backward of 42 MB)
        self.spent: List[torch.Tensor] = []

    def use(self, flat: torch.Tensor) -> None:
        """Keep the gradients in ``flat`` from now on; a ``.grad`` that was a view of the old
        buffer becomes the same view of ``flat``, with its values."""
        old = getattr(self, "views", None)
        if old is not None:
            flat.copy_(self.flat)
        self.flat = flat
        #: each parameter's slice of ``flat`` in its shape: its ``.grad`` after a reduction
        self.views = [flat[a:b].view(p.shape) for p, (a, b) in zip(self.params, self.bounds)]
        if old is not None:
            for p, before, view in zip(self.params, old, self.views):
                if p.grad is before:
                    p.grad = view


def _buckets(named: Sequence[Tuple[str, torch.Tensor]], bucket_mb: float) -> List[_Bucket]:
    """``named`` in reverse order, cut where the dtype changes or a bucket would pass ``bucket_mb``."""
    limit = bucket_mb * 1e6
    groups: List[List[Tuple[str, torch.Tensor]]] = []
    size = 0.0
    for name, p in reversed(named):
        nbytes = p.numel() * p.element_size()
        if not groups or p.dtype != groups[-1][0][1].dtype or (limit > 0 and size + nbytes > limit):
            groups.append([])
            size = 0.0
        groups[-1].append((name, p))
        size += nbytes
    return [_Bucket(g) for g in groups]


def _counted(ref: "weakref.ref", index: int, grad: torch.Tensor) -> None:
    """The one hook on parameter ``index`` where buckets are reduced in ``step()``: it refuses a
    pass too many, then counts the gradient in, before it is accumulated."""
    optimizer = ref()
    if optimizer is not None:
        optimizer._gradient_coming(index)
        optimizer._gradient_ready(index)


def _on_gradient(ref: "weakref.ref", index: int, param: torch.Tensor) -> None:
    """The hook on parameter ``index``: its gradient is accumulated for this backward pass."""
    optimizer = ref()
    if optimizer is not None:
        optimizer._gradient_ready(index)


def _before_gradient(ref: "weakref.ref", index: int, grad: torch.Tensor) -> None:
    """The hook on parameter ``index`` that runs before its gradient is accumulated."""
    optimizer = ref()
    if optimizer is not None:
        optimizer._gradient_coming(index)


class _DistributedOptimizer:
    """Mixed into the wrapped optimizer's class by ``DistributedOptimizer``."""

    _buckets: List[_Bucket]

    def _distribute(self, named: List[Tuple[str, torch.Tensor]], compression: Any, backward_passes_per_step: int,
                    op: str, gradient_predivide_factor: float, bucket_mb: Optional[float], overlap: Optional[bool]) -> None:
        s = mpi_ops.state()
        background, why = overlap_choice(overlap, sum(p.numel() * p.element_size() for _, p in named))
        if s.size > 1 and overlap is None:   # every rank must cut the same buckets: all or none overlap
            with INSPECTOR.watching(s.lib.watch, "DistributedOptimizer: choosing where buckets are reduced"):
                vote = s.lib.allreduce(int(background), op=MPI.MIN)
            if background and not vote:
                background, why = False, ("some node has no core to spare for it and the gradients fit one "
                                          "bucket; overlap=True forces it")
        if bucket_mb is None:
            bucket_mb = BUCKET_MB if background else 0.0
        self._size = s.size
        #: parameter -> its name, as Horovod's optimizer keeps it
        self._parameter_names: Dict[torch.Tensor, str] = {p: name for name, p in named}
        self._compression = compression
        self._backward_passes = backward_passes_per_step
        self._op = op
        self._predivide = gradient_predivide_factor
        self._bucket_mb = bucket_mb
        self._buckets = _buckets(named, bucket_mb)
        self._bucket_of: List[int] = []
        self._params: List[torch.Tensor] = []
        self._names: List[str] = []
        for k, bucket in enumerate(self._buckets):
            for name, p in zip(bucket.names, bucket.params):
                self._bucket_of.append(k)
                self._params.append(p)
                self._names.append(name)
        self._passes = [0] * len(self._params)      # backward passes counted in, per parameter
        self._ready = [0] * len(self._buckets)      # parameters whose gradient is complete, per bucket
        self._launched = 0                          # buckets handed over (or reduced) this step
        self._synchronized = False
        self._should_synchronize = True
        self._hooks = []
        self._background = background and len(self._buckets) > 1
        if s.size > 1 and compression is Compression.none:
            _into_window(self, s)
            if self._background and not core_to_spare(s):   # the thread shares busy cores: no spinning
                for shared in {id(b.shared): b.shared for b in self._buckets if b.shared is not None}.values():
                    shared.yield_while_waiting()
        if s.size > 1:
            ref = weakref.ref(self)
            for index, p in enumerate(self._params):
                if not self._background:   # nothing to hand over: one hook, before accumulation, does
                    self._hooks.append(p.register_hook(functools.partial(_counted, ref, index)))
                    continue
                self._hooks.append(p.register_hook(functools.partial(_before_gradient, ref, index)))
                self._hooks.append(p.register_post_accumulate_grad_hook(functools.partial(_on_gradient, ref, index)))
            if self._background:
                s.worker()  # start the thread now, not in the first backward
        self._timing = Timing()
        if background and len(self._buckets) == 1:
            why = "one bucket: reduced in step(), as the last bucket always is"
        self._timing.extra = {"buckets": len(self._buckets), "bucket_mb": bucket_mb, "background": self._background,
                              "background_reason": why}
        self._step_end = time.perf_counter()
        self._sync_start: Optional[float] = None
        self._waited = 0.0

    # -- the hooks, during backward -------------------------------------------------------------
    def _gradient_coming(self, index: int) -> None:
        """Before a gradient is added to ``.grad``: refuse one pass too many, leaving ``.grad``
        (which the worker may be reading) untouched."""
        passes = self._passes[index] + 1
        if passes > self._backward_passes:
            raise RuntimeError(
                f"DistributedOptimizer: the gradient of {self._names[index]!r} was computed {passes} times before "
                f"step(), but backward_passes_per_step is {self._backward_passes}: call step() (or synchronize()) "
                f"after every {self._backward_passes} backward passes, or raise backward_passes_per_step")

    def _gradient_ready(self, index: int) -> None:
        passes = self._passes[index] + 1
        self._passes[index] = passes
        self._synchronized = False
        if passes == self._backward_passes:
            k = self._bucket_of[index]
            self._ready[k] += 1
            if self._background and k == self._launched and self._ready[k] == len(self._buckets[k].params):
                self._hand_over()

    def _hand_over(self) -> None:
        """Hand complete buckets to the worker, in bucket order, all but the last."""
        worker = mpi_ops.state().worker()
        last = len(self._buckets) - 1
        while self._launched < last and self._ready[self._launched] == len(self._buckets[self._launched].params):
            worker.submit(functools.partial(self._reduce_bucket, self._launched))
            self._launched += 1

    # -- one bucket: pack, reduce, unpack ---------------------------------------------------------
    def _reduce_bucket(self, k: int) -> None:
        start = time.perf_counter()
        bucket = self._buckets[k]
        flat = bucket.flat
        spent, grads, into, sparse = [], [], [], {}
        for i, (p, view) in enumerate(zip(bucket.params, bucket.views)):
            grad = p.grad
            if grad is None:
                view.zero_()
            elif grad.is_sparse:   # reduced dense in the bucket, given back sparse
                sparse[i] = grad.sparse_dim()
                grads.append(grad.detach().to_dense())
                into.append(view)
            elif grad.data_ptr() != view.data_ptr():   # not already the bucket's own memory
                spent.append(grad)
                grads.append(grad.detach())
                into.append(view)
        if into and bucket.shared is not None:
            bucket.shared.fill(k, into, grads)
        elif into:
            torch._foreach_copy_(into, grads)   # every copy in one call
        bucket.spent = spent
        scaled = self._predivide != 1.0
        if scaled:
            flat.mul_(1.0 / self._predivide)
        if isinstance(self._compression, PowerSGDCompressor):  # op Average, no predivide: checked
            s = mpi_ops.state()
            self._compression.average(k, bucket.params, bucket.views,
                                      lambda a: mpi_ops.allreduce_array(a, op="sum", comm=s.dup, check=False), s.size)
            compressed, ctx = None, None
        else:
            compressed, ctx = self._compression.compress(flat)
        op = mpi_ops.Sum if scaled else self._op
        if compressed is None:  # averaged above
            pass
        elif compressed is flat and bucket.shared is not None:
            bucket.shared.reduce(k, op, "DistributedOptimizer")
        elif compressed is flat:  # the same length and dtype on every rank: the parameters were compared
            mpi_ops.reduce_(flat, op, "DistributedOptimizer", agreed=True)
        else:
            compressed = compressed.contiguous()
            mpi_ops.reduce_(compressed, op, "DistributedOptimizer", agreed=compressed.shape == flat.shape)
            flat.copy_(self._compression.decompress(compressed, ctx))
        if scaled:
            flat.mul_(self._predivide / self._size)
        for i, (p, view) in enumerate(zip(bucket.params, bucket.views)):
            if i in sparse:
                p.grad = view.to_sparse(sparse[i])   # the layout it came in
            elif p.grad is not view:
                p.grad = view        # the average, where it is: no copy back
        bucket.seconds = time.perf_counter() - start

    # -- what the user calls ----------------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait until every gradient is averaged over the ranks (``.grad`` then holds the average).

        ``step()`` calls it; call it yourself to use the averaged gradients before the update
        (clipping them, for example), then call ``step()`` inside ``with opt.skip_synchronize():``.
        A gradient that no backward pass produced on this rank counts as zero.
        """
        begun = time.perf_counter()
        if self._sync_start is None:
            self._sync_start = begun
        if self._size > 1 and not self._synchronized:
            with _on(self._set_state):
                self._reduce_rest()
        self._synchronized = True
        self._waited += time.perf_counter() - begun

    def _reduce_rest(self) -> None:
        """Hand over (or reduce here) the buckets not yet handed over, and wait for them all."""
        s = mpi_ops.state()
        count = len(self._buckets)
        inline = []
        for k in range(self._launched, count):
            if self._background and k < count - 1:
                s.worker().submit(functools.partial(self._reduce_bucket, k))
            else:
                inline.append(k)
        self._launched = count
        s.drain()
        for k in inline:
            self._reduce_bucket(k)
        self._passes = [0] * len(self._params)
        self._ready = [0] * len(self._buckets)
        self._launched = 0

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``with opt.skip_synchronize(): opt.step()``: the update without waiting again, after
        an explicit ``synchronize()``."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        """Average the gradients (``synchronize``, unless already done), then update. After an
        explicit ``synchronize()``, call it inside ``skip_synchronize()``: without, it warns (as
        Horovod's does) and updates with the gradients already averaged."""
        if self._should_synchronize and not self._synchronized:
            self.synchronize()
        elif self._should_synchronize and self._size > 1:
            warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                          "optimizer.synchronize(); call step() inside `with optimizer.skip_synchronize():` "
                          "after synchronizing explicitly", stacklevel=2)
        if self._sync_start is None:
            self._sync_start = time.perf_counter()
        begun = time.perf_counter()
        loss = super().step() if closure is None else super().step(closure)
        ended = time.perf_counter()
        reduction = sum(b.seconds for b in self._buckets) if self._size > 1 else 0.0
        for b in self._buckets:
            b.seconds = 0.0
        self._timing.record(self._sync_start - self._step_end, self._waited, ended - begun, reduction,
                            max(0.0, reduction - self._waited))
        self._synchronized = self._size == 1
        self._sync_start, self._waited, self._step_end = None, 0.0, ended
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``zero_grad`` of the wrapped optimizer; refused while gradients are being averaged."""
        if self._launched or any(self._ready):
            raise RuntimeError("DistributedOptimizer: zero_grad() was called after backward() and before step() or "
                               "synchronize(), while gradients are being averaged; call it before backward()")
        for bucket in self._buckets:
            bucket.spent = []
        super().zero_grad(set_to_none)

    def report(self, file: Optional[TextIO] = sys.stdout, json_path: Optional[str] = None) -> Dict[str, Any]:
        """The straggler report over the steps so far, and the share of the gradient reductions
        hidden behind backward, per step (collective; ``Timing.report``)."""
        with _on(self._set_state):
            mpi_ops.state().drain()
            return self._timing.report(file, json_path, title="DistributedOptimizer: straggler report")


def _into_window(optimizer: "_DistributedOptimizer", s) -> None:
    """Move the buckets' flat buffers into a window of the node where the ranks share one
    (``shared_buckets``); ``hvd.shutdown()`` moves them back out and frees it. Collective."""
    buckets = optimizer._buckets
    shared = shared_buckets.make(s.lib, [b.flat.numel() for b in buckets], [b.flat.dtype for b in buckets])
    if shared is None:
        return
    for bucket, flat in zip(buckets, shared.flats):
        if flat is not None:
            bucket.use(flat)
            bucket.shared = shared
    s.on_shutdown(functools.partial(_out_of_window, weakref.ref(optimizer), shared))


def _out_of_window(ref: "weakref.ref", shared: "shared_buckets.SharedBuckets") -> None:
    optimizer = ref()
    if optimizer is not None:
        for bucket in optimizer._buckets:
            if bucket.shared is shared:
                bucket.use(tensors.empty(tuple(bucket.flat.shape), bucket.flat.dtype))
                bucket.shared = None
    shared.free()


_CLASSES: Dict[type, type] = {}


def _state_for(process_set: Any, caller: str) -> Optional["mpi_ops._State"]:
    """Where an optimizer given ``process_set`` reduces: None for the global set; the set's
    state for a member; for a rank outside an added set, a state of its own alone (``_alone``):
    as in Horovod, its optimizer steps on its own gradients."""
    if isinstance(process_set, ProcessSet) and process_set.process_set_id not in (None, 0) \
            and process_set._state is None:
        return _alone()
    ps = check_process_set(process_set, caller)
    return None if ps is None else ps._state


def _alone() -> "mpi_ops._State":
    """A one-rank state over ``COMM_SELF`` (made once per ``init``, freed by ``shutdown``)."""
    s = mpi_ops.state()
    alone = getattr(s, "alone", None)
    if alone is None:
        alone = s.alone = mpi_ops._State(MPI.COMM_SELF)
        alone.threaded = False

        def release() -> None:
            for each in alone._on_shutdown:
                each()
            alone.dup.Free()
        s.on_shutdown(release)
    return alone


@contextmanager
def _on(set_state: Optional["mpi_ops._State"]) -> Iterator[None]:
    """Inside the block, this thread's calls run on ``set_state`` (nothing changes for None),
    after the global background thread's reductions (``process_sets.running_on``)."""
    if set_state is None:
        yield
        return
    mpi_ops.state().drain()
    previous = getattr(mpi_ops._on_set, "state", None)
    mpi_ops._on_set.state = set_state
    try:
        yield
    finally:
        mpi_ops._on_set.state = previous


def _named(optimizer: torch.optim.Optimizer, named_parameters: Any) -> List[Tuple[str, torch.Tensor]]:
    """The optimizer's parameters that take gradients, named, in model order; checked."""
    caller = "DistributedOptimizer"
    in_optimizer = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:
        named = [(f"allreduce.noname.{i}.{j}", p) for i, group in enumerate(optimizer.param_groups)
                 for j, p in enumerate(group["params"])]
    else:
        if isinstance(named_parameters, (torch.Tensor, dict)):
            raise TypeError(f"{caller}: named_parameters must be a sequence of (name, parameter) pairs such as "
                            f"model.named_parameters(), got {type(named_parameters).__name__}")
        named = list(named_parameters)
        for i, item in enumerate(named):
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
                raise ValueError(f"{caller}: named_parameters[{i}] is not a (name, parameter) pair; pass "
                                 f"model.named_parameters()")
        names = [name for name, _ in named]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"{caller}: parameter names in named_parameters must be unique; repeated: "
                             f"{', '.join(duplicates)}")
        known = {id(p) for _, p in named}
        unnamed = [i for i, p in enumerate(in_optimizer) if id(p) not in known]
        if unnamed:
            raise ValueError(f"{caller}: named_parameters does not name {len(unnamed)} of the optimizer's parameters "
                             f"(positions {unnamed[:10]} in its parameter groups); pass model.named_parameters() "
                             f"of the model the optimizer trains")
        ids = {id(p) for p in in_optimizer}
        named = [(name, p) for name, p in named if id(p) in ids]
    for name, p in named:  # a parameter without a gradient (an integer one, say) is not reduced: any dtype
        tensors.check_tensor(p, caller, f"parameter {name!r}", dtypes=tensors.GRADIENT if p.requires_grad else None,
                             contiguous=False)
    return [(name, p) for name, p in named if p.requires_grad]


def _checked_arguments(compression, backward_passes_per_step, op, gradient_predivide_factor,
                       bucket_mb, overlap) -> Tuple[Any, int, str, float, Optional[float], Optional[bool]]:
    caller = "DistributedOptimizer"
    check_compression(compression, caller)
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int):
        raise TypeError(f"{caller}: backward_passes_per_step must be an int, got {type(backward_passes_per_step).__name__}")
    if backward_passes_per_step < 1:
        raise ValueError(f"{caller}: backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    name = mpi_ops.reduce_op(op, None, caller)
    if name not in (mpi_ops.Average, mpi_ops.Sum):
        raise ValueError(f"{caller}: op must be Average or Sum, got {op!r}")
    predivide = mpi_ops.factor(gradient_predivide_factor, caller, "gradient_predivide_factor")
    if predivide <= 0:
        raise ValueError(f"{caller}: gradient_predivide_factor must be > 0, got {gradient_predivide_factor}")
    if predivide != 1.0 and name != mpi_ops.Average:
        raise ValueError(f"{caller}: gradient_predivide_factor applies to op=Average only")
    if isinstance(compression, PowerSGDCompressor) and (name != mpi_ops.Average or predivide != 1.0):
        raise ValueError(f"{caller}: compression=Compression.powersgd averages: op must be Average and "
                         f"gradient_predivide_factor 1")
    if bucket_mb is not None:
        if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)):
            raise TypeError(f"{caller}: bucket_mb must be a number of MB (10^6 bytes), got {type(bucket_mb).__name__}")
        if not 0 <= bucket_mb < math.inf:
            raise ValueError(f"{caller}: bucket_mb must be >= 0 (0: one bucket), got {bucket_mb}")
        bucket_mb = float(bucket_mb)
    if overlap is not None and not isinstance(overlap, bool):
        raise TypeError(f"{caller}: overlap must be True, False or None, got {type(overlap).__name__}")
    return compression, backward_passes_per_step, name, predivide, bucket_mb, overlap


def _check_horovod_grouping(num_groups: Any, groups: Any, sparse_as_dense: Any, caller: str) -> None:
    if isinstance(num_groups, bool) or not isinstance(num_groups, int):
        raise TypeError(f"{caller}: num_groups must be an int, got {type(num_groups).__name__}")
    if num_groups < 0:
        raise ValueError(f"{caller}: num_groups must be >= 0, got {num_groups}")
    if groups is not None:
        if isinstance(groups, bool) or not isinstance(groups, (int, list, tuple)):
            raise TypeError(f"{caller}: groups must be None, an int or a list of lists of parameters, "
                            f"got {type(groups).__name__}")
        if isinstance(groups, int) and groups < 0:
            raise ValueError(f"{caller}: groups must be >= 0, got {groups}")
        if isinstance(groups, (list, tuple)) and any(
                not isinstance(g, (list, tuple)) or not all(isinstance(p, torch.Tensor) for p in g) for g in groups):
            raise TypeError(f"{caller}: groups must be a list of lists of parameters")
    if not isinstance(sparse_as_dense, bool):
        raise TypeError(f"{caller}: sparse_as_dense must be True or False, got {type(sparse_as_dense).__name__}")


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step: int = 1, op=mpi_ops.Average, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups: Any = None, sparse_as_dense: bool = False,
                         process_set=global_process_set, *, bucket_mb: Optional[float] = None, overlap: Optional[bool] = None) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` applies the gradients averaged over all ranks.

    Collective. Returns an optimizer of the same class (``isinstance`` holds, learning-rate
    schedulers work) sharing the wrapped one's parameter groups and state. Gradients are
    reduced in buckets of at most ``bucket_mb`` MB while backward runs (module docstring) where
    ``overlap`` is True, or None and every node has a core to spare or the gradients fill more
    than one bucket of ``BUCKET_MB`` (``overlap_choice``);
    otherwise in ``step()``, in one bucket unless ``bucket_mb`` says otherwise;
    ``backward_passes_per_step`` backward passes are accumulated locally before a step;
    ``op`` is ``Average`` or ``Sum``; ``compression=Compression.fp16`` sends 2-byte floats.
    Every rank must wrap the same model (names, shapes and dtypes of the parameters, and these
    arguments, are compared across ranks: a difference raises ``ValueError`` on every rank).
    Also: ``synchronize()``, ``skip_synchronize()``, ``report()``.

    ``process_set`` (Horovod's): the gradients are averaged over that set's ranks only; every
    member wraps its optimizer with the same set (collective over the set), and its buckets are
    reduced in ``step()``, on the calling thread. A rank outside the set steps on its own
    gradients, as Horovod's does.

    ``num_groups`` and ``groups`` (Horovod's grouping of gradients into fused reductions) and
    ``sparse_as_dense`` are taken for Horovod's signature and checked, and change nothing: the
    gradients are reduced dense, in the buckets ``bucket_mb`` makes. A sparse gradient (of an
    ``Embedding(sparse=True)``) is reduced dense in its bucket and given back sparse
    (``to_sparse()``), as Horovod's ``sparse_as_dense=True`` does.
    """
    caller = "DistributedOptimizer"
    _check_horovod_grouping(num_groups, groups, sparse_as_dense, caller)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{caller}: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError(f"{caller}: optimizer is already a DistributedOptimizer")

    def validate():
        named = _named(optimizer, named_parameters)
        if isinstance(compression, PowerSGDCompressor):
            compression.check([tuple(p.shape) for _, p in named], caller)
        return named, _checked_arguments(
            compression, backward_passes_per_step, op, gradient_predivide_factor, bucket_mb, overlap)

    def describe(value) -> Dict[str, Any]:
        named, (comp, passes, name, predivide, mb, overlap_) = value
        return {"parameters (name, shape, dtype)": [(n, tuple(p.shape), str(p.dtype).replace("torch.", ""))
                                                    for n, p in named],
                "op": name, "backward_passes_per_step": passes, "compression": getattr(comp, "__name__", repr(comp)),
                "gradient_predivide_factor": predivide, "bucket_mb": mb, "overlap": overlap_}

    set_state = _state_for(process_set, caller)
    with _on(set_state):
        named, arguments = mpi_ops.begin(caller, True, validate, describe)
        base = type(optimizer)
        cls = _CLASSES.get(base)
        if cls is None:
            cls = _CLASSES[base] = type(base.__name__, (_DistributedOptimizer, base), {"__module__": __name__})
        distributed = cls.__new__(cls)
        distributed.__dict__.update(optimizer.__dict__)  # the same param_groups, state, defaults and hooks
        distributed._set_state = set_state
        distributed._distribute(named, *arguments)
    return distributed
