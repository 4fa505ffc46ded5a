"""Local SGD (``--local-sgd H``): H steps on each rank's own gradients, then the ranks average.

Each rank applies its own gradient to its own replica (the same SGD with momentum and weight
decay as plain sync) for H steps without any message, then the ranks average their parameters
with ``average_buffer`` (``allreduce(op="mean")``), and with them the momentum
(``--local-sgd-momentum average``, the default: the averaged model goes on with the averaged
velocity, as if one optimiser had taken the steps) or not (``local``: each rank keeps its own
velocity, and the average moves half the bytes). Parameters and momentum travel in one buffer,
so an average is one set of allreduce calls: H times fewer calls per sample than plain sync, and
H/2 times fewer bytes with the momentum (H times fewer without).

``--local-sgd-warmup STEPS`` runs the first STEPS steps as plain sync (gradients averaged every
step), then switches (Lin et al. 2020, "Don't Use Large Mini-Batches, Use Local SGD": post-local
SGD). Averages fall on every H-th step after the warm-up, counted over the whole run (not per
epoch), and on the run's last step, so the replicas end bitwise identical. Between averages the
replicas differ: an epoch's test accuracy is then measured by each rank on its own replica and
its own slice of the test set; the last epoch's is that of the averaged model. A straggler
holds the others back only at an average, once per H steps. ``--local-sgd 1`` is plain sync
(the trainer's own path, bitwise).
"""
import time
from typing import Any, Dict, Optional

import numpy as np

from ..params import average_buffer, bucket_bounds
from . import modes
from .optimizer import learning_rate
from .trainer import NonFiniteError, all_finite


class LocalSGD:
    """Finishes the steps of ``trainer``: ``steps`` local steps between averages, after ``warmup`` plain ones."""

    def __init__(self, trainer: Any, steps: int, warmup: int = 0, momentum: str = "average"):
        self.t = trainer
        self.steps, self.warmup, self.momentum = int(steps), int(warmup), momentum
        size = trainer.model.size
        self.buffer = np.empty(2 * size if momentum == "average" else size, dtype=trainer.model.dtype)
        self.averages = 0
        self.sums = np.zeros(3)

    def after_compute(self, idx: np.ndarray, loss: float, correct: int, t0: float, t1: float) -> None:
        t = self.t
        k = t.step
        if k < self.warmup:                                  # plain sync
            self._average(t.model.grads)
            t2 = time.perf_counter()
            modes.apply_update(t, k)
            t3 = time.perf_counter()
            t.timer.record(t1 - t0, t2 - t1, t3 - t2)
        else:
            cfg = t.config
            lr = learning_rate(cfg.lr, t.ranks, cfg.lr_scaling, t.warmup_steps, k)
            t.optimizer.step(t.model.params, t.model.grads, lr)
            t2 = time.perf_counter()
            if (k + 1 - self.warmup) % self.steps == 0 or k + 1 == t.total_steps():
                self._average_replicas(k)
            t.timer.record(t1 - t0, time.perf_counter() - t2, t2 - t1)
        self.sums = np.array([loss, correct, len(idx)], dtype=np.float64)
        t.step += 1

    def _average(self, buf: np.ndarray) -> None:
        t = self.t
        average_buffer(buf, bucket_mb=t.config.bucket_mb, comm=t.comm, algorithm=t.config.algorithm)
        t.traffic[0] += len(bucket_bounds(buf.size, buf.itemsize, t.config.bucket_mb))
        t.traffic[1] += buf.nbytes
        t.sent += t.sent_by_allreduce(buf.nbytes)

    def _average_replicas(self, k: int) -> None:
        """Average parameters (and momentum) in one buffer, and take the average on every rank."""
        t, size = self.t, self.t.model.size
        self.buffer[:size] = t.model.params
        if self.momentum == "average":
            self.buffer[size:] = t.optimizer.velocity
        self._average(self.buffer)
        if not all_finite(self.buffer):                      # the same bits everywhere: the same verdict
            raise NonFiniteError(k + 1, k // t.steps_per_epoch + 1)
        t.model.params[...] = self.buffer[:size]
        if self.momentum == "average":
            t.optimizer.velocity[...] = self.buffer[size:]
        self.averages += 1

    def finish(self) -> None:
        """Nothing is left in flight between steps."""

    def amend(self, out: Dict[str, Any], records: Optional[np.ndarray]) -> None:
        out["local_sgd"] = {"local_steps": self.steps, "warmup_steps": self.warmup, "momentum": self.momentum,
                            "averages": self.averages}

    def close(self) -> None:
        """No communicator of its own."""
