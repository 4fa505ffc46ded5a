"""Staleness bookkeeping on a parameter server: one record per gradient that arrives.

A gradient's staleness is the number of updates the server applied between the moment the
worker pulled the parameters it computed on and the moment the gradient arrives (0: nobody
else's update came in between, as in synchronous training). ``StalenessLog`` keeps one row per
arriving gradient (worker rank, staleness, applied or rejected) in a growing int64 array;
``per_worker`` turns it into the report's distribution per worker.
"""
from typing import Any, Dict, List, Sequence

import numpy as np

WORKER, STALENESS, APPLIED = 0, 1, 2


class StalenessLog:
    """Rows (worker, staleness, applied 0/1), appended as gradients arrive."""

    def __init__(self, capacity: int = 1024):
        self._rows = np.zeros((max(1, capacity), 3), dtype=np.int64)
        self._n = 0

    def record(self, worker: int, staleness: int, applied: bool) -> None:
        if self._n == len(self._rows):
            self._rows = np.concatenate([self._rows, np.zeros_like(self._rows)])
        self._rows[self._n] = (worker, staleness, int(applied))
        self._n += 1

    @property
    def rows(self) -> np.ndarray:
        return self._rows[:self._n]

    def applied_staleness(self) -> np.ndarray:
        """The staleness of every applied gradient, in arrival order."""
        rows = self.rows
        return rows[rows[:, APPLIED] == 1, STALENESS]


def distribution(values: np.ndarray) -> Dict[str, float]:
    """mean, p50, p95 and max of ``values`` (zeros when there are none)."""
    if values.size == 0:
        return {"mean": 0.0, "p50": 0.0, "p95": 0.0, "max": 0}
    return {"mean": float(values.mean()), "p50": float(np.percentile(values, 50)),
            "p95": float(np.percentile(values, 95)), "max": int(values.max())}


def per_worker(rows: np.ndarray, workers: Sequence[int]) -> List[Dict[str, Any]]:
    """A row per worker: gradients pushed, applied, rejected, and the applied ones' staleness."""
    out = []
    applied_total = max(int(rows[:, APPLIED].sum()), 1)
    for w in workers:
        mine = rows[rows[:, WORKER] == w]
        applied = mine[mine[:, APPLIED] == 1, STALENESS]
        out.append({"rank": int(w), "pushed": int(len(mine)), "applied": int(applied.size),
                    "rejected": int(len(mine) - applied.size), "share_of_updates": applied.size / applied_total,
                    "staleness": distribution(applied)})
    return out


def table(rows: List[Dict[str, Any]]) -> str:
    """The per-worker staleness table rank 0 prints."""
    head = ["worker", "pushed", "applied", "rejected", "share", "stale mean", "p50", "p95", "max"]
    cells = [[str(r["rank"]), f"{r['pushed']:,}", f"{r['applied']:,}", f"{r['rejected']:,}",
              f"{100 * r['share_of_updates']:.0f}%", f"{r['staleness']['mean']:.2f}",
              f"{r['staleness']['p50']:g}", f"{r['staleness']['p95']:g}", str(r["staleness"]["max"])] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(head)]
    fmt = lambda row: "  ".join(c.rjust(w) for c, w in zip(row, widths))
    return "\n".join([fmt(head), fmt(["-" * w for w in widths]), *map(fmt, cells)])
