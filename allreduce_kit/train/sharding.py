"""Sharded data parallelism (``--zero 1|2|3``): each rank keeps its block of the model state only.

Plain data parallelism (``--zero 0``) keeps on every rank the whole model: parameters, gradient
and optimizer state (16 bytes per float32 parameter with Adam). The stages of ZeRO (Rajbhandari
et al. 2020) keep on rank r only block r of what is partitioned, and communicate no more than
``--zero 0`` does (stages 1 and 2) or half as much again (stage 3):

- stage 1: block r of the optimizer state. The gradient is reduce-scattered (rank r receives the
  average of block r), rank r updates block r of the parameters, and the parameters are
  allgathered. A reduce-scatter and an allgather move what one allreduce moves.
- stage 2: and block r of the averaged gradient only. The backward pass writes each layer's
  gradient into one bucket buffer; each bucket is reduce-scattered as soon as the backward pass
  has written all of it, and the full-size gradient is never held (with ``--bucket-mb`` smaller
  than the model).
- stage 3: and block r of the parameters only. Each layer's parameters are allgathered just before
  its forward and again before its backward and dropped after; the next layer's allgather runs
  while the current layer computes (``iallgather``), at most two layers gathered at a time. Each
  layer's gradient is reduce-scattered as the backward pass leaves it.

Sharding is a partition of one flat buffer by one block rule: the flat parameter buffer is cut
into units, the buckets of ``--bucket-mb`` in stages 1 and 2 (the buckets ``--zero 0`` averages)
and the layers in stage 3, and every unit into blocks by ``allreduce_kit.blocks`` (``Layout``).
Rank r's shard is its block of every unit, one after the other. The collectives cut their
buffers by the same rule, so a unit's ``reduce_scatter`` leaves exactly rank r's block on rank r
and its ``allgather`` puts it back.

Same training: the optimizers are elementwise, so stages 1 and 2 update bitwise what ``--zero 0``
updates, provided the reduce-scatter folds every rank's copy of an element in the order
``--zero 0``'s allreduce does. The reduce-scatter algorithm is taken from
``allreduce_kit.algorithms.reduce_scatter.SAME_FOLDS`` for the allreduce algorithm ``--zero 0``
runs on each bucket (``--algorithm``, or ``auto``'s choice for the bucket's size): ``ring`` and
``two_shot`` have one, ``rabenseifner`` and ``recursive_doubling`` too; the others have none and
agree to rounding. Stage 3 reduces per layer, not per bucket: it agrees to rounding.

The trainer does not know which stage runs: the object made here finishes each step after the
compute (``after_compute``), as the other strategies do (``modes.py``), and in stages 2 and 3
it is also the ``layers`` the model's passes take their parameters from and hand their gradients
to (``model.OwnLayers``).
"""
import hashlib
import os
import resource
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from .. import faults, selection
from ..algorithms.reduce_scatter import SAME_FOLDS
from ..blocks import block
from ..collectives.allgather import allgather
from ..collectives.reduce_scatter import reduce_scatter
from ..comm import library_comm
from ..nonblocking import iallgather, ireduce_scatter
from ..params import broadcast_parameters, bucket_bounds
from . import checkpoint
from .optimizer import learning_rate, make_optimizer
from .trainer import NonFiniteError, all_finite, digest

#: The ``--zero`` stages.
STAGES = (0, 1, 2, 3)


class Layout:
    """Rank ``rank``'s blocks of ``units`` (``[start, stop)`` ranges of a flat buffer, in order),
    each unit cut into ``ranks`` blocks by the one block rule (``allreduce_kit.blocks.block``).

    ``pieces[u]`` is rank ``rank``'s block of unit u as a range of the flat buffer;
    ``at[u]:at[u + 1]`` where it lies in the rank's shard; ``size`` the shard's length."""

    def __init__(self, units: Sequence[Tuple[int, int]], ranks: int, rank: int):
        self.units = [(int(a), int(b)) for a, b in units]
        self.ranks, self.rank = int(ranks), int(rank)
        self.pieces: List[Tuple[int, int]] = []
        self.at = [0]
        for a, b in self.units:
            lo, hi = block(b - a, self.ranks, self.rank)
            self.pieces.append((a + lo, a + hi))
            self.at.append(self.at[-1] + hi - lo)
        self.size = self.at[-1]

    def part(self, shard: np.ndarray, unit: int) -> np.ndarray:
        """Unit ``unit``'s block in ``shard`` (a view)."""
        return shard[self.at[unit]:self.at[unit + 1]]

    def of(self, flat: np.ndarray, unit: int) -> np.ndarray:
        """This rank's block of unit ``unit`` in the full buffer ``flat`` (a view)."""
        a, b = self.pieces[unit]
        return flat[a:b]

    @staticmethod
    def largest(units: Sequence[Tuple[int, int]], ranks: int) -> int:
        """The longest shard any rank has."""
        return max(Layout(units, ranks, r).size for r in range(ranks))


def layer_units(model: Any) -> List[Tuple[int, int]]:
    return [model.layer_bounds(layer) for layer in range(model.layers)]


def units_for(stage: int, model: Any, bucket_mb: float) -> List[Tuple[int, int]]:
    """The units the flat buffer is sharded by at ``stage``: the buckets (1, 2) or the layers (3)."""
    if stage == 3:
        return layer_units(model)
    return bucket_bounds(model.size, model.dtype.itemsize, bucket_mb)


def sent_bytes(collective: str, nbytes: int, ranks: int) -> float:
    """The bytes a rank sends in one call on a buffer of ``nbytes`` by a bandwidth-optimal
    schedule: (p-1)/p of it for ``reduce_scatter`` and ``allgather``, twice that for ``allreduce``."""
    share = nbytes * (ranks - 1) / ranks
    return 2 * share if collective == "allreduce" else share


def reduce_scatter_algorithm(algorithm: str, comm: MPI.Intracomm, nbytes: int) -> str:
    """The reduce-scatter to run where ``--zero 0`` runs ``allreduce(algorithm=algorithm)`` on a
    bucket of ``nbytes``: the one that folds as it does (``SAME_FOLDS``), else MPI's for ``mpi``,
    else ``auto``."""
    name = algorithm
    if name == "auto" and comm.Get_size() > 1:
        name = selection.choose_for(library_comm(comm), nbytes)
    name = faults.runs_as(name, nbytes)
    return SAME_FOLDS.get(name, "mpi" if name == "mpi" else "auto")


def peak_rss_bytes() -> int:
    """This process's peak resident set size (``getrusage``; kilobytes on Linux)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class Sharded:
    """Finishes the steps of ``trainer`` at ZeRO ``stage`` 1, 2 or 3 (see the module's docstring).

    Made by the trainer right after its model (at stage 3 a model without buffers), before any
    checkpoint is read: it makes the optimizer for this rank's shard (``trainer.optimizer``) and,
    at stage 3, the parameters' shard, initialised as ``--zero 0`` initialises them; ``load``
    takes its blocks of a checkpoint's whole arrays."""

    def __init__(self, trainer: Any, stage: int):
        t = self.t = trainer
        self.stage = stage
        model, cfg, comm = t.model, t.config, t.comm
        self.ranks, self.rank = t.ranks, t.rank
        self.units = units_for(stage, model, cfg.bucket_mb)
        self.layout = Layout(self.units, self.ranks, self.rank)
        dtype = model.dtype
        size = self.layout.size
        isz = dtype.itemsize
        #: ``--compression fp16|bf16``: the gradients' reduce-scatters send 16-bit values, with the
        #: algorithm ``--zero 0``'s compressed allreduce would run (``auto``: ``compression.choose``)
        self.wire = cfg.compression if cfg.compression in ("fp16", "bf16") else "none"
        self.spared = 0.0                                # the bytes the 16-bit values left unsent
        if self.wire != "none":
            self.algorithms = [cfg.algorithm] * len(self.units)
        else:
            self.algorithms = [reduce_scatter_algorithm(cfg.algorithm, comm, (b - a) * isz) for a, b in self.units]
        # Stage 1 keeps the whole gradient (the backward pass writes it) and reduce-scatters each
        # bucket into its own block of it; stages 2 and 3 keep the reduced blocks only.
        self.grad_shard = np.zeros(size, dtype) if stage >= 2 else None
        t.optimizer = make_optimizer(cfg.optimizer, size, dtype, cfg.momentum, cfg.weight_decay)
        self.sums = np.zeros(3)
        self.nan_next = False
        self.buffers: Dict[str, np.ndarray] = {}
        if stage == 2:
            self.buffers["bucket"] = np.empty(max(b - a for a, b in self.units), dtype)
            self.buffers["layer gradient"] = np.empty(max(b - a for a, b in layer_units(model)), dtype)
            self._open: Optional[Tuple[int, int]] = None   # (unit, elements written) of the bucket being filled
            model.flat.grads = model.grads = None            # the whole gradient is not kept
            model._g = []
        if stage == 3:
            longest = max(b - a for a, b in self.units)
            self.param_shard = np.empty(size, dtype)
            self.buffers["gathered layers"] = np.empty(2 * longest, dtype)
            self.buffers["layer gradients"] = np.empty(2 * longest, dtype)
            self._slots = [self.buffers["gathered layers"][:longest], self.buffers["gathered layers"][longest:]]
            self._gslots = [self.buffers["layer gradients"][:longest], self.buffers["layer gradients"][longest:]]
            self._held: Optional[Tuple[int, int]] = None      # (layer, slot) gathered and in use
            self._coming: Optional[Tuple[int, int, Any]] = None   # (layer, slot, handle) being gathered
            self._last = -1
            self._reducing: List[Any] = [None, None]         # the reduce-scatter in flight from each slot
            self._gslot = 0
            self._init_shard()
        if stage >= 2:
            t.layers = self
            t.eval_layers = Evaluation(self) if stage == 3 else self

    def _init_shard(self) -> None:
        """Stage 3: the parameters ``--zero 0`` starts from (rank 0's draws, layer by layer), each
        layer broadcast from rank 0 and this rank's block kept: one layer whole at a time."""
        t, model = self.t, self.t.model
        rng = np.random.default_rng([t.config.seed, 4, self.rank])
        layer_buf = self.buffers["gathered layers"]
        for layer, (a, b) in enumerate(self.units):
            buf = layer_buf[:b - a]
            if self.rank == 0:
                model.init_layer(rng, layer, *model.layer_views(buf, layer))
            broadcast_parameters(buf, root=0, comm=t.comm)
            lo, hi = block(b - a, self.ranks, self.rank)
            self.layout.part(self.param_shard, layer)[...] = buf[lo:hi]

    def load(self, arrays: Dict[str, np.ndarray]) -> None:
        """Take this rank's blocks of whole-buffer ``arrays`` (``params`` and the optimizer's state
        by name), e.g. a checkpoint of another stage or rank count."""
        if self.stage == 3:
            for u in range(len(self.units)):
                self.layout.part(self.param_shard, u)[...] = self.layout.of(arrays["params"], u)
        else:
            self.t.model.params[...] = arrays["params"]
        for name, mine in self.t.optimizer.state().items():
            for u in range(len(self.units)):
                self.layout.part(mine, u)[...] = self.layout.of(arrays[name], u)

    # -- checkpoints -------------------------------------------------------------------------
    def arrays(self) -> Dict[str, np.ndarray]:
        """This rank's blocks of the parameters and of the optimizer state, as its checkpoint file holds them."""
        params = self.param_shard if self.stage == 3 else \
            np.concatenate([self.layout.of(self.t.model.params, u) for u in range(len(self.units))])
        return {"params": params, **self.t.optimizer.state()}

    def save(self, directory: str, step: int, meta: Optional[Dict[str, Any]], keep: int) -> None:
        """Every rank writes its blocks to ``checkpoint-STEP.shards/rank-R.npz`` (atomically), then
        rank 0 the manifest ``checkpoint-STEP.npz`` (``meta``, rank 0's, with the stage, the ranks,
        the block rule and the units), which makes the checkpoint: a crash before it leaves the
        previous one the newest. Collective; a failure on any rank raises on every rank."""
        t = self.t
        final = os.path.join(directory, checkpoint.name_for(step))
        folder = checkpoint.shards_dir(final)
        error = None
        try:
            os.makedirs(folder, exist_ok=True)
            checkpoint.write(os.path.join(folder, checkpoint.shard_name(self.rank)), self.arrays(),
                             {"rank": self.rank, "ranks": self.ranks, "stage": self.stage, "step": step,
                              "run": t.run_identity})
        except OSError as bad:
            error = f"rank {self.rank} could not write its checkpoint file in {folder}: {bad}"
        errors = [e for e in t.comm.allgather(error) if e]
        error = errors[0] if errors else None
        if self.rank == 0 and error is None:
            try:
                record = {"stage": self.stage, "ranks": self.ranks, "rule": checkpoint.BLOCK_RULE,
                          "units": [list(u) for u in self.units], "size": t.model.size,
                          "arrays": list(self.arrays()),
                          "files": [os.path.join(os.path.basename(folder), checkpoint.shard_name(r))
                                    for r in range(self.ranks)]}
                checkpoint.save(directory, step, {}, {**meta, "sharded": record}, keep=keep)
            except (OSError, checkpoint.CheckpointError) as bad:
                error = str(bad)
        error = t.comm.bcast(error, root=0)
        if error:
            raise checkpoint.CheckpointError(error)

    # -- the step ---------------------------------------------------------------------------
    def warm_up(self) -> None:
        """One untimed pass of this stage's compute and collectives (connections, compiled kernels);
        the gradient it leaves is overwritten by the first step's."""
        t = self.t
        t.optimizer.warm_up()
        X, y = t.data.X_train[:2], t.data.y_train[:2]
        if self.stage == 1:
            t.model.forward_backward(X, y)
            a, b = self.units[0]
            reduce_scatter(t.model.grads[a:b], out=self.grad_part(0), op="mean", algorithm=self.algorithms[0],
                           comm=t.comm, compression=self.wire)
        else:
            traffic, sent, spared = list(t.traffic), t.sent, self.spared
            t.model.forward_backward(X, y, self)
            self._settle()
            t.traffic[:], t.sent, self.spared = traffic, sent, spared
        if self.stage < 3:
            self._gather_parameters(count=False)
        self.drop_gathered()
        t.comm.Barrier()

    def after_compute(self, idx: np.ndarray, loss: float, correct: int, t0: float, t1: float) -> None:
        t = self.t
        k = t.step
        if self.stage == 1:
            for u, (a, b) in enumerate(self.units):
                self._reduce(t.model.grads[a:b], u)
        else:
            self._settle()
        t2 = time.perf_counter()
        mine = all(all_finite(self.grad_part(u)) for u in range(len(self.units)))
        finite = t.comm.allreduce(mine, op=MPI.LAND)     # every rank's verdict on its blocks: the same verdict
        if not finite:
            if t.config.on_nonfinite == "abort":
                raise NonFiniteError(k + 1, t.plan.position(k)[0] + 1)
            t.skipped_steps.append(k + 1)
            t3 = time.perf_counter()
        else:
            cfg = t.config
            lr = learning_rate(cfg.lr, t.ranks, cfg.lr_scaling, t.warmup_steps, k)
            if self.stage == 3:
                t.optimizer.step(self.param_shard, self.grad_shard, lr)
                self.drop_gathered()                      # the gathered copies are of the old parameters
                t3 = time.perf_counter()
            else:
                t.optimizer.step_pieces([(self.layout.of(t.model.params, u), self.grad_part(u))
                                         for u in range(len(self.units))], lr)
                t3 = time.perf_counter()
                self._gather_parameters()
        t4 = time.perf_counter()
        t.timer.record(t1 - t0, (t2 - t1) + (t4 - t3), t3 - t2)
        self.sums = np.array([loss, correct, len(idx)], dtype=np.float64)
        t.step += 1

    def grad_part(self, u: int) -> np.ndarray:
        """This rank's block of unit ``u``'s averaged gradient (stage 1: in the whole gradient)."""
        if self.grad_shard is None:
            return self.layout.of(self.t.model.grads, u)
        return self.layout.part(self.grad_shard, u)

    def _reduce(self, buf: np.ndarray, u: int) -> None:
        """Reduce-scatter unit ``u``'s gradient ``buf``: the average of this rank's block into its place."""
        reduce_scatter(buf, out=self.grad_part(u), op="mean", algorithm=self.algorithms[u], comm=self.t.comm,
                       compression=self.wire)
        self._count(buf.nbytes)

    def _count(self, nbytes: int) -> None:
        """A gradient reduce-scatter of ``nbytes``: the bytes it sent (16-bit values: half)."""
        self.t.traffic[0] += 1
        self.t.traffic[1] += nbytes
        whole = sent_bytes("reduce_scatter", nbytes, self.ranks)
        sent = whole / 2 if self.wire != "none" else whole
        self.t.sent += sent
        self.spared += whole - sent

    def _gather_parameters(self, count: bool = True) -> None:
        params = self.t.model.params
        for u, (a, b) in enumerate(self.units):
            allgather(self.layout.of(params, u), out=params[a:b], comm=self.t.comm)
            if count:
                self.t.sent += sent_bytes("allgather", (b - a) * params.itemsize, self.ranks)

    def _settle(self) -> None:
        """Stage 3: wait for the reduce-scatters still in flight."""
        if self.stage == 3:
            for i, handle in enumerate(self._reducing):
                if handle is not None:
                    handle.wait()
                    self._reducing[i] = None

    # -- the layers the model's passes use (stages 2 and 3) ----------------------------------
    def weights(self, layer: int) -> Tuple[np.ndarray, np.ndarray]:
        model = self.t.model
        if self.stage == 2:
            return model._p[2 * layer], model._p[2 * layer + 1]
        return model.layer_views(self._gathered(layer), layer)

    def gradients(self, layer: int) -> Tuple[np.ndarray, np.ndarray]:
        model = self.t.model
        a, b = model.layer_bounds(layer)
        if self.stage == 2:
            return model.layer_views(self.buffers["layer gradient"][:b - a], layer)
        slot = self._gslot
        if self._reducing[slot] is not None:              # its last reduce-scatter still reads it
            self._reducing[slot].wait()
            self._reducing[slot] = None
        return model.layer_views(self._gslots[slot][:b - a], layer)

    def gradient_done(self, layer: int) -> None:
        model = self.t.model
        a, b = model.layer_bounds(layer)
        if self.stage == 2:
            written = self.buffers["layer gradient"][:b - a]
            if self.nan_next and layer == 0:
                written[0] = np.nan                       # --inject-nan: a testing aid
            self._fill(a, written)
            return
        buf = self._gslots[self._gslot][:b - a]
        if self.nan_next and layer == 0:
            buf[0] = np.nan
        self._reducing[self._gslot] = ireduce_scatter(buf, out=self.layout.part(self.grad_shard, layer), op="mean",
                                                      algorithm=self.algorithms[layer], comm=self.t.comm,
                                                      compression=self.wire)
        self._count(buf.nbytes)
        self._gslot ^= 1

    def _fill(self, start: int, values: np.ndarray) -> None:
        """Stage 2: copy a layer's gradient (flat elements from ``start``) into the bucket buffer,
        reduce-scattering every bucket it completes. The backward pass goes down the flat buffer, so
        the bucket buffer holds one bucket at a time, filled from its top."""
        stop = start + values.size
        bucket = self.buffers["bucket"]
        while stop > start:
            u = next(i for i, (a, b) in enumerate(self.units) if a < stop <= b)
            a, b = self.units[u]
            lo = max(a, start)
            bucket[lo - a:stop - a] = values[lo - start:stop - start]
            if self._open is None or self._open[0] != u:
                self._open = (u, 0)
            self._open = (u, self._open[1] + stop - lo)
            if self._open[1] == b - a:                    # the whole bucket is written
                self._reduce(bucket[:b - a], u)
                self._open = None
            stop = lo

    def _gathered(self, layer: int, count: bool = True) -> np.ndarray:
        """Stage 3: layer's full parameters, gathered (or being gathered) into a slot; starts the
        gather of the layer the pass will ask for next."""
        if self._held is not None and self._held[0] == layer:
            view = self._slots[self._held[1]]
        else:
            if self._coming is not None and self._coming[0] == layer:
                _, slot, handle = self._coming
                handle.wait()
                self._coming = None
            else:
                if self._coming is not None:              # not the layer asked for: let it finish
                    self._coming[2].wait()
                    self._coming = None
                slot = 0 if self._held is None else self._held[1] ^ 1
                self._gather(layer, slot, count).wait()
            self._held = (layer, slot)
            view = self._slots[slot]
        going_down = layer > 0 and (layer < self._last or layer == self._last == self.t.model.layers - 1)
        nxt = layer - 1 if going_down else layer + 1
        self._last = layer
        if self._coming is None and (1 <= nxt if going_down else nxt < self.t.model.layers):
            self._coming = (nxt, self._held[1] ^ 1, self._gather(nxt, self._held[1] ^ 1, count))
        a, b = self.units[layer]
        return view[:b - a]

    def _gather(self, layer: int, slot: int, count: bool = True) -> Any:
        a, b = self.units[layer]
        out = self._slots[slot][:b - a]
        if count:                                         # the training steps' traffic, not evaluation's
            self.t.sent += sent_bytes("allgather", out.nbytes, self.ranks)
        return iallgather(self.layout.part(self.param_shard, layer), out, comm=self.t.comm)

    def drop_gathered(self) -> None:
        """Stage 3: forget the gathered layer (the shard changed under it, or a pass ends)."""
        if self.stage == 3:
            if self._coming is not None:
                self._coming[2].wait()
                self._coming = None
            self._held = None
            self._last = -1

    # -- what the trainer asks of a strategy -------------------------------------------------
    def full_parameters(self) -> np.ndarray:
        """The whole flat parameter buffer on every rank (collective; stage 3 gathers it)."""
        if self.stage < 3:
            return self.t.model.params
        self.drop_gathered()
        out = np.empty(self.t.model.size, self.t.model.dtype)
        for u, (a, b) in enumerate(self.units):
            allgather(self.layout.part(self.param_shard, u), out=out[a:b], comm=self.t.comm)
        return out

    def params_digest(self) -> str:
        """blake2b of the whole flat parameter buffer, as ``trainer.digest`` computes it (collective;
        stage 3 gathers one layer at a time)."""
        if self.stage < 3:
            return digest(self.t.model.params)
        self.drop_gathered()
        h = hashlib.blake2b(digest_size=16)
        for u, (a, b) in enumerate(self.units):
            out = self._slots[0][:b - a]
            allgather(self.layout.part(self.param_shard, u), out=out, comm=self.t.comm)
            h.update(out.data)
        return h.hexdigest()

    def held_bytes(self) -> Dict[str, int]:
        """The bytes of the model-state arrays this rank holds: parameters, gradients, optimizer
        state, and the buffers the stage gathers and reduces through."""
        t = self.t
        params = self.param_shard.nbytes if self.stage == 3 else t.model.params.nbytes
        grads = t.model.grads.nbytes if self.stage == 1 else self.grad_shard.nbytes
        state = sum(a.nbytes for a in t.optimizer.state().values())
        buffers = sum(a.nbytes for a in self.buffers.values())
        return {"parameters": params, "gradients": grads, "optimizer_state": state, "buffers": buffers,
                "total": params + grads + state + buffers}

    def finish(self) -> None:
        """Nothing is left in flight between steps."""
        self._settle()
        self.drop_gathered()

    def amend(self, out: Dict[str, Any], records: Optional[np.ndarray]) -> None:
        out["zero"] = {"stage": self.stage, "units": len(self.units), "shard_elements": self.layout.size,
                       "reduce_scatter_algorithms": sorted(set(self.algorithms))}

    def close(self) -> None:
        """No communicator of its own."""
        self.finish()


# -- the run's memory ------------------------------------------------------------------------------
def plain_held_bytes(trainer: Any) -> Dict[str, int]:
    """``Sharded.held_bytes`` for a run without sharding (``--zero 0``)."""
    params, grads = trainer.model.params.nbytes, trainer.model.grads.nbytes
    state = sum(a.nbytes for a in trainer.optimizer.state().values())
    extra = getattr(trainer, "_accumulated", None)               # --accum-steps' running sum
    buffers = 0 if extra is None else extra.nbytes
    return {"parameters": params, "gradients": grads, "optimizer_state": state, "buffers": buffers,
            "total": params + grads + state + buffers}


def estimate_for(widths: Sequence[int], ranks: int, stage: int, optimizer: str, dtype: str,
                 bucket_mb: float) -> Dict[str, int]:
    """``allreduce_kit.memory.model_state`` for the trainer's MLP of ``widths`` with these options."""
    from ..memory import mlp_sizes, model_state

    itemsize = np.dtype(dtype).itemsize
    layers = mlp_sizes(widths)
    size = sum(layers)
    bucket = max(b - a for a, b in bucket_bounds(size, itemsize, bucket_mb))
    return model_state(size, ranks, stage, optimizer, itemsize, layers, bucket)


def memory_report(trainer: Any) -> Dict[str, Any]:
    """The ``memory`` of ``--json`` (collective): the model-state bytes each rank holds (the largest as
    ``model_state_bytes``, rank 0's parts as ``model_state``), the estimate the run started with, and
    every rank's peak RSS."""
    held = trainer.shards.held_bytes() if trainer.shards is not None else plain_held_bytes(trainer)
    cfg = trainer.config
    estimate = estimate_for(trainer.model.widths, trainer.ranks, cfg.zero, cfg.optimizer, cfg.dtype, cfg.bucket_mb)
    every = trainer.comm.allgather((held["total"], peak_rss_bytes()))
    return {"zero": cfg.zero, "optimizer": cfg.optimizer,
            "model_state_bytes": max(total for total, _ in every),
            "model_state_bytes_per_rank": [total for total, _ in every],
            "model_state": held,
            "model_state_estimate": estimate["total"], "model_state_estimate_parts": estimate,
            "peak_rss_bytes": max(rss for _, rss in every),
            "peak_rss_bytes_per_rank": [rss for _, rss in every]}


def ranks_per_node(comm: MPI.Intracomm) -> int:
    """The most ranks of ``comm`` on one node (collective)."""
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return int(comm.allreduce(local.Get_size(), op=MPI.MAX))
    finally:
        local.Free()


# -- the command line ------------------------------------------------------------------------------
def add_arguments(parser: Any) -> None:
    """``--zero`` and ``--optimizer`` on the training CLI."""
    from .optimizer import OPTIMIZERS

    g = parser.add_argument_group("sharded data parallelism (docs/sharding.md)")
    g.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd",
                   help="sgd: SGD with --momentum and --weight-decay; adam: Adam with betas 0.9, 0.999, eps 1e-8 "
                        "and --weight-decay added to the gradient (PyTorch's Adam)")
    g.add_argument("--zero", type=int, choices=STAGES, default=0, metavar="{0,1,2,3}",
                   help="ZeRO stage: each rank keeps its block of the optimizer state (1), and of the averaged "
                        "gradient (2), and of the parameters (3); 0: every rank keeps everything")


#: (argparse destination, why) of what a ``--zero`` stage > 0 does not combine with.
NOT_WITH = (("backup_workers", "a late rank's block of the gradient would be missing from the step"),
            ("local_sgd", "the replicas' parameters differ between averages, and a rank keeps only its block"),
            ("elastic", "a lost rank takes its block of the model state with it"),
            ("bench_allreduce", "it times the allreduce of a whole gradient, which a sharded run does not make"))


def problems(args: Any, ranks: int, given: Any, per_node: int, available: Optional[int]) -> Optional[str]:
    """One message for a ``--zero``/``--optimizer`` combination that cannot run (None when all is well)."""
    zero = args.zero
    if "momentum" in given and args.optimizer == "adam":
        return "argument --momentum: only with --optimizer sgd (Adam's betas are 0.9, 0.999)"
    if args.optimizer == "adam" and args.mode != "sync":
        return "argument --optimizer: adam is for --mode sync only (the parameter servers run SGD)"
    if args.optimizer == "adam" and args.local_sgd > 1:
        return "argument --optimizer: adam does not combine with --local-sgd (it averages SGD's momentum)"
    if zero:
        if args.mode != "sync":
            return (f"argument --zero: {zero} is for --mode sync only (a parameter server keeps the model on the "
                    f"servers, already split between them)")
        for name, why in NOT_WITH:
            value = getattr(args, name, None)
            if (value > 1 if name == "local_sgd" else bool(value)) and not (name == "bench_allreduce" and zero == 1):
                flag = "--" + name.replace("_", "-")
                return f"argument --zero: {zero} does not combine with {flag} ({why})"
        if zero >= 2 and (args.accum_steps or 1) > 1:
            return (f"argument --zero: {zero} does not combine with --accum-steps {args.accum_steps} (the micro-batches' "
                    f"gradients are summed in a whole gradient, which --zero {zero} does not keep; use --zero 1)")
    if available is None or args.mode != "sync":
        return None
    features = 64 if args.dataset == "digits" else args.features
    classes = 10 if args.dataset == "digits" else args.classes
    widths = [features, *args.hidden, classes]
    from ..memory import activation_bytes

    def need(stage: int) -> int:
        return estimate_for(widths, ranks, stage, args.optimizer, args.dtype, args.bucket_mb)["total"] \
            + activation_bytes(widths, args.batch_size, np.dtype(args.dtype).itemsize)

    if per_node * need(zero) <= available:
        return None
    fits = [s for s in STAGES if per_node * need(s) <= available]
    advice = f"--zero {fits[0]} needs {_gb(need(fits[0]))} per rank" if fits else "no --zero stage fits either"
    return (f"argument --zero: {zero}: this run's model state and activations need {_gb(need(zero))} per rank, "
            f"{_gb(per_node * need(zero))} for the {per_node} rank(s) on one node, more than the node's "
            f"{_gb(available)} available; {advice} (python -m allreduce_kit.memory --hidden "
            f"{','.join(map(str, args.hidden))} --ranks {ranks} --optimizer {args.optimizer})")


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def check(config: Any, ranks: int) -> None:
    """Raise TypeError or ValueError naming the field if ``Config.zero``/``Config.optimizer`` cannot run.

    Local to every rank, before anything is sent."""
    from .optimizer import OPTIMIZERS

    if isinstance(config.zero, bool) or not isinstance(config.zero, int) or config.zero not in STAGES:
        raise ValueError(f"Config.zero must be 0, 1, 2 or 3, got {config.zero!r}")
    if config.optimizer not in OPTIMIZERS:
        raise ValueError(f"Config.optimizer must be one of {', '.join(OPTIMIZERS)}, got {config.optimizer!r}")
    if config.optimizer == "adam" and config.local_sgd > 1:
        raise ValueError("Config.optimizer='adam' does not combine with Config.local_sgd > 1")
    if config.zero:
        if config.backup_workers or config.local_sgd > 1:
            raise ValueError(f"Config.zero={config.zero} does not combine with Config.backup_workers or "
                             f"Config.local_sgd > 1")
        if config.zero >= 2 and (config.accum_steps or 1) > 1:
            raise ValueError(f"Config.zero={config.zero} does not combine with Config.accum_steps > 1 (use zero=1)")


def header(trainer: Any) -> str:
    """The line rank 0 prints before training: the stage and the model state per rank it estimates."""
    cfg = trainer.config
    m = estimate_for(trainer.model.widths, trainer.ranks, cfg.zero, cfg.optimizer, cfg.dtype, cfg.bucket_mb)
    what = {0: "every rank keeps the whole model state", 1: "each rank keeps its block of the optimizer state",
            2: "each rank keeps its block of the optimizer state and of the gradient",
            3: "each rank keeps its block of the optimizer state, the gradient and the parameters"}[cfg.zero]
    return (f"memory: --zero {cfg.zero} ({what}), {cfg.optimizer}: model state {_gb(m['total'])} per rank "
            f"(parameters {_gb(m['parameters'])}, gradients {_gb(m['gradients'])}, optimizer "
            f"{_gb(m['optimizer_state'])}, buffers {_gb(m['buffers'])})")


class Evaluation:
    """Stage 3's layers for the forward passes that measure accuracy: gathered as for training,
    their bytes not counted as the training steps'."""

    def __init__(self, sharded: Sharded):
        self.sharded = sharded

    def weights(self, layer: int) -> Tuple[np.ndarray, np.ndarray]:
        return self.sharded.t.model.layer_views(self.sharded._gathered(layer, count=False), layer)
