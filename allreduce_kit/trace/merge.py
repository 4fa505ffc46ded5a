"""Every rank's events on rank 0's clock, written by rank 0 as one Chrome trace event file.

The file is the JSON object form of the trace event format: ``traceEvents``, a flat list of
complete events (``ph: "X"``, ``ts`` and ``dur`` in microseconds since the trace began on rank
0's clock, ``pid`` the rank, ``tid`` the thread) and metadata events (``ph: "M"``) naming each
rank's process track ``rank R (host)`` and its thread tracks; ``distributedInfo`` and
``otherData`` (the clock alignment, with its uncertainty) beside it.
"""
import json
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .clock import Alignment
from .recorder import described

#: ``tid`` of a rank's main thread; other threads (the progress thread that runs nonblocking
#: calls) are numbered from 2 in the order they first recorded.
MAIN_TID = 1


def rank_events(rank: int, host: str, events: Sequence[tuple], threads: Dict[int, str], main_ident: int,
                alignment: Alignment, origin_ns: float) -> List[Dict[str, Any]]:
    """One rank's events, converted: its metadata events, then its ``X`` events in time order."""
    out: List[Dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank} ({host})"}},
        {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}},
    ]
    tids = {main_ident: MAIN_TID}
    for ident in threads:
        tids.setdefault(ident, len(tids) + 1)
    for ident, tid in tids.items():
        name = "main" if tid == MAIN_TID else f"{threads.get(ident, 'thread')} (nonblocking calls)"
        out.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": name}})
    if not events:
        return out
    raw = np.array([(e[3], e[4]) for e in events], dtype=np.int64)
    aligned = alignment.to_reference(rank, raw.reshape(-1)).reshape(-1, 2)
    # both ends through the same map, rounded to the ns: events that end at one reading end together
    ends_us = np.round((aligned - origin_ns) / 1e3, 3)
    converted = []
    for (name, category, ident, _, _, args), (ts, end) in zip(events, ends_us.tolist()):
        event = {"ph": "X", "name": name, "cat": category, "pid": rank, "tid": tids.get(ident, MAIN_TID),
                 "ts": ts, "dur": round(max(end - ts, 0.0), 3)}
        if args:
            event["args"] = described(args)
        converted.append(event)
    # enclosing events first where two start together, so that viewers nest them
    converted.sort(key=lambda e: (e["tid"], e["ts"], -e["dur"]))
    return out + converted


def trace_document(per_rank: Sequence[Tuple[str, Sequence[tuple], Dict[int, str], int]], alignment: Alignment,
                   window: Tuple[int, Optional[int]], origin_ns: float) -> Dict[str, Any]:
    """The whole file's object from every rank's ``(host, events, threads, main ident)``."""
    events: List[Dict[str, Any]] = []
    for rank, (host, recorded, threads, main_ident) in enumerate(per_rank):
        events.extend(rank_events(rank, host, recorded, threads, main_ident, alignment, origin_ns))
    first, stop = window
    return {"traceEvents": events,
            "displayTimeUnit": "ms",
            "distributedInfo": {"backend": "allreduce_kit", "rank": 0, "world_size": len(per_rank),
                                "hosts": [host for host, *_ in per_rank]},
            "otherData": {"producer": "allreduce_kit.trace", "ranks": len(per_rank),
                          "steps": f"{first}:{'' if stop is None else stop}",
                          "clock": alignment.metadata()}}


def write(path: str, document: Dict[str, Any]) -> int:
    """Write ``document`` to ``path``; its size in bytes."""
    text = json.dumps(document, separators=(",", ":"))
    with open(path, "w") as f:
        f.write(text)
    return len(text)
