"""Executes one pipeline rank's list of actions (``schedules.py``) for one step.

Activations go forward and input gradients backward between the ranks that hold neighbouring
virtual stages, by nonblocking point-to-point calls on the library's clone of the pipeline's
communicator (``comm.library_comm``), so they never match a message of the user's. Every
message's tag names its micro-batch, the virtual stage that receives it and its direction, so
no two messages of a step can be confused, whatever order they arrive in. A step runs its actions
in order, each receive posted a few actions ahead (``LOOKAHEAD``) so that an input can arrive while
the rank computes, waits only for an input that has not arrived, and returns once its sends are
complete: nothing is in flight between steps.

Every wait for a peer (an input not yet arrived, a send not yet received) is watched by the stall
inspector (``stall.Inspector.wait``): a wait longer than the stall timeout ends the job, naming the
stage and rank waited on and what that rank is doing. An exception in a stage's forward or
backward carries a note naming the stage, the micro-batch and the rank (the abort hook then
ends the job on every rank).

The runtime counts, per step, the time it waited for inputs (``idle``: the bubble as this rank
saw it), the step's span, and the most micro-batches whose activations it held at once
(``peak_live``, counted per virtual stage, as ``schedules.simulate`` counts them).
"""
import time
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from ..stall import INSPECTOR
from .schedules import Action, rank_of_stage, tag_of
from .stage import StageLayers, softmax_loss

__all__ = ["Runtime", "StepStats", "tag_of", "LOOKAHEAD"]

#: How many actions ahead of the one running a rank posts its receives.
LOOKAHEAD = 4


#: Seconds a wait sleeps between tests of its message when ranks share cores.
NAP_SECONDS = 50e-6


class StepStats:
    """What a rank measured over the steps it ran: seconds waiting for inputs, seconds of the
    steps' spans, and the most micro-batches held at once."""

    def __init__(self) -> None:
        self.idle = 0.0
        self.span = 0.0
        self.steps = 0
        self.peak_live = 0
        self.forward = 0.0           # seconds in forwards (the loss's too, at the last stage)
        self.backward = 0.0

    @property
    def idle_share(self) -> float:
        return self.idle / self.span if self.span > 0 else 0.0


class Runtime:
    """One pipeline rank: its ``actions`` over its virtual stages ``layers`` (stage -> StageLayers),
    talking to the other pipeline ranks on ``comm``, whose ranks ``peers[r]`` are pipeline ranks r
    (the library's clone of ``comm`` carries the messages)."""

    def __init__(self, comm: MPI.Intracomm, peers: Sequence[int], actions: Sequence[Action],
                 layers: Dict[int, StageLayers], total_stages: int, micro_batches: int, dtype):
        from ..comm import LibraryComm, library_comm
        self.comm = comm if isinstance(comm, LibraryComm) else library_comm(comm)
        self.peers = list(peers)
        self.pipeline_ranks = len(self.peers)
        self.actions = list(actions)
        #: forwards (and as many backwards) in a step: of one micro-batch through one virtual stage
        self.forwards_per_step = sum(a.kind == "F" for a in self.actions)
        self.layers = layers
        self.total_stages = total_stages
        self.micro_batches = micro_batches
        self.dtype = np.dtype(dtype)
        upper = self.comm.Get_attr(MPI.TAG_UB) or 32767
        if tag_of("B", micro_batches - 1, total_stages - 1, total_stages) > upper:
            raise ValueError(f"{micro_batches} micro-batches through {total_stages} stages need tags up to "
                             f"{tag_of('B', micro_batches - 1, total_stages - 1, total_stages)}, above this MPI's "
                             f"largest tag {upper}: use fewer micro-batches")
        self.stats = StepStats()
        #: with ranks sharing cores, a wait sleeps between tests (MPI's own polls without pause and
        #: would take the core from a stage that computes)
        self.nap = NAP_SECONDS if self.comm.oversubscribed else 0.0

    def _rank(self, stage: int) -> int:
        return self.peers[rank_of_stage(stage, self.pipeline_ranks)]

    def _wait(self, request: MPI.Request, stage: int, peer_stage: int, mb: int, kind: str, receiving: bool) -> None:
        """Wait for ``request`` (a message of micro-batch ``mb``, -1: of an evaluation batch,
        between ``stage`` here and ``peer_stage``), watched by the stall inspector."""
        peer = self._rank(peer_stage)
        what = ("activations" if kind == "F" else "gradient") + (f" of micro-batch {mb}" if mb >= 0 else
                                                                  " of an evaluation batch")

        def describe() -> str:
            waiting = f"pipeline stage {stage} (rank {self.comm.myrank}) waiting for stage {peer_stage} (rank {peer})"
            return f"{waiting} to send its {what}" if receiving else f"{waiting} to receive the {what}"
        INSPECTOR.wait(request, self.comm.watch, peer, describe, nap=self.nap)

    def _failed(self, error: BaseException, a: Action) -> None:
        error.add_note(f"in pipeline stage {a.stage} on rank {self.comm.myrank}: the "
                       f"{'forward' if a.kind == 'F' else 'backward'} of micro-batch {a.mb}")

    def step(self, rows: Sequence[int], inputs: Optional[Sequence[np.ndarray]] = None,
             targets: Optional[Sequence[np.ndarray]] = None, total: int = 1) -> Tuple[float, int]:
        """Run this rank's actions for micro-batches of ``rows`` samples each: ``inputs`` where
        this rank holds stage 0, ``targets`` where it holds the last stage, ``total`` the samples
        the loss is averaged over. Returns (loss sum, correct) of the micro-batches whose last
        stage is here (0, 0 elsewhere)."""
        last = self.total_stages - 1
        start = time.perf_counter()
        recvs: Dict[Tuple[str, int, int], Tuple[MPI.Request, np.ndarray]] = {}

        def post(a: Action) -> None:
            if a.kind == "F" and a.stage > 0:
                width, source = self.layers[a.stage].in_width, self._rank(a.stage - 1)
            elif a.kind == "B" and a.stage < last:
                width, source = self.layers[a.stage].out_width, self._rank(a.stage + 1)
            else:
                return
            buf = np.empty((rows[a.mb], width), dtype=self.dtype)
            recvs[a] = (self.comm.Irecv(buf, source, tag_of(a.kind, a.mb, a.stage, self.total_stages)), buf)

        sends: List[Tuple[MPI.Request, Action, int]] = []     # the request, its action, the receiving stage
        held: List[np.ndarray] = []                  # send buffers, alive until their sends complete
        deltas: Dict[int, np.ndarray] = {}
        idle, live, peak, loss, correct = 0.0, 0, 0, 0.0, 0
        forward = backward = 0.0
        posted = 0
        for i, a in enumerate(self.actions):
            # Receives are posted LOOKAHEAD actions ahead: an input can arrive while the rank computes,
            # and the receive buffers stay few (not one per micro-batch).
            while posted < len(self.actions) and posted <= i + LOOKAHEAD:
                post(self.actions[posted])
                posted += 1
            stage = self.layers[a.stage]
            if a in recvs:
                request, data = recvs.pop(a)
                t = time.perf_counter()
                self._wait(request, a.stage, a.stage - 1 if a.kind == "F" else a.stage + 1, a.mb, a.kind, True)
                idle += time.perf_counter() - t
            elif a.kind == "F":
                data = inputs[a.mb]
            else:
                data = deltas.pop(a.mb)
            t = time.perf_counter()
            if a.kind == "F":
                try:
                    out = stage.forward(a.mb, data)
                    if a.stage == last:
                        l, c, deltas[a.mb] = softmax_loss(out, targets[a.mb], total)
                except Exception as error:
                    self._failed(error, a)
                    raise
                forward += time.perf_counter() - t
                live += 1
                peak = max(peak, live)
                if a.stage == last:
                    loss += l
                    correct += c
                else:
                    out = np.ascontiguousarray(out)
                    held.append(out)
                    sends.append((self.comm.Isend(out, self._rank(a.stage + 1),
                                                  tag_of("F", a.mb, a.stage + 1, self.total_stages)), a, a.stage + 1))
            else:
                try:
                    grad = stage.backward(a.mb, data)
                except Exception as error:
                    self._failed(error, a)
                    raise
                backward += time.perf_counter() - t
                live -= 1
                if grad is not None:
                    grad = np.ascontiguousarray(grad)
                    held.append(grad)
                    sends.append((self.comm.Isend(grad, self._rank(a.stage - 1),
                                                  tag_of("B", a.mb, a.stage - 1, self.total_stages)), a, a.stage - 1))
        t = time.perf_counter()
        for request, a, to in sends:
            self._wait(request, a.stage, to, a.mb, a.kind, False)
        idle += time.perf_counter() - t
        s = self.stats
        s.idle += idle
        s.span += time.perf_counter() - start
        s.steps += 1
        s.peak_live = max(s.peak_live, peak)
        s.forward += forward
        s.backward += backward
        return loss, correct

    def forward_only(self, x: Optional[np.ndarray], rows: int) -> Optional[np.ndarray]:
        """The model's output for ``rows`` samples ``x`` (given where this rank holds stage 0),
        passed through the stages in order; returned where this rank holds the last stage.
        Blocking; keeps no activations (evaluation)."""
        last = self.total_stages - 1
        out = None
        for k in sorted(self.layers):
            stage = self.layers[k]
            if k > 0:
                x = np.empty((rows, stage.in_width), dtype=self.dtype)
                self._wait(self.comm.Irecv(x, self._rank(k - 1), tag_of("F", 0, k, self.total_stages)), k, k - 1, -1,
                           "F", True)
            out = stage.forward(0, x, keep=False)
            if k < last:
                out = np.ascontiguousarray(out)
                self._wait(self.comm.Isend(out, self._rank(k + 1), tag_of("F", 0, k + 1, self.total_stages)), k, k + 1,
                           -1, "F", False)
        return out if last in self.layers else None
