"""What a trace says per rank: time in compute, in collectives and waiting, and who was late.

A collective call is matched across ranks by its place among each rank's calls on its main
thread (the k-th call of every rank is one collective: ranks make the same calls in the same
order). In a matched call, the rank that started it last was the late one; every other rank
waited from its own start until then (at most its call's duration), and that wait is
attributed to the late rank. A step's slowest rank is the one that was busy longest in it: the
step's duration less the time it waited.
"""
import json
from typing import Any, Dict, List, Tuple

import numpy as np

MAIN_TID = 1


def load(path: str) -> Dict[str, Any]:
    """The trace file's object (``ValueError`` if it is not a trace in the JSON object form)."""
    with open(path) as f:
        document = json.load(f)
    if not isinstance(document, dict) or not isinstance(document.get("traceEvents"), list):
        raise ValueError(f"{path} is not a trace file (no traceEvents list)")
    return document


def summarise(document: Dict[str, Any]) -> Dict[str, Any]:
    """Per rank: ``steps``, ``step_ms``, ``compute_ms``, ``collective_ms``, ``waiting_ms``,
    ``others_waited_ms`` (waits it caused), ``slowest_steps``; and per step the slowest rank."""
    events = [e for e in document["traceEvents"] if e.get("ph") == "X"]
    names = {e["pid"]: e["args"]["name"] for e in document["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    ranks = sorted(set(names) | {e["pid"] for e in events})
    index = {r: i for i, r in enumerate(ranks)}
    p = len(ranks)
    compute, collective, stepped = np.zeros(p), np.zeros(p), np.zeros(p)
    calls: List[List[dict]] = [[] for _ in ranks]
    steps: Dict[int, Dict[int, Tuple[float, float]]] = {}       # step -> rank -> (ts, end)
    for e in events:
        i = index[e["pid"]]
        if e.get("cat") == "compute":
            compute[i] += e["dur"]
        elif e.get("cat") == "collective":
            collective[i] += e["dur"]
            if e.get("tid") == MAIN_TID:
                calls[i].append(e)
        elif e["name"].startswith("ProfilerStep#"):
            stepped[i] += e["dur"]
            steps.setdefault(int(e["name"].split("#", 1)[1]), {})[i] = (e["ts"], e["ts"] + e["dur"])
    for own in calls:
        own.sort(key=lambda e: e["ts"])
    waiting, caused = np.zeros(p), np.zeros(p)
    waits: List[Tuple[float, float, int]] = []                  # (ts, wait, rank index) per call and rank
    matched = min((len(c) for c in calls), default=0) if p else 0
    for k in range(matched):
        group = [c[k] for c in calls]
        if len({e["name"] for e in group}) > 1:
            break                                              # the ranks' calls part ways: stop matching
        starts = np.array([e["ts"] for e in group])
        late = int(starts.argmax())
        for i, e in enumerate(group):
            wait = min(max(starts[late] - e["ts"], 0.0), e["dur"])
            waiting[i] += wait
            caused[late] += wait
            waits.append((e["ts"], wait, i))
    # per rank, its calls' starts in time order and the running sum of its waits
    starts_of, sums_of = [], []
    for i in range(p):
        mine = sorted((t, w) for t, w, r in waits if r == i)
        starts_of.append(np.array([t for t, _ in mine]))
        sums_of.append(np.concatenate(([0.0], np.cumsum([w for _, w in mine]))))
    slowest = np.zeros(p, dtype=np.int64)
    per_step = []
    for n in sorted(steps):
        spans = steps[n]
        if len(spans) < p:
            continue
        busy = np.zeros(p)
        for i, (ts, end) in spans.items():
            lo, hi = np.searchsorted(starts_of[i], [ts, end])
            busy[i] = (end - ts) - (sums_of[i][hi] - sums_of[i][lo])
        worst = int(busy.argmax())
        slowest[worst] += 1
        per_step.append({"step": n, "slowest_rank": ranks[worst], "busy_ms": [float(b) / 1e3 for b in busy]})
    rows = []
    for r, i in index.items():
        rows.append({"rank": r, "name": names.get(r, f"rank {r}"), "steps": sum(1 for s in steps.values() if i in s),
                     "step_ms": stepped[i] / 1e3, "compute_ms": compute[i] / 1e3,
                     "collective_ms": collective[i] / 1e3, "waiting_ms": waiting[i] / 1e3,
                     "others_waited_ms": caused[i] / 1e3, "slowest_steps": int(slowest[i])})
    return {"ranks": rows, "steps": per_step, "matched_calls": matched,
            "clock": document.get("otherData", {}).get("clock")}


def table(summary: Dict[str, Any]) -> str:
    """The per-rank summary as text."""
    lines = [f"{'rank':<24} {'steps':>5} {'step ms':>10} {'compute ms':>10} {'collective ms':>13} "
             f"{'waiting ms':>10} {'others waited ms':>16} {'slowest in':>10}"]
    for row in summary["ranks"]:
        lines.append(f"{row['name']:<24} {row['steps']:>5} {row['step_ms']:>10.2f} {row['compute_ms']:>10.2f} "
                     f"{row['collective_ms']:>13.2f} {row['waiting_ms']:>10.2f} {row['others_waited_ms']:>16.2f} "
                     f"{row['slowest_steps']:>10}")
    steps = len(summary["steps"])
    if steps:
        worst = max(summary["ranks"], key=lambda row: row["slowest_steps"])
        lines.append(f"slowest rank: {worst['name']}, in {worst['slowest_steps']} of {steps} steps "
                     f"({100 * worst['slowest_steps'] / steps:.0f}%)")
    lines.append(f"{summary['matched_calls']} collective calls matched across ranks")
    clock = summary.get("clock")
    if clock:
        lines.append(f"clock alignment uncertainty: at most {max(clock['uncertainty_us']):.1f} us")
    return "\n".join(lines)
