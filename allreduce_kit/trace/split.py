"""One file per rank from a merged trace, in the form readers of PyTorch profiler traces load.

``python -m allreduce_kit.trace split PATH.json OUTDIR`` writes ``OUTDIR/rank-R.json`` for every
rank: what Holistic Trace Analysis (HTA) and other readers of per-rank Kineto traces expect, a
directory of files each naming its rank in ``distributedInfo``. The timestamps stay on rank 0's
clock, as merged.

Those readers break a rank's time down from its device's kernels: time in computation kernels,
in communication kernels (which they tell by NCCL's names) and idle (no kernel running). A rank of
this library has no device, so each rank's file gets one, whose kernels mirror the host's work:

- every ``compute`` event (forward and backward, update) is a computation kernel of its name;
- every ``collective`` event (``allreduce``, ``reduce_scatter``, ``allgather``, ``broadcast``) is a
  communication kernel named ``ncclKernel_<call>`` (the form of the NCCL
  kernel names readers match): its time includes the wait for the last rank, as a
  NCCL kernel's does;
- each kernel runs on the stream of the host thread that made the call (``STREAM`` for the main
  thread, the next for the progress thread's nonblocking calls), and is linked to its host event
  by ``args.correlation``, as a kernel to its launch;
- the host events keep their names and times; their category becomes ``cpu_op`` (the step
  markers ``ProfilerStep#N`` stay ``user_annotation``) and ``args.category`` keeps the merged
  file's.

So a reader's *idle* is what the rank did outside compute and collectives (the trainer's own
work between phases and between steps, a checkpoint write), its *communication* the collective
calls, waiting included.
"""
import json
import os
from typing import Any, Dict, List

#: The stream of the main thread's kernels (PyTorch's default compute stream on a GPU is 7).
STREAM = 7
#: The first kernel's ``correlation`` (large, as a profiler's are: readers store the column in
#: the smallest integer type that holds it, and then write row numbers into a copy of it).
CORRELATION_BASE = 1 << 20
#: Events that become kernels, and the name each kernel gets.
KERNEL_NAMES = {"compute": "{name}", "collective": "ncclKernel_{name}"}


def rank_documents(document: Dict[str, Any]) -> Dict[int, Dict[str, Any]]:
    """Per rank, its file's object: ``distributedInfo`` (``rank``, ``world_size``), its
    ``traceEvents`` (host events, then the device's kernels) and the merged file's ``otherData``."""
    events = document["traceEvents"]
    ranks = sorted({e["pid"] for e in events if isinstance(e.get("pid"), int)})
    info = document.get("distributedInfo", {})
    world = int(info.get("world_size", len(ranks)))
    hosts = info.get("hosts", [])
    out: Dict[int, Dict[str, Any]] = {}
    for rank in ranks:
        mine = [e for e in events if e.get("pid") == rank]
        device = world + rank                      # a pid no rank has, so that the files may be opened together
        name = next((e["args"]["name"] for e in mine if e.get("ph") == "M" and e.get("name") == "process_name"),
                    f"rank {rank}")
        host_events: List[Dict[str, Any]] = []
        kernels: List[Dict[str, Any]] = []
        streams = set()
        correlation = CORRELATION_BASE
        for e in mine:
            if e.get("ph") != "X":
                host_events.append(dict(e))
                continue
            category = e.get("cat", "")
            host = dict(e, cat="user_annotation" if e["name"].startswith("ProfilerStep#") else "cpu_op",
                        args=dict(e.get("args") or {}, category=category))
            kernel_name = KERNEL_NAMES.get(category)
            if kernel_name is not None:
                correlation += 1
                stream = STREAM + e["tid"] - 1
                streams.add(stream)
                host["args"]["correlation"] = correlation
                kernels.append({"ph": "X", "cat": "kernel", "name": kernel_name.format(name=e["name"]),
                                "pid": device, "tid": stream, "ts": e["ts"], "dur": e["dur"],
                                "args": {"device": 0, "stream": stream, "correlation": correlation}})
            host_events.append(host)
        device_tracks = [{"ph": "M", "name": "process_name", "pid": device, "tid": 0,
                          "args": {"name": f"{name}: compute and collectives as kernels"}},
                         {"ph": "M", "name": "process_sort_index", "pid": device, "tid": 0,
                          "args": {"sort_index": world + rank}}]
        device_tracks += [{"ph": "M", "name": "thread_name", "pid": device, "tid": s, "args": {"name": f"stream {s}"}}
                          for s in sorted(streams)]
        # distributedInfo first: readers find the rank by the first '"rank": N' in the file
        out[rank] = {"distributedInfo": {"backend": info.get("backend", "allreduce_kit"), "rank": rank,
                                         "world_size": world, "host": hosts[rank] if rank < len(hosts) else None},
                     "traceEvents": host_events + device_tracks + kernels,
                     "displayTimeUnit": document.get("displayTimeUnit", "ms"),
                     "otherData": document.get("otherData", {})}
    return out


def write_split(document: Dict[str, Any], folder: str) -> List[str]:
    """Write ``folder/rank-R.json`` for every rank of ``document`` (the folder is made if
    missing); the paths written, in rank order."""
    os.makedirs(folder, exist_ok=True)
    paths = []
    for rank, per_rank in rank_documents(document).items():
        path = os.path.join(folder, f"rank-{rank}.json")
        with open(path, "w") as f:
            json.dump(per_rank, f)               # the default separators: '"rank": N', as readers search for it
        paths.append(path)
    return paths
