"""What ``algorithm="auto"`` runs: a choice from message size and rank count.

The choice comes from a table of crossover points: for each measured rank count, a list of
``(min_bytes, algorithm)`` rules sorted by ``min_bytes`` (the last rule whose ``min_bytes`` is
at most the message size wins). In the built-in table, rank counts not in it use the nearest one
measured (on a log scale; ties go to the larger). A tuning file is used only where it measured:
at its rank counts, and for message sizes within the range its tune covered (recorded in the
file); everywhere else ``auto`` keeps the built-in table.

Where the table comes from, first match wins:

1. ``$ALLREDUCE_KIT_TUNING``: a path to a tuning file, or ``builtin`` for the table below;
2. the default tuning file, ``$XDG_CONFIG_HOME/allreduce_kit/tuning.json`` (``XDG_CONFIG_HOME``
   defaults to ``~/.config``), if it exists;
3. ``BUILTIN``, measured on the machine this package was developed on (docs/performance.md).

``python -m allreduce_kit.bench --tune [PATH]`` measures the crossover points at the rank count
it runs with and writes (or updates) the file. Rank 0 reads the table once per communicator, at
the first ``auto`` call on it, and broadcasts it, so every rank makes the same choice even if
the file differs between nodes.

Online tuning (``allreduce_kit/online.py``, on unless ``ALLREDUCE_KIT_ONLINE_TUNING=0``) refines
the built-in table's choice by timing candidates during the first calls of each size class; a
tuning file's rules are followed as written where they measured.
On a communicator whose ranks span several nodes, ``auto`` follows the node-aware cost model of
``allreduce_kit/multinode.py`` instead (hierarchical or flat, by size, node count and ranks per
node), which online tuning refines for short messages.
"""
import json
import math
import os
from bisect import bisect_right
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import config
from .algorithms import ALGORITHMS

ENV = config.TUNING.name
FORMAT = 1

#: rank count -> ((min_bytes, algorithm), ...): ``bench --tune`` on the development machine (2 cores,
#: MPICH 5.0.2, float32 sum, 4 B to 64 MiB; docs/performance.md, "auto"),
#: with the switch at 32 MiB, not the tune's 16 MiB: the tune's runs of at least three sizes
#: cannot end a sweep with a two-size run, though its own 16 MiB rows have ``shared_memory``
#: ahead there at every p, as have the every-size repeats at 2 and 4 ranks (a tie at 8;
#: docs/performance.md, "auto").
BUILTIN: Dict[int, Tuple[Tuple[int, str], ...]] = {
    2: ((0, "shared_memory"), (32 << 20, "two_shot")),
    4: ((0, "shared_memory"), (32 << 20, "two_shot")),
    8: ((0, "shared_memory"), (32 << 20, "two_shot")),
}

Rules = Tuple[Tuple[int, str], ...]


class Table(dict):
    """rank count -> rules, and ``ranges[p]``: the message sizes ``(smallest, largest)`` in bytes
    that the rules for ``p`` ranks were measured over (no entry: they stand for every size);
    ``online``: what online tuning saved (``online.py``), as the file holds it."""

    def __init__(self, rules=(), ranges: Optional[Dict[int, Tuple[int, int]]] = None, online: Optional[dict] = None):
        super().__init__(rules)
        self.ranges: Dict[int, Tuple[int, int]] = dict(ranges or {})
        self.online: dict = dict(online or {})


def default_path() -> Path:
    """The tuning file ``auto`` reads when ``$ALLREDUCE_KIT_TUNING`` is not set."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "allreduce_kit" / "tuning.json"


def parse(payload: dict, source: str = "tuning file") -> Table:
    """Check a tuning file's contents and turn them into a table; ``ValueError`` names the fault."""
    if not isinstance(payload, dict) or not isinstance(payload.get("rules", {} if "online" in payload else None), dict):
        raise ValueError(f"{source}: expected a JSON object with a 'rules' object (rank count -> rules)")
    table = Table()
    measured = payload.get("measured") or {}
    if not isinstance(measured, dict):
        raise ValueError(f"{source}: 'measured' must be an object (rank count -> what the tune measured)")
    for key, rules in payload.get("rules", {}).items():
        if not str(key).isdigit() or int(key) < 2:
            raise ValueError(f"{source}: rank count {key!r} is not an integer >= 2")
        if not isinstance(rules, list) or not rules:
            raise ValueError(f"{source}: rules for {key} ranks must be a non-empty list of [min_bytes, algorithm]")
        parsed = []
        for rule in rules:
            if (not isinstance(rule, (list, tuple)) or len(rule) != 2 or not isinstance(rule[0], int)
                    or rule[0] < 0 or rule[1] not in ALGORITHMS):
                raise ValueError(f"{source}: bad rule {rule!r} for {key} ranks; want [min_bytes >= 0, one of "
                                 f"{', '.join(ALGORITHMS)}]")
            parsed.append((int(rule[0]), str(rule[1])))
        parsed.sort()
        if parsed[0][0] != 0:
            raise ValueError(f"{source}: the rules for {key} ranks must start at min_bytes 0")
        table[int(key)] = tuple(parsed)
        sizes = (measured.get(key) or {}).get("sizes") if isinstance(measured.get(key), dict) else None
        if sizes is not None:
            if (not isinstance(sizes, list) or len(sizes) != 2 or not all(isinstance(s, int) for s in sizes)
                    or not 0 < sizes[0] <= sizes[1]):
                raise ValueError(f"{source}: measured sizes for {key} ranks must be [smallest, largest] bytes, "
                                 f"got {sizes!r}")
            table.ranges[int(key)] = (sizes[0], sizes[1])
    online = payload.get("online", {})
    if not isinstance(online, dict) or not all(isinstance(v, dict) for v in online.values()):
        raise ValueError(f"{source}: 'online' must be an object (layout -> size class -> what was measured)")
    for layout, classes in online.items():
        names = _registry_of(layout, source)
        for low, entry in classes.items():
            if not str(low).isdigit() or not isinstance(entry, dict) or entry.get("algorithm") not in names:
                raise ValueError(f"{source}: bad online entry {low!r} for {layout!r}: want a size in bytes -> "
                                 f"{{\"algorithm\": one of {', '.join(names)}, ...}}")
    table.online = online
    if not table and not online:
        raise ValueError(f"{source}: no rules")
    return table


def _registry_of(layout: str, source: str) -> Dict[str, Any]:
    """The algorithms an ``online`` layout's entries may name: allreduce's for ``"<ranks>/<nodes>"``,
    the collective's for ``"<collective> <ranks>/<nodes>"``."""
    if " " not in layout:
        return ALGORITHMS
    from .online import COLLECTIVES, spec_of
    name = layout.split(" ", 1)[0]
    if name not in COLLECTIVES:
        raise ValueError(f"{source}: online layout {layout!r} names no collective online tuning keeps "
                         f"({', '.join(COLLECTIVES)})")
    return spec_of(name).algorithms


def load(path: Optional[str] = None) -> Tuple[Table, str]:
    """The table ``auto`` uses and where it came from (a path, or ``builtin``).

    ``path`` overrides the environment; a named file that is missing or malformed raises
    ``ValueError`` (the default file is used only if it exists), except a missing file that online
    tuning is to write (``ALLREDUCE_KIT_ONLINE_TUNING=save``): the built-in table until it is.
    """
    chosen = path or config.read(config.TUNING)
    if chosen == "builtin":
        return Table(BUILTIN), "builtin"
    if not chosen:
        default = default_path()
        if not default.is_file():
            return Table(BUILTIN), "builtin"
        chosen = str(default)
    try:
        with open(chosen, encoding="utf-8") as handle:
            payload = json.load(handle)
    except OSError as error:
        if isinstance(error, FileNotFoundError) and not path and config.read(config.ONLINE_TUNING) == "save":
            return Table(BUILTIN), "builtin"          # online tuning writes the file (online.save)
        raise ValueError(f"tuning file {chosen} (from {'$' + ENV if not path else 'the caller'}): {error.strerror}") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"tuning file {chosen}: not JSON ({error})") from None
    return parse(payload, f"tuning file {chosen}"), chosen


def rules_for(table: Table, size: int) -> Tuple[Tuple[int, str], ...]:
    """The rules for ``size`` ranks: its own, else those of the nearest rank count measured."""
    if size in table:
        return table[size]
    nearest = min(table, key=lambda q: (abs(math.log2(q) - math.log2(size)), -q))
    return table[nearest]


def choose(nbytes: int, size: int, table: Optional[Table] = None) -> str:
    """The algorithm ``auto`` uses for a message of ``nbytes`` bytes on ``size`` ranks."""
    rules = rules_for(BUILTIN if table is None else table, size)
    return rules[bisect_right([r[0] for r in rules], nbytes) - 1][1]


class Auto:
    """One communicator's ``auto``: its rank count's rules, where they came from, and the
    choices made so far by message size (``choices``, read first by ``allreduce``).

    ``within``: the sizes ``(smallest, largest)`` the rules were measured over, outside which
    ``outside`` (the built-in rules) decide; ``None``: the rules decide at every size."""

    __slots__ = ("rules", "starts", "source", "choices", "within", "outside", "outside_starts", "from_file",
                 "online", "saved")

    def __init__(self, rules: Sequence[Tuple[int, str]], source: str,
                 within: Optional[Tuple[int, int]] = None, outside: Sequence[Tuple[int, str]] = ()):
        self.rules, self.source = tuple(rules), source
        self.starts = [r[0] for r in rules]
        self.within, self.outside = within, tuple(outside)
        self.outside_starts = [r[0] for r in self.outside]
        self.choices: Dict[int, str] = {}
        #: the rules are a tuning file's (not the built-in table's)
        self.from_file = bool(outside)
        #: the online tuner (``online.Tuner``) that refines the choice, if online tuning is on
        self.online = None
        #: what online tuning saved in the tuning file (``Table.online``)
        self.saved: dict = {}

    def untimed(self, nbytes: int) -> bool:
        """A tuning file's rules, not the built-in table's, choose for ``nbytes``: followed as
        written, never timed by online tuning."""
        return self.from_file and (self.within is None or self.within[0] <= nbytes <= self.within[1])

    def choose(self, nbytes: int) -> str:
        if self.within is not None and not self.within[0] <= nbytes <= self.within[1]:
            return self.outside[bisect_right(self.outside_starts, nbytes) - 1][1]
        return self.rules[bisect_right(self.starts, nbytes) - 1][1]


#: Message sizes remembered per communicator; beyond this, choices are looked up afresh.
MEMO_SIZES = 4096


def choose_for(lib, nbytes: int) -> str:
    """``auto``'s choice on the library communicator ``lib`` (collective on its first call).

    Each choice is remembered in the communicator's ``Auto.choices``, which ``allreduce`` reads
    first."""
    auto = lib.attach(Auto, _load_everywhere)
    if auto.online is not None:
        return auto.online.choice(nbytes)
    name = auto.choices.get(nbytes)
    if name is None:
        name = auto.choose(nbytes)
        if len(auto.choices) < MEMO_SIZES:
            auto.choices[nbytes] = name
    return name


def _load_everywhere(lib, caller: str = "allreduce") -> Auto:
    """Rank 0 loads the table and broadcasts it; a bad file raises on every rank, naming the
    collective whose ``auto`` call loaded it (``caller``). Across nodes, the node-aware cost model
    instead (``multinode.py``), with what online tuning saved: the table's rules are measured on
    one node."""
    try:
        loaded: object = load() if lib.myrank == 0 else None
    except ValueError as error:
        loaded = error
    loaded = lib.bcast(loaded, root=0)
    if isinstance(loaded, ValueError):
        raise ValueError(f"{caller}(algorithm='auto'): {loaded}")
    table, source = loaded
    if not lib.layout.single_node:
        from .multinode import NodeAware

        return NodeAware(lib.layout, getattr(table, "online", {}))  # type: ignore[return-value]
    auto = auto_from(table, source, lib.nranks)
    auto.saved = getattr(table, "online", {})
    return auto


def auto_from(table: Table, source: str, size: int) -> Auto:
    """``auto`` for ``size`` ranks from a loaded table: a tuning file's rules only at the rank
    counts and message sizes it measured, the built-in table elsewhere."""
    builtin = rules_for(BUILTIN, size)
    if source == "builtin":
        return Auto(builtin, "builtin")
    if size not in table:
        return Auto(builtin, f"builtin ({source} has no rules for {size} ranks)")
    within = getattr(table, "ranges", {}).get(size)
    where = f" for {within[0]} B to {within[1]} B; built-in elsewhere" if within else ""
    return Auto(table[size], f"{source}{where}", within, builtin)


def source_for(lib, caller: str = "allreduce") -> str:
    """Where ``lib``'s ``auto`` table came from (collective if ``auto`` was not used yet, when an
    error names ``caller``)."""
    return lib.attach(Auto, lambda lib: _load_everywhere(lib, caller)).source


def write(path: str, size: int, rules: List[Tuple[int, str]], note: dict) -> dict:
    """Add (or replace) the rules for ``size`` ranks in the tuning file at ``path``; return it.

    Rules for other rank counts already in the file are kept, so running ``bench --tune`` at
    2, 4 and 8 ranks in turn builds one file for all three.
    """
    payload = {"format": FORMAT, "rules": {}, "measured": {}}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as handle:
            old = json.load(handle)
        parse(old, f"tuning file {path}")  # refuse to extend a broken file
        payload["rules"].update(old.get("rules", {}))
        payload["measured"].update(old.get("measured", {}))
        if old.get("online"):
            payload["online"] = old["online"]
    payload["rules"][str(size)] = [[int(b), name] for b, name in rules]
    payload["measured"][str(size)] = note
    payload["rules"] = dict(sorted(payload["rules"].items(), key=lambda kv: int(kv[0])))
    parse(payload, f"tuning file {path}")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as out:
        json.dump(payload, out, indent=2)
        out.write("\n")
    return payload
