"""``broadcast_parameters`` and ``broadcast_optimizer_state``: every replica starts from the root's.

Both pack every tensor's bytes into one buffer and send it with one ``Bcast``, however many
tensors a model has. Both compare what each rank holds (names, shapes, dtypes) with the other
ranks first, so a rank whose model differs raises ``ValueError`` on every rank instead of
receiving bytes that do not fit.
"""
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..stall import INSPECTOR
from . import mpi_ops, tensors
from .tensors import check_tensor

#: Each tensor starts at a multiple of this many bytes of the packed buffer, so that a view of
#: its bytes can be reinterpreted as its dtype.
_ALIGN = 16


def _offsets(members: Sequence[torch.Tensor]) -> Tuple[List[int], int]:
    starts, total = [], 0
    for t in members:
        starts.append(total)
        total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    return starts, total


def _broadcast_tensors(members: Sequence[torch.Tensor], r: int, what: str) -> None:
    """Overwrite every tensor with ``r``'s, through one packed buffer and one ``Bcast``."""
    s = mpi_ops.state()
    if s.size == 1 or not members:
        return
    starts, total = _offsets(members)
    buf = tensors.empty((total,), torch.uint8)
    if s.rank == r:
        for t, start in zip(members, starts):
            raw = t.detach().reshape(-1).contiguous()
            raw = raw if raw.dtype == torch.uint8 else raw.view(torch.uint8)
            buf[start:start + raw.numel()].copy_(raw)
    with INSPECTOR.watching(s.lib.watch, f"{what}(root_rank={r}, {len(members)} tensors, {total} bytes)"):
        s.lib.Bcast(buf.numpy(), root=r)
    if s.rank != r:
        for t, start in zip(members, starts):
            nbytes = t.numel() * t.element_size()
            t.detach().copy_(buf[start:start + nbytes].view(t.dtype).view(t.shape))


def _items(params: Any, caller: str) -> List[Tuple[Optional[str], torch.Tensor]]:
    if isinstance(params, torch.Tensor):
        raise TypeError(f"{caller}: params must be a state_dict, a list of tensors or of (name, tensor) pairs, "
                        f"got one tensor (pass [tensor])")
    if isinstance(params, dict):
        return sorted(params.items(), key=lambda item: str(item[0]))
    try:
        listed = list(params)
    except TypeError:
        raise TypeError(f"{caller}: params must be a state_dict, a list of tensors or of (name, tensor) pairs, "
                        f"got {type(params).__name__}") from None
    items = []
    for i, p in enumerate(listed):
        if isinstance(p, tuple):
            if len(p) != 2:
                raise ValueError(f"{caller}: params[{i}] must be a (name, tensor) pair, got a tuple of {len(p)}")
            items.append(p)
        else:
            items.append((None, p))
    return items


def broadcast_parameters(params: Any, root_rank: int = 0) -> None:
    """Overwrite every tensor of ``params`` in place with ``root_rank``'s (collective).

    ``params``: ``model.state_dict()`` (tensors in the order of their names),
    ``model.named_parameters()`` or a list of tensors. Tensors of any dtype and layout in memory
    are taken; the parameters of a model share memory with its ``state_dict()``, so broadcasting
    that updates the model. One ``Bcast`` carries them all.
    """
    caller = "broadcast_parameters"

    def validate():
        items = _items(params, caller)
        for i, (name, t) in enumerate(items):
            check_tensor(t, caller, f"params[{name!r}]" if name is not None else f"params[{i}]", contiguous=False)
        return items, mpi_ops.root(root_rank, caller)

    def describe(value) -> Dict[str, Any]:
        items, r = value
        return {"root_rank": r, "tensors (name, shape, dtype)":
                [(name, tuple(t.shape), str(t.dtype).replace("torch.", "")) for name, t in items]}

    items, r = mpi_ops.begin(caller, True, validate, describe)
    _broadcast_tensors([t for _, t in items], r, caller)


class _Slot:
    """Where a tensor stood in an optimizer's state_dict, while the tensors travel apart."""

    __slots__ = ("index", "shape", "dtype")

    def __init__(self, index: int, shape: Tuple[int, ...], dtype: torch.dtype):
        self.index, self.shape, self.dtype = index, shape, dtype


def _strip(value: Any, found: List[torch.Tensor]) -> Any:
    """``value`` with every tensor replaced by a ``_Slot`` (the tensors appended to ``found``)."""
    if isinstance(value, torch.Tensor):
        found.append(value)
        return _Slot(len(found) - 1, tuple(value.shape), value.dtype)
    if isinstance(value, dict):
        return {k: _strip(v, found) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_strip(v, found) for v in value)
    return value


def _fill(value: Any, found: Sequence[torch.Tensor]) -> Any:
    if isinstance(value, _Slot):
        return found[value.index]
    if isinstance(value, dict):
        return {k: _fill(v, found) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_fill(v, found) for v in value)
    return value


def _shape_of(state_dict: Dict[str, Any]) -> List[int]:
    return [len(group["params"]) for group in state_dict["param_groups"]]


def _initialize_state(optimizer: torch.optim.Optimizer, model: Optional[torch.nn.Module]) -> Dict[str, Any]:
    """``optimizer.state_dict()``, after one local step with zero gradients where the state is
    empty (Horovod's): the state then holds what the first step makes (momentum buffers, step
    counts), to be overwritten by the root's. The zero gradients are sparse for ``SparseAdam``
    and for the parameters of ``model``'s sparse embeddings. ``LBFGS``, whose step needs a
    closure, is left as it is. A ``DistributedOptimizer`` steps as the optimizer it wraps:
    nothing is reduced."""
    from .optimizer import _DistributedOptimizer

    state_dict = optimizer.state_dict()
    if state_dict["state"] or isinstance(optimizer, torch.optim.LBFGS):
        return state_dict
    sparse = {id(p) for m in (model.modules() if model is not None else ())
              if isinstance(m, torch.nn.Embedding) and m.sparse for p in m.parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                zeros = torch.zeros_like(p)
                p.grad = zeros.to_sparse() if isinstance(optimizer, torch.optim.SparseAdam) or id(p) in sparse else zeros
    with torch.no_grad():
        if isinstance(optimizer, _DistributedOptimizer):
            super(_DistributedOptimizer, optimizer).step()
        else:
            optimizer.step()
    return optimizer.state_dict()


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0,
                              model: Optional[torch.nn.Module] = None) -> None:
    """Give every rank's ``optimizer`` ``root_rank``'s state and hyperparameters (collective).

    Afterwards ``optimizer.state_dict()`` is the same on every rank: momentum buffers, step
    counts, learning rates. A rank whose optimizer has not stepped yet (an empty state) first
    makes its state as Horovod's does (``_initialize_state``): each trainable parameter's
    ``.grad`` is set to zeros and the wrapped optimizer steps once, locally (with weight decay
    that step moves the parameters, as any step does). Every rank's optimizer must have as many
    parameter groups, with as many parameters each, as the root's. ``model`` (optional, as in
    Horovod) names the sparse embeddings whose zero gradients must be sparse.
    """
    caller = "broadcast_optimizer_state"
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{caller}: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"{caller}: model must be a torch.nn.Module or None, got {type(model).__name__}")
    r = mpi_ops.root(root_rank, caller)
    s = mpi_ops.state()
    s.drain()
    mine = _initialize_state(optimizer, model)
    if s.size == 1:
        return
    found: List[torch.Tensor] = []
    skeleton = _strip(mine, found) if s.rank == r else None
    with INSPECTOR.watching(s.lib.watch, f"{caller}(root_rank={r}): the state's structure"):
        skeleton = s.lib.bcast(skeleton, root=r)
    error = None
    if _shape_of(skeleton) != _shape_of(mine):
        error = ValueError(f"{caller}: this rank's optimizer has parameter groups of {_shape_of(mine)} parameters, "
                           f"root rank {r}'s has {_shape_of(skeleton)}")
    mpi_ops.agree(caller, error if error is not None else {})
    if s.rank != r:
        slots: List[_Slot] = []

        def collect(value: Any) -> None:
            if isinstance(value, _Slot):
                slots.append(value)
            elif isinstance(value, dict):
                for v in value.values():
                    collect(v)
            elif isinstance(value, (list, tuple)):
                for v in value:
                    collect(v)

        collect(skeleton)
        found = [None] * len(slots)  # type: ignore[list-item]
        for slot in slots:
            found[slot.index] = torch.empty(slot.shape, dtype=slot.dtype)
    _broadcast_tensors(found, r, caller)
    if s.rank != r:
        optimizer.load_state_dict(_fill(skeleton, found))
