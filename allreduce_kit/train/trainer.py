"""Synchronous data-parallel SGD over the public API: ``broadcast_parameters``, ``allreduce``.

One step on every rank: forward and backward on the local batch into the flat gradient buffer,
``average_buffer`` (``allreduce(op="mean")`` per bucket), then the same SGD update everywhere,
so the replicas stay bitwise identical. The trainer never chooses the algorithm (``algorithm``
is passed through to ``allreduce``; "auto" lets the library pick); for its report it asks the
library afterwards what ``auto`` picked for each bucket's size.
"""
import hashlib
import os
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
from mpi4py import MPI

from .. import faults, selection
from ..collective import allreduce
from ..comm import library_comm
from ..params import average_buffer, bucket_bounds, broadcast_parameters
from ..trace.recorder import ACTIVE, CURRENT as TRACE
from . import checkpoint, compressed, data, modes, resize
from .signals import StopSignals, stop_if_asked
from .model import MLP
from .optimizer import OPTIMIZERS, learning_rate, make_optimizer
from .summary import epoch_record
from .timing import StepTimer, analyse, pause


@dataclass
class Config:
    """Everything a run depends on (the CLI's options; defaults are the CLI's defaults)."""
    epochs: int = 40
    batch_size: int = 32                              # per rank; the Trainer lowers it to a rank's shard
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 1e-4
    hidden: Tuple[int, ...] = (128, 64)
    dataset: str = "digits"
    samples: int = 20000
    features: int = 64
    classes: int = 10
    test_fraction: float = 0.2
    algorithm: str = "auto"
    bucket_mb: float = 25.0
    lr_scaling: str = "none"
    warmup_epochs: float = 0.0
    seed: int = 0
    dtype: str = "float32"
    straggler: Optional[Tuple[int, float]] = None    # (rank, ms)
    jitter_ms: float = 0.0
    gather_every: int = 50
    max_steps: int = 0
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 0
    resume: bool = False
    keep_checkpoints: int = 3
    on_nonfinite: str = "abort"                       # or "skip"
    inject_nan: Optional[Tuple[int, int]] = None     # (rank, step): a testing aid
    backup_workers: int = 0                           # modes.py: backup.py, local_sgd.py
    local_sgd: int = 1
    local_sgd_warmup: int = 0
    local_sgd_momentum: str = "average"
    accum_steps: Optional[int] = None                 # micro-batches per step (None: 1, or what a resize chooses)
    on_resize: str = "keep-batch"                     # or "rescale-lr" (resize.py)
    optimizer: str = "sgd"                            # or "adam" (optimizer.py)
    zero: int = 0                                     # sharded data parallelism, stages 1-3 (sharding.py)
    compression: str = "none"                         # or fp16, bf16, powersgd (compressed.py)
    compression_rank: int = 1                         # powersgd: matrix_approximation_rank
    compression_start: int = 1000                     # powersgd: start_powerSGD_iter

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)


class ResumeError(Exception):
    """The checkpoint to resume from is missing or does not fit this run (same on every rank)."""


#: What decides the data, its split and its order: a checkpoint's step means the same samples only
#: if these are the same. (option, Config field, only for the synthetic data set)
DATA_OPTIONS = (("--dataset", "dataset", False), ("--seed", "seed", False), ("--test-fraction", "test_fraction", False),
                ("--samples", "samples", True), ("--features", "features", True), ("--classes", "classes", True))


class NonFiniteError(Exception):
    """The averaged gradient holds NaN or Inf (raised on every rank at the same step)."""

    def __init__(self, step: int, epoch: int):
        super().__init__(f"non-finite averaged gradient (NaN or Inf) at step {step} (epoch {epoch}); stopping "
                         f"before the update (--on-nonfinite abort). The parameters are those after step "
                         f"{step - 1}; --on-nonfinite skip would skip such steps on every rank instead")
        self.step = step


def all_finite(buf: np.ndarray) -> bool:
    """Whether ``buf`` holds no NaN or Inf: one summing pass; an exact check only if the sum is not finite."""
    with np.errstate(over="ignore", invalid="ignore"):
        total = np.add.reduce(buf, dtype=np.float64) if buf.size else 0.0
    return bool(np.isfinite(total)) or bool(np.isfinite(buf).all())


def load_data(config: Config) -> data.Dataset:
    if config.dataset == "digits":
        return data.digits(config.test_fraction, config.seed, config.dtype)
    return data.synthetic(config.samples, config.features, config.classes, config.test_fraction,
                          config.seed, config.dtype)


def digest(buf: np.ndarray) -> str:
    return hashlib.blake2b(np.ascontiguousarray(buf).data, digest_size=16).hexdigest()


class Trainer:
    """Data-parallel training of an MLP on the ranks of ``comm`` (default ``COMM_WORLD``)."""

    def __init__(self, config: Config, comm: Optional[MPI.Intracomm] = None,
                 dataset: Optional[data.Dataset] = None, snapshot: Optional[Tuple[Dict[str, np.ndarray], Dict[str, Any]]] = None):
        modes.check(config, (comm or MPI.COMM_WORLD).Get_size())   # before any message
        from .sharding import check as check_sharding
        check_sharding(config, (comm or MPI.COMM_WORLD).Get_size())
        self.comm = (comm or MPI.COMM_WORLD).Dup()       # the trainer's own few messages
        self.rank, self.ranks = self.comm.Get_rank(), self.comm.Get_size()
        self.data = dataset if dataset is not None else load_data(config)
        #: The run's identity (checkpoint.py): every checkpoint it writes carries it, and --resume
        #: continues only from checkpoints that carry it.
        self.run_settings = checkpoint.run_settings(config.as_dict(), "sync")
        self.run_identity = checkpoint.run_identity(self.run_settings)
        #: The checkpoint a --resume continued from (None: a fresh run), and what it said about the directory.
        self.resumed_from: Optional[str] = None
        self.resume_note: Optional[str] = None
        #: The run's configuration, with ``batch_size`` lowered to a rank's shard if it was larger.
        self.config = config = replace(config, batch_size=data.shard_batch(len(self.data.y_train), self.ranks,
                                                                           config.batch_size))
        self.model = MLP(self.data.features, config.hidden, self.data.classes, dtype=config.dtype,
                         buffers=config.zero < 3)
        compressed.check(config, self.model.shapes)      # before any message
        #: What the model's passes take their parameters from and give their gradients to (None: its
        #: own buffers; sharding.py at --zero 2 and 3).
        self.layers = None
        self.eval_layers = None                          # and the forward passes that measure accuracy
        self.traffic = [0, 0]                            # the model's collective calls and bytes handed, this rank
        self.sent = 0.0                                  # the bytes this rank sent (counted per call)
        self.shards = None
        if config.zero < 3:
            # Every rank draws different initial values; the broadcast makes rank 0's everyone's.
            self.model.init(np.random.default_rng([config.seed, 4, self.rank]))
            broadcast_parameters(self.model.params, root=0, comm=self.comm)
        if config.zero:                                  # its own optimizer, for this rank's shard
            from .sharding import Sharded
            self.shards = Sharded(self, config.zero)
        else:
            self.optimizer = make_optimizer(config.optimizer, self.model.size, self.model.dtype, config.momentum,
                                            config.weight_decay)
        #: Which samples each step takes (resize.py); a resume moves it to the checkpoint's sample.
        self.plan = resize.Plan(len(self.data.y_train), self.ranks, self.rank, config.batch_size,
                                config.accum_steps or 1, config.seed)
        self.steps_per_epoch = self.plan.steps_per_epoch
        self.resize_note: Optional[str] = None           # what a resume at another rank count changed
        #: The global batch the run started with (its --lr is for that batch; --on-resize rescale-lr scales it).
        self.base_global_batch = config.batch_size * self.ranks * self.plan.accum
        self.warmup_steps = int(round(config.warmup_epochs * self.steps_per_epoch))
        self.jitter_rng = np.random.default_rng([config.seed, 5, self.rank])
        self.delay = config.straggler[1] / 1e3 if config.straggler and config.straggler[0] == self.rank else 0.0
        self.timer = StepTimer(self.comm, config.gather_every)
        self.hosts = self.comm.allgather(MPI.Get_processor_name())
        self.step = 0
        self.skipped_steps: List[int] = []               # steps whose update was skipped (non-finite)
        self.saved_step = -1
        self.nan_at = config.inject_nan[1] if config.inject_nan and config.inject_nan[0] == self.rank else 0
        self.history: List[Dict[str, Any]] = []
        #: Stop at a step boundary on SIGTERM/SIGUSR1/SIGINT (signals.py), if the caller installed one.
        self.stop: Optional[StopSignals] = None
        # The epoch under way (its sums so far on this rank, its clock), and one carried over in a checkpoint.
        self._open: Optional[Dict[str, Any]] = None
        self._carried: Optional[Dict[str, Any]] = None
        self.bounds = bucket_bounds(self.model.size, self.model.dtype.itemsize, config.bucket_mb)
        self.buckets = len(self.bounds)
        if config.resume or snapshot is not None:    # snapshot: (arrays, meta) every rank holds (injob.py)
            self._resume(snapshot)
        self.first_step = self.step                      # the steps this run takes start here
        # One untimed pass first: the first compute, collective and update pay for loading
        # compiled kernels, starting BLAS and setting up connections, which would otherwise
        # show up as the first steps of epoch 1. (The gradient it leaves is overwritten.)
        if self.shards is not None:
            self.shards.warm_up()
        else:
            self.model.forward_backward(self.data.X_train[:2], self.data.y_train[:2])
            average_buffer(self.model.grads.copy(), bucket_mb=config.bucket_mb, comm=self.comm,
                           algorithm=config.algorithm)
            self.optimizer.warm_up()
            self.comm.Barrier()
        #: The algorithm each bucket's allreduce runs first: ``auto``'s choice by size (for the report;
        #: online tuning may settle on another, which ``results`` reports).
        self.bucket_algorithms = self._algorithms_ran()
        self.strategy = modes.strategy_for(self)         # backup workers or local SGD; None: plain sync
        self.compressed = compressed.for_trainer(self)   # --compression; None: average_buffer

    def _algorithms_ran(self) -> List[str]:
        if self.ranks == 1:
            return ["none"] * self.buckets               # one rank: allreduce has nothing to send
        sizes = [(stop - start) * self.model.dtype.itemsize for start, stop in self.bounds]
        if self.config.algorithm != "auto":
            return [faults.runs_as(self.config.algorithm, nbytes) for nbytes in sizes]
        lib = library_comm(self.comm)                    # auto's table is loaded: the warm-up average used it
        return [faults.runs_as(selection.choose_for(lib, nbytes), nbytes) for nbytes in sizes]

    # -- one step ---------------------------------------------------------------------------
    def train_step(self, idx: np.ndarray) -> Tuple[float, int]:
        """Compute, average, update on this rank's batch ``idx``; records the three times."""
        tracer, traced_step = TRACE[0], self.step          # --trace (allreduce_kit/trace): this step's events
        if tracer is not None:
            tracer.begin(traced_step)
        t0 = time.perf_counter()
        if self.shards is not None:
            self.shards.nan_next = self.nan_at == self.step + 1
        if self.plan.accum > 1:                          # --accum-steps: micro-batches averaged here
            loss, correct = resize.accumulate(self, idx)
        else:
            loss, correct = self.model.forward_backward(self.data.X_train[idx], self.data.y_train[idx], self.layers)
        if self.nan_at == self.step + 1 and self.model.grads is not None:
            self.model.grads[0] = np.nan                 # --inject-nan: a testing aid
        if self.delay:
            pause(self.delay)
        if self.config.jitter_ms > 0:
            pause(self.jitter_rng.uniform(0.0, 2.0 * self.config.jitter_ms) / 1e3)
        t1 = time.perf_counter()
        if self.strategy is not None:                    # it averages, updates, records and counts the step
            self.strategy.after_compute(idx, loss, correct, t0, t1)
            if tracer is not None:
                tracer.step(traced_step, t0, time.perf_counter(), (("forward_backward", t0, t1),))
            return loss, correct
        if self.compressed is not None:
            self.sent += self.compressed.average()
        else:
            average_buffer(self.model.grads, bucket_mb=self.config.bucket_mb, comm=self.comm,
                           algorithm=self.config.algorithm)
            self.sent += self.sent_by_allreduce(self.model.grads.nbytes)
        self.traffic[0] += self.buckets
        self.traffic[1] += self.model.grads.nbytes
        t2 = time.perf_counter()
        # Every rank holds bitwise the same average, so every rank reaches the same verdict here
        # without another message.
        if not all_finite(self.model.grads):
            if self.config.on_nonfinite == "abort":
                raise NonFiniteError(self.step + 1, self.plan.position(self.step)[0] + 1)
            self.skipped_steps.append(self.step + 1)
        else:
            lr = learning_rate(self.config.lr, self.ranks, self.config.lr_scaling, self.warmup_steps, self.step)
            self.optimizer.step(self.model.params, self.model.grads, lr)
        t3 = time.perf_counter()
        self.timer.record(t1 - t0, t2 - t1, t3 - t2)
        if tracer is not None:
            tracer.step(traced_step, t0, t3, (("forward_backward", t0, t1), ("gradient_average", t1, t2),
                                              ("update", t2, t3)))
        self.step += 1
        return loss, correct

    def sent_by_allreduce(self, nbytes: int, ranks: Optional[int] = None) -> float:
        """The bytes a rank sends averaging ``nbytes`` over ``ranks`` (default: all) by a
        bandwidth-optimal allreduce: 2(p-1)/p of them."""
        p = self.ranks if ranks is None else ranks
        return 2.0 * nbytes * (p - 1) / p

    def total_steps(self) -> int:
        total = self.plan.total_steps(self.config.epochs)
        return min(total, self.config.max_steps) if self.config.max_steps > 0 else total

    # -- the loop ---------------------------------------------------------------------------
    def run(self, on_step: Optional[Callable[[int], None]] = None,
            on_epoch: Optional[Callable[[Dict[str, Any]], None]] = None) -> Dict[str, Any]:
        """Train until ``epochs`` (or ``max_steps``) and return the run's results (report on rank 0)."""
        cfg, total = self.config, self.total_steps()
        while self.step < total:
            epoch, first = self.plan.position(self.step)
            batches = self.plan.batches(epoch)
            sums = np.zeros(3, dtype=np.float64)        # this rank's loss sum, correct, samples
            carried, counted_from = 0.0, first          # steps before this run count if a checkpoint carried them
            if self._carried is not None and self._carried["epoch"] == epoch:
                sums[:] = self._carried["sums"]
                carried, counted_from = self._carried["seconds"], 0
            self._carried = None
            self._open = {"epoch": epoch, "sums": sums, "start": time.perf_counter() - carried, "end": None}
            start = self.step - first                    # the step at which this epoch began
            for i in range(first, len(batches)):
                if self.step >= total:
                    break
                if self.step > start + i:
                    continue                             # a step this rank skipped (backup workers)
                loss, correct = self.train_step(batches[i])
                sums += (loss, correct, len(batches[i])) if self.strategy is None else self.strategy.sums
                if self._checkpoint_due() and self.step - start < len(batches):
                    self.save_checkpoint()               # within the epoch: with its sums so far
                if i + 1 < len(batches):
                    stop_if_asked(self)                  # the epoch's last step is asked after its record
                if on_step:
                    on_step(i + 1)
            self._open["end"] = time.perf_counter()
            elapsed = self._open["end"] - self._open["start"]
            ended = self.plan.position(self.step)[0] > epoch
            self.history.append(self._epoch_metrics(epoch, sums, elapsed,
                                                    (len(batches) if ended else self.plan.position(self.step)[1])
                                                    - counted_from))
            if on_epoch:
                on_epoch(self.history[-1])
            if ended and self._checkpoint_due():
                self.save_checkpoint()                   # at the epoch's end: after its record, which it keeps
            if ended:
                stop_if_asked(self)
        if self.strategy is not None:
            self.strategy.finish()
        self.timer.flush()
        if cfg.checkpoint_dir and self.saved_step != self.step:
            self.save_checkpoint()
        return self.results()

    def _checkpoint_due(self) -> bool:
        cfg = self.config
        return bool(cfg.checkpoint_dir) and cfg.checkpoint_every > 0 and self.step % cfg.checkpoint_every == 0

    def _epoch_metrics(self, epoch: int, sums: np.ndarray, elapsed: float, steps: int) -> Dict[str, Any]:
        """The epoch's record from this rank's ``sums`` (left as they are: a checkpoint may still need them)."""
        test = slice(self.rank, None, self.ranks)
        totals = np.zeros(5, dtype=np.float64)         # loss, correct, samples, test correct, test samples
        totals[:3] = sums
        totals[3] = self.model.evaluate(self.data.X_test[test], self.data.y_test[test], layers=self.eval_layers)
        totals[4] = len(self.data.y_test[test])
        allreduce(totals, op="sum", comm=self.comm)
        seconds = float(self.comm.bcast(elapsed, root=0))
        lr = learning_rate(self.config.lr, self.ranks, self.config.lr_scaling, self.warmup_steps, max(self.step - 1, 0))
        return epoch_record(epoch, steps, *totals, seconds, lr)

    # -- the end ----------------------------------------------------------------------------
    def replicas_identical(self) -> Tuple[bool, str]:
        """Whether every rank holds bitwise the same parameters (collective); and rank 0's digest."""
        mine = digest(self.model.params) if self.shards is None else self.shards.params_digest()
        digests = self.comm.allgather(mine)
        return all(d == digests[0] for d in digests), digests[0]

    def results(self) -> Dict[str, Any]:
        identical, params_digest = self.replicas_identical()
        records = self.timer.records()
        samples = sum(e["samples"] for e in self.history)
        seconds = sum(e["seconds"] for e in self.history)
        out = {
            "ranks": self.ranks,
            "hosts": sorted(set(self.hosts)),
            "parameters": self.model.size,
            "model": self.model.describe(),
            "buckets": self.buckets,
            "bucket_algorithms": self._algorithms_ran(),  # at the end: what auto settled on, if it tuned online
            "steps": self.step,
            "updates_applied": self.step - len(self.skipped_steps),
            "epochs": self.history,
            "test_accuracy": self.history[-1]["test_accuracy"] if self.history else None,
            "samples_per_second": samples / seconds if seconds > 0 else 0.0,
            "train_seconds": seconds,
            "replicas_identical": identical,
            "params_digest": params_digest,
            "skipped_steps": self.skipped_steps,
            "communication": modes.communication(*self.comm.allreduce(np.array([*self.traffic, self.sent],
                                                                               dtype=np.float64)) / self.ranks,
                                                 samples, self.step - self.first_step),
            "memory": self.memory(),
            "compression": compressed.report(self),
        }
        if records is not None:
            out["straggler"] = analyse(records, self.hosts)
        if self.strategy is not None:
            self.strategy.amend(out, records)           # collective
        return out

    def memory(self) -> Dict[str, Any]:
        """The model state each rank holds, beside the estimate, and peak RSS (collective; sharding.py)."""
        from .sharding import memory_report
        return memory_report(self)

    def allreduce_alone(self, calls: int) -> Optional[Dict[str, float]]:
        """Time ``calls`` gradient averages of the same buffer and buckets, outside the trainer.

        Two loops after training: back to back, each call after a barrier (the collective alone,
        as a benchmark runs it); and a bare ``compute; average`` loop (this rank's first batch
        through ``forward_backward``, then ``average_buffer`` on the gradient it wrote, nothing
        else), which arrives at the collective the way the trainer does but without any of the
        trainer's code. Per call the smallest time over ranks is the transfer, the trainer's
        estimator. Call after ``run``: it overwrites the gradient buffer. Medians on rank 0.
        """
        batch = data.epoch_batches(len(self.data.y_train), self.ranks, self.rank, self.config.batch_size,
                                   self.config.seed, 0)[0]
        X, y = self.data.X_train[batch], self.data.y_train[batch]
        buf = self.model.grads.copy()
        times = np.zeros((2, calls), dtype=np.float64)
        for bare in (0, 1):
            self.comm.Barrier()
            for i in range(calls):
                if bare:
                    self.model.forward_backward(X, y)
                    target = self.model.grads
                else:
                    self.comm.Barrier()
                    target = buf
                t0 = time.perf_counter()
                average_buffer(target, bucket_mb=self.config.bucket_mb, comm=self.comm,
                               algorithm=self.config.algorithm)
                times[bare, i] = time.perf_counter() - t0
        every = np.zeros((self.ranks, 2, calls)) if self.rank == 0 else None
        self.comm.Gather(times, every, root=0)
        if every is None:
            return None
        transfer = every.min(axis=0) * 1e3
        return {"calls": calls, "transfer_ms_p50": float(np.median(transfer[0])),
                "transfer_ms_p10": float(np.percentile(transfer[0], 10)),
                "transfer_ms_p90": float(np.percentile(transfer[0], 90)),
                "bare_loop_transfer_ms_p50": float(np.median(transfer[1]))}

    def close(self) -> None:
        """Free the trainer's communicator (collective)."""
        if getattr(self, "strategy", None) is not None:
            self.strategy.close()
            self.strategy = None
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()

    # -- checkpoints ------------------------------------------------------------------------
    def _open_epoch(self) -> Optional[Tuple[List[float], float]]:
        """The epoch under way at this step, if some but not all of its steps are done: this rank's
        sums so far (loss, correct, samples) and the seconds it has taken so far."""
        epoch, into = self.plan.position(self.step)
        if into == 0:
            return None
        for state in (self._open, self._carried):
            if state is not None and state["epoch"] == epoch:
                seconds = (state["end"] or time.perf_counter()) - state["start"] if "start" in state else state["seconds"]
                return state["sums"].tolist(), seconds
        return None

    def save_checkpoint(self) -> None:
        """Rank 0 writes parameters, velocity, step, every rank's jitter RNG state and the history (collective).

        The history is every finished epoch's record and, if the step falls inside an epoch, every
        rank's sums of that epoch so far and its seconds: a run resumed from it reports what the
        uninterrupted run reports (losses, accuracies, samples, steps; not its timings)."""
        started = time.perf_counter()
        now = self._open_epoch()
        gathered = self.comm.gather((self.jitter_rng.bit_generator.state, None if now is None else now[0]), root=0)
        if self.shards is not None:                      # every rank its blocks, rank 0 the manifest
            self.shards.save(self.config.checkpoint_dir, self.step,
                             self.checkpoint_meta(gathered, now) if self.rank == 0 else None,
                             self.config.keep_checkpoints)
        elif self.rank == 0:
            checkpoint.save(self.config.checkpoint_dir, self.step,
                            {"params": self.model.params, **self.optimizer.state()},
                            self.checkpoint_meta(gathered, now), keep=self.config.keep_checkpoints)
        self.saved_step = self.step
        if ACTIVE[0] is not None:                        # --trace, inside its window
            ACTIVE[0].span_s("checkpoint", "checkpoint", started, time.perf_counter(), {"step": self.step})

    def checkpoint_meta(self, gathered: List[Tuple[Any, Any]], now: Optional[Tuple[List[float], float]]) -> Dict[str, Any]:
        """A checkpoint's record of this step, from every rank's (jitter RNG state, open epoch's sums)."""
        done, into = self.plan.position(self.step)
        return checkpoint.sync_record(self, self.ranks, done, [state for state, _ in gathered],
                                      None if now is None else {"epoch": done, "sums": [sums for _, sums in gathered],
                                                                "seconds": now[1]},
                                      self._position_record(into))

    def _position_record(self, into: int) -> Dict[str, Any]:
        """What a checkpoint records of the position in the data (in samples) and the batch it was reached with."""
        epoch, offset = self.plan.offset(self.step)
        return {"position": {"epoch": epoch, "offset": offset, "steps": into}, "accum_steps": self.plan.accum,
                "base_global_batch": self.base_global_batch, "lr": self.config.lr}

    def _mismatch(self, path: str, meta: Dict[str, Any], arrays: Dict[str, np.ndarray]) -> Optional[str]:
        """Why the checkpoint at ``path`` does not fit this run, or None."""
        mode = checkpoint.mode_of(meta)
        if mode != "sync":
            return (f"{path} was written by a --mode {mode} run (a parameter server's final parameters, with no "
                    f"position in the data order of --mode sync), and --resume continues --mode sync checkpoints "
                    f"only")
        saved = meta.get("config") or {}
        for option, field, synthetic_only in DATA_OPTIONS:
            if synthetic_only and (saved.get("dataset") != "synthetic" or self.config.dataset != "synthetic"):
                continue
            if field in saved and saved[field] != getattr(self.config, field):
                return (f"{path} was written by a run with {option} {saved[field]}; this run has {option} "
                        f"{getattr(self.config, field)}, which changes the data (its split into training and test "
                        f"samples, or their order): its step would mean other samples and its test set could "
                        f"hold samples already trained on (resume with {option} {saved[field]})")
        if meta["widths"] != self.model.widths or meta["dtype"] != self.model.dtype.name:
            return (f"{path} holds a {'-'.join(map(str, meta['widths']))} {meta['dtype']} model, this run builds "
                    f"{self.model.describe()} {self.model.dtype.name}")
        needed = ["params", *self.optimizer.state()]
        parts = checkpoint.parts_of(meta)                # a sharded or pipeline run's manifest
        held = parts["arrays"] if parts is not None else sorted(arrays)
        missing = [name for name in needed if name not in held]
        if missing:
            return (f"{path} holds {', '.join(held)}; this run's --optimizer {self.config.optimizer} needs "
                    f"{', '.join(missing)} (resume with the --optimizer that wrote it)")
        if parts is not None:                            # the parts are checked as they are read
            return None if parts.get("size") == self.model.size else \
                f"{path} holds {parts.get('size')} parameters, this model has {self.model.size}"
        for name in needed:
            got = arrays.get(name)
            if got is None or got.shape != (self.model.size,) or got.dtype != self.model.dtype:
                return (f"{path} holds {name} of shape {None if got is None else got.shape}, this model needs "
                        f"{(self.model.size,)} {self.model.dtype}")
        return None

    def _resume(self, snapshot: Optional[Tuple[Dict[str, np.ndarray], Dict[str, Any]]] = None) -> None:
        """Continue from ``snapshot``, or from the newest checkpoint of this run in the checkpoint
        directory (read by rank 0, broadcast). Checkpoints of other runs there are left alone and
        never continued from; one whose run cannot be told (its record names none, or cannot be
        read) is taken as this run's when it is the newest, so that ``load`` and ``_mismatch`` say
        what is wrong with it rather than an older one being used silently."""
        error, meta, path, others, own = None, None, None, [], []
        directory = self.config.checkpoint_dir
        if snapshot is not None:                          # held by every rank: nothing to read
            self.model.params[...] = snapshot[0]["params"]
            for name, state in self.optimizer.state().items():
                state[...] = snapshot[0][name]
            meta = snapshot[1]
        elif self.rank == 0:
            try:
                found = checkpoint.survey(directory)
                if not found:
                    raise FileNotFoundError
                own = [f for f in found if f.run in (self.run_identity, None)]
                others = [(f.step, f.path, "its settings are not recorded" if f.settings is None else
                           checkpoint.differences(f.settings, self.run_settings), f.run)
                          for f in found if f.run not in (self.run_identity, None)]
                path = (own or found)[-1].path
                arrays, meta = checkpoint.load(path)
                error = self._mismatch(path, meta, arrays)
                if error is None and not own:             # another run's, alike in what _mismatch looks at
                    error = f"{path} is another run's ({others[-1][2]})"
                if error is not None and not own:
                    error += f"; {directory} holds no checkpoint of this run"
                if error is None and self.shards is None and checkpoint.parts_of(meta) is None:
                    self.model.params[...] = arrays["params"]
                    for name, state in self.optimizer.state().items():
                        state[...] = arrays[name]
            except FileNotFoundError:
                error = f"no checkpoint in {directory} (no checkpoint-*.npz)"
            except checkpoint.CheckpointError as bad:
                error = str(bad)
                older = [f.path for f in own if f.path != path]
                if older:
                    error += f"; it is not loaded: move it away to resume from the previous one, {older[-1]}"
            except (ValueError, KeyError, OSError) as bad:
                error = f"cannot read {path or directory}: {bad}"
            if error:
                error = f"--resume: {error}"
        error, meta, path, others = self.comm.bcast((error, meta, path, others), root=0)
        if error:
            raise ResumeError(error)
        if snapshot is None:
            self._load_arrays(path, meta, arrays if self.rank == 0 else {})
        else:
            self.optimizer.load_scalars(meta.get("optimizer_scalars", {}))
        self.step = self.saved_step = int(meta["step"])
        self._resize(meta)
        self.skipped_steps = list(meta.get("skipped_steps", []))
        self.history = [dict(record) for record in meta.get("history", [])]   # older checkpoints hold none
        now = meta.get("open_epoch")
        if now:
            sums = now["sums"][self.rank] if meta["ranks"] == self.ranks else \
                np.sum(now["sums"], axis=0) * (self.rank == 0)   # at another rank count: all on rank 0
            self._carried = {"epoch": int(now["epoch"]), "sums": np.asarray(sums, dtype=np.float64),
                             "seconds": float(now["seconds"])}
        if self.rank < len(meta["jitter_rng_states"]):
            self.jitter_rng.bit_generator.state = meta["jitter_rng_states"][self.rank]
        self.resumed_from = path
        if others:
            self._other_runs(directory, others)

    def _load_arrays(self, path: str, meta: Dict[str, Any], arrays: Dict[str, np.ndarray]) -> None:
        """Take the checkpoint's parameters and optimizer state (collective): a whole checkpoint's
        from rank 0 (``arrays``, read there), a sharded or pipeline run's read by every rank from its files;
        a sharded run keeps its blocks of them (sharding.py), at any stage and rank count."""
        names = ["params", *self.optimizer.state()]
        if checkpoint.parts_of(meta) is not None:
            error = None
            try:
                arrays = checkpoint.read_parts(path, meta, names)
            except (checkpoint.CheckpointError, OSError, ValueError) as bad:
                error = f"--resume: {bad}"
            errors = [e for e in self.comm.allgather(error) if e]
            if errors:
                raise ResumeError(errors[0])
        elif self.shards is not None:                    # a whole checkpoint, read by rank 0
            if self.rank != 0:
                arrays = {name: np.empty(self.model.size, self.model.dtype) for name in names}
            for name in names:
                broadcast_parameters(arrays[name], root=0, comm=self.comm)
        else:
            broadcast_parameters(self.model.params, root=0, comm=self.comm)
            for state in self.optimizer.state().values():
                broadcast_parameters(state, root=0, comm=self.comm)
            arrays = {}
        if self.shards is not None:
            self.shards.load(arrays)
        elif arrays:
            self.model.params[...] = arrays["params"]
            for name, state in self.optimizer.state().items():
                state[...] = arrays[name]
        self.optimizer.load_scalars(meta.get("optimizer_scalars", {}))

    def _other_runs(self, directory: str, others: List[Tuple[int, str, str, str]]) -> None:
        """Refuse to go on where this run would write over another run's checkpoint (a step between its
        own and its last, where a save could fall); else note that the others are left alone.
        ``others``: (step, path, how its run's settings differ, its run) of each, oldest first."""
        whose = "another run" if len({run for *_, run in others}) == 1 else "other runs"
        reached = [(step, path, how) for step, path, how, _ in others if self.step < step <= self.total_steps()]
        if reached:
            step, path, how = reached[-1]
            raise ResumeError(f"--resume: {directory} also holds checkpoints of {whose} at steps this run reaches, "
                              f"which its own would write over ({', '.join(str(s) for s, _, _ in reached)}; "
                              f"{os.path.basename(path)}: {how}): move them away, or resume from a copy of this "
                              f"run's checkpoints in another directory")
        step, path, how, _ = others[-1]
        self.resume_note = (f"--resume: left alone {len(others)} checkpoint{'s' if len(others) != 1 else ''} of {whose} "
                            f"in {directory} (the newest {os.path.basename(path)}, step {step}: {how})")

    def _resize(self, meta: Dict[str, Any]) -> None:
        """Continue from the checkpoint's sample at this rank count, batch and accumulation (resize.py)."""
        cfg = self.config
        batch, accum, lr, self.resize_note = resize.resize_config(meta, self.ranks, cfg.batch_size, cfg.accum_steps,
                                                                  cfg.on_resize, cfg.lr)
        self.config = cfg = replace(cfg, batch_size=batch, accum_steps=accum, lr=lr)
        self.base_global_batch = int(meta.get("base_global_batch", meta["ranks"] * meta["batch_size"]
                                              * meta.get("accum_steps", 1)))
        where = resize.position_of(meta, len(self.data.y_train))
        self.plan = replace(self.plan, batch=batch, accum=accum, step0=self.step, epoch0=where["epoch"],
                            offset0=where["offset"], before=where["steps"])
        self.steps_per_epoch = self.plan.steps_per_epoch
        self.warmup_steps = int(round(cfg.warmup_epochs * self.steps_per_epoch))
