"""``fully_shard``: each layer's parameters held as this rank's block only (ZeRO stage 3), in the
shape of PyTorch's FSDP2 ``fully_shard(module)``; ``full_state_dict``: the whole parameters back.

After ``fully_shard(model)`` (an ``nn.Sequential``, an ``nn.ModuleList``, or any module as one
layer), every layer with trainable parameters holds one parameter, ``flat_shard``: rank r's block
(``allreduce_kit.shard_bounds``) of the layer's parameters laid out in one flat buffer. Its
original parameters are attributes that exist only while the layer runs:

- before a layer's forward, its block is ``iallgather``-ed into the layer's flat buffer, and the
  parameters are views of it; after the forward the buffer's memory is freed;
- before its backward (a hook on the layer's output), the same again; after, the gradient of
  the flat buffer is ``ireduce_scatter``-ed (mean over the ranks) into ``flat_shard.grad``
  (added to what is there, as autograd accumulates) and the buffer is freed again;
- the next layers' allgathers (the previous ones' in backward) start while a layer computes,
  at most ``prefetch`` ahead: at most ``prefetch + 1`` layers are whole at a time.

Every collective is one of ``allreduce_kit.nonblocking``'s, on the communicator of ``init()``,
started in the same order on every rank; none is left in flight when forward returns, nor when
backward does. Layers run in the order of the container (forward) and its reverse (backward).
"""
import ctypes
import functools
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.nn as nn

from ..blocks import block as block_of
from ..collectives.allgather import allgather
from ..nonblocking import Handle, iallgather, ireduce_scatter
from ..stall import INSPECTOR
from . import mpi_ops, tensors

CALLER = "fully_shard"
#: The name of each sharded layer's one parameter.
SHARD = "flat_shard"
DTYPES = (torch.float32, torch.float64)
_NUMPY = {torch.float32: np.float32, torch.float64: np.float64}


class _Layer:
    """One layer's trainable parameters: where they live, their flat layout and this rank's block."""

    def __init__(self, name: str, module: nn.Module, members: List[Tuple[str, nn.Module, str, nn.Parameter]],
                 rank: int, size: int):
        self.name, self.module = name, module
        #: (name under the layer, owning submodule, attribute, shape, (start, stop) in the flat buffer)
        self.places: List[Tuple[str, nn.Module, str, torch.Size, Tuple[int, int]]] = []
        n = 0
        for qualified, owner, attr, p in members:
            self.places.append((qualified, owner, attr, p.shape, (n, n + p.numel())))
            n += p.numel()
        self.n = n
        self.dtype = members[0][3].dtype
        self.lo, self.hi = block_of(n, size, rank)
        self.originals = [p for _, _, _, p in members]
        #: the whole flat buffer, while gathered; its memory is freed (size 0) otherwise
        self.full = torch.empty(n, dtype=self.dtype)
        self.full.untyped_storage().resize_(0)
        self.shard: Optional[nn.Parameter] = None
        self.gathered = False
        self.handle: Optional[Handle] = None

    def flat_of_originals(self) -> torch.Tensor:
        flat = torch.empty(self.n, dtype=self.dtype)
        with torch.no_grad():
            for p, (_, _, _, _, (a, b)) in zip(self.originals, self.places):
                flat[a:b].copy_(p.detach().reshape(-1))
        return flat


def _memory(full: torch.Tensor) -> np.ndarray:
    """A numpy array over ``full``'s memory that torch does not know of: ``tensor.numpy()`` would
    make its storage one that can no longer be freed by resizing it to 0 (and given memory
    again), which is how a layer's buffer is freed while the views autograd saved stay valid."""
    raw = (ctypes.c_char * (full.numel() * full.element_size())).from_address(full.data_ptr())
    return np.frombuffer(raw, dtype=_NUMPY[full.dtype])


class _Gathered(torch.autograd.Function):
    """The layer's whole flat buffer from its block: forward hands over the gathered buffer;
    backward reduce-scatters its gradient into the block's (``_Sharding.reduce``)."""

    @staticmethod
    def forward(ctx, shard, sharding, k):
        ctx.sharding, ctx.k = sharding, k
        return sharding.layers[k].full.detach()

    @staticmethod
    def backward(ctx, grad):
        ctx.sharding.reduce(ctx.k, grad)
        return None, None, None


class _Sharding:
    """What ``fully_shard`` keeps on the module: the layers, the hooks' state, the calls in flight."""

    def __init__(self, layers: List[_Layer], prefetch: int):
        self.mpi = mpi_ops.state()
        self.layers = layers
        self.prefetch = prefetch
        #: reduce-scatters in flight: (layer, handle, the gradient sent, the block it lands in)
        self.reducing: List[Tuple[int, Handle, torch.Tensor, torch.Tensor]] = []
        self.in_backward = False

    # -- gathering and freeing ------------------------------------------------------------------
    def _live(self) -> int:
        return sum(1 for layer in self.layers if layer.gathered or layer.handle is not None)

    def _start(self, k: int) -> None:
        layer = self.layers[k]
        full = layer.full
        full.untyped_storage().resize_(layer.n * full.element_size())
        if self.mpi.size == 1:   # through numpy: the views autograd saved must not see a new version
            _memory(full)[:] = layer.shard.detach().numpy()
            layer.gathered = True
            return
        layer.handle = iallgather(layer.shard.detach().numpy(), _memory(full), comm=self.mpi.dup, check=False)

    def gather(self, k: int) -> None:
        """Layer ``k`` whole: wait for its prefetched allgather, or gather it now."""
        layer = self.layers[k]
        if layer.gathered:
            return
        if layer.handle is None:
            self._start(k)
        if layer.handle is not None:
            layer.handle.wait()
            layer.handle = None
        layer.gathered = True

    def ahead(self, order: List[int]) -> None:
        """Start the allgathers of the layers in ``order`` (the ones that run next) while fewer
        than ``prefetch + 1`` layers are whole or on their way."""
        for k in order[:self.prefetch]:
            layer = self.layers[k]
            if not layer.gathered and layer.handle is None and self._live() < self.prefetch + 1:
                self._start(k)

    def free(self, k: int) -> None:
        layer = self.layers[k]
        if layer.handle is not None:
            layer.handle.wait()
            layer.handle = None
        layer.full.untyped_storage().resize_(0)
        layer.gathered = False

    def free_all(self) -> None:
        for k in range(len(self.layers)):
            self.free(k)

    # -- gradients --------------------------------------------------------------------------------
    def reduce(self, k: int, grad: torch.Tensor) -> None:
        """Layer ``k``'s backward is done: start the reduce-scatter (mean) of its flat gradient and
        free its buffer; retire the reductions that have finished."""
        layer = self.layers[k]
        self.free(k)
        if self.mpi.size == 1:
            self._accumulate(k, grad.reshape(-1).clone())
        else:
            flat = tensors.empty((layer.n,), layer.dtype)
            flat.copy_(grad.reshape(-1))
            out = torch.empty(layer.hi - layer.lo, dtype=layer.dtype)
            handle = ireduce_scatter(flat.numpy(), out.numpy(), op="mean", comm=self.mpi.dup, check=False)
            self.reducing.append((k, handle, flat, out))
        while self.reducing and (self.reducing[0][1].done or len(self.reducing) > self.prefetch + 1):
            self._retire()

    def _retire(self) -> None:
        k, handle, _, out = self.reducing.pop(0)
        handle.wait()
        self._accumulate(k, out)

    def _accumulate(self, k: int, block: torch.Tensor) -> None:
        shard = self.layers[k].shard
        if shard.grad is None:
            shard.grad = block
        else:
            shard.grad.add_(block)

    def end_of_backward(self) -> None:
        """Queued at the first layer's backward: nothing stays in flight or whole after it."""
        try:
            while self.reducing:
                self._retire()
        finally:
            self.free_all()
            self.in_backward = False

    # -- the hooks ----------------------------------------------------------------------------------
    def before_forward(self, k: int, module: nn.Module, args: Any) -> None:
        if k == 0:   # what an interrupted pass left (stale: the blocks may have changed since)
            self.free_all()
            self.in_backward = False
        self.gather(k)
        self.ahead(list(range(k + 1, len(self.layers))))
        layer = self.layers[k]
        if torch.is_grad_enabled() and layer.shard.requires_grad:
            full = _Gathered.apply(layer.shard, self, k)
        else:
            full = layer.full
        for _, owner, attr, shape, (a, b) in layer.places:
            owner.__dict__[attr] = full[a:b].view(shape)

    def after_forward(self, k: int, module: nn.Module, args: Any, output: Any) -> None:
        layer = self.layers[k]
        for _, owner, attr, _, _ in layer.places:
            owner.__dict__.pop(attr, None)
        self.free(k)
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        for tensor in outputs:
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(functools.partial(self.before_backward, k))

    def before_backward(self, k: int, grad: torch.Tensor) -> None:
        if not self.in_backward:
            self.in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self.end_of_backward)
        self.gather(k)
        self.ahead(list(range(k - 1, -1, -1)))


def _layers_of(module: nn.Module) -> List[Tuple[str, nn.Module]]:
    if isinstance(module, (nn.Sequential, nn.ModuleList)):
        return [(name, child) for name, child in module.named_children()]
    return [("", module)]


def _members(layer: nn.Module, name: str) -> List[Tuple[str, nn.Module, str, nn.Parameter]]:
    found = []
    for owner_name, owner in layer.named_modules(remove_duplicate=False):
        for attr, p in owner._parameters.items():
            if p is None or not p.requires_grad:
                continue
            qualified = f"{owner_name}.{attr}" if owner_name else attr
            found.append((qualified, owner, attr, p))
    return found


def fully_shard(module: nn.Module, *, prefetch: int = 1) -> nn.Module:
    """Shard ``module``'s layers' parameters over the ranks of ``init()``; return ``module``.

    Collective. ``module``: an ``nn.Sequential`` or ``nn.ModuleList`` (each child with trainable
    parameters is a layer), or any other module (one layer). Each layer's trainable parameters
    (one dtype, float32 or float64, CPU) become its parameter ``flat_shard``, this rank's block of
    them; rank 0's values are the ones kept. Every rank passes the same model (layers, names,
    shapes and dtypes are compared: a difference raises the same ``ValueError`` on every rank).
    ``prefetch`` (>= 0): how many layers' allgathers may run ahead of the one computing.

    Train as usual, with a plain optimizer over ``module.parameters()`` (each rank steps its
    blocks: the optimizer state is sharded too; it must be element-wise, as for
    ``ZeroRedundancyOptimizer``). Backward leaves in each ``flat_shard.grad`` this rank's block
    of the gradient averaged over the ranks (accumulated over backward passes until zeroed), so
    p ranks with batch b train as one process with batch p*b. Unlike PyTorch's, the parameters
    are plain tensors (no DTensor) and exist only inside the layer's forward; a norm over all
    gradients (``clip_grad_norm_``) sees this rank's blocks only. ``full_state_dict(module)``
    gives the whole state.
    """
    s = mpi_ops.state()

    def validate():
        if not isinstance(module, nn.Module):
            raise TypeError(f"{CALLER}: module must be a torch.nn.Module, got {type(module).__name__}")
        if getattr(module, "_allreduce_kit_sharding", None) is not None:
            raise ValueError(f"{CALLER}: module is already sharded")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int):
            raise TypeError(f"{CALLER}: prefetch must be an int, got {type(prefetch).__name__}")
        if prefetch < 0:
            raise ValueError(f"{CALLER}: prefetch must be >= 0, got {prefetch}")
        layers, seen = [], {}
        for name, child in _layers_of(module):
            members = _members(child, name)
            for qualified, _, _, p in members:
                where = f"parameter {name + '.' if name else ''}{qualified}"
                tensors.check_tensor(p, CALLER, where, dtypes=DTYPES, contiguous=False)
                if id(p) in seen and seen[id(p)] != name:
                    raise ValueError(f"{CALLER}: {where} is shared with layer {seen[id(p)]!r}; a parameter must "
                                     f"belong to one layer")
                seen[id(p)] = name
            members = list({id(m[3]): m for m in members}.values())   # a parameter used twice in a layer: once
            if not members:
                continue
            dtypes = {str(m[3].dtype) for m in members}
            if len(dtypes) > 1:
                raise TypeError(f"{CALLER}: layer {name!r} has parameters of several dtypes ({', '.join(sorted(dtypes))}); "
                                f"a layer's parameters must share one")
            layers.append(_Layer(name, child, members, s.rank, s.size))
        if not layers:
            raise ValueError(f"{CALLER}: module has no trainable parameters")
        return layers

    def describe(layers: List[_Layer]) -> Dict[str, Any]:
        return {"layers (name, parameters: name, shape, dtype)":
                [(layer.name, [(q, tuple(shape), str(layer.dtype).replace("torch.", ""))
                               for q, _, _, shape, _ in layer.places]) for layer in layers],
                "prefetch": prefetch}

    layers = mpi_ops.begin(CALLER, True, validate, describe)
    keys = list(module.state_dict().keys())
    for layer in layers:
        flat = layer.flat_of_originals()
        if s.size > 1 and layer.n:
            with INSPECTOR.watching(s.lib.watch, f"{CALLER}: rank 0's layer {layer.name!r} to every rank"):
                s.lib.Bcast(flat.numpy(), root=0)
        layer.shard = nn.Parameter(flat[layer.lo:layer.hi].clone())
        for _, owner, attr, _, _ in layer.places:
            if attr in owner._parameters:
                del owner._parameters[attr]
        layer.module.register_parameter(SHARD, layer.shard)
        layer.originals = []
    sharding = _Sharding(layers, prefetch)
    for k, layer in enumerate(layers):
        layer.module.register_forward_pre_hook(functools.partial(sharding.before_forward, k))
        layer.module.register_forward_hook(functools.partial(sharding.after_forward, k))
    sharding.keys = keys
    module.__dict__["_allreduce_kit_sharding"] = sharding
    return module


def full_state_dict(module: nn.Module) -> Dict[str, torch.Tensor]:
    """``module.state_dict()`` as it was before ``fully_shard``: every parameter whole (new
    tensors), on every rank. Collective (one allgather per layer)."""
    sharding = getattr(module, "_allreduce_kit_sharding", None) if isinstance(module, nn.Module) else None
    if sharding is None:
        raise ValueError("full_state_dict: module was not sharded by fully_shard")
    s = sharding.mpi
    s.drain()
    state = module.state_dict()
    whole: Dict[str, torch.Tensor] = {}
    for layer in sharding.layers:
        flat = tensors.empty((layer.n,), layer.dtype)
        if s.size == 1:
            flat.copy_(layer.shard.detach())
        elif layer.n:
            allgather(layer.shard.detach().numpy(), flat.numpy(), comm=s.dup, check=False)
        prefix = f"{layer.name}." if layer.name else ""
        state.pop(prefix + SHARD, None)
        for qualified, _, _, shape, (a, b) in layer.places:
            whole[prefix + qualified] = flat[a:b].view(shape).clone()
    merged = {**state, **whole}
    return {key: merged[key] for key in sharding.keys if key in merged}
