"""Where a run is in the data, in samples: so that it can continue at another rank count.

Every epoch's samples come in one order, a permutation drawn from ``(seed, epoch)``. A step
takes the next ``batch x ranks x accum`` samples of that order, rank r every ranks-th of them
(``data.epoch_batches`` at ``accum`` 1), so a position in an epoch is a count of samples, whatever
the rank count. A checkpoint records it (``position``); a run resumed at another rank count
continues the epoch from that sample: the rest of the order, less its last ``rest mod ranks``
samples (as ``data.epoch_batches`` drops ``N mod ranks``), shared out the same way. No sample of
the epoch is taken twice, none is skipped but those last few.

``--accum-steps K``: each rank takes ``batch x K`` samples per step, in K micro-batches whose
gradients it averages (weighted by their sizes) before the one allreduce of the step.

``--on-resize``: at another rank count, ``keep-batch`` keeps the global batch (per-rank batch and
accumulation chosen so that ``batch x ranks x accum`` is the checkpoint's, or the nearest the rank
count allows), ``rescale-lr`` keeps the per-rank batch and scales the learning rate with the global
batch (linear scaling).
"""
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from . import data

__all__ = ["Plan", "position_of", "reshard", "resize_config", "accumulate", "ON_RESIZE"]

ON_RESIZE = ("keep-batch", "rescale-lr")


def reshard(samples: int, ranks: int, rank: int, per_step: int, order: np.ndarray, offset: int = 0) -> List[np.ndarray]:
    """This rank's batches of the rest of an epoch: ``order[offset:]`` less its last ``rest mod
    ranks`` entries, rank r taking every ranks-th, ``per_step`` at a time."""
    rest = samples - offset
    usable = rest - rest % ranks
    mine = order[offset:offset + usable][rank::ranks]
    return [mine[i:i + per_step] for i in range(0, len(mine), per_step)]


@dataclass
class Plan:
    """Which samples every step of this run takes, at this rank count, from ``step0`` on.

    ``step0`` is the step the run starts at, inside epoch ``epoch0`` at sample ``offset0``, with
    ``before`` steps of that epoch already done (by this or another configuration). Later epochs
    start at their first sample.
    """
    samples: int
    ranks: int
    rank: int
    batch: int
    accum: int
    seed: int
    step0: int = 0
    epoch0: int = 0
    offset0: int = 0
    before: int = 0

    @property
    def per_step(self) -> int:
        """Samples one rank takes per step (all its micro-batches)."""
        return self.batch * self.accum

    @property
    def steps_per_epoch(self) -> int:
        return data.steps_per_epoch(self.samples, self.ranks, self.per_step)

    def _steps_left(self, epoch: int) -> int:
        """Steps this run takes in ``epoch`` (counting only those from ``step0`` in the first)."""
        if epoch > self.epoch0:
            return self.steps_per_epoch
        rest = self.samples - self.offset0
        return -(-(rest // self.ranks) // self.per_step)

    def position(self, step: int) -> Tuple[int, int]:
        """(epoch, steps of it done) at ``step`` (>= ``step0``); the end of an epoch is the next one's start."""
        epoch, start = self.epoch0, self.step0 - self.before
        end = self.step0 + self._steps_left(epoch)
        while step >= end:
            epoch, start, end = epoch + 1, end, end + self.steps_per_epoch
        return epoch, step - start

    def offset(self, step: int) -> Tuple[int, int]:
        """(epoch, samples of its order taken) at ``step``."""
        epoch, done = self.position(step)
        if epoch == self.epoch0:
            return epoch, self.offset0 + (done - self.before) * self.per_step * self.ranks
        return epoch, done * self.per_step * self.ranks

    def batches(self, epoch: int) -> List[Optional[np.ndarray]]:
        """This rank's batches of ``epoch``, indexed by the epoch's step (steps done before ``step0``: None)."""
        order = np.random.default_rng([self.seed, 3, epoch]).permutation(self.samples)
        if epoch != self.epoch0:
            return reshard(self.samples, self.ranks, self.rank, self.per_step, order)
        return [None] * self.before + reshard(self.samples, self.ranks, self.rank, self.per_step, order, self.offset0)

    def total_steps(self, epochs: int) -> int:
        """The step at which ``epochs`` epochs are done."""
        if epochs <= self.epoch0:
            return self.step0
        return self.step0 + self._steps_left(self.epoch0) + (epochs - self.epoch0 - 1) * self.steps_per_epoch


def position_of(meta: Dict[str, Any], samples: int) -> Dict[str, int]:
    """A checkpoint's position: ``epoch``, ``offset`` (samples of its order taken), ``steps`` (of it
    done). Checkpoints that record none are placed from their step, rank count and batch."""
    if "position" in meta:
        return {k: int(v) for k, v in meta["position"].items()}
    per_step = int(meta["batch_size"]) * int(meta.get("accum_steps", 1))
    epoch, done = divmod(int(meta["step"]), data.steps_per_epoch(samples, int(meta["ranks"]), per_step))
    return {"epoch": epoch, "offset": done * per_step * int(meta["ranks"]), "steps": done}


def resize_config(meta: Dict[str, Any], ranks: int, batch: int, accum: Optional[int], on_resize: str,
                  lr: float) -> Tuple[int, int, float, Optional[str]]:
    """The (batch, accum, lr) a run at ``ranks`` resumed from a checkpoint with ``meta`` uses, and a
    note saying what changed (None if nothing). ``accum`` None: not given on the command line.

    The learning rate given is the one for the global batch the run started with (the
    checkpoint's ``base_global_batch``); ``rescale-lr`` scales it to the global batch now.
    """
    was_ranks, was_batch = int(meta["ranks"]), int(meta["batch_size"])
    was_accum = int(meta.get("accum_steps", 1))
    was_global = was_ranks * was_batch * was_accum
    base_global = int(meta.get("base_global_batch", was_global))
    if ranks == was_ranks:
        accum = was_accum if accum is None else accum
        now = (batch, accum, lr * batch * ranks * accum / base_global if on_resize == "rescale-lr" else lr)
        return (*now, None)
    if on_resize == "keep-batch":
        if accum is None:
            accum = max(1, math.ceil(was_ranks * was_accum / ranks))
        batch = max(1, int(round(was_global / (ranks * accum))))
    else:
        accum = 1 if accum is None else accum
    now_global = batch * ranks * accum
    if on_resize == "rescale-lr":
        lr = lr * now_global / base_global
    kept = ("kept" if now_global == was_global else f"the nearest to {was_global} at {ranks} ranks") \
        if on_resize == "keep-batch" else f"was {was_global}; lr scaled to {lr:g}"
    note = (f"checkpoint of {was_ranks} ranks resumed at {ranks} (--on-resize {on_resize}): batch {batch}/rank x "
            f"{accum} accumulation step{'s' if accum != 1 else ''}, global batch {now_global} ({kept})")
    return batch, accum, lr, note


def accumulate(trainer, idx: np.ndarray) -> Tuple[float, int]:
    """Forward and backward over the batch ``idx`` in ``trainer.plan.accum`` micro-batches: the
    model's gradient is their size-weighted mean. Returns (loss sum, correct)."""
    model, X, y = trainer.model, trainer.data.X_train, trainer.data.y_train
    if len(idx) < 2:
        return model.forward_backward(X[idx], y[idx])
    total = getattr(trainer, "_accumulated", None)
    if total is None or total.shape != model.grads.shape:
        total = trainer._accumulated = np.empty_like(model.grads)
    total[...] = 0
    loss, correct = 0.0, 0
    for part in np.array_split(idx, min(trainer.plan.accum, len(idx))):
        part_loss, part_correct = model.forward_backward(X[part], y[part])
        total += model.grads * model.grads.dtype.type(len(part) / len(idx))
        loss += part_loss
        correct += part_correct
    model.grads[...] = total
    return loss, correct


def add_arguments(group, at_least) -> None:
    """``--accum-steps`` and ``--on-resize`` on the training CLI's ``group`` (``at_least``: its argparse type maker)."""
    group.add_argument("--accum-steps", type=at_least(1), default=None, metavar="K",
                       help="gradient accumulation: each rank takes K micro-batches of --batch-size per step and "
                            "averages their gradients before the one allreduce (global batch P x batch x K) "
                            "(default: 1; at a --resume at another rank count with --on-resize keep-batch, what "
                            "keeps the checkpoint's global batch)")
    group.add_argument("--on-resize", choices=ON_RESIZE, default="keep-batch",
                       help="--resume of a checkpoint written at another rank count: keep-batch keeps the global "
                            "batch (per-rank batch and --accum-steps chosen to match, or the nearest the rank "
                            "count allows); rescale-lr keeps --batch-size and scales --lr with the global batch. "
                            "Either way the data continue from the checkpoint's sample (docs/elastic.md)")
