"""``--compression``: how the plain sync trainer averages a step's gradient with fewer bytes.

- ``none`` (the default): ``average_buffer``, as without this option;
- ``fp16``, ``bf16``: every bucket's ``allreduce(op="mean", compression=...)``: 16-bit values on
  the wire, float32 folds (``allreduce_kit/compression``);
- ``powersgd``: ``compression.PowerSGD`` over the model's layers (rank ``--compression-rank``,
  from step ``--compression-start``; before it, plain averages), its sums by ``allreduce``.

This module holds the options and their checks, the object that averages (``for_trainer``), the
bytes it counts and the line rank 0 prints. The report's ``compression`` record gives the bytes a
rank sent per step, what it would have sent uncompressed, and their ratio (counted as a
bandwidth-optimal allreduce sends: 2(p-1)/p of what it is handed).
"""
from typing import Any, Dict, Optional, Set

import numpy as np

from .. import compression as wire_formats
from ..collective import allreduce
from ..compression.powersgd import DEFAULTS, PowerSGD, matrix_shape

METHODS = ("none", "fp16", "bf16", "powersgd")
#: The CLI options of compression (argparse destinations).
OPTIONS = ("compression", "compression_rank", "compression_start")


def add_arguments(parser: Any, at_least: Any) -> None:
    """``--compression``, ``--compression-rank``, ``--compression-start``."""
    g = parser.add_argument_group("compression (--mode sync; docs/compression.md)")
    g.add_argument("--compression", choices=METHODS, default="none",
                   help="average gradients as 16-bit values (fp16, bf16; float32 only) or as PowerSGD's low-rank "
                        "factors with error feedback (powersgd)")
    g.add_argument("--compression-rank", type=at_least(1), default=DEFAULTS["matrix_approximation_rank"], metavar="R",
                   help="powersgd: the rank of each gradient matrix's approximation")
    g.add_argument("--compression-start", type=at_least(0), default=DEFAULTS["start_powerSGD_iter"], metavar="STEPS",
                   help="powersgd: plain averages for the first STEPS steps (PyTorch's start_powerSGD_iter)")


def problems(args: Any, ranks: int, given: Set[str]) -> Optional[str]:
    """One message for a combination compression cannot run, naming the flag (None when all is well)."""
    method = args.compression
    for name in ("compression_rank", "compression_start"):
        if name in given and method != "powersgd":
            return f"argument --{name.replace('_', '-')}: only with --compression powersgd"
    if method == "none":
        return None
    others = (("--mode", args.mode != "sync", args.mode),
              ("--zero", args.zero > 0 and method == "powersgd", args.zero),   # 16-bit: the reduce-scatters
              ("--backup-workers", args.backup_workers > 0, args.backup_workers),
              ("--local-sgd", args.local_sgd > 1, args.local_sgd),
              ("--pipeline", getattr(args, "pipeline", None) is not None, getattr(args, "pipeline", None)))
    steps = "plain sync steps" if method == "powersgd" else "sync steps (plain or --zero)"
    for flag, clash, value in others:
        if clash:
            return f"argument --compression: {method} compresses {steps} only, not with {flag} {value}"
    if method in ("fp16", "bf16"):
        if args.dtype != "float32":
            return f"argument --compression: {method} sends float32 values as 16 bits, not --dtype {args.dtype}"
        if args.algorithm != "auto" and args.algorithm not in wire_formats.COMPRESSED:
            names = ["auto", *wire_formats.COMPRESSED]
            return (f"argument --compression: {method} runs with --algorithm {', '.join(names[:-1])} or {names[-1]}, "
                    f"not {args.algorithm}")
        return None
    if args.resume or args.elastic:
        return (f"argument --compression: powersgd keeps per-rank state (error feedback, warm start) that checkpoints "
                f"do not hold; not with {'--resume' if args.resume else '--elastic'}")
    inputs, classes = (64, 10) if args.dataset == "digits" else (args.features, args.classes)
    widths = [inputs, *args.hidden, classes]
    smaller = max(min(a, b) for a, b in zip(widths[:-1], widths[1:]))
    if args.compression_rank > smaller:
        return (f"argument --compression-rank: {args.compression_rank} is above the smaller side of every weight "
                f"matrix of this model (at most {smaller})")
    return None


class Compressed:
    """Averages the trainer's flat gradient each step as ``method`` says; ``average`` returns the
    bytes this rank sent (``sent``) and adds to the totals ``results`` reports."""

    def __init__(self, trainer: Any, method: str, rank: int, start: int):
        self.trainer, self.method = trainer, method
        model, config = trainer.model, trainer.config
        self.itemsize = model.dtype.itemsize
        self.sent = self.uncompressed = 0.0
        self.steps = 0
        self.views = model.flat.views(model.grads)
        self.state = None
        if method == "powersgd":
            self.state = PowerSGD.over(trainer.comm, model.shapes, algorithm=config.algorithm,
                                       matrix_approximation_rank=rank, start_powerSGD_iter=start,
                                       dtype=model.dtype)

    def average(self) -> float:
        """Average ``trainer.model.grads`` across the ranks in place (collective); the bytes sent."""
        t, grads = self.trainer, self.trainer.model.grads
        if self.state is not None:
            handed = self.state.elements_sent() * self.itemsize
            self.state.average(self.views)
        else:
            for start, stop in t.bounds:
                allreduce(grads[start:stop], op="mean", algorithm=t.config.algorithm, comm=t.comm,
                          compression=self.method)
            handed = grads.size * 2
        sent = t.sent_by_allreduce(handed)
        self.sent += sent
        self.uncompressed += t.sent_by_allreduce(grads.nbytes)
        self.steps += 1
        return sent

    def compressed_matrices(self) -> str:
        """Which gradients PowerSGD compresses, in words."""
        plan = self.state.plan
        shapes = [f"{n}x{m} at rank {r}" for n, m, r in filter(None, plan)]
        return f"{len(shapes)} of {len(plan)} gradients compressed ({', '.join(shapes) or 'none'})"


def for_trainer(trainer: Any) -> Optional[Compressed]:
    """The trainer's ``Compressed``, or None for ``--compression none`` and with ``--zero`` (whose
    reduce-scatters send the 16-bit values, ``sharding.py``)."""
    c = trainer.config
    if c.compression == "none" or c.zero:
        return None
    return Compressed(trainer, c.compression, c.compression_rank, c.compression_start)


def check(config: Any, shapes: Any) -> None:
    """Raise ``ValueError`` naming the field if ``config``'s compression cannot run (before any message)."""
    if config.compression not in METHODS:
        raise ValueError(f"Config.compression must be one of {', '.join(METHODS)}, got {config.compression!r}")
    if config.compression in ("fp16", "bf16") and np.dtype(config.dtype) != np.float32:
        raise ValueError(f"Config.compression={config.compression!r} needs Config.dtype float32, got {config.dtype}")
    if config.compression != "none" and (config.backup_workers or config.local_sgd > 1
                                         or (config.zero and config.compression == "powersgd")):
        raise ValueError(f"Config.compression={config.compression!r} compresses plain sync steps only (not with "
                         f"backup_workers or local_sgd; fp16 and bf16 also with zero)")
    if config.compression == "powersgd":
        matrices = [matrix_shape(s) for s in shapes if len(s) >= 2]
        if config.compression_rank < 1 or (matrices and config.compression_rank > max(min(s) for s in matrices)):
            raise ValueError(f"Config.compression_rank must be between 1 and the larger of the weight matrices' "
                             f"smaller sides, got {config.compression_rank}")


def report(trainer: Any) -> Dict[str, Any]:
    """The ``compression`` record of the results (collective): per step, the mean over ranks."""
    p = trainer.ranks
    compressed = getattr(trainer, "compressed", None)
    steps = max(trainer.step - trainer.first_step, 0)
    if compressed is None:
        shards = getattr(trainer, "shards", None)
        sent = trainer.sent
        uncompressed = sent + (shards.spared if shards is not None else 0.0)
    else:
        sent, uncompressed = compressed.sent, compressed.uncompressed
    sent, uncompressed = trainer.comm.allreduce(np.array([sent, uncompressed], np.float64)) / p
    record = {"method": trainer.config.compression,
              "bytes_sent_per_step": sent / steps if steps else 0.0,
              "uncompressed_bytes_per_step": uncompressed / steps if steps else 0.0,
              "ratio": float(uncompressed / sent) if sent else 1.0}
    if compressed is not None and compressed.state is not None:
        state = compressed.state
        record.update(rank=state.matrix_approximation_rank, start_step=state.start_powerSGD_iter,
                      compressed_steps=max(state.iter - state.start_powerSGD_iter, 0),
                      compressed_matrices=[list(c) for c in state.plan if c is not None])
    return record


def header(trainer: Any) -> Optional[str]:
    """The line rank 0 prints before training, or None without compression."""
    compressed = getattr(trainer, "compressed", None)
    if compressed is None:
        return None
    if compressed.state is None:
        return (f"compression: {compressed.method}, every bucket's average sent as 16-bit values "
                f"(folded in float32)")
    state, total = compressed.state, trainer.total_steps()
    when = (f"from step {state.start_powerSGD_iter}" if state.start_powerSGD_iter < total
            else f"from step {state.start_powerSGD_iter}, after this run's {total} steps: never (lower --compression-start)")
    return f"compression: powersgd rank {state.matrix_approximation_rank}, {when}; {compressed.compressed_matrices()}"
