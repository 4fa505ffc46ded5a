"""The straggler report of ``python -m allreduce_kit.train`` for a PyTorch loop of your own.

Each rank records per step its compute time, the time it waited for gradients to be averaged
(the allreduce time that was not hidden behind backward), its update time, and beside them the
time the reductions took in all and how much of it ran while backward was still computing.
The records travel to rank 0 every ``every`` steps in one ``Gather`` (the trainer's
``StepTimer``) and are analysed by the trainer's own ``analyse``: per rank compute, allreduce
and wait, and the rank that was slowest.

``DistributedOptimizer`` records every step itself (``opt.report()``). For a loop that averages
gradients some other way, ``Timing`` takes the three phases from ``with`` blocks::

    timing = hvd.Timing()
    for x, y in batches:
        with timing.compute():
            loss_fn(model(x), y).backward()
        with timing.allreduce():
            for p in model.parameters():
                hvd.allreduce_(p.grad)
        with timing.update():
            opt.step()
        timing.step()
    timing.report()
"""
import json
import sys
import time
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, TextIO

import numpy as np
from ..train.report import headline, straggler_table
from ..train.timing import StepTimer, analyse
from . import mpi_ops

#: Steps between two gathers of the records to rank 0.
GATHER_EVERY = 64


class Timing:
    """Per-step compute, allreduce and update times on every rank, and the report (collective).

    The first step is not recorded: it pays for setting up communicators and shared memory.
    Every rank must record the same number of steps.
    """

    def __init__(self, every: int = GATHER_EVERY):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"Timing: every must be an int >= 1, got {every!r}")
        s = mpi_ops.state()
        self.layout = s.layout
        # The gathers run on ``init``'s Dup, which no other call sends on (those run on the
        # library's clone of it): no communicator per Timing, however many are made.
        self.comm = s.dup
        self.phases = StepTimer(self.comm, every)    # compute, exposed allreduce, update
        self.overlap = StepTimer(self.comm, every)   # the reductions in all, the part hidden, 0
        self.steps = 0
        self.extra: Dict[str, Any] = {}
        self._open = np.zeros(3)
        self._reduction = 0.0
        self._hidden = 0.0

    def record(self, compute: float, allreduce: float, update: float, reduction: float, hidden: float) -> None:
        """One step's seconds: ``allreduce`` is the time spent waiting for it, ``reduction`` what
        the reductions took in all, ``hidden`` the part of that overlapped with compute."""
        self.steps += 1
        if self.steps > 1:
            self.phases.record(compute, allreduce, update)
            self.overlap.record(reduction, hidden, 0.0)

    @contextmanager
    def _phase(self, column: int) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self._open[column] += time.perf_counter() - start

    def compute(self):
        """``with timing.compute():`` forward and backward (and anything else of the step's)."""
        return self._phase(0)

    def allreduce(self):
        """``with timing.allreduce():`` averaging the gradients."""
        return self._phase(1)

    def update(self):
        """``with timing.update():`` the optimizer's step."""
        return self._phase(2)

    def step(self) -> None:
        """End a step: record the time of the ``with`` blocks since the previous ``step()``."""
        compute, allreduce, update = self._open
        self.record(compute, allreduce, update, allreduce, 0.0)
        self._open[:] = 0.0

    def report(self, file: Optional[TextIO] = sys.stdout, json_path: Optional[str] = None,
               title: str = "straggler report") -> Dict[str, Any]:
        """The straggler report over the steps so far, on every rank (collective).

        Rank 0 prints it to ``file`` (``None``: nothing) and writes it as JSON to ``json_path``.
        The dict has ``straggler`` (``python -m allreduce_kit.train --json``'s section of that
        name: ``step_ms_p50``, ``ranks``, ...) and ``overlap``: the reductions' time per step
        and the share of it hidden behind backward, per step and its median.
        """
        self.phases.flush()
        self.overlap.flush()
        hosts = [self.layout.hosts[n] if self.layout.hosts else "?" for n in self.layout.node_of]
        records = self.phases.records()
        result = None
        if records is not None:
            result = {"ranks": int(records.shape[1]), "steps_recorded": int(records.shape[0]),
                      "straggler": analyse(records, hosts), "overlap": _overlap(self.overlap.records()), **self.extra}
        result = self.comm.bcast(result, root=0)
        if self.comm.Get_rank() == 0:
            if file is not None:
                print(text(result, title), file=file, flush=True)
            if json_path:
                with open(json_path, "w", encoding="utf-8") as out:
                    json.dump(result, out, indent=2)
        return result


def _overlap(records: np.ndarray) -> Dict[str, Any]:
    """Per step: the reductions' time (mean over ranks) and the share of it hidden; medians."""
    if records.shape[0] == 0:
        return {"reduction_ms_p50": 0.0, "hidden_ms_p50": 0.0, "hidden_share_p50": 0.0, "hidden_share": []}
    reduction = records[..., 0].mean(axis=1) * 1e3
    hidden = records[..., 1].mean(axis=1) * 1e3
    share = np.divide(hidden, reduction, out=np.zeros_like(hidden), where=reduction > 0)
    return {
        "reduction_ms_p50": float(np.median(reduction)),
        "hidden_ms_p50": float(np.median(hidden)),
        "hidden_share_p50": float(np.median(share)),
        "hidden_share": [float(x) for x in share],
    }


def text(result: Dict[str, Any], title: str = "straggler report") -> str:
    """The report as ``python -m allreduce_kit.train`` prints it, and a line on the overlap."""
    s = result["straggler"]
    if not s["steps"]:
        return f"{title}: no steps recorded yet (the first step is not recorded)"
    o = result["overlap"]
    lines: List[str] = [f"{title} over {s['steps']} steps (the first step, which sets up, is not recorded):",
                        headline(s), straggler_table(s)]
    where = ""
    if "buckets" in result:
        size = f"at most {result['bucket_mb']:g} MB" if result["bucket_mb"] else "one for all parameters"
        where = (f"; {result['buckets']} bucket{'s' if result['buckets'] != 1 else ''} ({size}), reduced "
                 f"{'on a background thread during backward' if result.get('background') else 'in step()'}")
        if result.get("background_reason"):
            where += f": {result['background_reason']}"
    lines.append(f"gradient reduction: {o['reduction_ms_p50']:.2f} ms per step (median), "
                 f"{100 * o['hidden_share_p50']:.0f}% of it hidden behind backward (median over steps){where}")
    return "\n".join(lines)
