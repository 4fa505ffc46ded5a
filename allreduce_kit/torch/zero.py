"""``ZeroRedundancyOptimizer``: each rank keeps the optimizer state of its block of the parameters
only (ZeRO stage 1), and with ``stage=2`` only its block of the averaged gradients too.

The trainable parameters of each parameter group are laid out in flat buffers ("buckets": at
most ``bucket_mb`` MB, one dtype, the last parameters first, as backward produces their
gradients); every parameter's ``.data`` becomes a view of its bucket. Rank r owns block r of
every bucket by the package's one block rule (``allreduce_kit.shard_bounds``), and the wrapped
optimizer (``optimizer_class``, made on this rank only) steps one tensor per bucket: a view of
that block. A step:

1. each bucket's gradients are averaged by reduce-scatter (mean): rank r receives block r of
   the average, the gradient of its block. On one node the ranks read each other's gradients
   where backward left them (``reduce_scatter_parts``); elsewhere they are copied into one
   buffer first. Stage 1 does it in ``step()``; stage 2 while backward runs: a hook counts each
   parameter's gradient in, and a bucket whose gradients are all in is reduced and its
   parameters' ``.grad`` are dropped, so the full-size gradients are not kept beyond a bucket.
   Where the node has a core to spare (``overlap``) the bucket is copied into a buffer of its
   own and its ``ireduce_scatter`` runs on the progress thread while backward goes on; else it
   is reduced in the hook, on the calling thread;
2. the wrapped optimizer updates this rank's blocks (its state is that of the blocks only);
3. each bucket is ``allgather``-ed in place: every rank's parameters are whole again.

The update must be element-wise (SGD, Adam, AdamW, RMSprop, Adagrad, ...): the state of one
element depends on that element only, so stepping blocks equals stepping whole parameters. An
optimizer that looks at a whole parameter (LAMB's or LARS's norms) would step blocks differently.
"""
import functools
import math
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from mpi4py import MPI

from ..blocks import block as block_of
from ..blocks import counts as block_counts
from ..collectives.allgather import allgather
from ..collectives.reduce_scatter import reduce_scatter_parts
from ..nonblocking import Handle, ireduce_scatter
from ..stall import INSPECTOR
from . import mpi_ops, tensors
from .optimizer import core_to_spare

CALLER = "ZeroRedundancyOptimizer"
#: Default bucket size in MB (10^6 bytes), ``DistributedOptimizer``'s.
BUCKET_MB = 25.0
#: Gradient dtypes the reduce-scatter takes.
DTYPES = (torch.float32, torch.float64)
#: State names that hold one value per parameter, not one per element, where a parameter's
#: shape alone cannot tell (a 0-dimensional parameter): torch's optimizers' counters.
_SCALAR_STATE = frozenset({"step", "mu_product", "eta", "mu"})


class _Bucket:
    """Some trainable parameters of one group and dtype, laid out in one flat buffer, and this
    rank's block of it."""

    def __init__(self, group: int, members: Sequence[Tuple[int, torch.Tensor]], rank: int, size: int):
        self.group = group
        #: (index in the optimizer's state_dict numbering, parameter)
        self.indices = [i for i, _ in members]
        self.params = [p for _, p in members]
        self.bounds: List[Tuple[int, int]] = []
        n = 0
        for p in self.params:
            self.bounds.append((n, n + p.numel()))
            n += p.numel()
        self.n = n
        self.dtype = self.params[0].dtype
        self.lo, self.hi = block_of(n, size, rank)
        #: the parameters' values, whole (their ``.data`` become views of it)
        self.flat = tensors.empty((n,), self.dtype)
        with torch.no_grad():
            for p, (a, b) in zip(self.params, self.bounds):
                self.flat[a:b].copy_(p.detach().reshape(-1))
        #: what the wrapped optimizer steps: this rank's block of ``flat`` (a view of it)
        self.shard = torch.nn.Parameter(self.flat[self.lo:self.hi], requires_grad=True)
        #: this rank's block of the averaged gradients (``shard.grad`` when a step has gradients)
        self.grad = torch.zeros(self.hi - self.lo, dtype=self.dtype)

    def point_parameters(self) -> None:
        """Make every parameter's ``.data`` its view of ``flat``."""
        for p, (a, b) in zip(self.params, self.bounds):
            p.data = self.flat[a:b].view(p.shape)

    def parts(self) -> List[np.ndarray]:
        """The parameters' gradients, in bucket order, as 1-D numpy arrays over their memory
        where they are dense and contiguous; a missing gradient as zeros, any other as a dense
        contiguous copy."""
        out = []
        for p, (a, b) in zip(self.params, self.bounds):
            grad = p.grad
            if grad is None:
                out.append(np.zeros(b - a, self.flat.numpy().dtype))
                continue
            grad = grad.detach()
            if grad.layout != torch.strided:
                grad = grad.to_dense()
            out.append(grad.contiguous().numpy().reshape(-1))
        return out

    def fill(self, into: np.ndarray) -> None:
        """Copy the parameters' gradients into ``into`` (``n`` elements), with numpy's copy, which
        moves large blocks faster than torch's ``copy_``; a missing one is zero."""
        for part, (a, b) in zip(self.parts(), self.bounds):
            np.copyto(into[a:b], part)


def _buckets(groups: List[Dict[str, Any]], bucket_mb: float, rank: int, size: int) -> List[_Bucket]:
    """The trainable parameters of each group, the last first, cut where the dtype changes or a
    bucket would pass ``bucket_mb`` (0: one bucket per group and dtype)."""
    limit = bucket_mb * 1e6
    numbered, index = [], 0
    for g, group in enumerate(groups):
        for p in group["params"]:
            numbered.append((g, index, p))
            index += 1
    made: List[Tuple[int, List[Tuple[int, torch.Tensor]]]] = []
    size_bytes = 0.0
    for g, i, p in reversed(numbered):
        if not p.requires_grad:
            continue
        nbytes = p.numel() * p.element_size()
        if (not made or made[-1][0] != g or p.dtype != made[-1][1][0][1].dtype
                or (limit > 0 and size_bytes + nbytes > limit)):
            made.append((g, []))
            size_bytes = 0.0
        made[-1][1].append((i, p))
        size_bytes += nbytes
    return [_Bucket(g, members, rank, size) for g, members in made]


def _stage_argument(stage: Any) -> int:
    if isinstance(stage, bool) or not isinstance(stage, int):
        raise TypeError(f"{CALLER}: stage must be 1 or 2, got {type(stage).__name__}")
    if stage not in (1, 2):
        raise ValueError(f"{CALLER}: stage must be 1 (optimizer state sharded) or 2 (gradients too), got {stage}; "
                         f"for stage 3 (parameters too) see allreduce_kit.torch.fully_shard")
    return stage


def _bucket_mb_argument(bucket_mb: Any) -> float:
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)):
        raise TypeError(f"{CALLER}: bucket_mb must be a number of MB (10^6 bytes), got {type(bucket_mb).__name__}")
    if not 0 <= bucket_mb < math.inf:
        raise ValueError(f"{CALLER}: bucket_mb must be >= 0 (0: one bucket per group and dtype), got {bucket_mb}")
    return float(bucket_mb)


def _check_params(groups: List[Dict[str, Any]]) -> None:
    seen = set()
    for g, group in enumerate(groups):
        for j, p in enumerate(group["params"]):
            where = f"parameter {j} of group {g}"
            tensors.check_tensor(p, CALLER, where, dtypes=DTYPES if p.requires_grad else None, contiguous=False)
            if id(p) in seen:
                raise ValueError(f"{CALLER}: {where} appears more than once")
            seen.add(id(p))
    if not any(p.requires_grad for group in groups for p in group["params"]):
        raise ValueError(f"{CALLER}: no parameter requires a gradient: nothing to optimize")


def _on_gradient(ref: "weakref.ref", index: int, param: torch.Tensor) -> None:
    """Stage 2's hook on trainable parameter ``index``: its gradient is accumulated."""
    optimizer = ref()
    if optimizer is not None:
        optimizer._gradient_ready(index)


class ZeroRedundancyOptimizer(torch.optim.Optimizer):
    """``torch.distributed.optim.ZeroRedundancyOptimizer``'s constructor and methods, over MPI.

    Collective (after ``init()``): every rank passes the same parameters (shapes, dtypes, groups,
    hyperparameters and these arguments are compared across ranks first: a difference, or a bad
    argument on any rank, raises the same ``ValueError``/``TypeError`` on every rank). Rank 0's
    parameter values are copied to every rank, as ``DistributedDataParallel`` does when it is made.

    ``params``: tensors or parameter groups (dicts), float32 or float64 CPU tensors (those that do
    not require a gradient are left alone); ``optimizer_class`` (an element-wise
    ``torch.optim.Optimizer`` class) is made on this rank's blocks with ``**defaults`` and each
    group's settings, as ``self.optim``. ``param_groups`` is the groups of all parameters:
    learning-rate schedulers work on it, and ``step()`` hands its settings to ``self.optim``.

    Where it differs from PyTorch's: PyTorch's expects the gradients already averaged over the
    ranks by ``DistributedDataParallel`` and gives each rank whole parameters; this one averages
    the gradients itself, by reduce-scatter, so **no DDP wrapper is needed** (the model is
    plain; wrapping it in DDP as well only averages twice), and it shards every bucket of
    parameters element-wise by the block rule, so any parameter count splits evenly. A
    gradient that a rank's backward did not produce counts as zero (every rank must run the
    same backward passes, as under DDP). Each ``.data`` becomes a view of a flat bucket
    (``parameters_as_bucket_view`` is taken and changes nothing). ``process_group`` must be
    None (the ranks of ``init()``); ``overlap_with_ddp=True`` is refused: ``stage=2``
    overlaps the gradients' reduction with backward without DDP.

    Keyword-only: ``stage`` 1 (default: gradients reduce-scattered in ``step()``) or 2 (during
    backward; each rank keeps its block of them only; several backward passes before a step
    accumulate, as ``.grad`` does); ``bucket_mb`` (default ``BUCKET_MB``; 0: one bucket per group
    and dtype); ``overlap`` (stage 2): each bucket reduced on the progress thread while backward
    goes on (True) or in backward's hook on the calling thread (False); by default True where
    the node has a core to spare beyond its ranks' torch threads (``DistributedOptimizer``'s
    rule): with every core computing, the thread only takes time from backward. ``step()``,
    ``zero_grad()``, ``consolidate_state_dict(to)``, ``state_dict()`` (on rank ``to``: every
    parameter's state, in ``torch.optim``'s format, as a plain ``optimizer_class`` on one process
    would hold it), ``load_state_dict()`` (that format, from any run at any rank count). ``add_param_group`` after construction is not supported.
    """

    def __init__(self, params, optimizer_class: type, process_group: Any = None, parameters_as_bucket_view: bool = False,
                 overlap_with_ddp: bool = False, *, stage: int = 1, bucket_mb: Optional[float] = None,
                 overlap: Optional[bool] = None, **defaults: Any):
        self._initialized = False
        s = mpi_ops.state()
        self._mpi = s

        def validate():
            if isinstance(params, torch.Tensor):
                raise TypeError(f"{CALLER}: params must be an iterable of tensors or of parameter groups (dicts), "
                                f"got one tensor (pass [tensor])")
            try:
                listed = list(params)
            except TypeError:
                raise TypeError(f"{CALLER}: params must be an iterable of tensors or of parameter groups (dicts), "
                                f"got {type(params).__name__}") from None
            if not listed:
                raise ValueError(f"{CALLER}: got an empty parameter list")
            if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
                raise TypeError(f"{CALLER}: optimizer_class must be a torch.optim.Optimizer class, "
                                f"got {optimizer_class!r}")
            if process_group is not None:
                raise ValueError(f"{CALLER}: process_group must be None: it works over the ranks of "
                                 f"allreduce_kit.torch.init()")
            if not isinstance(parameters_as_bucket_view, bool):
                raise TypeError(f"{CALLER}: parameters_as_bucket_view must be True or False")
            if overlap_with_ddp is not False:
                raise ValueError(f"{CALLER}: overlap_with_ddp=True is not supported (it needs DDP's communication "
                                 f"hook); stage=2 reduces the gradients during backward without DDP")
            if overlap is not None and not isinstance(overlap, bool):
                raise TypeError(f"{CALLER}: overlap must be None, True or False, got {overlap!r}")
            chosen_stage = _stage_argument(stage)
            mb = BUCKET_MB if bucket_mb is None else _bucket_mb_argument(bucket_mb)
            torch.optim.Optimizer.__init__(self, listed, dict(defaults))
            _check_params(self.param_groups)
            buckets = _buckets(self.param_groups, mb, s.rank, s.size)
            local_groups = []
            for g, group in enumerate(self.param_groups):
                settings = {k: v for k, v in group.items() if k != "params"}
                local_groups.append({**settings, "params": [b.shard for b in buckets if b.group == g]})
            try:
                local = optimizer_class(local_groups, **defaults)
            except (TypeError, ValueError):
                raise
            except Exception as failed:  # noqa: B902 - every rank must hear of it, as a ValueError
                raise ValueError(f"{CALLER}: {optimizer_class.__name__}(...) failed: {failed}") from failed
            return chosen_stage, mb, buckets, local

        def describe(value) -> Dict[str, Any]:
            chosen_stage, mb, buckets, local = value
            groups = self.param_groups
            return {"parameters (group, shape, dtype, requires_grad)":
                    [(g, tuple(p.shape), str(p.dtype).replace("torch.", ""), p.requires_grad)
                     for g, group in enumerate(groups) for p in group["params"]],
                    "group settings": [repr(sorted((k, repr(v)) for k, v in group.items() if k != "params"))
                                       for group in groups],
                    "optimizer_class": f"{optimizer_class.__module__}.{optimizer_class.__qualname__}",
                    "stage": chosen_stage, "bucket_mb": mb, "overlap": overlap}

        self._stage, self._bucket_mb, self._buckets, self.optim = mpi_ops.begin(CALLER, True, validate, describe)
        #: the process set's communicator, as ``process_group`` would be PyTorch's
        self.process_group = None
        self.parameters_as_bucket_view = parameters_as_bucket_view
        self.world_size, self.rank = s.size, s.rank
        self._copy_settings(self.optim.param_groups, self.param_groups)
        self._bucket_of: Dict[int, int] = {}
        self._position: Dict[int, int] = {}
        for k, bucket in enumerate(self._buckets):
            for j, i in enumerate(bucket.indices):
                self._bucket_of[i] = k
                self._position[i] = j
        if s.size > 1:
            with INSPECTOR.watching(s.lib.watch, f"{CALLER}: rank 0's parameters to every rank"):
                for bucket in self._buckets:
                    if bucket.n:
                        s.lib.Bcast(tensors.as_bytes(bucket.flat), root=0)
        for bucket in self._buckets:
            bucket.point_parameters()
        self._scratch: Optional[torch.Tensor] = None
        #: stage 2: each bucket's reduce-scatter runs on the progress thread while backward goes on
        #: (True) or in backward's hook, on the calling thread (False)
        self._overlap = core_to_spare(s) if overlap is None else overlap
        # stage 2: gradients counted in per bucket, buckets launched this pass, reductions in flight
        self._ready = [0] * len(self._buckets)
        self._launched = 0
        self._in_flight: List[Tuple[int, Handle, torch.Tensor, torch.Tensor]] = []
        self._reduced = [False] * len(self._buckets)
        self._hooks = []
        if self._stage == 2 and s.size > 1:
            ref = weakref.ref(self)
            for bucket in self._buckets:
                for i, p in zip(bucket.indices, bucket.params):
                    self._hooks.append(p.register_post_accumulate_grad_hook(functools.partial(_on_gradient, ref, i)))
        #: the state consolidated on this rank by ``consolidate_state_dict`` (``None`` elsewhere)
        self._consolidated: Optional[Dict[int, Dict[str, Any]]] = None
        self._initialized = True

    # -- parameter groups --------------------------------------------------------------------------
    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Only while the optimizer is made (``torch.optim.Optimizer``'s constructor calls it)."""
        if getattr(self, "_initialized", False):
            raise RuntimeError(f"{CALLER}: add_param_group after construction is not supported (the buckets and "
                               f"blocks are laid out once); make a new {CALLER} over every group")
        super().add_param_group(param_group)

    @staticmethod
    def _copy_settings(source: List[Dict[str, Any]], target: List[Dict[str, Any]]) -> None:
        for src, dst in zip(source, target):
            for key, value in src.items():
                if key != "params":
                    dst[key] = value

    # -- stage 2: the hooks, during backward -------------------------------------------------------
    def _gradient_ready(self, index: int) -> None:
        k = self._bucket_of[index]
        self._ready[k] += 1
        while (self._launched < len(self._buckets)
               and self._ready[self._launched] == len(self._buckets[self._launched].params)):
            self._launch(self._launched)
            self._launched += 1
        if self._launched == len(self._buckets):   # a whole pass reduced: the next one starts over
            self._launched = 0
            self._ready = [0] * len(self._buckets)

    def _launch(self, k: int) -> None:
        """Reduce-scatter (mean) bucket ``k``'s gradients into this rank's block and drop the
        parameters' ``.grad``: at once, on this thread, as stage 1 does (``overlap`` off), or
        copied into a buffer of their own whose reduce-scatter starts on the progress thread and
        is waited for in ``step()``."""
        bucket = self._buckets[k]
        if not self._overlap:
            first = not self._reduced[k]
            out = bucket.grad if first else torch.empty(bucket.hi - bucket.lo, dtype=bucket.dtype)
            self._reduce(bucket, out)
            for p in bucket.params:
                p.grad = None
            self._land(k, out, first)
            return
        flat = tensors.empty((bucket.n,), bucket.dtype)
        bucket.fill(flat.numpy())
        for p in bucket.params:
            p.grad = None
        out = torch.empty(bucket.hi - bucket.lo, dtype=bucket.dtype)
        handle = ireduce_scatter(flat.numpy(), out.numpy(), op="mean", comm=self._mpi.dup, check=False)
        self._in_flight.append((k, handle, flat, out))

    def _land(self, k: int, out: torch.Tensor, into: bool = False) -> None:
        """Bucket ``k``'s reduced block ``out`` of one backward pass: the block's gradient, or added
        to it after the step's first pass (``into``: ``out`` is already the block's gradient)."""
        bucket = self._buckets[k]
        if self._reduced[k]:
            bucket.grad.add_(out)
        elif not into:
            bucket.grad.copy_(out)
        self._reduced[k] = True

    def _finish_stage2(self) -> None:
        """In ``step()``: launch what the last pass left (a gradient not produced counts as zero;
        with no pass since the last step, every bucket from ``.grad`` as it is), then wait for every
        reduction still in flight and add each into its bucket's block of the gradient."""
        if self._launched or any(self._ready) or not (self._in_flight or any(self._reduced)):
            for k in range(self._launched, len(self._buckets)):
                self._launch(k)
        self._launched, self._ready = 0, [0] * len(self._buckets)
        done, self._in_flight = self._in_flight, []
        for k, handle, _, out in done:
            handle.wait()
            self._land(k, out)

    # -- stage 1: in step() ------------------------------------------------------------------------
    def _flat_for(self, bucket: _Bucket) -> torch.Tensor:
        """A flat buffer of ``bucket``'s length and dtype, kept between calls (one for the largest
        bucket of each dtype in turn)."""
        if self._scratch is None or self._scratch.numel() < bucket.n or self._scratch.dtype != bucket.dtype:
            self._scratch = tensors.empty((max(b.n for b in self._buckets if b.dtype == bucket.dtype),),
                                          bucket.dtype)
        return self._scratch[:bucket.n]

    def _reduce(self, bucket: _Bucket, out: torch.Tensor) -> None:
        """The mean over the ranks of ``bucket``'s gradients, this rank's block into ``out``: read
        where the gradients are where the ranks can read each other's memory, else copied into
        one buffer first (``reduce_scatter_parts``)."""
        reduce_scatter_parts(bucket.parts(), out.numpy(), lambda n: self._flat_for(bucket).numpy(), op="mean",
                             comm=self._mpi.dup)

    def _reduce_in_step(self) -> None:
        for bucket in self._buckets:
            if self._mpi.size == 1:   # the block is the bucket: its gradients are the average
                bucket.fill(bucket.grad.numpy())
            else:
                self._reduce(bucket, bucket.grad)

    # -- what the user calls -----------------------------------------------------------------------
    def step(self, closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
        """Average the gradients (stage 1: here; stage 2: what backward left), update this rank's
        blocks with ``self.optim``, then allgather every bucket. ``closure`` (re-evaluates the
        model and calls backward) runs first; ``kwargs`` go to ``self.optim.step``. Collective."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        s = self._mpi
        s.drain()
        if self._stage == 2 and s.size > 1:
            self._finish_stage2()
        else:
            self._reduce_in_step()
        for bucket in self._buckets:
            bucket.shard.grad = bucket.grad
        self._copy_settings(self.param_groups, self.optim.param_groups)
        self.optim.step(**kwargs)
        self._copy_settings(self.optim.param_groups, self.param_groups)
        for bucket in self._buckets:
            bucket.shard.grad = None
        self._reduced = [False] * len(self._buckets)
        if s.size > 1:
            for bucket in self._buckets:
                if bucket.n:
                    flat = bucket.flat.numpy()
                    allgather(flat[bucket.lo:bucket.hi], flat, comm=s.dup, check=False)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``torch.optim.Optimizer.zero_grad`` of every parameter; refused in stage 2 while a
        backward pass's gradients are being reduced (call it before backward, or after step)."""
        if self._in_flight or self._launched or any(self._ready) or any(self._reduced):
            raise RuntimeError(f"{CALLER}: zero_grad() was called after backward() and before step(), while "
                               f"gradients are being reduced; call it before backward()")
        super().zero_grad(set_to_none)

    # -- state -----------------------------------------------------------------------------------
    def _element_keys(self, bucket: _Bucket) -> Tuple[List[str], List[str]]:
        """The names of this rank's state of ``bucket``: per element (a tensor of the block's
        shape) and per parameter (the rest)."""
        state = self.optim.state.get(bucket.shard, {})
        per_element = [k for k, v in state.items()
                       if torch.is_tensor(v) and v.dim() == 1 and v.shape == bucket.shard.shape]
        return per_element, [k for k in state if k not in per_element]

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's state on rank ``to`` (collective), where ``state_dict()`` then
        returns it; the other ranks keep nothing."""
        s = self._mpi
        if isinstance(to, bool) or not isinstance(to, (int, np.integer)):
            raise TypeError(f"{CALLER}.consolidate_state_dict: to must be an int, got {type(to).__name__}")
        if not 0 <= to < s.size:
            raise ValueError(f"{CALLER}.consolidate_state_dict: to must be a rank in 0..{s.size - 1}, got {to}")
        to = int(to)
        s.drain()
        lib = s.lib
        with INSPECTOR.watching(lib.watch, f"{CALLER}.consolidate_state_dict(to={to})"):
            if s.size > 1:
                mpi_ops.agree_cheaply(lib, f"{CALLER}.consolidate_state_dict", {"to": to})
            keys = [self._element_keys(b) for b in self._buckets]
            if s.size > 1:
                keys = lib.bcast(keys, root=to)
            gathered: Dict[int, Dict[str, Any]] = {}
            for bucket, (per_element, per_param) in zip(self._buckets, keys):
                state = self.optim.state.get(bucket.shard, {})
                whole: Dict[str, torch.Tensor] = {}
                for key in per_element:
                    mine = state.get(key)
                    if mine is None:
                        raise RuntimeError(f"{CALLER}.consolidate_state_dict: rank {s.rank} has no state {key!r}")
                    mine = mine.detach().contiguous()
                    if s.size == 1:
                        whole[key] = mine
                        continue
                    size = mine.element_size()
                    counts = [c * size for c in block_counts(bucket.n, s.size)]
                    out = tensors.empty((bucket.n,), mine.dtype) if s.rank == to else None
                    recv = [tensors.as_bytes(out), (counts, [sum(counts[:r]) for r in range(s.size)])] \
                        if s.rank == to else None
                    lib.Gatherv(tensors.as_bytes(mine), recv, root=to)
                    if s.rank == to:
                        whole[key] = out
                if s.rank != to:
                    continue
                for i, p, (a, b) in zip(bucket.indices, bucket.params, bucket.bounds):
                    entry = {key: whole[key][a:b].view(p.shape).clone() for key in per_element}
                    for key in per_param:
                        value = state[key]
                        entry[key] = value.clone() if torch.is_tensor(value) else value
                    if entry:
                        gathered[i] = entry
        self._consolidated = dict(sorted(gathered.items())) if s.rank == to else None

    def _groups_numbered(self) -> List[Dict[str, Any]]:
        groups, index = [], 0
        for group in self.param_groups:
            numbered = {k: v for k, v in group.items() if k != "params"}
            numbered["params"] = list(range(index, index + len(group["params"])))
            index += len(group["params"])
            groups.append(numbered)
        return groups

    def state_dict(self) -> Dict[str, Any]:
        """The state last consolidated on this rank (``consolidate_state_dict(to=this rank)``
        first), with the current parameter groups, in ``torch.optim``'s format (the state of
        every parameter in its shape, numbered as ``param_groups`` numbers them): what a plain
        ``optimizer_class`` over the same parameters would return. ``RuntimeError`` elsewhere."""
        if self._consolidated is None:
            raise RuntimeError(f"{CALLER}: the optimizer state has not been consolidated on this rank; call "
                               f"consolidate_state_dict(to={self.rank}) on every rank first")
        return {"state": self._consolidated, "param_groups": self._groups_numbered()}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load ``state_dict`` (``state_dict()``'s format, or a plain ``torch.optim`` optimizer's
        over the same parameters, from a run at any rank count): every group's settings, and this
        rank's blocks of every parameter's state. Not collective."""
        caller = f"{CALLER}.load_state_dict"
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise TypeError(f"{caller}: state_dict must be a dict with 'state' and 'param_groups'")
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"{caller}: state_dict has {len(groups)} parameter groups, this optimizer "
                             f"{len(self.param_groups)}")
        for g, (theirs, ours) in enumerate(zip(groups, self.param_groups)):
            if len(theirs["params"]) != len(ours["params"]):
                raise ValueError(f"{caller}: group {g} of state_dict has {len(theirs['params'])} parameters, this "
                                 f"optimizer's {len(ours['params'])}")
        numbering = {theirs_i: ours_i for theirs_g, ours_g in zip(groups, self._groups_numbered())
                     for theirs_i, ours_i in zip(theirs_g["params"], ours_g["params"])}
        state = {numbering[i]: v for i, v in state_dict["state"].items() if i in numbering}
        local_state: Dict[int, Dict[str, Any]] = {}
        for k, bucket in enumerate(self._buckets):
            entries = [state.get(i) for i in bucket.indices]
            present = [e for e in entries if e]
            if not present:
                continue
            if len(present) != len(entries):
                missing = [i for i, e in zip(bucket.indices, entries) if not e]
                raise ValueError(f"{caller}: parameters {missing[:10]} have no state while others of their group do")
            shaped = [(p, e) for p, e in zip(bucket.params, entries) if p.dim() > 0]
            local: Dict[str, Any] = {}
            for key in present[0]:
                if shaped:
                    per_element = all(torch.is_tensor(e.get(key)) and e[key].shape == p.shape for p, e in shaped)
                else:
                    per_element = key not in _SCALAR_STATE
                if not per_element:   # a copy: the optimizer steps counters in place
                    value = present[0][key]
                    local[key] = value.clone() if torch.is_tensor(value) else value
                    continue
                values = [e.get(key) for e in entries]
                if any(not torch.is_tensor(v) or v.numel() != p.numel() for v, p in zip(values, bucket.params)):
                    raise ValueError(f"{caller}: state {key!r} is not one value per element for every parameter")
                block = torch.empty(bucket.hi - bucket.lo, dtype=values[0].dtype)
                for v, (a, b) in zip(values, bucket.bounds):
                    lo, hi = max(a, bucket.lo), min(b, bucket.hi)
                    if lo < hi:
                        block[lo - bucket.lo:hi - bucket.lo].copy_(v.detach().reshape(-1)[lo - a:hi - a])
                local[key] = block
            local_state[k] = local
        shard_index = {id(b.shard): k for k, b in enumerate(self._buckets)}
        local_groups, numbered = [], 0
        position: Dict[int, int] = {}
        for group, settings in zip(self.optim.param_groups, groups):
            indices = []
            for shard in group["params"]:
                position[shard_index[id(shard)]] = numbered
                indices.append(numbered)
                numbered += 1
            local_groups.append({**{k: v for k, v in settings.items() if k != "params"}, "params": indices})
        self.optim.load_state_dict({"state": {position[k]: v for k, v in local_state.items()},
                                    "param_groups": local_groups})
        self._copy_settings(groups, self.param_groups)
        self._copy_settings(self.param_groups, self.optim.param_groups)

    def __repr__(self) -> str:
        return f"{CALLER}(stage={self._stage}, {len(self._buckets)} bucket(s), {self.optim!r})"
