"""How a synchronous step combines the ranks' work: plain sync, backup workers, local SGD.

``--mode sync`` has three ways to turn the ranks' gradients into the next parameters:

- plain sync (the default): every step averages every rank's gradient (``trainer.py``);
- ``--backup-workers B``: every step averages the gradients of the first P - B ranks to finish
  and the late ranks skip ahead with the new parameters (``backup.py``);
- ``--local-sgd H``: every rank takes H steps on its own gradients, then the ranks average their
  parameters and momentum (``local_sgd.py``), after ``--local-sgd-warmup`` plain steps.

This module holds what the trainer and the CLI need of them: the options and their checks, the
object that runs a step (``strategy_for``), the update every mode applies, the communication
count and the lines rank 0 prints. ``--backup-workers 0`` and ``--local-sgd 1`` are plain sync:
the same code path, so the same bits.
"""
from typing import Any, Callable, Dict, List, Optional, Set

from ..cli import plural

#: The CLI options of these modes (argparse destinations); all only with --mode sync.
OPTIONS = ("backup_workers", "local_sgd", "local_sgd_warmup", "local_sgd_momentum")


def check(config: Any, ranks: int) -> None:
    """Raise TypeError or ValueError naming the field if the modes' settings cannot run on ``ranks`` ranks.

    Local to every rank, before anything is sent."""
    for name in ("backup_workers", "local_sgd", "local_sgd_warmup"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"Config.{name} must be an int, got {type(value).__name__}")
    if config.backup_workers < 0:
        raise ValueError(f"Config.backup_workers must be >= 0, got {config.backup_workers}")
    if config.backup_workers >= ranks:
        raise ValueError(f"Config.backup_workers={config.backup_workers} leaves no gradient in a step of "
                         f"{plural(ranks, 'rank')} (at most {ranks - 1})")
    if config.local_sgd < 1:
        raise ValueError(f"Config.local_sgd must be >= 1 (local steps between averages), got {config.local_sgd}")
    if config.local_sgd_warmup < 0:
        raise ValueError(f"Config.local_sgd_warmup must be >= 0, got {config.local_sgd_warmup}")
    if config.local_sgd_momentum not in ("average", "local"):
        raise ValueError(f"Config.local_sgd_momentum must be 'average' or 'local', got {config.local_sgd_momentum!r}")
    if config.backup_workers > 0 and config.local_sgd > 1:
        raise ValueError("Config.backup_workers and Config.local_sgd > 1 do not combine: choose one")
    if config.local_sgd > 1 and config.on_nonfinite != "abort":
        raise ValueError("Config.on_nonfinite='skip' does not combine with Config.local_sgd > 1")
    if config.local_sgd > 1 and config.checkpoint_dir and config.checkpoint_every > 0:
        raise ValueError("Config.checkpoint_every > 0 does not combine with Config.local_sgd > 1 (between averages "
                         "the replicas differ; the checkpoint at the end is written)")


def method(config: Any) -> str:
    """The run's method in words: ``sync``, ``backup-workers 1``, ``local-sgd 4``."""
    if config.backup_workers > 0:
        return f"backup-workers {config.backup_workers}"
    if config.local_sgd > 1:
        return f"local-sgd {config.local_sgd}"
    return "sync"


def strategy_for(trainer: Any) -> Optional[Any]:
    """The object that finishes a step after the compute, or None for plain sync (collective)."""
    config = trainer.config
    if getattr(trainer, "shards", None) is not None:   # --zero 1, 2, 3 (sharding.py)
        return trainer.shards
    if config.backup_workers > 0:
        from .backup import BackupWorkers
        return BackupWorkers(trainer, config.backup_workers)
    if config.local_sgd > 1:
        from .local_sgd import LocalSGD
        return LocalSGD(trainer, config.local_sgd, config.local_sgd_warmup, config.local_sgd_momentum)
    return None


def apply_update(trainer: Any, step: int) -> None:
    """The update of 0-based ``step`` from the averaged gradient in ``trainer.model.grads``.

    What the plain trainer does: a non-finite average stops the run (every rank holds the same
    bits, so every rank stops at the same step) or skips the update (``--on-nonfinite``)."""
    from .optimizer import learning_rate
    from .trainer import NonFiniteError, all_finite

    if not all_finite(trainer.model.grads):
        if trainer.config.on_nonfinite == "abort":
            raise NonFiniteError(step + 1, step // trainer.steps_per_epoch + 1)
        trainer.skipped_steps.append(step + 1)
        return
    cfg = trainer.config
    lr = learning_rate(cfg.lr, trainer.ranks, cfg.lr_scaling, trainer.warmup_steps, step)
    trainer.optimizer.step(trainer.model.params, trainer.model.grads, lr)


def communication(calls: float, nbytes: float, sent: float, samples: int, steps: int) -> Dict[str, Any]:
    """The model's collective calls and the bytes handed to them, per rank (the mean over ranks: with backup
    workers a late rank makes none), and per sample trained; and the bytes a rank sends per step, counted per
    call as a bandwidth-optimal schedule sends them (allreduce 2(p-1)/p of the buffer, reduce-scatter and
    allgather (p-1)/p; ``--zero`` runs the latter two: ``allreduce_calls`` then counts its reduce-scatters)."""
    return {"allreduce_calls": float(calls), "allreduce_bytes": float(nbytes), "samples": int(samples),
            "calls_per_sample": calls / samples if samples else 0.0,
            "bytes_per_sample": nbytes / samples if samples else 0.0,
            "bytes_sent": float(sent), "bytes_sent_per_step": sent / steps if steps else 0.0}


def idle_options(mode: str, config: Any) -> Set[str]:
    """The options of these modes that do not apply to a run (recorded as null in ``--json``)."""
    if mode != "sync":
        return set(OPTIONS)
    return {"local_sgd_warmup", "local_sgd_momentum"} if config.local_sgd == 1 else set()


# -- the command line --------------------------------------------------------------------------------
def add_arguments(parser: Any, at_least: Callable) -> None:
    """``--backup-workers``, ``--local-sgd``, ``--local-sgd-warmup``, ``--local-sgd-momentum``."""
    g = parser.add_argument_group(
        "stragglers: backup workers and local SGD (--mode sync; docs/stragglers.md)",
        "0 backup workers and 1 local step are plain sync, bitwise.")
    g.add_argument("--backup-workers", type=at_least(0), default=0, metavar="B",
                   help="every step averages the gradients of the first P - B ranks to finish; the late "
                        "ranks' gradients are dropped and they go on with the new parameters")
    g.add_argument("--local-sgd", type=at_least(1), default=1, metavar="H",
                   help="every rank takes H steps on its own gradients, then parameters (and momentum) are "
                        "averaged")
    g.add_argument("--local-sgd-warmup", type=at_least(0), default=0, metavar="STEPS",
                   help="with --local-sgd: plain sync for the first STEPS steps (post-local SGD)")
    g.add_argument("--local-sgd-momentum", choices=("average", "local"), default="average",
                   help="with --local-sgd: average the momentum with the parameters, or keep each rank's own")


def problems(args: Any, ranks: int, given: Set[str]) -> Optional[str]:
    """One message for a combination these modes cannot run (None when all is well)."""
    typed = [name for name in OPTIONS if name in given]
    flag = lambda name: "--" + name.replace("_", "-")
    if args.mode != "sync" and typed:
        return f"argument {flag(typed[0])}: only with --mode sync"
    if args.backup_workers >= ranks:
        return (f"argument --backup-workers: {args.backup_workers} backup worker(s) leave no gradient in a step of "
                f"{plural(ranks, 'rank')} (at most {ranks - 1})")
    if args.backup_workers > 0 and args.local_sgd > 1:
        return "argument --local-sgd: not with --backup-workers (choose one)"
    for name in ("local_sgd_warmup", "local_sgd_momentum"):
        if name in given and args.local_sgd == 1:
            return f"argument {flag(name)}: only with --local-sgd H > 1"
    if args.local_sgd > 1:
        if args.on_nonfinite != "abort":
            return ("argument --on-nonfinite: skip does not combine with --local-sgd (a local step's gradient is "
                    "one rank's; a non-finite average of the parameters stops the run)")
        if args.checkpoint_every:
            return ("argument --checkpoint-every: not with --local-sgd (between averages the replicas differ); "
                    "the checkpoint at the end is written")
    return None


def header(config: Any, ranks: int) -> Optional[str]:
    """The line rank 0 prints before training, or None for plain sync."""
    if config.backup_workers > 0:
        need = ranks - config.backup_workers
        return (f"backup workers: {config.backup_workers}; every step averages the gradients of the first "
                f"{need} of {ranks} ranks to finish, late ranks skip ahead")
    if config.local_sgd > 1:
        warm = f" after {plural(config.local_sgd_warmup, 'step')} of plain sync" if config.local_sgd_warmup else ""
        what = "parameters and momentum" if config.local_sgd_momentum == "average" else "parameters (momentum local)"
        return f"local SGD: {config.local_sgd} local steps, then {what} averaged{warm}"
    return None


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def report_text(result: Dict[str, Any]) -> Optional[str]:
    """The backup-worker lines of the straggler report (rank 0), or None."""
    b = (result.get("straggler") or {}).get("backup_workers")
    if not b:
        return None
    lines: List[str] = [
        f"backup workers {b['backup_workers']}: effective global batch {b['effective_global_batch_mean']:.1f} "
        f"of {b['global_batch']} (mean over steps); a step waited {b['step_wait_ms_p50']:.2f} ms (median, first to "
        f"{_ordinal(b['ranks_in'])} arrival) where plain sync would have waited {b['sync_step_wait_ms_p50']:.2f} ms "
        f"(first to last arrival), {b['wait_saved_ms_p50']:.2f} ms saved per step; most often dropped: rank "
        f"{b['most_dropped_rank']}",
    ]
    head = ["rank", "dropped", "computed", "late", "skipped", "compute p50"]
    rows = [[str(r["rank"]), f"{100 * r['dropped_share']:.0f}%", str(r["gradients_computed"]),
             str(r["gradients_late"]), str(r["steps_skipped"]),
             "-" if r["compute_ms_p50"] is None else f"{r['compute_ms_p50']:.2f} ms"] for r in b["ranks"]]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    fmt = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))
    lines += [fmt(head), fmt(["-" * w for w in widths]), *map(fmt, rows)]
    return "\n".join(lines)
