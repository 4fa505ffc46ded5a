"""The trainer's ``--pipeline`` options: their checks, and the run (``python -m allreduce_kit.train
--pipeline S``). docs/pipeline.md.

A pipeline run is synchronous (``--mode sync``) and plain: what does not combine with it is
refused with one message naming the option (``problems``): ``--zero``, ``--mode async-ps``,
``--elastic``, ``--backup-workers``, ``--local-sgd``, ``--accum-steps`` (the micro-batches are
the accumulation), ``--jitter-ms``, ``--inject-nan`` and ``--bench-allreduce``.
Checkpoints are per stage (``checkpoint.py``).
"""
import argparse
import sys
import time
from typing import Any, Callable, Optional, Set

from ..cli import plural, say, write_json
from . import schedules
from .grid import PLACEMENTS
from .stage import check_split

#: The options of a pipeline run (argparse destinations), all only with --pipeline.
OPTIONS = ("micro_batches", "schedule", "virtual_stages", "split", "placement")
#: Options that do not combine with --pipeline: destination -> how it reads when given.
REFUSED = {"zero": "--zero", "elastic": "--elastic", "backup_workers": "--backup-workers",
           "local_sgd": "--local-sgd", "accum_steps": "--accum-steps", "jitter_ms": "--jitter-ms", "inject_nan": "--inject-nan",
           "bench_allreduce": "--bench-allreduce", "trace": "--trace"}


def _split(text: str):
    try:
        layers = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices such as 2,5, got {text!r}")
    if not layers:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices such as 2,5, got {text!r}")
    return layers


def add_arguments(parser: Any, at_least: Callable) -> None:
    """``--pipeline``, ``--micro-batches``, ``--schedule``, ``--virtual-stages``, ``--split``, ``--placement``."""
    g = parser.add_argument_group(
        "pipeline parallelism (docs/pipeline.md)",
        "P = S x D ranks: the model's layers cut into S stages, D data-parallel replicas of the pipeline.")
    g.add_argument("--pipeline", type=at_least(1), default=None, metavar="S",
                   help="cut the MLP into S pipeline stages (S divides the rank count, at most the layer count); "
                        "each stage's gradient is averaged over its D = P / S replicas")
    g.add_argument("--micro-batches", type=at_least(1), default=1, metavar="M",
                   help="with --pipeline: cut each replica's batch into M micro-batches (M divides --batch-size)")
    g.add_argument("--schedule", choices=schedules.SCHEDULES, default="1f1b",
                   help="with --pipeline: the order of forwards and backwards (gpipe, 1f1b, interleaved 1F1B)")
    g.add_argument("--virtual-stages", type=at_least(1), default=1, metavar="V",
                   help="with --schedule interleaved: V stages per rank (the model cut into S x V)")
    g.add_argument("--split", type=_split, default=None, metavar="I,J,...",
                   help="with --pipeline: the layer index where each stage but the first starts (S x V - 1 "
                        "indices; default: balanced by compute)")
    g.add_argument("--placement", choices=PLACEMENTS, default="auto",
                   help="with --pipeline: rank = stage x D + replica (stage-major: a stage's replicas next to "
                        "each other) or replica x S + stage (replica-major); auto keeps the heavier traffic "
                        "inside a node")


def problems(args: Any, ranks: int, given: Set[str]) -> Optional[str]:
    """One message for pipeline options that cannot run on ``ranks`` ranks (None when all is well)."""
    if args.pipeline is None:
        typed = [name for name in OPTIONS if name in given]
        return f"argument --{typed[0].replace('_', '-')}: only with --pipeline" if typed else None
    S, M, V = args.pipeline, args.micro_batches, args.virtual_stages
    if args.mode != "sync":
        return f"argument --pipeline: not with --mode {args.mode} (a pipeline run is synchronous)"
    for name, flag in REFUSED.items():
        value = getattr(args, name, None)
        if value not in (None, False, 0, 0.0) and not (name == "local_sgd" and value == 1):
            return f"argument {flag}: not with --pipeline (docs/pipeline.md lists what combines)"
    if ranks % S:
        return f"argument --pipeline: {S} stages do not divide the {plural(ranks, 'rank')} (P = S x D)"
    layers = len(args.hidden) + 1
    if S * V > layers:
        what = f"{S} stages" if V == 1 else f"{S} stages x {V} virtual stages"
        return (f"argument --{'pipeline' if V == 1 else 'virtual-stages'}: {what} exceed the model's "
                f"{plural(layers, 'layer')} (--hidden)")
    if args.batch_size % M:
        return f"argument --micro-batches: {M} does not divide --batch-size {args.batch_size}"
    if V > 1 and args.schedule != "interleaved":
        return f"argument --virtual-stages: only with --schedule interleaved (got --schedule {args.schedule})"
    problem = schedules.interleaved_problem(S, M) if args.schedule == "interleaved" else None
    if problem:
        return f"argument --micro-batches: --schedule interleaved {problem}"
    if args.split is not None:
        problem = check_split(args.split, layers, S * V)
        if problem:
            return f"argument --split: {problem}"
    return None


def main(args: Any, config: Any, threads: int, yield_note: str, comm: Any, parser: Any, started: float) -> int:
    """The pipeline run (every rank); rank 0 prints, and writes ``--json``."""
    from ..train.checkpoint import CheckpointError
    from ..train.signals import STOPPED_STATUS, StopSignals, Stopped
    from ..train.report import epoch_line
    from ..train.summary import build_summary, summary_lines
    from ..train.trainer import NonFiniteError, ResumeError
    from .train import PipelineError, PipelineSettings, PipelineTrainer

    settings = PipelineSettings(args.pipeline, args.micro_batches, args.schedule, args.virtual_stages,
                                args.split, args.placement)
    try:
        trainer = PipelineTrainer(config, settings, comm)
    except PipelineError as error:
        say(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    except ResumeError as error:
        say(f"{parser.prog}: {error}", file=sys.stderr)
        return 1
    s = trainer.settings
    d = trainer.data
    say(f"allreduce_kit.train: {plural(trainer.ranks, 'rank')}, {plural(threads, 'thread')} per rank, {yield_note}")
    say(f"data: {d.name}, {len(d.y_train)} train / {len(d.y_test)} test samples; "
        f"{plural(trainer.steps_per_epoch, 'step')} per epoch")
    say(f"pipeline: {s.stages} stages x {trainer.replicas} replicas ({s.placement}), schedule {s.schedule}"
        f"{f' with {s.virtual_stages} virtual stages per rank' if s.virtual_stages > 1 else ''}, "
        f"{plural(s.micro_batches, 'micro-batch', 'micro-batches')} of a {trainer.config.batch_size}-sample batch "
        f"per replica; model {trainer.model.describe()}, layers per stage "
        + " ".join(f"[{a}, {b})" for a, b in trainer.bounds))
    if trainer.resumed_from:
        say(f"resumed from {trainer.resumed_from} at step {trainer.step}")
    if config.straggler:
        say(f"injected straggler: rank {config.straggler[0]} +{config.straggler[1]:g} ms per step")

    def on_epoch(m) -> None:
        say(epoch_line(m, config.epochs))                # the data-parallel run's line

    if config.checkpoint_dir:                            # SIGTERM/SIGUSR1/SIGINT: save at the next step boundary, exit 75
        trainer.stop = StopSignals(comm)
    try:
        result = trainer.run(on_epoch=on_epoch)
    except (NonFiniteError, CheckpointError, Stopped) as error:
        say(f"{parser.prog}: {error}", file=sys.stderr)
        trainer.close()
        return STOPPED_STATUS if isinstance(error, Stopped) else 1
    finally:
        if trainer.stop is not None:
            trainer.stop.close()
    pipe = result["pipeline"]
    say(f"test accuracy {100 * result['test_accuracy']:.2f}% after {plural(result['steps'], 'step')} | "
        f"{result['samples_per_second']:,.0f} samples/s | {result['train_seconds']:.1f} s training")
    say(f"replicas of each stage bitwise identical: {'yes' if result['replicas_identical'] else 'NO'} "
        f"(parameters blake2b {result['params_digest']})")
    say("stage  idle share  simulated  expected  waiting  peak live  simulated  forward ms  backward ms")
    for k in range(s.stages):
        say(f"{k:>5}  {100 * pipe['idle_share'][k]:9.1f}%  {100 * pipe['simulated_idle_share'][k]:8.1f}%  "
            f"{100 * pipe['expected_idle_share'][k]:7.1f}%  {100 * pipe['wait_share'][k]:6.1f}%  "
            f"{pipe['peak_live'][k]:>9}  {pipe['simulated_peak_live'][k]:>9}  {pipe['forward_ms'][k]:10.2f}  "
            f"{pipe['backward_ms'][k]:11.2f}")
    say("(simulated: the schedule with the stages' multiply-adds; expected: with the forward and backward "
        "times measured)")
    if config.straggler:
        say(f"the straggler holds stage {pipe['straggler_stage']}: the whole pipeline waits on it (the other stages' idle share grows)")
    shared = build_summary("sync", trainer.ranks, trainer.ranks, result["epochs"], result["updates_applied"],
                           wall_seconds=time.perf_counter() - started)
    say(summary_lines(shared))
    if args.json and comm.Get_rank() == 0:
        from ..train.async_main import recorded_config
        write_json(args.json, {"config": {**recorded_config(parser, args, trainer.config), "mode": "sync",
                                          "batch_size_requested": args.batch_size},
                               "threads_per_rank": threads, **result, "resumed_from": trainer.resumed_from,
                               "summary": shared})
        say(f"wrote {args.json}")
    if args.plot and comm.Get_rank() == 0:
        from .report import plot
        plot(args.plot, result)
        say(f"wrote {args.plot}")
    identical = result["replicas_identical"]
    trainer.close()
    return 0 if identical else 1
