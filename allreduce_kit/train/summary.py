"""The end-of-run summary both modes share, so a sync run and an async run compare row by row.

Both ``--mode sync`` and ``--mode async-ps`` keep a list of per-epoch records (``epoch_record``)
and end with ``build_summary``: the same keys in the same units whatever the mode, printed by
``summary_lines`` and written under ``"summary"`` in ``--json``. ``python -m allreduce_kit.compare``
reads exactly these keys.
"""
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from ..cli import plural

#: The keys of ``build_summary``'s result, in the order ``compare`` prints them.
FIELDS = ("mode", "ranks", "workers", "wall_seconds", "train_seconds", "samples", "samples_per_second", "updates_applied",
          "gradients_rejected", "staleness_mean", "staleness_max", "train_accuracy", "test_accuracy",
          "loss_per_epoch")


def epoch_record(epoch: int, steps: int, loss_sum: float, correct: float, samples: float, test_correct: float,
                 test_samples: float, seconds: float, lr: float) -> Dict[str, Any]:
    """One epoch's metrics (``epoch`` is 0-based; the record's is 1-based); the same shape in both modes."""
    return {
        "epoch": epoch + 1,
        "steps": int(steps),
        "loss": loss_sum / max(samples, 1),
        "train_accuracy": correct / max(samples, 1),
        "test_accuracy": test_correct / max(test_samples, 1),
        "samples": int(samples),
        "seconds": float(seconds),
        "samples_per_second": samples / seconds if seconds > 0 else 0.0,
        "step_ms": 1e3 * seconds / steps if steps else 0.0,
        "lr": float(lr),
    }


def build_summary(mode: str, ranks: int, workers: int, epochs: Sequence[Dict[str, Any]], updates_applied: int,
                  gradients_rejected: int = 0, staleness: Optional[Sequence[int]] = None,
                  wall_seconds: Optional[float] = None) -> Dict[str, Any]:
    """The shared summary from the per-epoch records.

    ``updates_applied`` counts parameter updates (sync: steps, each on the average of every
    rank's gradient, less any skipped; async: gradients the server applied). ``staleness`` lists,
    per applied gradient, the updates between its pull and its push (sync: none, i.e. all zero).
    ``train_seconds`` is the epochs' time (training and its evaluation), ``samples_per_second``
    the samples over it; ``wall_seconds`` is the whole run's, from the command's start to its
    report (start-up, data, warm-up, training), when the caller gives it (else the epochs' time).
    """
    seconds = np.cumsum([e["seconds"] for e in epochs]).tolist()
    samples = np.cumsum([e["samples"] for e in epochs]).astype(int).tolist()
    stale = np.asarray(staleness if staleness is not None else [], dtype=np.int64)
    train = seconds[-1] if seconds else 0.0
    total = samples[-1] if samples else 0
    return {
        "mode": mode,
        "ranks": int(ranks),
        "workers": int(workers),
        "wall_seconds": float(train if wall_seconds is None else wall_seconds),
        "train_seconds": float(train),
        "samples": int(total),
        "samples_per_second": total / train if train > 0 else 0.0,
        "updates_applied": int(updates_applied),
        "gradients_rejected": int(gradients_rejected),
        "staleness_mean": float(stale.mean()) if stale.size else 0.0,
        "staleness_max": int(stale.max()) if stale.size else 0,
        "train_accuracy": float(epochs[-1]["train_accuracy"]) if epochs else None,
        "test_accuracy": float(epochs[-1]["test_accuracy"]) if epochs else None,
        "loss_per_epoch": [float(e["loss"]) for e in epochs],
        "epoch_numbers": [int(e["epoch"]) for e in epochs],
        "curve": {"seconds": seconds, "samples": samples, "loss": [float(e["loss"]) for e in epochs]},
    }


def _percent(x: Optional[float]) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def summary_lines(s: Dict[str, Any]) -> str:
    """The summary as people read it (the same lines in both modes)."""
    train = s.get("train_seconds", s["wall_seconds"])
    lines: List[str] = [
        f"summary ({s['mode']}, {plural(s['ranks'], 'rank')}, {s['workers']} computing gradients): "
        f"{plural(s['samples'], 'sample')} in {train:.2f} s of training = {s['samples_per_second']:,.0f} samples/s, "
        f"{s['wall_seconds']:.2f} s wall for the whole run; "
        f"{plural(s['updates_applied'], 'update')} applied, {plural(s['gradients_rejected'], 'gradient')} rejected; "
        f"staleness mean {s['staleness_mean']:.2f}, max {s['staleness_max']}",
        f"final accuracy: train {_percent(s['train_accuracy'])}, test {_percent(s['test_accuracy'])}; "
        f"loss per epoch {' '.join(f'{x:.4f}' for x in s['loss_per_epoch'])}",
    ]
    return "\n".join(lines)
