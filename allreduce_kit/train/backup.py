"""Backup workers (``--backup-workers B``): each step averages the gradients of the first P - B ranks.

Chen et al. 2016, "Revisiting Distributed Synchronous SGD": with B backup workers a step does not
wait for the B slowest ranks. Every rank still applies the same averaged update, so the replicas
stay bitwise identical, and a late rank does not fall behind: it drops its gradient and goes on
from the newest parameters.

Two protocols, on a communicator of its own (a ``Dup`` of the trainer's). **On one node** (every
rank of the communicator on one node, ``--algorithm auto``, a window of at most ``WINDOW_LIMIT``
bytes), ``tickets.py``: no message decides who is in. A rank with its gradient copies it into its
slot of a shared window and draws a ticket (an atomic compare-and-swap on the step's counter);
the first P - B tickets are in, and each rank in, once the P - B tickets are all drawn, folds
their slots in rank order into its own gradient buffer (the sum divided by P - B). Deciding and
reducing are one wait, for the (P - B)-th arrival; then steps 4 and 5 below, the average going
to a late rank in a message whose tag carries the step (a late rank receives it from any
source), and a late rank looks in the window, not for a message, for steps already decided.

**Across nodes** (or with another ``--algorithm``, or a larger model), for step k:

1. **Arrival.** A rank that has its gradient sends one 8-byte message, ``k``, to the step's
   coordinator (nonblocking). The coordinator of step k is the first rank to arrive in step k-1,
   so a slow rank is not the one every other rank waits for.
2. **Decision.** The coordinator finishes its own compute, takes the arrivals already queued
   (they came before it), then itself, then further arrivals, until it has P - B ranks: the
   chosen set, in arrival order (it leaves itself out when P - B others came first). It sends
   ``[k, chosen...]`` to every other rank (nonblocking, P - 1 small messages). Arrivals of an
   older step that are still queued are dropped. That is the one extra small-message round.
3. **Reduction among the chosen only.** The chosen ranks average their gradients with the
   library's ``average_buffer`` (``allreduce(op="mean")``, so divided by P - B) over a
   communicator of exactly the chosen ranks. It is made once per distinct set with
   ``Create_group``, which only the chosen ranks call, and kept: a steady straggler gives one set
   for the whole run, jitter at most C(P, B) of them. No late rank takes part, so no chosen rank
   waits for one: an allreduce over all P ranks with zeros from the late ones would wait for
   the slowest rank to arrive, which is what this mode exists to avoid.
4. **The late ranks get the result.** The i-th late rank (in rank order) receives the averaged
   gradient from the (i mod (P - B))-th chosen rank (in arrival order), as a nonblocking send
   from a copy, which the chosen rank does not wait for. Every rank then applies the same update
   to the same bits.
5. **Skipping ahead.** A late rank finishes its compute, receives the decision of its step (it is
   not in), the average, and applies it. Before it computes again it looks (``Iprobe``; on one node,
   in the window's step records) for decisions of later steps already made without it; for each it
   receives the decision and the average and applies the update without computing, then computes the
   first step not yet decided, with the newest parameters. It drops the gradients it computed late
   and skips the batches of the steps it missed (they count as not trained on). It stops skipping at
   an epoch's end and at a checkpoint step, where every rank meets anyway.

Points where every rank meets, straggler or not: the end of each epoch (the test evaluation and
the epoch's sums are collective), the gathering of the timing records every ``--gather-every``
steps and checkpoints. At the end of the run every rank receives the arrival messages that came
too late to count, so none is left unreceived.

Why the window: where ranks share cores, every wait for all the chosen ranks to be scheduled
costs about what a small allreduce costs. After the (P - B)-th arrival the messages pay two (the
coordinator's round, then the reduction among the chosen), the window one, the same number as
plain sync's allreduce after the last arrival.

The report (``straggler["backup_workers"]`` in ``--json``): per rank the share of steps whose
average does not hold its gradient, the gradients it computed, how many of those came late and the
steps it skipped; per run the effective global batch (the samples in each step's average), the
protocol (``shared window`` or ``messages``) and the distinct sets of ranks in (``groups``, those
rank 0 was in); and per step, from the same run's arrival records (each rank's compute time, ranks
starting a step together as plain sync would), how long the step waited from its first arrival to
its (P - B)-th, against from the first to the last, which is what plain sync waits. A rank that
skipped a step counts with its latest compute time. ``step_ms_p50`` is the step time of the ranks
whose gradient is in, the pace at which the updates come.
"""
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
from mpi4py import MPI

from ..comm import library_comm
from ..params import average_buffer
from . import modes
from .tickets import tickets_for
from .timing import analyse

ARRIVE, DECIDE, GRADIENT = 1, 2, 3
IN, LATE, SKIPPED = 0, 1, 2
#: One node: the averages sent on to late ranks carry the step in their tag, from this tag on.
STEP_TAGS = 16
#: The largest shared window (bytes: two gradients per rank) for the one-node protocol; a larger
#: model takes the message protocol.
WINDOW_LIMIT = 256 << 20


class BackupWorkers:
    """Finishes the steps of ``trainer`` with ``backups`` backup workers (collective to make)."""

    def __init__(self, trainer: Any, backups: int):
        self.t = trainer
        self.comm = trainer.comm.Dup()
        self.rank, self.ranks = self.comm.Get_rank(), self.comm.Get_size()
        self.backups = int(backups)
        self.need = self.ranks - self.backups
        self.coordinator = 0
        self.groups: Dict[Tuple[int, ...], MPI.Intracomm] = {}
        self.pending: List[Tuple[MPI.Request, Any]] = []
        self.sent = np.zeros(self.ranks, dtype=np.int64)     # arrival messages sent to each rank
        self.got = np.zeros(self.ranks, dtype=np.int64)      # ... and received from each
        self.decision = np.zeros(self.need + 1, dtype=np.int64)
        self.rows: List[Tuple[int, float, int]] = []          # per step: status, compute s, samples in
        self.sums = np.zeros(3)
        self.forwarded = 0                                     # bytes of averages sent on to late ranks
        lib = library_comm(trainer.comm)
        #: One node, ``--algorithm auto``: tickets and the average in a shared window (``tickets.py``).
        self.tickets = (tickets_for(self.comm, lib.layout, trainer.model.grads, self.need, lib.oversubscribed,
                                    WINDOW_LIMIT) if trainer.config.algorithm == "auto" else None)
        self.first = trainer.step                             # the window counts steps from here
        self.cycle = self.comm.Get_attr(MPI.TAG_UB) - STEP_TAGS
        self.sets: set = set()                                 # the distinct chosen sets this rank was in

    # -- a step ------------------------------------------------------------------------------
    def after_compute(self, idx: np.ndarray, loss: float, correct: int, t0: float, t1: float) -> None:
        """Steps 1-4 for the step whose gradient is in ``model.grads``; then skip ahead (step 5)."""
        t = self.t
        k = t.step
        if self.tickets is not None:
            chosen = self.tickets.step(t.model.grads, k - self.first)    # the average too, if in
            tag = self._tag(k)
        else:
            chosen, tag = self._decide(k, arrive=True), GRADIENT
            if self.rank in chosen:
                average_buffer(t.model.grads, bucket_mb=t.config.bucket_mb, comm=self._group(chosen),
                               algorithm=t.config.algorithm)
        if chosen is not None and self.rank in chosen:
            self.sets.add(tuple(sorted(int(r) for r in chosen)))
            t.traffic[0] += t.buckets
            t.traffic[1] += t.model.grads.nbytes
            t.sent += t.sent_by_allreduce(t.model.grads.nbytes, len(chosen))
            self._serve_late(chosen, tag)
            status, self.sums = IN, np.array([loss, correct, len(idx)], dtype=np.float64)
        else:
            self._receive_average(chosen, tag)
            status, self.sums = LATE, np.zeros(3)
        self._finish(k, status, t1 - t0, len(idx) if status == IN else 0, t1)
        self._skip_ahead()

    def _finish(self, k: int, status: int, compute: float, samples: int, since: float) -> None:
        t2 = time.perf_counter()
        modes.apply_update(self.t, k)
        t3 = time.perf_counter()
        self.t.timer.record(compute, t2 - since, t3 - t2)
        self.rows.append((status, compute if status != SKIPPED else float("nan"), samples))
        self.t.step += 1

    def _decide(self, k: int, arrive: bool) -> np.ndarray:
        """The chosen ranks of step ``k`` in arrival order (every rank learns them); ``arrive``: this
        rank has a gradient for step ``k`` (else it only receives the decision)."""
        comm, coordinator = self.comm, self.coordinator
        if self.rank != coordinator:
            if arrive:
                note = np.array([k], dtype=np.int64)
                self.pending.append((comm.Isend(note, dest=coordinator, tag=ARRIVE), note))
                self.sent[coordinator] += 1
            comm.Recv(self.decision, source=coordinator, tag=DECIDE)
        else:
            chosen: List[int] = []
            while len(chosen) < self.need and comm.Iprobe(source=MPI.ANY_SOURCE, tag=ARRIVE):
                self._take_arrival(k, chosen)               # arrived before the coordinator
            if len(chosen) < self.need:
                chosen.append(self.rank)
            while len(chosen) < self.need:
                self._take_arrival(k, chosen)
            self.decision[0] = k
            self.decision[1:] = chosen
            out = self.decision.copy()
            for r in range(self.ranks):
                if r != self.rank:
                    self.pending.append((comm.Isend(out, dest=r, tag=DECIDE), out))
        assert self.decision[0] == k, f"decision of step {self.decision[0]} received in step {k}"
        chosen = self.decision[1:].copy()
        self.coordinator = int(chosen[0])
        self._prune()
        return chosen

    def _take_arrival(self, k: int, chosen: List[int]) -> None:
        status, note = MPI.Status(), np.zeros(1, dtype=np.int64)
        self.comm.Recv(note, source=MPI.ANY_SOURCE, tag=ARRIVE, status=status)
        source = status.Get_source()
        self.got[source] += 1
        if note[0] == k:                                    # older steps' arrivals came too late: dropped
            chosen.append(source)

    def _group(self, chosen: np.ndarray) -> MPI.Intracomm:
        """The communicator of exactly the chosen ranks (made by them alone the first time, then kept)."""
        key = tuple(sorted(int(r) for r in chosen))
        if key not in self.groups:
            group = self.comm.Get_group().Incl(list(key))
            self.groups[key] = self.comm.Create_group(group, tag=DECIDE)
            group.Free()
        return self.groups[key]

    def _late(self, chosen: np.ndarray) -> List[int]:
        inside = set(int(r) for r in chosen)
        return [r for r in range(self.ranks) if r not in inside]

    def _tag(self, k: int) -> int:
        """The tag of step ``k``'s average on its way to a late rank (one node)."""
        return STEP_TAGS + k % self.cycle

    def _serve_late(self, chosen: np.ndarray, tag: int) -> None:
        """Send the averaged gradient to the late ranks this rank serves (nonblocking, from a copy)."""
        mine = [r for i, r in enumerate(self._late(chosen)) if int(chosen[i % self.need]) == self.rank]
        if mine:
            copy = self.t.model.grads.copy()
            for r in mine:
                self.pending.append((self.comm.Isend(copy, dest=r, tag=tag), copy))
                self.forwarded += copy.nbytes

    def _receive_average(self, chosen: Optional[np.ndarray], tag: int) -> None:
        """The step's average, from the chosen rank that serves this one (any of them: one node)."""
        if chosen is None:
            self.comm.Recv(self.t.model.grads, source=MPI.ANY_SOURCE, tag=tag)
            return
        i = self._late(chosen).index(self.rank)
        self.comm.Recv(self.t.model.grads, source=int(chosen[i % self.need]), tag=tag)

    def _limit(self) -> int:
        """The step where skipping ahead stops: the run's end, the epoch's end, the next checkpoint."""
        t, cfg = self.t, self.t.config
        ceil = lambda every: -(-t.step // every) * every
        limit = min(t.total_steps(), ceil(t.steps_per_epoch))
        if cfg.checkpoint_dir and cfg.checkpoint_every > 0:
            limit = min(limit, ceil(cfg.checkpoint_every))
        return limit

    def _skip_ahead(self) -> None:
        """Apply the updates of the steps already decided without this rank (step 5)."""
        t, limit = self.t, self._limit()
        while t.step < limit:
            t0 = time.perf_counter()
            if self.tickets is not None:
                if not self.tickets.decided(t.step - self.first):
                    break
                self._receive_average(None, self._tag(t.step))
            else:
                if not self.comm.Iprobe(source=self.coordinator, tag=DECIDE):
                    break
                chosen = self._decide(t.step, arrive=False)           # the decision is there: Recv returns at once
                assert self.rank not in chosen
                self._receive_average(chosen, GRADIENT)
            self._finish(t.step, SKIPPED, 0.0, 0, t0)

    def _prune(self) -> None:
        self.pending = [(request, buf) for request, buf in self.pending if not request.Test()]

    # -- the end -----------------------------------------------------------------------------
    def finish(self) -> None:
        """Complete every send and receive the arrivals that came too late (collective, after the last step)."""
        MPI.Request.Waitall([request for request, _ in self.pending])
        self.pending = []
        owed = np.zeros(self.ranks, dtype=np.int64)
        self.comm.Alltoall(self.sent, owed)                 # owed[r]: arrival messages rank r sent here
        note = np.zeros(1, dtype=np.int64)
        for source in range(self.ranks):
            for _ in range(int(owed[source] - self.got[source])):
                self.comm.Recv(note, source=source, tag=ARRIVE)
            self.got[source] = owed[source]

    def amend(self, out: Dict[str, Any], records: Optional[np.ndarray]) -> None:
        """Add the backup-worker report to ``out["straggler"]`` on rank 0 (collective)."""
        mine = np.array(self.rows, dtype=np.float64).reshape(-1, 3)
        every = self.comm.gather(mine, root=0)
        forwarded = self.comm.reduce(self.forwarded, root=0)
        if records is None or not len(records):
            return
        if "communication" in out:                           # per rank, as the allreduce figures
            out["communication"]["forwarded_bytes"] = forwarded / self.ranks
        out["straggler"] = report_of(np.stack(every, axis=1), records, self.t.hosts, self.backups,
                                     self.ranks * self.t.config.batch_size * self.t.plan.accum, groups=len(self.sets),
                                     protocol="shared window" if self.tickets is not None else "messages")

    def close(self) -> None:
        """Free the protocol's window and communicators (collective over each one's ranks, in one order everywhere)."""
        if self.tickets is not None:
            self.tickets.free()
            self.tickets = None
        for key in sorted(self.groups):
            self.groups[key].Free()
        self.groups = {}
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()


def report_of(rows: np.ndarray, records: np.ndarray, hosts: List[str], backups: int, global_batch: int,
              groups: int = 1, protocol: str = "messages") -> Dict[str, Any]:
    """The straggler report of a run with ``backups`` backup workers (rank 0's, no communication).

    ``rows`` holds per step and rank (status, compute seconds, samples in the average): (steps,
    ranks, 3), NaN compute for a skipped step; ``records`` the timing records (``timing.py``);
    ``global_batch`` the samples of a step with every rank in (ranks x batch x accumulation
    steps, as the run's header counts it); ``groups`` and ``protocol`` are recorded as given.

    Who was slowest is read from the compute times, not from the arrival at the collective as in
    plain sync: a late rank takes no part in the step's reduction and a rank that skipped a step
    arrives nowhere, so the rank that holds the run back would otherwise seldom be named. Per
    step the slowest is the rank with the longest compute (a skipped step counted with the rank's
    latest compute time); ``slowest_by`` says so. The headline's parts are those of the rank the
    step waited for: the last of the ranks in to arrive.
    """
    ranks = rows.shape[1]
    need = ranks - backups
    status, compute = rows[..., 0].astype(int), rows[..., 1].copy()
    # A rank that skipped a step counts with its latest compute time (its median before any).
    for r in range(ranks):
        known = compute[~np.isnan(compute[:, r]), r]
        last = float(np.median(known)) if known.size else 0.0
        for s in range(len(compute)):
            if np.isnan(compute[s, r]):
                compute[s, r] = last
            else:
                last = compute[s, r]
    filled = records.copy()
    filled[..., 0] = compute
    inside = status == IN
    waited_for = np.where(inside, filled[..., 1], np.inf).argmin(axis=1)   # the last rank in: waits least
    report = analyse(filled, hosts, slowest=compute.argmax(axis=1), last=waited_for)
    report["slowest_by"] = "compute"
    per_step = filled.sum(axis=2)                        # each rank's step time
    pace = np.where(inside, per_step, 0).sum(axis=1) / np.maximum(inside.sum(axis=1), 1)
    report["step_ms_p50_all_ranks"] = report["step_ms_p50"]
    report["step_ms_p50"] = float(np.median(pace) * 1e3)
    report["step_ms"] = [float(x * 1e3) for x in pace]
    ordered = np.sort(compute, axis=1) * 1e3
    waited = ordered[:, need - 1] - ordered[:, 0]
    sync = ordered[:, -1] - ordered[:, 0]
    effective = rows[..., 2].sum(axis=1)
    dropped = (status != IN).mean(axis=0)
    per_rank = []
    for r in range(ranks):
        computed = rows[status[:, r] != SKIPPED, r, 1]
        per_rank.append({"rank": r, "dropped_share": float(dropped[r]),
                         "gradients_computed": int(computed.size),
                         "gradients_late": int(np.sum(status[:, r] == LATE)),
                         "steps_skipped": int(np.sum(status[:, r] == SKIPPED)),
                         "compute_ms_p50": float(np.median(computed) * 1e3) if computed.size else None})
    report["backup_workers"] = {
        "backup_workers": backups, "ranks_in": need,
        "global_batch": int(global_batch),
        "effective_global_batch_mean": float(effective.mean()),
        "effective_global_batch_min": int(effective.min()),
        "step_wait_ms_p50": float(np.median(waited)), "step_wait_ms_mean": float(waited.mean()),
        "sync_step_wait_ms_p50": float(np.median(sync)), "sync_step_wait_ms_mean": float(sync.mean()),
        "wait_saved_ms_p50": float(np.median(sync - waited)),
        "most_dropped_rank": int(np.argmax(dropped)),
        "groups": int(groups),
        "protocol": protocol,
        "ranks": per_rank,
    }
    return report
