"""Pipeline (model) parallelism combined with data parallelism, for the trainer's MLP.

P = S x D ranks (``grid.py``): the MLP's layers are cut into S x V virtual stages (balanced by
compute, or at ``split``), pipeline rank s holding stages s, s + S, ...; each of the D replicas
runs its own pipeline over its share of the global batch, cut into M micro-batches, in the order
the schedule gives (``schedules.py``, executed by ``runtime.py``). After a step's pipeline
drains, each rank averages its stages' gradient over the D replicas of its pipeline rank with the
toolkit's allreduce (a sub-communicator of those replicas) and applies the optimizer to its own
parameters only. A rank holds only its stages' parameters, gradients and optimizer state.

What it trains is what one rank trains on the same global batch: the same initial parameters
(drawn layer by layer from the seed as ``Trainer`` draws them), the same samples per step, the
gradient of the mean loss over the global batch. Only the order of floating-point additions
differs (micro-batch gradients summed, replicas averaged): the parameters agree to rounding
(bitwise at M = 1 and D = 1); the D replicas of a stage are bitwise identical.
"""
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
from mpi4py import MPI

from ..comm import library_comm
from ..params import FlatParameters, average_buffer
from ..stall import INSPECTOR
from ..train import checkpoint as ckpt_format
from ..train import data
from ..train.model import MLP
from ..train.optimizer import learning_rate, make_optimizer
from ..train.resize import Plan
from ..train.signals import stop_if_asked
from ..train.summary import epoch_record
from ..train.trainer import Config, NonFiniteError, all_finite, digest, load_data
from . import checkpoint, schedules
from .grid import Grid, choose_placement
from .runtime import Runtime
from .stage import StageLayers, balanced_split, check_split, layer_costs, stage_layers

__all__ = ["PipelineSettings", "PipelineTrainer", "PipelineError", "check"]


@dataclass(frozen=True)
class PipelineSettings:
    """The pipeline's shape: S ``stages``, M ``micro_batches`` per step, the ``schedule``, V
    ``virtual_stages`` per rank (interleaved only), ``split`` (the layer index where each stage
    but the first starts; None: balanced by compute) and the grid's ``placement``."""
    stages: int
    micro_batches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    split: Optional[Tuple[int, ...]] = None
    placement: str = "auto"


class PipelineError(ValueError):
    """Stages that do not fit together (raised on every rank, naming the stage)."""


def check(settings: PipelineSettings, config: Config, ranks: int, layers: int) -> None:
    """Raise ValueError naming the setting if the pipeline cannot run on ``ranks`` ranks with a
    model of ``layers`` layers (local to every rank, before any message)."""
    S, V, M = settings.stages, settings.virtual_stages, settings.micro_batches
    if S < 1 or ranks % S:
        raise ValueError(f"stages={S} must divide the rank count {ranks}")
    if S * V > layers:
        raise ValueError(f"stages={S} x virtual_stages={V} exceeds the model's {layers} layers")
    if config.batch_size % M:
        raise ValueError(f"micro_batches={M} must divide the batch size {config.batch_size}")
    schedules.build(S, M, settings.schedule, V)          # raises on a schedule it cannot make
    if settings.split is not None:
        problem = check_split(settings.split, layers, S * V)
        if problem:
            raise ValueError(f"split: {problem}")
    if settings.placement not in ("auto", "stage-major", "replica-major"):
        raise ValueError(f"placement must be auto, stage-major or replica-major, got {settings.placement!r}")


class PipelineTrainer:
    """Pipeline-parallel (x data-parallel) training of the MLP on the ranks of ``comm``."""

    def __init__(self, config: Config, settings: PipelineSettings, comm: Optional[MPI.Intracomm] = None,
                 dataset: Optional[data.Dataset] = None):
        comm = comm or MPI.COMM_WORLD
        self.data = dataset if dataset is not None else load_data(config)
        widths = [self.data.features, *config.hidden, self.data.classes]
        check(settings, config, comm.Get_size(), len(widths) - 1)   # before any message
        #: The library's clone of ``comm``: the pipeline's messages and the trainer's few collectives.
        self.comm = library_comm(comm)
        self.rank, self.ranks = self.comm.myrank, self.comm.nranks
        S, V, M = settings.stages, settings.virtual_stages, settings.micro_batches
        D = self.replicas = self.ranks // S
        batch = data.shard_batch(len(self.data.y_train), D, config.batch_size)
        batch -= batch % M if batch >= M else 0                 # a lowered batch still splits into M
        self.config = config = Config(**{**config.as_dict(), "batch_size": batch})
        self.model = MLP(self.data.features, config.hidden, self.data.classes, dtype=config.dtype, buffers=False)
        L = self.model.layers
        split = list(settings.split) if settings.split is not None else \
            balanced_split(layer_costs(self.model.widths), S * V)
        self.bounds = stage_layers(split, L)                  # [first, stop) of each virtual stage
        itemsize = self.model.dtype.itemsize
        placement = settings.placement
        if placement == "auto":
            grad = max(self.model.offsets[2 * b] - self.model.offsets[2 * a] for a, b in self.bounds) * itemsize
            act = max((self.model.widths[a] for a, _ in self.bounds[1:]), default=0) * batch * itemsize
            placement = choose_placement(S, D, grad, act, self.comm.layout.node_of)
        self.settings = PipelineSettings(S, M, settings.schedule, V, tuple(split), placement)
        self.grid = Grid(S, D, placement)
        self.stage, self.replica = self.grid.position(self.rank)
        self.virtual = schedules.stage_of_rank(self.stage, S, V)
        self._check_boundaries()
        #: This rank's stage's replicas (the gradient's allreduce), made once per grid and communicator.
        self.replica_comm = self.comm.attach(GridComms, GridComms).replicas(self.comm, self.grid)
        self.my_layers = [layer for k in self.virtual for layer in range(*self.bounds[k])]
        shapes = [shape for layer in self.my_layers for shape in self.model.shapes[2 * layer:2 * layer + 2]]
        self.flat = FlatParameters(shapes, dtype=self.model.dtype)
        self.params, self.grads = self.flat.params, self.flat.grads
        p, g = self.flat.views(self.params), self.flat.views(self.grads)
        pv = {layer: (p[2 * i], p[2 * i + 1]) for i, layer in enumerate(self.my_layers)}
        gv = {layer: (g[2 * i], g[2 * i + 1]) for i, layer in enumerate(self.my_layers)}
        # The initial values one rank draws (Trainer: rank 0's, broadcast): every layer in order.
        rng = np.random.default_rng([config.seed, 4, 0])
        for layer in range(L):
            W, b = pv.get(layer) or (np.empty(self.model.shapes[2 * layer], self.model.dtype),
                                     np.empty(self.model.shapes[2 * layer + 1], self.model.dtype))
            self.model.init_layer(rng, layer, W, b)
        self.layers = {k: StageLayers(self.model.widths, *self.bounds[k], pv, gv) for k in self.virtual}
        self.actions = schedules.build(S, M, settings.schedule, V)
        costs = layer_costs(self.model.widths)
        work = [sum(costs[a:b]) for a, b in self.bounds]
        mean = sum(work) / len(work)
        # The schedule with these stages' costs (multiply-adds of forward and backward; a backward
        # twice a forward): also the proof that it cannot hang.
        self.simulated = schedules.simulate(self.actions, 1.0, 2.0, stage_costs={k: w / mean for k, w in enumerate(work)})
        self.runtime = Runtime(self.comm, self.grid.pipeline(self.replica), self.actions[self.stage], self.layers,
                               S * V, M, self.model.dtype)
        self.optimizer = make_optimizer(config.optimizer, self.params.size, self.model.dtype, config.momentum,
                                        config.weight_decay)
        self.plan = Plan(len(self.data.y_train), D, self.replica, batch, 1, config.seed)
        self.steps_per_epoch = self.plan.steps_per_epoch
        self.warmup_steps = int(round(config.warmup_epochs * self.steps_per_epoch))
        self.delay = config.straggler[1] / 1e3 if config.straggler and config.straggler[0] == self.rank else 0.0
        self.step = self.saved_step = 0
        self.skipped_steps: List[int] = []
        self.history: List[Dict[str, Any]] = []
        #: what makes this run's checkpoints its own (the data-parallel trainer's identity: the same
        #: model on the same data in the same order)
        self.run_settings = ckpt_format.run_settings(config.as_dict(), "sync")
        self.run_identity = ckpt_format.run_identity(self.run_settings)
        #: the open epoch a checkpoint carried: its epoch, sums (on rank 0) and seconds
        self.carried: Optional[Dict[str, Any]] = None
        #: the epoch under way: this rank's sums so far and when it began (a checkpoint's open epoch)
        self._open: Tuple[np.ndarray, float] = (np.zeros(3), time.perf_counter())
        #: SIGTERM/SIGUSR1/SIGINT: the ranks' agreement to save and stop (``signals.StopSignals``), set by the CLI
        self.stop: Any = None
        self.times = np.zeros(3)                            # seconds: pipeline, allreduce, update
        self.step_seconds: List[float] = []                 # each step of this run, whole
        self.sent = 0.0
        self.optimizer.warm_up()
        if D > 1:
            average_buffer(self.grads.copy(), bucket_mb=config.bucket_mb, comm=self.replica_comm,
                           algorithm=config.algorithm)
        self.comm.Barrier()
        #: the checkpoint this run continued from (``--resume``), or None
        self.resumed_from = checkpoint.resume(self) if config.resume else None

    def _check_boundaries(self) -> None:
        """Every stage's output is what the next stage takes (width, dtype), checked across the
        ranks before the first step; a mismatch raises PipelineError on every rank naming the stage."""
        widths = self.model.widths
        mine = [(k, widths[self.bounds[k][0]], widths[self.bounds[k][1]], self.model.dtype.name) for k in self.virtual]
        seen = {k: (i, o, d) for part in self.comm.allgather(mine) for k, i, o, d in part}
        for k in range(len(self.bounds) - 1):
            out, nxt = seen[k], seen[k + 1]
            if (out[1], out[2]) != (nxt[0], nxt[2]):
                raise PipelineError(f"stage {k} puts out {out[1]} features of {out[2]}, stage {k + 1} takes "
                                    f"{nxt[0]} of {nxt[2]}")

    @property
    def holds_first(self) -> bool:
        return 0 in self.layers

    @property
    def holds_last(self) -> bool:
        return len(self.bounds) - 1 in self.layers

    # -- one step -----------------------------------------------------------------------------
    def train_step(self, idx: np.ndarray) -> Tuple[float, int]:
        """The pipeline on this replica's batch ``idx``, the replicas' average, the update."""
        t0 = time.perf_counter()
        for stage in self.layers.values():             # each layer's first backward writes its gradient
            stage.new_step()
        parts = np.array_split(idx, self.settings.micro_batches)
        rows = [len(part) for part in parts]
        inputs = [self.data.X_train[part] for part in parts] if self.holds_first else None
        targets = [self.data.y_train[part] for part in parts] if self.holds_last else None
        if self.delay:
            from ..train.timing import pause
            pause(self.delay)
        loss, correct = self.runtime.step(rows, inputs, targets, len(idx))
        t1 = time.perf_counter()
        if self.replicas > 1:
            average_buffer(self.grads, bucket_mb=self.config.bucket_mb, comm=self.replica_comm,
                           algorithm=self.config.algorithm)
            self.sent += 2.0 * self.grads.nbytes * (self.replicas - 1) / self.replicas
        t2 = time.perf_counter()
        # The replicas of a stage hold bitwise the same average; the stages agree with one small call.
        with INSPECTOR.watching(self.comm.watch, "pipeline: the step's finiteness check (allreduce of one flag)"):
            finite = self.comm.allreduce(all_finite(self.grads), op=MPI.LAND)
        if not finite:
            if self.config.on_nonfinite == "abort":
                raise NonFiniteError(self.step + 1, self.plan.position(self.step)[0] + 1)
            self.skipped_steps.append(self.step + 1)
        else:
            lr = learning_rate(self.config.lr, self.replicas, self.config.lr_scaling, self.warmup_steps, self.step)
            self.optimizer.step(self.params, self.grads, lr)
        self.times += (t1 - t0, t2 - t1, time.perf_counter() - t2)
        self.step_seconds.append(time.perf_counter() - t0)
        self.step += 1
        return loss, correct

    def save_checkpoint(self) -> None:
        """This step's checkpoint, with the open epoch's sums so far (collective; ``checkpoint.py``)."""
        checkpoint.save(self, self._open[0], time.perf_counter() - self._open[1])

    def total_steps(self) -> int:
        total = self.plan.total_steps(self.config.epochs)
        return min(total, self.config.max_steps) if self.config.max_steps > 0 else total

    def run(self, on_step=None, on_epoch=None) -> Dict[str, Any]:
        """Train until ``epochs`` (or ``max_steps``); return the results (the same on every rank)."""
        total, every = self.total_steps(), self.config.checkpoint_every
        due = lambda: bool(self.config.checkpoint_dir) and every > 0 and self.step % every == 0  # noqa: E731
        start = time.perf_counter()
        while self.step < total:
            epoch, first = self.plan.position(self.step)
            batches = self.plan.batches(epoch)
            sums = np.zeros(3)
            carried, counted_from = 0.0, first           # steps before this run count if a checkpoint carried them
            if self.carried is not None and self.carried["epoch"] == epoch:
                sums[:] = self.carried["sums"]
                carried, counted_from = self.carried["seconds"], 0
            self.carried = None
            began = time.perf_counter() - carried
            self._open = (sums, began)
            for i in range(first, len(batches)):
                if self.step >= total:
                    break
                loss, correct = self.train_step(batches[i])
                if self.holds_last:
                    sums += (loss, correct, len(batches[i]))
                if due() and i + 1 < len(batches):
                    self.save_checkpoint()               # within the epoch: with its sums so far
                if i + 1 < len(batches):
                    stop_if_asked(self)                  # the epoch's last step is asked after its record
                if on_step:
                    on_step(i + 1)
            ended = self.plan.position(self.step)[0] > epoch
            steps = (len(batches) if ended else self.plan.position(self.step)[1]) - counted_from
            self.history.append(self._epoch_metrics(epoch, sums, time.perf_counter() - began, steps))
            if on_epoch:
                on_epoch(self.history[-1])
            if ended and due():
                self.save_checkpoint()                   # at the epoch's end: after its record, which it keeps
            if ended:
                stop_if_asked(self)
            elif self.config.checkpoint_dir and self.saved_step != self.step:
                self.save_checkpoint()                   # the run ends inside the epoch: with its sums
        if self.config.checkpoint_dir and self.saved_step != self.step:
            self.save_checkpoint()
        self.train_seconds = time.perf_counter() - start
        return self.results()

    def evaluate(self, X: np.ndarray, y: np.ndarray) -> int:
        """Samples of (X, y) this replica's pipeline classifies correctly (counted on its last stage)."""
        correct = 0
        for i in range(0, len(y), 4096):
            rows = len(y[i:i + 4096])
            out = self.runtime.forward_only(X[i:i + 4096] if self.holds_first else None, rows)
            if out is not None:
                correct += int((out.argmax(axis=1) == y[i:i + 4096]).sum())
        return correct

    def _epoch_metrics(self, epoch: int, sums: np.ndarray, seconds: float, steps: int) -> Dict[str, Any]:
        test = slice(self.replica, None, self.replicas)
        totals = np.zeros(5)
        totals[:3] = sums
        totals[3] = self.evaluate(self.data.X_test[test], self.data.y_test[test])
        totals[4] = len(self.data.y_test[test]) if self.holds_last else 0
        with INSPECTOR.watching(self.comm.watch, "pipeline: the epoch's totals (allreduce of 5 numbers)"):
            totals = self.comm.allreduce(totals)
        seconds = float(self.comm.bcast(seconds, root=0))
        lr = learning_rate(self.config.lr, self.replicas, self.config.lr_scaling, self.warmup_steps,
                           max(self.step - 1, 0))
        return epoch_record(epoch, steps, *totals, seconds, lr)

    # -- the end ------------------------------------------------------------------------------
    def full_parameters(self) -> np.ndarray:
        """The whole model's flat parameters, in ``MLP``'s layout, on every rank (collective)."""
        mine = (self.my_layers, self.params) if self.replica == 0 else None
        full = np.empty(self.model.size, self.model.dtype)
        for part in self.comm.allgather(mine):
            if part is None:
                continue
            at = 0
            for layer in part[0]:
                lo, hi = self.model.layer_bounds(layer)
                full[lo:hi] = part[1][at:at + hi - lo]
                at += hi - lo
        return full

    def stats(self) -> Dict[str, Any]:
        """``idle_share`` and ``peak_live`` per pipeline rank (the mean, and the most, over its
        replicas), measured by the runtime; the simulator's figures beside them.

        A rank's idle share is the simulator's: the share of its pipeline's time (the longest span
        of the pipeline's ranks, summed over the steps) in which it did not compute, whether it
        waited for a message or had finished its list before the others; ``wait_share`` is the
        time it waited for messages over its own span."""
        s = self.runtime.stats
        mine = (self.stage, self.replica, s.idle, s.span, s.peak_live)
        actions = max(s.steps * self.runtime.forwards_per_step, 1)
        costs = (s.forward / actions, s.backward / actions)
        gathered, measured = (list(part) for part in zip(*self.comm.allgather((mine, costs))))
        S = self.settings.stages
        makespan = {r: max(span for _, rep, _, span, _ in gathered if rep == r) for r in range(self.replicas)}
        rows = [(st, (makespan[rep] - span + waited) / makespan[rep] if makespan[rep] > 0 else 0.0,
                 waited / span if span > 0 else 0.0, peak) for st, rep, waited, span, peak in gathered]
        idle = [float(np.mean([i for st, i, _, _ in rows if st == k])) for k in range(S)]
        wait = [float(np.mean([w for st, _, w, _ in rows if st == k])) for k in range(S)]
        peak = [int(max(p for st, _, _, p in rows if st == k)) for k in range(S)]
        # each pipeline rank's mean forward and backward of one micro-batch through one of its
        # virtual stages, over its replicas; the schedule simulated with them
        cost = [(float(np.mean([c[0] for (st, *_), c in zip(gathered, measured) if st == k])),
                 float(np.mean([c[1] for (st, *_), c in zip(gathered, measured) if st == k]))) for k in range(S)]
        expected = schedules.simulate(self.actions, stage_costs={v: cost[schedules.rank_of_stage(v, S)]
                                                                 for v in range(S * self.settings.virtual_stages)})
        return {"stages": S, "replicas": self.replicas, "micro_batches": self.settings.micro_batches,
                "schedule": self.settings.schedule, "virtual_stages": self.settings.virtual_stages,
                "split": list(self.settings.split), "placement": self.settings.placement,
                "layers_per_stage": [[a, b] for a, b in self.bounds],
                "idle_share": idle, "wait_share": wait, "peak_live": peak,
                "forward_ms": [1e3 * f for f, _ in cost], "backward_ms": [1e3 * b for _, b in cost],
                "expected_idle_share": expected.idle_share,
                "simulated_idle_share": self.simulated.idle_share, "simulated_peak_live": self.simulated.peak_live,
                "straggler_stage": self.grid.position(self.config.straggler[0])[0] if self.config.straggler else None,
                "ranks": [{"rank": r, "stage": st, "idle_share": i, "wait_share": w, "peak_live": p}
                          for r, (st, i, w, p) in enumerate(rows)]}

    def results(self) -> Dict[str, Any]:
        gathered = self.comm.allgather((self.stage, digest(self.params), self.times / max(self.step, 1), self.sent))
        identical = all(d == next(e for st, e, _, _ in gathered if st == s) for s, d, _, _ in gathered)
        times = [t for _, _, t, _ in gathered]
        full = self.full_parameters()
        series = self.comm.bcast(self.step_seconds, root=0)          # rank 0's steps, whole
        samples = sum(e["samples"] for e in self.history)
        seconds = sum(e["seconds"] for e in self.history)
        return {"ranks": self.ranks, "steps": self.step, "epochs": self.history,
                "test_accuracy": self.history[-1]["test_accuracy"] if self.history else 0.0,
                "samples_per_second": samples / seconds if seconds > 0 else 0.0,
                "train_seconds": getattr(self, "train_seconds", seconds), "updates_applied": self.step - len(self.skipped_steps),
                "skipped_steps": self.skipped_steps, "replicas_identical": bool(identical),
                "params_digest": digest(full), "pipeline": self.stats(),
                "step_ms": {"step_p50": 1e3 * float(np.median(series)) if series else 0.0,
                            "per_step": [1e3 * t for t in series],
                            "pipeline_p50": 1e3 * float(np.median([t[0] for t in times])),
                            "allreduce_p50": 1e3 * float(np.median([t[1] for t in times])),
                            "update_p50": 1e3 * float(np.median([t[2] for t in times]))},
                "allreduce_bytes_sent_per_step": sum(s for *_, s in gathered) / self.ranks / max(self.step, 1)}

    def close(self) -> None:
        """Nothing to free: the replicas' communicator lives as long as the caller's (``GridComms``)."""


class GridComms:
    """The replicas' communicators of the grids used on one library communicator, made once each
    (collective then) and freed with it."""

    def __init__(self, lib: Any):
        self.made: Dict[Grid, MPI.Intracomm] = {}

    def replicas(self, lib: Any, grid: Grid) -> MPI.Intracomm:
        """The ranks of ``lib`` holding this rank's stage of ``grid``, in replica order."""
        if grid not in self.made:
            stage, replica = grid.position(lib.myrank)
            self.made[grid] = MPI.Intracomm(lib).Split(color=stage, key=replica)   # a plain communicator
        return self.made[grid]

    def free(self) -> None:
        for made in self.made.values():
            made.Free()
        self.made.clear()
