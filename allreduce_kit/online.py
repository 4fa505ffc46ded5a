"""Online tuning for ``algorithm="auto"``: time the candidates on the first calls of each size
class, agree across ranks, keep the fastest, and look again when its time drifts.

A size class is a power-of-two range of message sizes (``2**k`` to ``2**(k+1) - 1`` bytes).
On one node wherever the built-in table would choose (a tuning file's rules are followed as
written where they measured), and across nodes (below ``multinode.tuned_below`` among several,
from there the node-aware cost model's choice against MPI's own call only), the first calls of a
class on a communicator explore:

1. the candidates are the table's (or the model's) choice and a short list for the size: on one
   node ``CANDIDATES``, less what cannot win where the ranks read each other's buffers
   (``DOMINATED_WITH_DIRECT``); across nodes ``multinode.candidates``;
2. the calls take turns by candidate: ``block`` calls in a row each, one untimed round (the first
   call of an algorithm allocates its window or scratch) and then ``ROUNDS`` timed rounds, each
   round in a rotated order; every rank times its own calls (``perf_counter``), all but the
   first of each turn of several (it inherits the caches and the ranks' skew another candidate
   left: a winner runs after itself);
3. on the last exploring call one ``Allreduce`` (MAX over ranks of each candidate's median time
   per call) gives every rank the same figures, and so the same winner, which runs from then on:
   the fastest, unless the table's choice is within ``PRIOR_MARGIN`` of it.

Every call's result is the reduction asked for (each runs a registered algorithm in full). The
schedule is a pure function of how many calls of the class the communicator has made, and calls
are collective, so every rank runs the same algorithm on the same call.

**Cost**: ``len(candidates) * (ROUNDS + 1) * block`` calls per class (``exploration_calls``:
80 below 16 KiB, 60 from 16 KiB, 45 from 64 KiB, 20 from 1 MiB, 10 with direct transfers),
each no slower than the slowest candidate; then one ``Allreduce`` of a few doubles. If those calls took
less than ``MIN_EXPLORE_SECONDS`` on the slowest rank, ``ROUNDS`` more rounds follow (and another
``Allreduce``), up to ``MAX_EXTENSIONS`` times: at most ``len(candidates) * (1 + ROUNDS * 16) *
block`` calls (1040 below 16 KiB, 780 from 16 KiB, 585 from 64 KiB), and only where calls are so
short that they add up to less than 0.2 s.

**Drift**: a settled class times its winner over one window (``ROUNDS * block`` calls) before
each check; a check is one ``Allreduce`` of one double. The first comes ``CHECK_AFTER`` times
the exploration's calls after it, then each gap doubles up to ``MAX_GAP`` times that. If the
winner's time has moved by more than ``DRIFT`` (either way) against what exploration measured,
the class explores again: the machine's state changed.

**Other collectives**: ``reduce_scatter``, ``allgather`` and ``broadcast`` tune the same way,
each with its own ``Spec`` (its registry, short lists and table; ``Tuner`` runs
``algorithm(lib, *args)`` whatever the collective), on one node only: across nodes their tables'
choices run untimed (``CollectiveTable``).

**Saved results** (``ALLREDUCE_KIT_ONLINE_TUNING=save``): rank 0 writes each class's result, with
what was measured, to the tuning file (``$ALLREDUCE_KIT_TUNING``'s path, else the default
file), under ``online`` -> ``"<ranks>/<nodes>"`` -> the class's first byte count. A later job on
the same layout starts with those classes settled and checks them on their first window.
Another collective's go under ``"<collective> <ranks>/<nodes>"``.
"""
import json
import os
import sys
import warnings
from time import perf_counter
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from . import config, multinode, selection
from .algorithms import ALGORITHMS
from .algorithms.direct import peers_for

#: ``(from bytes, candidates, calls per timed turn)``: the short list tried from each size on,
#: besides the table's own choice. Small messages take turns in blocks of calls, so a turn is
#: long enough to time against the scheduler's noise.
CANDIDATES: Tuple[Tuple[int, Tuple[str, ...], int], ...] = (
    (0, ("shared_memory", "recursive_doubling"), 8),
    (16 << 10, ("shared_memory", "two_shot", "recursive_doubling"), 4),
    (64 << 10, ("shared_memory", "two_shot", "rabenseifner"), 3),
    (1 << 20, ("shared_memory", "two_shot", "rabenseifner", "ring"), 1),
)
#: From ``DOMINATED_FROM`` bytes, left out of a class's candidates (unless the table chose one)
#: where the communicator's ranks read and write each other's buffers directly
#: (``algorithms/direct.py``): there ``two_shot`` moves the same bytes with less memory traffic
#: (2p against 5(p-1) segments per rank, its docstring) and waits twice per call, not at every
#: step, and it was at least as fast as both at every such size and rank count measured
#: (docs/performance.md). Timed anyway, with calls that vary by a fifth from one to the next
#: where ranks share cores, they won a third of the explorations at 8 ranks and 8-16 MiB, and
#: then took 1.2x-1.6x ``two_shot``'s time.
DOMINATED_WITH_DIRECT = ("rabenseifner", "ring")
DOMINATED_FROM = 1 << 20
#: Timed rounds of turns per exploration (after one untimed round).
ROUNDS = 4
#: An exploration that took less than this (seconds, on the slowest rank) takes ``ROUNDS`` more
#: rounds, up to ``MAX_EXTENSIONS`` times: a burst of load elsewhere (a scheduler's time slice is
#: milliseconds) must not decide alone, and calls of a few milliseconds each, where ranks share
#: cores, vary by half from one to the next, so four of each do not rank two candidates.
MIN_EXPLORE_SECONDS = 0.2
MAX_EXTENSIONS = 15
#: The first drift check comes this many times a class's exploration calls after it settles.
CHECK_AFTER = 64
#: Gaps between checks double up to this many times the first gap.
MAX_GAP = 64
#: A winner whose time moved by more than this factor against its exploration sends the class
#: back to exploring.
DRIFT = 1.5
#: The table's choice stays unless another candidate is faster by more than this fraction: a
#: near tie is not worth a change that noise may have made.
PRIOR_MARGIN = 0.05
#: Message sizes whose class is remembered by size (beyond this, it is looked up by class).
MEMO_SIZES = 4096


class Spec(NamedTuple):
    """What online tuning needs of one collective: its name, its registry (name -> algorithm,
    called ``algorithm(lib, *args)``), its short lists (as ``CANDIDATES``), the names left out
    where the ranks transfer directly (as ``DOMINATED_WITH_DIRECT``), its table
    (``table(lib, nbytes)``, ``None``: ``selection``'s, allreduce's own) and whether it is tuned
    across nodes (else the table's choice runs there, untimed)."""
    name: str
    algorithms: Dict[str, Callable]
    candidates: Tuple[Tuple[int, Tuple[str, ...], int], ...]
    dominated: Tuple[str, ...] = ()
    table: Optional[Callable[[Any, int], str]] = None
    across_nodes: bool = False


#: ``allreduce``'s.
ALLREDUCE = Spec("allreduce", ALGORITHMS, CANDIDATES, DOMINATED_WITH_DIRECT, None, True)


def size_class(nbytes: int) -> int:
    """The class of a message of ``nbytes`` bytes: its first byte count, a power of two."""
    return 1 << (nbytes.bit_length() - 1) if nbytes > 0 else 0


def candidates_for(nbytes: int, prior: str, direct: bool = False,
                   across: Optional[Tuple[str, ...]] = None, spec: Spec = ALLREDUCE) -> Tuple[Tuple[str, ...], int]:
    """The algorithms of ``spec``'s collective explored for ``nbytes`` (the table's choice
    ``prior`` first) and the calls per timed turn; ``direct``: the ranks transfer directly, so
    ``spec.dominated`` are left out; ``across``: the list tried across nodes, in place of the
    short lists (the turns stay as long)."""
    listed, block = spec.candidates[0][1], spec.candidates[0][2]
    for start, names, turn in spec.candidates:
        if nbytes >= start:
            listed, block = names, turn
    if across is not None:
        listed = across
    if direct and nbytes >= DOMINATED_FROM:
        listed = tuple(n for n in listed if n not in spec.dominated)
    names = tuple(n for n in dict.fromkeys((prior,) + listed) if n in spec.algorithms)
    return names, block


def exploration_calls(nbytes: int, prior: str = "shared_memory", extensions: int = 0, direct: bool = False,
                      spec: Spec = ALLREDUCE) -> int:
    """How many calls of ``nbytes``' class exploration takes with ``extensions`` sets of extra
    rounds (at most ``MAX_EXTENSIONS``)."""
    names, block = candidates_for(nbytes, prior, direct, spec=spec)
    return len(names) * (1 + ROUNDS * (1 + extensions)) * block


class SizeClass:
    """One size class on one communicator: its candidates and where it is in its schedule.

    ``quiet``: calls left that run ``winner`` untimed (``allreduce`` counts them down itself)."""

    __slots__ = ("low", "candidates", "block", "winner", "quiet", "exploring", "calls", "spent", "samples",
                 "window", "pending", "first_gap", "gap", "reference", "times", "explorations", "elapsed",
                 "extensions", "took")

    def __init__(self, low: int, candidates: Sequence[str], block: int, winner: Optional[str] = None):
        self.low, self.candidates, self.block = low, tuple(candidates), block
        self.winner = winner
        self.quiet = 0
        self.first_gap = CHECK_AFTER * len(self.candidates) * (ROUNDS + 1) * block
        self.gap = self.first_gap
        self.reference = 0.0
        self.times: Dict[str, float] = {}
        self.explorations = 0
        self.spent = self.took = 0
        self.explore() if winner is None else self.watch()

    @property
    def exploration_calls(self) -> int:
        return len(self.candidates) * (ROUNDS + 1) * self.block

    def explore(self) -> None:
        """Start (again) taking turns from the first call of the schedule."""
        self.exploring, self.calls, self.pending = True, 0, 0.0
        self.elapsed, self.extensions, self.took = 0.0, 0, 0
        self.samples: List[List[float]] = [[] for _ in self.candidates]

    def watch(self, quiet: int = 0) -> None:
        """Run the winner: ``quiet`` calls untimed, then a timed window and a drift check."""
        self.exploring, self.calls, self.pending, self.quiet = False, 0, 0.0, quiet
        self.window: List[float] = []

    def settled(self, winner: str, times: Dict[str, float]) -> None:
        self.winner, self.times, self.reference = winner, times, times[winner]
        self.explorations += 1
        self.gap = self.first_gap
        self.watch(self.gap - ROUNDS * self.block)


class Tuner:
    """One communicator's online tuning: its size classes, each exploring or settled."""

    def __init__(self, lib, auto: "selection.Auto", mode: str, path: Optional[str], direct: bool = False,
                 spec: Spec = ALLREDUCE):
        self.auto, self.mode, self.path, self.spec = auto, mode, path, spec
        self.algorithms = spec.algorithms
        #: The ranks read and write each other's buffers with the compiled kernels, so the
        #: algorithms that can (``two_shot``, ``ring``, ``rabenseifner``) do (``candidates_for``).
        self.direct = direct
        #: Where the ranks sit across nodes (``None`` on one node): the list tried depends on it.
        self.across = None if lib.layout.single_node else lib.layout
        #: where the tuning file keeps this communicator's results (allreduce's: "<ranks>/<nodes>";
        #: another collective's are prefixed by its name)
        self.layout = f"{lib.nranks}/{lib.layout.nodes}" if spec is ALLREDUCE else \
            f"{spec.name} {lib.nranks}/{lib.layout.nodes}"
        self.rank, self.nranks, self.nodes = lib.myrank, lib.nranks, lib.layout.nodes
        self.classes: Dict[int, SizeClass] = {}
        #: message size -> its class (``allreduce`` reads it first)
        self.by_nbytes: Dict[int, SizeClass] = {}
        for low, entry in (auto.saved.get(self.layout) or {}).items():
            low = int(low)
            if low > 0 and low & (low - 1) == 0 and not auto.untimed(low):
                names, block = candidates_for(low, auto.choose(low), self.direct, self._across(low), spec)
                names = tuple(dict.fromkeys((entry["algorithm"],) + names))
                saved = SizeClass(low, names, block, entry["algorithm"])
                times = entry.get("times_us") or {}
                saved.reference = float(times.get(entry["algorithm"], 0.0)) / 1e6
                saved.times = {n: float(t) / 1e6 for n, t in times.items()}
                self.classes[low] = saved

    def _across(self, nbytes: int) -> Optional[Tuple[str, ...]]:
        """The list tried across nodes for ``nbytes`` (``multinode.candidates``); ``None`` on one node."""
        return None if self.across is None else multinode.candidates(self.across, nbytes)

    def class_for(self, nbytes: int) -> SizeClass:
        """The class that ``nbytes`` belongs to (made the first time; local, sends nothing)."""
        found = self.by_nbytes.get(nbytes)
        if found is not None:
            return found
        if self.auto.untimed(nbytes):  # the tuning file's rule or the cost model's, untimed for ever
            found = SizeClass(nbytes, (self.auto.choose(nbytes),), 1, self.auto.choose(nbytes))
            found.quiet = sys.maxsize
        else:
            low = size_class(nbytes)
            found = self.classes.get(low)
            if found is None:
                found = self.classes[low] = SizeClass(
                    low, *candidates_for(nbytes, self.auto.choose(nbytes), self.direct, self._across(nbytes),
                                         self.spec))
        if len(self.by_nbytes) < MEMO_SIZES:
            self.by_nbytes[nbytes] = found
        return found

    def choice(self, nbytes: int) -> str:
        """What ``auto`` runs (or, while the class explores, what it would run) for ``nbytes``."""
        found = self.class_for(nbytes)
        return found.winner or self.auto.choose(nbytes)

    def call(self, lib, nbytes: int, *args) -> None:
        """Run one ``auto`` call of ``nbytes`` bytes on ``lib``, ``algorithm(lib, *args)`` (for
        allreduce: the buffer and the reduction): collective, as the algorithm is."""
        c = self.class_for(nbytes)
        if c.quiet:
            c.quiet -= 1
            self.algorithms[c.winner](lib, *args)
            return
        algorithms = self.algorithms
        self.run(lib, c, lambda name: algorithms[name](lib, *args))

    def run(self, lib, c: SizeClass, runner: Callable[[str], None]) -> None:
        """One call of class ``c``: ``runner(name)`` runs the algorithm ``name`` (collective)."""
        if c.quiet:
            c.quiet -= 1
            runner(c.winner)
            return
        m = len(c.candidates)
        if c.exploring:
            turn, within = divmod(c.calls, c.block)
            rnd, slot = divmod(turn, m)
            index = (slot + rnd) % m
            start = perf_counter()
            runner(c.candidates[index])
            elapsed = perf_counter() - start
            c.calls += 1
            c.spent += 1
            c.took += 1
            if rnd:  # round 0 is untimed
                c.elapsed += elapsed
                if within or c.block == 1:  # a turn's first call inherits what another candidate left: untimed
                    c.pending += elapsed
                if within == c.block - 1:
                    c.samples[index].append(c.pending / max(1, c.block - 1))
                    c.pending = 0.0
            if c.calls == c.exploration_calls:
                self._agree_on_winner(lib, c)
            return
        start = perf_counter()
        runner(c.winner)
        c.pending += perf_counter() - start
        c.calls += 1
        if c.calls % c.block == 0:
            c.window.append(c.pending / c.block)
            c.pending = 0.0
        if c.calls == ROUNDS * c.block:
            self._check_drift(lib, c)

    def _agree_on_winner(self, lib, c: SizeClass) -> None:
        agreed = np.array([np.median(s) for s in c.samples] + [c.elapsed], dtype=np.float64)
        lib.Allreduce(MPI.IN_PLACE, agreed, op=MPI.MAX)
        if agreed[-1] < MIN_EXPLORE_SECONDS and c.extensions < MAX_EXTENSIONS:  # too short to trust: more rounds
            c.extensions += 1
            c.calls = len(c.candidates) * c.block  # the first timed round again; the samples so far are kept
            return
        medians = agreed[:-1]
        times = dict(zip(c.candidates, medians.tolist()))
        fastest = int(np.argmin(medians))
        c.settled(c.candidates[0 if medians[0] <= medians[fastest] * (1 + PRIOR_MARGIN) else fastest], times)
        if self.mode == "save" and self.rank == 0:
            self._save(lib, c)

    def _check_drift(self, lib, c: SizeClass) -> None:
        now = np.array([np.median(c.window)], dtype=np.float64)
        lib.Allreduce(MPI.IN_PLACE, now, op=MPI.MAX)
        ratio = now[0] / c.reference if c.reference > 0 else float("inf")
        if ratio > DRIFT or ratio * DRIFT < 1:
            c.explore()
        else:
            c.gap = min(c.gap * 2, MAX_GAP * c.first_gap)
            c.watch(c.gap - ROUNDS * c.block)

    def _save(self, lib, c: SizeClass) -> None:
        """Rank 0 adds the class's result to the tuning file; a failure is a warning, not an error."""
        entry = {"algorithm": c.winner, "sizes": [c.low, 2 * c.low - 1],
                 "times_us": {n: round(t * 1e6, 3) for n, t in c.times.items()},
                 "exploration_calls": c.took, "ranks": self.nranks, "nodes": self.nodes,
                 "mpi_library": MPI.Get_library_version().strip().splitlines()[0]}
        try:
            save(self.path, self.layout, c.low, entry)
        except (OSError, ValueError) as error:
            warnings.warn(f"{self.spec.name}(algorithm='auto'): could not save online tuning to {self.path}: {error}")

    def report(self, nbytes: int) -> Optional[dict]:
        """What exploration measured for ``nbytes``' class (``None`` until it settled)."""
        c = self.class_for(nbytes)
        if c.winner is None or not c.times:
            return None
        return {"algorithm": c.winner, "class_bytes": [c.low, 2 * c.low - 1],
                "times_us": {n: t * 1e6 for n, t in c.times.items()}, "explorations": c.explorations,
                "exploration_calls": c.took, "calls_exploring": c.spent}


def save(path: str, layout: str, low: int, entry: dict) -> dict:
    """Put ``entry`` under ``online`` -> ``layout`` -> ``low`` in the tuning file at ``path``
    (created if missing; the rest of it kept), replacing the file in one step."""
    payload: dict = {"format": selection.FORMAT}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as handle:
            payload = json.load(handle)
        selection.parse(payload, f"tuning file {path}")
    payload.setdefault("online", {}).setdefault(layout, {})[str(low)] = entry
    selection.parse(payload, f"tuning file {path}")
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w", encoding="utf-8") as out:
        json.dump(payload, out, indent=2)
        out.write("\n")
    os.replace(temporary, path)
    return payload


def save_path() -> str:
    """Where ``save`` mode writes: ``$ALLREDUCE_KIT_TUNING``'s path, else the default file."""
    named = config.read(config.TUNING)
    if named == "builtin":
        raise ValueError(f"{config.ONLINE_TUNING.name}=save needs a tuning file to write to, but "
                         f"{config.TUNING.name}=builtin; name a path there or unset it")
    return named or str(selection.default_path())


def _settings_on_rank_zero() -> object:
    """Rank 0's mode and save path, or the ``ValueError`` a bad setting gives."""
    try:
        mode = config.read(config.ONLINE_TUNING)
        return mode, (save_path() if mode == "save" else None)
    except ValueError as error:
        return error


def _make(lib, caller: str = "allreduce") -> Optional[Tuner]:
    """Rank 0's setting decides for every rank (a rank with other settings cannot make other
    choices); ``None`` when online tuning is off. An error names ``caller``, the collective whose
    first ``auto`` call made it."""
    selection.source_for(lib, caller)  # the table (or the cost model) first: collective the first time
    auto = lib.state[selection.Auto]
    decided = lib.bcast(_settings_on_rank_zero() if lib.myrank == 0 else None, root=0)
    if isinstance(decided, ValueError):
        raise ValueError(f"{caller}(algorithm='auto'): {decided}")
    mode, path = decided
    if mode == "off":
        return None
    transfers = peers_for(lib) is not None and lib.reductions["sum"].code is not None  # collective
    auto.online = Tuner(lib, auto, mode, path, transfers)
    return auto.online


class CollectiveTable:
    """Another collective's ``auto`` table as the tuner reads allreduce's (``selection.Auto``):
    its choice, what the tuning file saved, and where its choice is followed untimed (across
    nodes, unless ``spec.across_nodes``)."""

    def __init__(self, lib, spec: Spec, saved: dict):
        self.lib, self.spec, self.saved = lib, spec, saved
        self.fixed = not spec.across_nodes and not lib.layout.single_node

    def choose(self, nbytes: int) -> str:
        return self.spec.table(self.lib, nbytes)

    def untimed(self, nbytes: int) -> bool:
        return self.fixed


#: The collectives besides allreduce that tune online; each module defines its ``SPEC``.
COLLECTIVES = ("reduce_scatter", "allgather", "broadcast")


def spec_of(name: str) -> Spec:
    """The ``Spec`` of collective ``name``: ``allreduce`` or one of ``COLLECTIVES``."""
    if name == ALLREDUCE.name:
        return ALLREDUCE
    if name not in COLLECTIVES:
        raise KeyError(f"no online tuning for {name!r}: one of allreduce, {', '.join(COLLECTIVES)}")
    from importlib import import_module
    return import_module(f"{__package__}.collectives.{name}").SPEC


def _make_for(lib, spec: Spec) -> Optional[Tuner]:
    # the settings, agreed once per communicator (collective)
    allreduce_tuner = lib.attach(Tuner, lambda lib: _make(lib, spec.name))
    if allreduce_tuner is None:
        return None
    saved = lib.state[selection.Auto].saved
    return Tuner(lib, CollectiveTable(lib, spec, saved), allreduce_tuner.mode, allreduce_tuner.path,
                 peers_for(lib) is not None, spec)


def tuner_for(lib, spec: Spec = ALLREDUCE) -> Optional[Tuner]:
    """``lib``'s tuner for ``spec``'s collective, made on the first ``auto`` call (collective
    then); ``None`` if online tuning is off."""
    if spec is ALLREDUCE:
        return lib.attach(Tuner, _make)
    key = ("online", spec.name)
    if key in lib.state:
        return lib.state[key]
    return lib.attach(key, lambda lib: _make_for(lib, spec))  # type: ignore[arg-type]


def exploring(lib, nbytes: int, spec: Spec = ALLREDUCE) -> bool:
    """``auto`` is still exploring the class of ``nbytes`` on ``lib`` (collective on the first
    ``auto`` use of ``lib``): the bench runs ``auto`` until this is false before timing it."""
    tuner = tuner_for(lib, spec)
    return tuner is not None and lib.nranks > 1 and nbytes > 0 and tuner.class_for(nbytes).exploring


def report(lib, nbytes: int, spec: Spec = ALLREDUCE) -> Optional[dict]:
    """What online tuning measured for ``nbytes``' class on ``lib``, or ``None``."""
    tuner = lib.state.get(Tuner if spec is ALLREDUCE else ("online", spec.name))
    return tuner.report(nbytes) if tuner is not None else None
