"""A check of a trace file against the Chrome trace event format (a test helper).

Written from the format's specification ("Trace Event Format", the JSON Object Format): the
file is an object whose ``traceEvents`` is a list of events; every event has ``ph`` (its
phase), ``pid`` and ``tid``; a complete event (``ph: "X"``) has ``name``, a numeric ``ts`` and a
numeric ``dur`` >= 0, in microseconds, and an optional ``args`` object; a metadata event
(``ph: "M"``) has a ``name`` among ``process_name``, ``process_sort_index``, ``thread_name``,
``thread_sort_index`` and an ``args`` object carrying ``name`` or ``sort_index``. On one thread,
complete events must nest: two either do not overlap or one contains the other (viewers stack
them as a flame graph). ``displayTimeUnit``, if given, is ``ms`` or ``ns``.
"""
from collections import defaultdict
from numbers import Real
from typing import Any, Dict, List

METADATA = {"process_name": "name", "process_sort_index": "sort_index", "thread_name": "name",
            "thread_sort_index": "sort_index"}
#: Slack for rounding: ``ts`` and ``dur`` are written to the nanosecond (3 decimals of us).
SLACK_US = 0.002


def problems(document: Any) -> List[str]:
    """What is wrong with ``document`` as a trace; empty if nothing."""
    found: List[str] = []
    if not isinstance(document, dict) or not isinstance(document.get("traceEvents"), list):
        return ["not an object with a traceEvents list"]
    if document.get("displayTimeUnit", "ms") not in ("ms", "ns"):
        found.append(f"displayTimeUnit {document['displayTimeUnit']!r}")
    threads: Dict[tuple, list] = defaultdict(list)
    for n, e in enumerate(document["traceEvents"]):
        if not isinstance(e, dict) or "ph" not in e:
            found.append(f"event {n}: no ph")
            continue
        for field in ("pid", "tid"):
            if not isinstance(e.get(field), int):
                found.append(f"event {n}: {field} {e.get(field)!r} is not an int")
        if "args" in e and not isinstance(e["args"], dict):
            found.append(f"event {n}: args is not an object")
        if e["ph"] == "X":
            if not isinstance(e.get("name"), str):
                found.append(f"event {n}: X without a name")
            if not isinstance(e.get("ts"), Real) or not isinstance(e.get("dur"), Real) or e.get("dur", -1) < 0:
                found.append(f"event {n}: X needs numeric ts and dur >= 0, got ts={e.get('ts')!r} dur={e.get('dur')!r}")
                continue
            threads[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"], e["name"]))
        elif e["ph"] == "M":
            key = METADATA.get(e.get("name"))
            if key is None or not isinstance(e.get("args"), dict) or key not in e["args"]:
                found.append(f"event {n}: metadata {e.get('name')!r} without args.{key}")
        else:
            found.append(f"event {n}: phase {e['ph']!r} is not written by allreduce_kit.trace")
    for (pid, tid), spans in threads.items():
        spans.sort(key=lambda s: (s[0], -s[1]))
        open_: List[tuple] = []                  # the enclosing events still open, innermost last
        for start, end, name in spans:
            while open_ and open_[-1][1] <= start + SLACK_US:
                open_.pop()
            if open_ and end > open_[-1][1] + SLACK_US:
                found.append(f"pid {pid} tid {tid}: {name} [{start}, {end}] overlaps {open_[-1][2]} "
                             f"[{open_[-1][0]}, {open_[-1][1]}] without nesting")
            open_.append((start, end, name))
    return found
