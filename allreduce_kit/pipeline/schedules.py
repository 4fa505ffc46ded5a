"""Pipeline schedules as data, and a simulator that times them.

A schedule says, for each pipeline rank, the ordered list of actions that rank runs in one
training step: ``Forward(mb, stage)`` and ``Backward(mb, stage)``, where ``mb`` is a micro-batch
(0 .. M-1) and ``stage`` a virtual stage (0 .. S*V-1). Pipeline rank r holds the virtual stages
r, r + S, r + 2S, ... (V of them; V = 1 but for the interleaved schedule), as Megatron-LM and
``torch.distributed.pipelining`` place them. The runtime (``runtime.py``) only executes a list;
the messages follow from it: a forward of stage k > 0 receives stage k-1's output, a backward of
stage k < last receives stage k+1's input gradient.

- ``gpipe`` (Huang et al. 2019): all M forwards, then all M backwards. Peak live micro-batches M.
- ``1f1b`` (PipeDream-Flush, Narayanan et al. 2021): rank r runs min(S-r-1, M) forwards, then
  alternates one forward and one backward, then drains the backwards. Same bubble as GPipe, at
  most S micro-batches live on any rank.
- ``interleaved`` (Megatron-LM's interleaved 1F1B): V virtual stages per rank, forwards taken in
  rounds of micro-batches chunk by chunk; the bubble shrinks about V-fold. The rounds are
  ``torch.distributed.pipelining``'s: max(1, M // S) of them, M / rounds micro-batches each, so M
  must divide by the round count (any M below 2S does; M = S, 2S, ... gives Megatron-LM's rounds
  of S).

``simulate`` runs the lists against each other with a cost per action, as the runtime would
(a rank runs its next action once what it needs has arrived; sends never block), and returns
the timeline, each rank's idle share and peak live micro-batches. A schedule that could hang
raises ``DeadlockError`` there, before any rank runs it.
"""
from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional, Tuple, Union

__all__ = ["Action", "Forward", "Backward", "SCHEDULES", "build", "simulate", "Timeline", "DeadlockError",
           "stage_of_rank", "rank_of_stage", "gpipe_idle_share", "format_timeline", "tag_of", "interleaved_rounds"]

#: The ``--schedule`` choices.
SCHEDULES = ("gpipe", "1f1b", "interleaved")


class Action(NamedTuple):
    """One step of a rank's list: ``kind`` "F" (forward) or "B" (backward) of micro-batch ``mb``
    through virtual stage ``stage``."""
    kind: str
    mb: int
    stage: int

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}.{self.stage}"


def Forward(mb: int, stage: int) -> Action:
    return Action("F", mb, stage)


def Backward(mb: int, stage: int) -> Action:
    return Action("B", mb, stage)


#: The pipeline's tags start here, above every tag of the library's collectives (``algorithms/``,
#: 101 to 214), so that a pipeline message is never taken for a collective's on the same communicator.
TAG_BASE = 1000


def tag_of(kind: str, mb: int, stage: int, stages: int) -> int:
    """The tag of the message micro-batch ``mb`` brings to virtual ``stage`` (of ``stages``): an
    activation (``kind`` "F") or an input gradient ("B")."""
    return TAG_BASE + (mb * stages + stage) * 2 + (kind == "B")


class DeadlockError(ValueError):
    """The ranks' lists wait on each other: no order of execution finishes them."""


def rank_of_stage(stage: int, stages: int) -> int:
    """The pipeline rank that holds virtual ``stage`` (S = ``stages`` ranks)."""
    return stage % stages


def stage_of_rank(rank: int, stages: int, virtual: int) -> List[int]:
    """The virtual stages pipeline ``rank`` holds, in order."""
    return [rank + c * stages for c in range(virtual)]


def interleaved_rounds(stages: int, micro_batches: int) -> int:
    """The interleaved schedule's round count for S = ``stages`` and M = ``micro_batches``,
    ``torch.distributed.pipelining``'s: max(1, M // S); each round takes M / rounds micro-batches."""
    return max(1, micro_batches // stages)


def interleaved_problem(stages: int, micro_batches: int) -> Optional[str]:
    """Why the interleaved schedule cannot take M micro-batches over S stages (the end of a
    sentence whose subject is the schedule), or None."""
    rounds = interleaved_rounds(stages, micro_batches)
    if micro_batches % rounds:
        return (f"takes micro-batches in max(1, M // S) = {rounds} equal rounds: {micro_batches} does not divide "
                f"by {rounds} (with {stages} stages: any M below {2 * stages}, or a multiple of the round count)")
    return None


def _check(stages: int, micro_batches: int, virtual: int, schedule: str) -> None:
    for name, value in (("stages", stages), ("micro_batches", micro_batches), ("virtual_stages", virtual)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if virtual > 1 and schedule != "interleaved":
        raise ValueError(f"virtual_stages={virtual} needs schedule 'interleaved', got {schedule!r}")
    if virtual > 1 and stages < 2:
        raise ValueError("virtual_stages > 1 needs at least 2 stages (a rank would send to itself)")
    problem = interleaved_problem(stages, micro_batches) if schedule == "interleaved" else None
    if problem:
        raise ValueError(f"the interleaved schedule {problem}")


def _gpipe(rank: int, S: int, M: int) -> List[Action]:
    return [Forward(mb, rank) for mb in range(M)] + [Backward(mb, rank) for mb in range(M)]


def _one_f_one_b(rank: int, S: int, M: int) -> List[Action]:
    warm = min(S - rank - 1, M)
    out = [Forward(mb, rank) for mb in range(warm)]
    for i in range(M - warm):
        out += [Forward(warm + i, rank), Backward(i, rank)]
    return out + [Backward(mb, rank) for mb in range(M - warm, M)]


def _interleaved(rank: int, S: int, M: int, V: int) -> List[Action]:
    # Forwards in equal rounds of micro-batches: each round through chunk 0, then chunk 1, ...;
    # backwards likewise with the chunks in reverse (Megatron-LM's order). The warm-up is
    # torch.distributed.pipelining's: (V - 1) rounds' chunks, and 2 more per hop from the last rank.
    per_round = M // interleaved_rounds(S, M)
    fwd: List[Action] = []
    bwd: List[Action] = []
    for first in range(0, M, per_round):
        group = range(first, first + per_round)
        for c in range(V):
            fwd += [Forward(mb, rank + c * S) for mb in group]
        for c in reversed(range(V)):
            bwd += [Backward(mb, rank + c * S) for mb in group]
    total = len(fwd)
    warm = min((S - rank - 1) * 2 + (V - 1) * per_round if V > 1 else S - rank - 1, total)   # V = 1: 1F1B
    out = fwd[:warm]
    for i in range(total - warm):
        out += [fwd[warm + i], bwd[i]]
    return out + bwd[total - warm:]


def build(stages: int, micro_batches: int, schedule: str = "1f1b", virtual_stages: int = 1) -> List[List[Action]]:
    """Every pipeline rank's list of actions for one step (``[rank][i]``)."""
    _check(stages, micro_batches, virtual_stages, schedule)
    S, M, V = stages, micro_batches, virtual_stages
    if schedule == "gpipe":
        return [_gpipe(r, S, M) for r in range(S)]
    if schedule == "1f1b":
        return [_one_f_one_b(r, S, M) for r in range(S)]
    return [_interleaved(r, S, M, V) for r in range(S)]


def gpipe_idle_share(stages: int, micro_batches: int) -> float:
    """The share of a step a rank idles in GPipe and 1F1B with stages of equal cost: (S-1)/(M+S-1)."""
    return (stages - 1) / (micro_batches + stages - 1)


@dataclass
class Timeline:
    """What ``simulate`` found: per rank, ``(start, end, action)`` of each action in its order; the
    step's length; per rank the time it waited and the most micro-batches it held at once (a
    forward done whose backward is not: activations kept, counted per virtual stage)."""
    spans: List[List[Tuple[float, float, Action]]]
    makespan: float
    idle: List[float]
    peak_live: List[int]

    @property
    def idle_share(self) -> List[float]:
        return [i / self.makespan if self.makespan else 0.0 for i in self.idle]

    @property
    def bubble(self) -> float:
        """The share of the step the pipeline idles, over all ranks."""
        return sum(self.idle) / (self.makespan * len(self.idle)) if self.makespan else 0.0


def simulate(lists: List[List[Action]], forward_cost: float = 1.0, backward_cost: float = 2.0,
             latency: float = 0.0,
             stage_costs: Optional[Dict[int, Union[float, Tuple[float, float]]]] = None) -> Timeline:
    """Run every rank's list as the runtime does and time it.

    An action starts once its rank is free and its input has arrived (``latency`` after the
    neighbour finished); a backward runs after its own forward. ``stage_costs`` scales a virtual
    stage's costs (default 1 each); a pair (forward, backward) gives its two costs instead
    (``forward_cost`` and ``backward_cost`` are then not used for it). Checks the lists first:
    every (micro-batch, stage) forward and backward exactly once, each on the rank that holds the
    stage, the backward after the forward; raises ``ValueError`` otherwise and ``DeadlockError``
    if the lists cannot all finish."""
    S = len(lists)
    stages = 1 + max((a.stage for rank in lists for a in rank), default=-1)
    seen: Dict[Action, int] = {}
    for r, actions in enumerate(lists):
        for a in actions:
            if rank_of_stage(a.stage, S) != r:
                raise ValueError(f"rank {r} runs {a}, whose stage is held by rank {rank_of_stage(a.stage, S)}")
            if a in seen:
                raise ValueError(f"{a} appears twice")
            if a.kind == "B" and Forward(a.mb, a.stage) not in seen:
                raise ValueError(f"rank {r} runs {a} before its forward")
            seen[a] = r
    for a in list(seen):
        other = Action("B" if a.kind == "F" else "F", a.mb, a.stage)
        if other not in seen:
            raise ValueError(f"{a} has no {'backward' if a.kind == 'F' else 'forward'}")
        for k in (a.stage - 1, a.stage + 1):
            if 0 <= k < stages and Action(a.kind, a.mb, k) not in seen:
                raise ValueError(f"{a} has no {Action(a.kind, a.mb, k)} to exchange with")
    costs = stage_costs or {}
    done: Dict[Action, float] = {}
    spans: List[List[Tuple[float, float, Action]]] = [[] for _ in range(S)]
    free = [0.0] * S
    nxt = [0] * S
    live = [0] * S
    peak = [0] * S
    remaining = sum(map(len, lists))
    while remaining:
        progressed = False
        for r in range(S):
            while nxt[r] < len(lists[r]):
                a = lists[r][nxt[r]]
                if a.kind == "F":
                    need = Forward(a.mb, a.stage - 1) if a.stage > 0 else None
                else:
                    need = Backward(a.mb, a.stage + 1) if a.stage < stages - 1 else None
                if need is not None and need not in done:
                    break
                ready = done[need] + latency if need is not None else 0.0
                start = max(free[r], ready)
                given = costs.get(a.stage, 1.0)
                if isinstance(given, tuple):
                    cost = given[0] if a.kind == "F" else given[1]
                else:
                    cost = (forward_cost if a.kind == "F" else backward_cost) * given
                end = start + cost
                spans[r].append((start, end, a))
                done[a] = free[r] = end
                live[r] += 1 if a.kind == "F" else -1
                peak[r] = max(peak[r], live[r])
                nxt[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            waiting = [f"rank {r} at {lists[r][nxt[r]]}" for r in range(S) if nxt[r] < len(lists[r])]
            raise DeadlockError("the schedule cannot finish: " + "; ".join(waiting))
    makespan = max(free) if free else 0.0
    idle = [makespan - sum(e - s for s, e, _ in spans[r]) for r in range(S)]
    return Timeline(spans, makespan, idle, peak)


def format_timeline(timeline: Timeline, tick: float = 1.0) -> str:
    """The timeline as text, one row per rank, one column per ``tick``: ``F3`` a forward of
    micro-batch 3 (``F3.5`` at virtual stage 5 when a rank holds several), ``.`` idle."""
    stages_per_rank = max((len({a.stage for _, _, a in row}) for row in timeline.spans), default=1)
    label = (lambda a: f"{a.kind}{a.mb}.{a.stage}") if stages_per_rank > 1 else (lambda a: f"{a.kind}{a.mb}")
    width = max((len(label(a)) for row in timeline.spans for _, _, a in row), default=2)
    slots = int(round(timeline.makespan / tick))
    lines = []
    for r, row in enumerate(timeline.spans):
        cells = ["." * width] * slots
        for s, e, a in row:
            for t in range(int(round(s / tick)), int(round(e / tick))):
                cells[t] = label(a).ljust(width)
        lines.append(f"rank {r}: " + " ".join(cells))
    return "\n".join(lines)
