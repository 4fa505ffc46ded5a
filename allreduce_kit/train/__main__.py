"""``mpirun -n 8 python -m allreduce_kit.train``: synchronous data-parallel SGD with a straggler report.

Run ``python -m allreduce_kit.train --help`` for the options; docs/training.md explains the output.
"""
import time

STARTED = time.perf_counter()                          # the summary's wall time counts from here

if __name__ == "__main__":  # abort-on-error and heavy yield, asked for before MPI starts
    import gc
    import sys

    from ..run import prepare, ulfm_launched

    if "--elastic" in sys.argv[1:] and not ulfm_launched():   # the supervisor: one process, without MPI (elastic.py)
        from .elastic import main as supervise

        sys.exit(supervise(sys.argv[1:]))
    prepare()
    # Set-up makes hundreds of thousands of objects that live until the end (numba's tables,
    # the modules): the collector, held until main() freezes them, would traverse them again
    # and again while they are made (about 0.05 s of CPU per rank; docs/training.md).
    gc.disable()

import argparse  # noqa: E402
import gc  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from typing import List, Optional, Set  # noqa: E402

from mpi4py import MPI  # noqa: E402

from .. import run, stall, startup  # noqa: E402
from ..cli import settings_problem  # noqa: E402
from ..algorithms import ALGORITHMS
from ..cli import RankZeroParser, is_root, outputs_problem, plural, say, write_json
from ..launch import check_launch
from ..threads import limit_threads
from . import checkpoint, elastic, injob, modes, report, resize, sharding
from ..pipeline import cli as pipeline_cli            # --pipeline S: model parallelism (docs/pipeline.md)
from . import compressed
from ..memory import available_bytes
from ..trace import session as trace_session
from ..trace.session import TraceError, steps_window
from .trainer import Config, NonFiniteError, ResumeError, Trainer
from .signals import STOPPED_STATUS, StopSignals, Stopped
# --mode sync|async-ps: the async side lives in async_main.py, the summary both share in summary.py
from . import async_main
from .summary import build_summary, summary_lines

DEFAULTS = Config()


def _hidden(text: str):
    try:
        sizes = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer widths such as 256,128, got {text!r}")
    if any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"layer widths must be >= 1, got {text!r}")
    return sizes


def _rank_and(convert, minimum, form: str):
    """An argparse type for ``RANK:VALUE`` (rank >= 0, value >= ``minimum``); ``form`` names both."""
    def parse(text: str):
        rank, sep, rest = text.partition(":")
        try:
            value = (int(rank), convert(rest))
        except ValueError:
            value = None
        if not sep or value is None or value[0] < 0 or not value[1] >= minimum:
            raise argparse.ArgumentTypeError(f"expected {form}, got {text!r}")
        return value
    return parse


_straggler = _rank_and(float, 0, "RANK:MS such as 3:20 (rank >= 0, delay in ms >= 0)")


def _trace_window(text: str):
    try:
        return steps_window(text)
    except TraceError as bad:
        raise argparse.ArgumentTypeError(str(bad)) from None


def _at_least(low, kind=int, strict=False):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}")
        if value < low or (strict and value == low) or value != value:
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {low}, got {text!r}")
        return value
    return parse


def build_parser() -> RankZeroParser:
    d = DEFAULTS
    p = RankZeroParser(prog="python -m allreduce_kit.train",
                       description="Synchronous data-parallel SGD of an MLP over allreduce_kit's allreduce, "
                                   "with per-rank timing and a straggler report. Launch with "
                                   "mpirun -n P; only rank 0 prints.")
    g = p.add_argument_group("training")
    g.add_argument("--epochs", type=_at_least(1), default=d.epochs, help="passes over the training set")
    g.add_argument("--batch-size", type=_at_least(1), default=d.batch_size,
                   help="samples per rank per step (the global batch is P times this); a value larger "
                        "than a rank's shard of the training set is lowered to the shard, and the "
                        "header and the --json config show the batch used")
    g.add_argument("--lr", type=_at_least(0.0, float, strict=True), default=d.lr, help="base learning rate")
    g.add_argument("--lr-scaling", choices=("none", "linear"), default=d.lr_scaling,
                   help="linear: use lr x P, reached by a linear warm-up from lr (Goyal et al. 2017)")
    g.add_argument("--warmup-epochs", type=_at_least(0.0, float), default=d.warmup_epochs,
                   help="epochs of linear warm-up from lr to the scaled lr")
    g.add_argument("--momentum", type=_at_least(0.0, float), default=d.momentum, help="SGD momentum (< 1)")
    g.add_argument("--weight-decay", type=_at_least(0.0, float), default=d.weight_decay, help="L2 weight decay")
    g.add_argument("--hidden", type=_hidden, default=",".join(map(str, d.hidden)), metavar="W1,W2,...",
                   help="hidden layer widths (empty string: softmax regression)")
    g.add_argument("--dtype", choices=("float32", "float64"), default=d.dtype, help="parameter and data dtype")
    g.add_argument("--seed", type=int, default=d.seed, help="seed for data, split, shuffling, init and jitter")
    g.add_argument("--max-steps", type=_at_least(0), default=d.max_steps, help="stop after this many steps (0: no limit)")
    resize.add_arguments(g, _at_least)               # --accum-steps, --on-resize
    g = p.add_argument_group("data")
    g.add_argument("--dataset", choices=("digits", "synthetic"), default=d.dataset,
                   help="digits: scikit-learn's bundled 8x8 digits; synthetic: generated from --seed")
    g.add_argument("--samples", type=_at_least(2), default=d.samples, help="synthetic: number of samples")
    g.add_argument("--features", type=_at_least(1), default=d.features, help="synthetic: features per sample")
    g.add_argument("--classes", type=_at_least(2), default=d.classes, help="synthetic: number of classes")
    g.add_argument("--test-fraction", type=_at_least(0.0, float, strict=True), default=d.test_fraction,
                   help="share of the data held out for testing (< 1)")
    g = p.add_argument_group("communication")
    g.add_argument("--algorithm", choices=("auto", *ALGORITHMS), default=d.algorithm,
                   help="allreduce algorithm (auto: the library's choice for the size)")
    g.add_argument("--bucket-mb", type=_at_least(0.0, float), default=d.bucket_mb,
                   help="reduce the fused gradient in buckets of at most this many MB of 10^6 bytes (0: one "
                        "bucket); PyTorch's bucket_cap_mb counts MiB of 2^20 bytes")
    g = p.add_argument_group("stragglers and timing")
    g.add_argument("--straggler", type=_straggler, default=None, metavar="RANK:MS",
                   help="add MS milliseconds to RANK's compute every step")
    g.add_argument("--jitter-ms", type=_at_least(0.0, float), default=d.jitter_ms,
                   help="add a random delay, uniform in [0, 2 x MS] (mean MS), to every rank's compute every step")
    g.add_argument("--gather-every", type=_at_least(1), default=d.gather_every, metavar="K",
                   help="gather the per-step timing records to rank 0 every K steps")
    g.add_argument("--trace", metavar="PATH.json", default=None,
                   help="write one Chrome trace of every rank's steps, compute, collectives and checkpoints on "
                        "rank 0's clock (open in Perfetto; python -m allreduce_kit.trace summary PATH.json; "
                        "docs/trace.md); --mode sync, backup workers and local SGD")
    g.add_argument("--trace-steps", type=_trace_window, default=None, metavar="A:B",
                   help="with --trace: record steps A to B-1 only, counted from 0 (A: to the end)")
    g.add_argument("--bench-allreduce", type=_at_least(0), default=0, metavar="N",
                   help="after training, time N averages of a gradient-sized buffer alone and compare")
    g = p.add_argument_group("output")
    g.add_argument("--progress", choices=("auto", "bar", "lines"), default="auto",
                   help="auto: a tqdm bar on a terminal, plain per-epoch lines otherwise (async-ps: lines)")
    g.add_argument("--json", metavar="PATH", default=None,
                   help="write config, per-epoch metrics and the report to this file (checked before training)")
    g.add_argument("--plot", metavar="PATH.png", default=None,
                   help="draw per-rank compute/transfer/wait bars and the step-time timeline as a PNG, written to "
                        "exactly PATH.png (a path not ending in .png is refused; needs matplotlib)")
    g = p.add_argument_group("checkpoints")
    g.add_argument("--checkpoint-dir", metavar="DIR", default=None, help="where rank 0 writes checkpoint-STEP.npz files")
    g.add_argument("--checkpoint-every", type=_at_least(0), default=d.checkpoint_every, metavar="N",
                   help="save every N steps (0: only at the end), atomically")
    g.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint of this run in DIR (other runs' checkpoints there "
                        "are left alone; without --resume, a DIR holding checkpoints is refused), with its history "
                        "(per-epoch metrics, "
                        "counters); it must come from a --mode sync run with the same data (--dataset, --seed, "
                        "--test-fraction; for synthetic also --samples, --features, --classes) and model; at "
                        "another rank count the data continue from its sample, re-sharded (--on-resize)")
    add_reliability_options(p)
    modes.add_arguments(p, _at_least)                  # --backup-workers, --local-sgd, ...
    async_main.add_arguments(p, _at_least)             # --mode, --servers, --max-staleness, ...
    elastic.add_arguments(p)                           # --elastic, -n, --min-ranks, --mpiexec
    sharding.add_arguments(p)                          # --zero, --optimizer
    pipeline_cli.add_arguments(p, _at_least)           # --pipeline, --micro-batches, --schedule, ...
    compressed.add_arguments(p, _at_least)             # --compression, --compression-rank, --compression-start
    return p


# -- reliability: options and their checks, kept together ----------------------------------------
_rank_step = _rank_and(int, 1, "RANK:STEP such as 1:5 (rank >= 0, step >= 1)")


def add_reliability_options(p: RankZeroParser) -> None:
    d = DEFAULTS
    g = p.add_argument_group("reliability (docs/reliability.md)")
    g.add_argument("--stall-timeout", type=_at_least(0.0, float), default=None, metavar="SECONDS",
                   help="a collective still waiting after this long names the ranks that have not arrived "
                        "and aborts the job (0: off) (default: $ALLREDUCE_KIT_STALL_TIMEOUT, else 60)")
    g.add_argument("--keep-checkpoints", type=_at_least(1), default=d.keep_checkpoints, metavar="K",
                   help="keep the newest K checkpoints in --checkpoint-dir")
    g.add_argument("--on-nonfinite", choices=("abort", "skip"), default=d.on_nonfinite,
                   help="NaN or Inf in the averaged gradient: stop the run naming the step, or skip that "
                        "step's update on every rank")
    g.add_argument("--inject-nan", type=_rank_step, default=None, metavar="RANK:STEP",
                   help="testing aid: put a NaN in RANK's gradient at STEP (1-based), before the allreduce")


def _reliability_problems(args, ranks: int) -> Optional[str]:
    """Checks of the reliability options that need the rank count or the file system (rank 0's verdict)."""
    if args.inject_nan and args.inject_nan[0] >= ranks:
        return (f"argument --inject-nan: rank {args.inject_nan[0]} does not exist in a job of {plural(ranks, 'rank')} "
                f"(0..{ranks - 1})")
    if args.checkpoint_dir is not None:
        if not args.checkpoint_dir:
            return "argument --checkpoint-dir: expected a directory, got an empty string"
        if is_root() and not (args.resume and not os.path.lexists(args.checkpoint_dir)):
            problem = checkpoint.directory_problem(args.checkpoint_dir)   # --resume reports a missing one
            if problem:
                return f"argument --checkpoint-dir: {problem}"
            problem = None if args.resume else _occupied(args)
            if problem:
                return f"argument --checkpoint-dir: {problem}"
    return None


def _occupied(args) -> Optional[str]:
    """Why a fresh run (no --resume) cannot write its checkpoints into --checkpoint-dir, or None.

    A fresh run starts in a directory that holds no checkpoints. Another run's would be mixed with
    its own, the newest of either taken by a later --resume; this run's own (the same run identity:
    checkpoint.py) would be overtaken by the fresh ones' steps, or overtake them. Either way the
    user says which they mean: --resume to continue, another directory to start over."""
    try:
        found = checkpoint.survey(args.checkpoint_dir)
    except OSError:                                   # not there yet: the run makes it
        return None
    if not found:
        return None
    directory, newest = args.checkpoint_dir, found[-1]
    name = f"{os.path.basename(newest.path)}, step {newest.step}"
    if newest.mode is not None and newest.mode != args.mode:
        # --resume from one is refused by the trainer, naming the mode.
        return (f"{directory} holds checkpoints of a --mode {newest.mode} run ({os.path.basename(newest.path)}); this "
                f"--mode {args.mode} run would mix its own in and delete the oldest: give it another directory")
    settings = checkpoint.run_settings(vars(args), args.mode)
    own = [f for f in found if f.run == checkpoint.run_identity(settings)]
    if own:
        how = (f"--resume continues from {os.path.basename(own[-1].path)}" if args.mode == "sync" else
               "a --mode async-ps run does not resume")
        return (f"{directory} holds checkpoints of this run (the same --mode, data, --seed and model; newest "
                f"{os.path.basename(own[-1].path)}, step {own[-1].step}); a fresh run would mix its own in with them: "
                f"{how}; to start over, give it another directory (or move them away)")
    if newest.settings is None:
        what = f"whose run cannot be told ({name}: its record {'names no run' if newest.readable else 'cannot be read'})"
    else:
        what = f"of another run ({name}: {checkpoint.differences(newest.settings, settings)})"
    resume = " or --resume with that run's settings to continue it" if args.mode == "sync" else ""
    return (f"{directory} holds checkpoints {what}; this run would mix its own in with them and delete the "
            f"oldest: give it another directory{resume}")
# -- end of the reliability block ---------------------------------------------------------------


def _problems(args, ranks: int) -> Optional[str]:
    """Checks that need the rank count or the file system; the verdict is rank 0's, shared by all."""
    if args.momentum >= 1:
        return f"argument --momentum: must be < 1, got {args.momentum}"
    if args.test_fraction >= 1:
        return f"argument --test-fraction: must be < 1, got {args.test_fraction}"
    if args.trace_steps and not args.trace:
        return "argument --trace-steps: needs --trace"
    if args.trace and args.elastic:
        return "argument --trace: not available with --elastic"
    if args.straggler and args.straggler[0] >= ranks:
        return f"argument --straggler: rank {args.straggler[0]} does not exist in a job of {plural(ranks, 'rank')} (0..{ranks - 1})"
    if args.elastic and injob.available():           # recovery in this job (ULFM): its own checks
        problem = injob.problems(args, ranks)
        if problem:
            return problem
    for name in ("elastic", "ranks", "min_ranks", "mpiexec", "launcher"):   # the supervisor takes these before MPI starts
        if getattr(args, name) not in (None, False) and not (args.elastic and injob.available()):
            return f"argument --{name.replace('_', '-')}: only for the supervisor, python -m allreduce_kit.train --elastic -n P (one process, not under mpirun)"
    if (args.resume or (args.checkpoint_every and not (args.elastic and injob.available()))) and not args.checkpoint_dir:
        return f"argument {'--resume' if args.resume else '--checkpoint-every'}: needs --checkpoint-dir"
    total = 1797 if args.dataset == "digits" else args.samples
    test = int(round(total * args.test_fraction))
    if test < 1:
        return f"argument --test-fraction: {args.test_fraction} of {total} samples leaves no test sample"
    if total - test < ranks:
        return (f"argument {'--test-fraction' if args.dataset == 'digits' else '--samples'}: "
                f"{plural(total - test, 'training sample')} cannot give each of {ranks} ranks a shard")
    if not is_root():
        return None
    problem = outputs_problem((("--json", args.json), ("--plot", args.plot, ".png"), ("--trace", args.trace)))
    if problem:
        return problem
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            from ..plots import NO_MATPLOTLIB
            return f"argument --plot: {NO_MATPLOTLIB}"
    return None


def _algorithm_note(algorithm: str, ran: List[str]) -> str:
    """``auto, ran ring``: the algorithm asked for and, for auto, what it chose per bucket size."""
    if algorithm != "auto":
        return algorithm
    if set(ran) <= {"none"}:
        return "auto (nothing to send at 1 rank)"
    counts = {name: ran.count(name) for name in dict.fromkeys(ran)}
    if len(counts) == 1:
        return f"auto, ran {ran[0]}"
    return "auto, ran " + ", ".join(f"{name} ({plural(n, 'bucket')})" for name, n in counts.items())


def _yield_note() -> str:
    return run.heavy_yield_state()


def given_options(parser: argparse.ArgumentParser, args: argparse.Namespace,
                  argv: Optional[List[str]] = None) -> Set[str]:
    """The destinations of the options typed on ``argv`` (``args`` is its parse); defaults do not count."""
    unset = object()
    typed = argparse.Namespace(**{name: unset for name in vars(args)})
    parser.parse_args(argv, namespace=typed)        # argparse fills only what is missing with defaults
    return {name for name, value in vars(typed).items() if value is not unset}


def config_from(args) -> Config:
    return Config(**{k: getattr(args, k) for k in Config.__dataclass_fields__})


def _finish_trace(args) -> None:
    """Write --trace's file (collective; rank 0 writes and says so)."""
    if args.trace:
        size = trace_session.finish()
        if size is not None:
            say(f"wrote {args.trace} ({size / 1e6:.2f} MB; python -m allreduce_kit.trace summary {args.trace})")


def main(argv: Optional[List[str]] = None) -> int:
    check_launch(prog="python -m allreduce_kit.train")  # N unconnected copies (srun --mpi=none) stop here
    parser = build_parser()
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    given = given_options(parser, args, argv)
    per_node = sharding.ranks_per_node(comm)
    problem = comm.bcast(settings_problem() or pipeline_cli.problems(args, comm.Get_size(), given)
                         or async_main.other_mode_problem(args, given)
                         or modes.problems(args, comm.Get_size(), given)
                         or compressed.problems(args, comm.Get_size(), given)
                         or sharding.problems(args, comm.Get_size(), given, per_node, available_bytes())
                         or _problems(args, comm.Get_size()) or _reliability_problems(args, comm.Get_size())
                         or async_main.problems(args, comm.Get_size()), root=0)
    if problem:
        parser.error(problem)                          # rank 0 prints; every rank exits 2
    if args.stall_timeout is not None:
        stall.set_stall_timeout(args.stall_timeout)
    threads = limit_threads(comm)
    startup.numba_without_scipy()                      # before the first compiled call
    startup.one_rank_compiles()
    config = config_from(args)
    if args.pipeline is not None:                      # stages x replicas (pipeline/cli.py)
        return pipeline_cli.main(args, config, threads, _yield_note(), comm, parser, STARTED)
    if args.mode == "async-ps":                        # the parameter-server run
        return async_main.main(args, config, threads, _yield_note(), comm, parser, STARTED)
    recovery = injob.Recovery(comm, config, args.min_ranks, args.checkpoint_every) if args.elastic else None
    if args.trace:                                     # before the first collective: the clocks are measured now
        trace_session.start(args.trace, args.trace_steps or (0, None), comm)
    try:
        trainer = Trainer(config, comm if recovery is None else recovery.comm)
    except ResumeError as error:
        say(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    # What is alive now (modules, numba's compiled kernels and type tables) lives until the
    # process ends: taken out of the garbage collector's sight, it is not traversed again by
    # the collections during the run and at exit (about 0.25 s of CPU per rank; docs/training.md).
    gc.freeze()
    gc.enable()                                      # held since the start (see the top)
    config = trainer.config                          # --batch-size lowered to the shard, if it was larger
    ranks = trainer.ranks
    yield_state = os.environ.get(run.HEAVY_YIELD, "unset")
    yield_note = _yield_note()
    d = trainer.data
    say(f"allreduce_kit.train: {plural(ranks, 'rank')} on {plural(len(set(trainer.hosts)), 'host')}, "
        f"{plural(threads, 'thread')} per rank, {yield_note}")
    say(f"data: {d.name}, {len(d.y_train)} train / {len(d.y_test)} test samples, {d.features} features, "
        f"{d.classes} classes; {plural(trainer.steps_per_epoch, 'step')} per epoch on shards of {len(d.y_train) // ranks}")
    say(report.model_line(trainer, args.batch_size, _algorithm_note(config.algorithm, trainer.bucket_algorithms)))
    if trainer.resume_note:
        say(trainer.resume_note)
    if trainer.resize_note:
        say(trainer.resize_note)
    if recovery is not None:
        say(recovery.header(trainer))
    if trainer.step >= trainer.total_steps():
        say(f"nothing to train: the checkpoint is at step {trainer.step} and this run ends at step "
            f"{trainer.total_steps()}; raise --epochs (or --max-steps) to continue")
        trainer.close()
        return 0
    if config.straggler:
        say(f"injected straggler: rank {config.straggler[0]} +{config.straggler[1]:g} ms per step")
    if config.jitter_ms:
        say(f"injected jitter: every rank +uniform(0, {2 * config.jitter_ms:g}) ms per step")
    if modes.header(config, ranks):
        say(modes.header(config, ranks))
    say(sharding.header(trainer))
    if compressed.header(trainer):
        say(compressed.header(trainer))

    bar = None
    use_bar = is_root() and (args.progress == "bar" or (args.progress == "auto" and sys.stderr.isatty()))
    if use_bar:
        from tqdm import tqdm

    def on_step(i: int) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=trainer.steps_per_epoch, initial=i - 1, leave=False, unit="step",
                       desc=f"epoch {(trainer.step - 1) // trainer.steps_per_epoch + 1}/{config.epochs}")
        bar.update(1)

    def on_epoch(metrics) -> None:
        nonlocal bar
        line = report.epoch_line(metrics, config.epochs)
        if bar is not None:
            bar.close()
            bar = None
        say(line)

    resumed_from = trainer.resumed_from                # --json; a recovery in the job makes a trainer anew
    elastic.ignore_exit_notices()                      # under the supervisor: mpiexec's notices of ranks ending
    if config.checkpoint_dir and (trainer.strategy is None or trainer.shards is not None):   # SIGTERM/SIGUSR1/SIGINT: save at the next step boundary, exit 75
        trainer.stop = StopSignals(trainer.comm)
    try:
        progress = elastic.report_in(trainer)          # under the supervisor: pid, host, steps done
        step_hook = on_step if use_bar else None
        if progress is not None:
            step_hook = progress if step_hook is None else (lambda i: (on_step(i), progress(i)))
        if recovery is None:
            result = trainer.run(on_step=step_hook, on_epoch=on_epoch)
        else:                                          # a lost rank: go on with the survivors (injob.py)
            trainer, result = recovery.run(trainer, lambda survivors, kept: Trainer(
                config_from(args), survivors, trainer.data, snapshot=(kept.arrays, kept.meta)), step_hook, on_epoch)
            ranks = trainer.ranks
    except (NonFiniteError, Stopped) as error:       # raised on every rank at the same step
        if bar is not None:
            bar.close()
        say(f"{parser.prog}: {error}", file=sys.stderr)
        _finish_trace(args)
        trainer.close()
        return STOPPED_STATUS if isinstance(error, Stopped) else 1
    finally:
        if trainer.stop is not None:
            trainer.stop.close()
    _finish_trace(args)
    alone = trainer.allreduce_alone(args.bench_allreduce) if args.bench_allreduce else None
    if is_root():
        s = result["straggler"]
        acc = result["test_accuracy"]
        say(f"test accuracy {100 * acc:.2f}% after {plural(result['steps'], 'step')} | "
            f"{result['samples_per_second']:,.0f} samples/s | {result['train_seconds']:.1f} s training")
        say(f"replicas bitwise identical on {'the 1 rank' if ranks == 1 else f'all {ranks} ranks'}: "
            f"{'yes' if result['replicas_identical'] else 'NO'}"
            f" (parameters blake2b {result['params_digest']})")
        if result["bucket_algorithms"] != trainer.bucket_algorithms:
            say(f"algorithm {_algorithm_note(config.algorithm, result['bucket_algorithms'])} once it had tuned online "
                f"(ALLREDUCE_KIT_ONLINE_TUNING; docs/auto.md)")
        if result["compression"]["method"] != "none":
            c = result["compression"]
            say(f"compression {c['method']}: {c['bytes_sent_per_step'] / 1e3:,.1f} kB sent per rank per step, against "
                f"{c['uncompressed_bytes_per_step'] / 1e3:,.1f} kB uncompressed: ratio {c['ratio']:.2f}")
        if result["skipped_steps"]:
            say(f"skipped the update of {len(result['skipped_steps'])} step(s) with a non-finite averaged gradient "
                f"(--on-nonfinite skip): {result['skipped_steps'][:20]}")
        if s["steps"]:
            say(f"\nstraggler report over {plural(s['steps'], 'step')} (records gathered every "
                f"{plural(config.gather_every, 'step') if config.gather_every > 1 else 'step'}"
                f"{'' if s['steps'] == result['steps'] else '; timings of this run only, not of the steps before --resume'}):")
            say(report.headline(s))
            say(report.straggler_table(s))
            if modes.report_text(result):
                say(modes.report_text(result))
        if alone:
            ratio = s["transfer_ms_p50"] / alone["transfer_ms_p50"] if alone["transfer_ms_p50"] > 0 else float("nan")
            alone["trainer_transfer_ms_p50"] = s["transfer_ms_p50"]
            alone["ratio"] = ratio
            bare = alone["bare_loop_transfer_ms_p50"]
            alone["bare_loop_ratio"] = s["transfer_ms_p50"] / bare if bare > 0 else float("nan")
            say(f"\nallreduce of the {trainer.model.size * trainer.model.dtype.itemsize / 1e6:.2f} MB gradient, transfer (median of"
                f" {plural(alone['calls'], 'call')}): in the trainer {s['transfer_ms_p50']:.3f} ms; alone back to back"
                f" {alone['transfer_ms_p50']:.3f} ms (p10-p90 {alone['transfer_ms_p10']:.3f}-"
                f"{alone['transfer_ms_p90']:.3f}), ratio {ratio:.3f}; in a bare compute-then-average loop"
                f" {bare:.3f} ms, ratio {alone['bare_loop_ratio']:.3f}")
        lost = recovery.report(trainer.comm) if recovery is not None else None
        # the summary both modes share (summary.py), printed and under "summary" in --json
        shared = build_summary("sync", ranks, ranks, result["epochs"], result["updates_applied"],
                               wall_seconds=time.perf_counter() - STARTED)
        say(summary_lines(shared))
        payload = {"config": {**async_main.recorded_config(parser, args, config), "mode": "sync",
                              "batch_size_requested": args.batch_size},
                   "threads_per_rank": threads,
                   "heavy_yield": yield_state, "stall_timeout": stall.default_timeout_now(),
                   **result, "allreduce_alone": alone, "summary": shared,
                   "run": trainer.run_identity, "resumed_from": resumed_from,
                   **({"elastic": lost} if lost else {})}
        if args.json:
            write_json(args.json, payload)
            say(f"wrote {args.json}")
        if args.plot:
            report.plot(args.plot, result)
            say(f"wrote {args.plot}")
    trainer.close()
    return 0 if result["replicas_identical"] else 1


if __name__ == "__main__":
    sys.exit(injob.ended(main()))
