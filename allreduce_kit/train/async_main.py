"""The ``--mode`` switch of ``python -m allreduce_kit.train`` and the async-ps run's command-line side.

``add_arguments`` adds ``--mode``, ``--servers``, ``--max-staleness``, ``--worker-timeout`` and
``--inject-fault``; ``other_mode_problem`` refuses an option of the other mode typed on the
command line; ``problems`` checks the options against the job (rank 0's verdict is shared by the
CLI); ``main`` runs ``async_ps.run`` and prints, on rank 0, the same epoch lines and summary as
the synchronous trainer plus the staleness table and the shutdown line.
"""
import argparse
import dataclasses
import gc
import os
import sys
import time
from typing import AbstractSet, Any, Callable, Dict, Optional

from mpi4py import MPI

from .. import stall
from ..cli import RankZeroParser, is_root, plural, say, write_json
from . import modes, report, staleness
from .async_ps import Options, run
from .data import shard_batch
from .summary import summary_lines
from .trainer import Config, load_data

MODES = ("sync", "async-ps")
#: Options (argparse destinations) that only ``--mode async-ps`` uses ...
ASYNC_ONLY = ("servers", "max_staleness", "worker_timeout", "inject_fault")
#: ... and those that only ``--mode sync`` uses: the allreduce, its timing, resuming, the
#: learning-rate schedule and the non-finite-gradient handling.
SYNC_ONLY = ("lr_scaling", "warmup_epochs", "algorithm", "bucket_mb", "gather_every", "bench_allreduce",
             "checkpoint_every", "resume", "on_nonfinite", "inject_nan", "accum_steps", "on_resize", "trace",
             "trace_steps")


#: Options that apply only to the synthetic data set (digits has its own sizes) ...
SYNTHETIC_ONLY = ("samples", "features", "classes")
#: ... and only with --checkpoint-dir.
CHECKPOINT_ONLY = ("checkpoint_every", "keep_checkpoints")


def recorded_config(parser: argparse.ArgumentParser, args: argparse.Namespace, config: Config) -> Dict[str, Any]:
    """The run's options for ``--json``: every option of the command line under its destination's
    name, with the value the run used (``config``'s, e.g. the batch lowered to the shard; the
    stall timeout in effect); an option that does not apply to this run (the other mode's, the
    synthetic data set's sizes on digits, checkpoint options without --checkpoint-dir, the
    warm-up without --lr-scaling linear, the local SGD options without --local-sgd) is recorded as null."""
    values = {a.dest: getattr(args, a.dest) for a in parser._actions if a.dest not in ("help", "version")}
    values.update(config.as_dict())
    values["stall_timeout"] = stall.default_timeout_now()
    idle = set(ASYNC_ONLY if args.mode == "sync" else SYNC_ONLY)
    if config.dataset != "synthetic":
        idle.update(SYNTHETIC_ONLY)
    if not config.checkpoint_dir:
        idle.update(CHECKPOINT_ONLY)
    if config.lr_scaling != "linear":
        idle.add("warmup_epochs")
    idle.update(modes.idle_options(args.mode, config))
    return {name: None if name in idle else value for name, value in values.items()}


def _fault(text: str):
    parts = text.split(":")
    try:
        rank, after, kind = int(parts[0]), int(parts[1]), parts[2]
    except (ValueError, IndexError):
        rank = after = kind = None
    if len(parts) != 3 or rank is None or rank < 0 or after < 0 or kind not in ("crash", "hang"):
        raise argparse.ArgumentTypeError(f"expected RANK:N:crash or RANK:N:hang (a worker rank, N >= 0 "
                                         f"gradients before the fault), got {text!r}")
    return rank, after, kind


def add_arguments(parser: RankZeroParser, at_least: Callable) -> None:
    """The mode switch and the asynchronous parameter server's options."""
    g = parser.add_argument_group(
        "mode: synchronous allreduce or asynchronous parameter server (docs/sync-vs-async.md)",
        "An option of the other mode is refused. Only with --mode sync: "
        + ", ".join("--" + name.replace("_", "-") for name in SYNC_ONLY) + ".")
    g.add_argument("--mode", choices=MODES, default="sync",
                   help="sync: every step averages all ranks' gradients with allreduce; async-ps: ranks "
                        "0..K-1 are parameter servers, the others workers that pull, compute, push and go on")
    g.add_argument("--servers", type=at_least(1), default=1, metavar="K",
                   help="async-ps: parameter servers, the flat parameters sharded across them")
    g.add_argument("--max-staleness", type=at_least(0), default=None, metavar="S",
                   help="async-ps: reject a gradient computed on parameters more than S updates old "
                        "(stale-synchronous; None: apply every gradient)")
    g.add_argument("--worker-timeout", type=at_least(0.0, float, strict=True), default=Options.worker_timeout,
                   metavar="SEC", help="async-ps: a worker silent this long is reported by the server, "
                                       "which aborts the job")
    g.add_argument("--inject-fault", type=_fault, default=None, metavar="RANK:N:crash|hang",
                   help="async-ps, for testing: worker RANK raises (crash) or stops talking (hang) after N gradients")


def other_mode_problem(args, given: AbstractSet[str]) -> Optional[str]:
    """An option of the other mode among those typed (``given``: argparse destinations), or None.

    Only typed options count: every option has a default in both modes.
    """
    other, mode = (ASYNC_ONLY, "async-ps") if args.mode == "sync" else (SYNC_ONLY, "sync")
    for name in other:
        if name in given:
            return f"argument --{name.replace('_', '-')}: only with --mode {mode}"
    return None


def problems(args, ranks: int) -> Optional[str]:
    """Option errors of the asynchronous mode that need the rank count (None when all is well)."""
    if args.mode == "sync":
        return None
    servers = args.servers
    if servers >= ranks:
        return (f"argument --servers: {servers} server(s) leave no worker in a job of {ranks} ranks "
                f"(async-ps needs at least {servers + 1} ranks)")
    workers = f"{servers}..{ranks - 1}"
    for flag, value in (("--straggler", args.straggler), ("--inject-fault", args.inject_fault)):
        if value and not servers <= value[0] < ranks:
            return f"argument {flag}: rank {value[0]} is not a worker; the workers are ranks {workers}"
    return None


def main(args, config: Config, threads: int, yield_note: str, comm: MPI.Intracomm = MPI.COMM_WORLD,
         parser: Optional[argparse.ArgumentParser] = None, started: Optional[float] = None) -> int:
    """Run async-ps with the parsed ``args``; print and write the report on rank 0. Returns the exit status.

    ``parser`` (which parsed ``args``) lets ``--json`` record every option; ``started``
    (``time.perf_counter()`` at the command's start) makes the summary's wall time the whole run's."""
    ranks = comm.Get_size()
    options = Options(servers=args.servers, max_staleness=args.max_staleness,
                      worker_timeout=args.worker_timeout, fault=args.inject_fault)
    dataset = load_data(config)
    k = options.servers
    # A gradient takes at most a worker's shard (a larger --batch-size would repeat samples in it).
    config = dataclasses.replace(config, batch_size=shard_batch(len(dataset.y_train), ranks - k, config.batch_size))
    servers = "parameter server rank 0" if k == 1 else f"parameter servers ranks 0..{k - 1}"
    say(f"allreduce_kit.train --mode async-ps: {plural(ranks, 'rank')}; {servers}, workers ranks {k}..{ranks - 1}; "
        f"{plural(threads, 'thread')} per rank, {yield_note}")
    budget = config.epochs * ((len(dataset.y_train) // (ranks - k)) * (ranks - k))
    say(f"data: {dataset.name}, {len(dataset.y_train)} train / {len(dataset.y_test)} test samples; budget "
        f"{plural(config.epochs, 'epoch')} = {plural(budget, 'sample')}" + (f" or {plural(config.max_steps, 'gradient')}" if config.max_steps else "")
        + f", {config.batch_size} per gradient"
        + (f" (--batch-size {args.batch_size} is more than a worker's shard)" if args.batch_size > config.batch_size else ""))
    bound = "unbounded" if options.max_staleness is None else f"at most {options.max_staleness} (older gradients rejected)"
    say(f"model: MLP hidden {','.join(map(str, config.hidden))} in {k} shard(s); server SGD lr {config.lr:g}, "
        f"momentum {config.momentum:g}, weight decay {config.weight_decay:g}; staleness {bound}")
    if config.straggler:
        say(f"injected straggler: worker rank {config.straggler[0]} +{config.straggler[1]:g} ms per gradient")
    gc.freeze()                                  # as the synchronous CLI does: see its main
    gc.enable()
    result = run(config, options, comm, dataset, on_epoch=lambda e: say(report.epoch_line(e, config.epochs)))
    if not is_root():
        return 0
    if started is not None:
        result["summary"]["wall_seconds"] = time.perf_counter() - started
    print_report(result)
    recorded = recorded_config(parser, args, config) if parser is not None else config.as_dict()
    payload = {"config": {**recorded, "mode": "async-ps", "batch_size_requested": args.batch_size,
                          **options.as_dict()}, "threads_per_rank": threads,
               "heavy_yield": os.environ.get("MPIR_CVAR_ENABLE_HEAVY_YIELD", "unset"), **result}
    if args.json:
        write_json(args.json, payload)
        say(f"wrote {args.json}")
    if args.plot:
        from ..compare import plot
        plot(args.plot, [payload], [os.path.basename(args.json or "async-ps")])
        say(f"wrote {args.plot}")
    return 0 if result["shutdown"]["messages_in_flight"] == 0 else 1


def print_report(result: Dict[str, Any]) -> None:
    """Rank 0's end of an async-ps run: summary, staleness per worker, shutdown."""
    s = result["staleness"]
    say(summary_lines(result["summary"]))
    o = s["overall"]
    say(f"\nstaleness of the {result['steps']:,} applied gradients (updates between a worker's pull and its "
        f"push): mean {o['mean']:.2f}, p50 {o['p50']:g}, p95 {o['p95']:g}, max {o['max']}"
        + ("" if s["max_staleness"] is None else
           f"; bound {s['max_staleness']}: rejected per server {s['rejected_per_server']}"))
    say(staleness.table(s["workers"]))
    d = result["shutdown"]
    where = f"final parameters saved to {d['saved']}" if d["saved"] else "final parameters held by rank 0 (--checkpoint-dir to save)"
    say(f"\nshutdown: {d['workers_stopped']}/{d['workers']} workers stopped at the budget; {where}; "
        f"messages left in flight: {d['messages_in_flight']}; parameters blake2b {result['params_digest']}")
    sys.stdout.flush()
