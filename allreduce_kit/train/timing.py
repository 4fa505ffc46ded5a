"""Per-step timing on every rank, gathered to rank 0 every K steps, and the straggler analysis.

Each rank records, per step, its compute time (from the start of the step until it enters the
allreduce), its allreduce time, and its update time, into a local K x 3 array. Every K steps the
arrays are gathered to rank 0 in one ``Gather``, so measuring adds one collective per K steps,
not one per step.

The slowest rank of a step arrives last at the allreduce and waits least; every other rank's
wait is estimated as its allreduce time minus that step's smallest allreduce time, and the
smallest allreduce time is the transfer itself.
"""
import time
from typing import Dict, List, Optional

import numpy as np
from mpi4py import MPI

COMPUTE, ALLREDUCE, UPDATE = 0, 1, 2


class StepTimer:
    """Collects (compute, allreduce, update) seconds per step; ``flush`` gathers them to rank 0."""

    def __init__(self, comm: MPI.Intracomm, every: int):
        self.comm = comm
        self.every = max(1, int(every))
        self._local = np.zeros((self.every, 3), dtype=np.float64)
        self._n = 0
        self._gathered = (np.zeros((comm.Get_size(), self.every, 3), dtype=np.float64)
                          if comm.Get_rank() == 0 else None)
        self.chunks: List[np.ndarray] = []   # on rank 0: arrays (steps, ranks, 3)

    def record(self, compute: float, allreduce: float, update: float) -> None:
        row = self._local[self._n]
        row[COMPUTE], row[ALLREDUCE], row[UPDATE] = compute, allreduce, update
        self._n += 1
        if self._n == self.every:
            self.flush()

    def flush(self) -> None:
        """Gather the records held since the last flush (collective; every rank holds as many)."""
        if self._n == 0:
            return
        self.comm.Gather(self._local, self._gathered, root=0)
        if self._gathered is not None:
            self.chunks.append(self._gathered[:, :self._n].transpose(1, 0, 2).copy())
        self._n = 0

    def records(self) -> Optional[np.ndarray]:
        """On rank 0, all records as (steps, ranks, 3); None elsewhere."""
        if self._gathered is None:
            return None
        return np.concatenate(self.chunks) if self.chunks else np.zeros((0, self.comm.Get_size(), 3))


def analyse(records: np.ndarray, hosts: List[str], slowest: Optional[np.ndarray] = None,
            last: Optional[np.ndarray] = None) -> Dict:
    """The straggler report from records (steps, ranks, 3) in seconds; times in the report in ms.

    ``last``: per step, the rank the step waited for, whose compute and update the headline's
    parts are (default: the one that spent the least time in the allreduce, i.e. arrived last);
    ``slowest``: per step, the rank counted as the slowest in ``slowest_share`` and
    ``slowest_rank`` (default: ``last``). They differ where not every rank takes part in every
    step's reduction (backup workers: ``backup.py``)."""
    steps, ranks, _ = records.shape
    if steps == 0:
        return {"steps": 0, "ranks": []}
    ms = records * 1e3
    compute, allreduce, update = ms[..., COMPUTE], ms[..., ALLREDUCE], ms[..., UPDATE]
    transfer = allreduce.min(axis=1)                       # per step
    wait = allreduce - transfer[:, None]                   # per step and rank
    arrived_last = allreduce.argmin(axis=1) if last is None else np.asarray(last)   # waits least
    slowest = arrived_last if slowest is None else np.asarray(slowest)
    step_time = (compute + allreduce + update).mean(axis=1)   # every rank's wall time, averaged
    rows = np.arange(steps)
    # What the slowest rank's compute, the transfer and the update do not explain: ranks that
    # start a step at different times (they leave the previous collective at different times).
    other = step_time - (compute[rows, arrived_last] + transfer + update[rows, arrived_last])
    compute_p50 = np.median(compute, axis=0)
    fastest = compute_p50.min()
    per_rank = []
    for r in range(ranks):
        row = {
            "rank": r,
            "host": hosts[r] if r < len(hosts) else "?",
            "compute_p50_ms": float(compute_p50[r]),
            "compute_p95_ms": float(np.percentile(compute[:, r], 95)),
            "allreduce_p50_ms": float(np.median(allreduce[:, r])),
            "step_p50_ms": float(np.median(compute[:, r] + allreduce[:, r] + update[:, r])),
            "wait_p50_ms": float(np.median(wait[:, r])),
            "slowest_share": float(np.mean(slowest == r)),
            "score": float(fastest / compute_p50[r]) if compute_p50[r] > 0 else 1.0,
        }
        # The same figures named as everywhere else in the report: quantity, unit, statistic.
        for quantity in ("compute", "allreduce", "step", "wait"):
            row[f"{quantity}_ms_p50"] = row[f"{quantity}_p50_ms"]
        row["compute_ms_p95"] = row["compute_p95_ms"]
        per_rank.append(row)
    busy = (compute + allreduce + update).sum()
    return {
        "steps": int(steps),
        "step_ms_p50": float(np.median(step_time)),
        "slowest_compute_ms_p50": float(np.median(compute[rows, arrived_last])),
        "transfer_ms_p50": float(np.median(transfer)),
        "update_ms_p50": float(np.median(update)),
        "other_ms_p50": float(np.median(other)),
        "skew_ms_p50": float(np.median(other)),             # the same, under the name the report prints
        "wait_ms_mean": float(wait.mean()),
        "wait_ms_p50": float(np.median(wait.mean(axis=1))),     # per step, the ranks' mean wait
        "wait_share": float(wait.sum() / busy) if busy > 0 else 0.0,
        "slowest_rank": int(np.bincount(slowest, minlength=ranks).argmax()),
        "slowest_by": "arrival",                            # last at the allreduce (backup workers: "compute")
        "step_ms": [float(t) for t in step_time],
        "ranks": per_rank,
    }


def pause(seconds: float) -> None:
    """Sleep for an injected delay (a straggler's or jitter's)."""
    if seconds > 0:
        time.sleep(seconds)
