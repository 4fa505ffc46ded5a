"""Run on the emulated cluster (``test_cluster.py``) with ``ALLREDUCE_KIT_TRACE_CLOCK_SKEW_US``
moving one node's clock: a trace finds the offset given and takes it out.

    python -m mpi4py trace_check.py PATH.json HOST US

The emulated nodes are one machine, so their clocks are one clock: the offset the setting gives
``HOST`` is the only one there is, and every event's true time is known (the reading the
recorder took, before the offset is added). Every rank traces ``CALLS`` allreduces of 8 bytes
(warmed up first); rank 0 reads the file it wrote and reports ``aligned: ...`` only if:

- the ranks on ``HOST`` were found ``US`` microseconds ahead, within ``BOUND_US``, at the start
  and at the end; the ranks on rank 0's node within ``SAME_NODE_BOUND_US`` of zero;
- in the merged file every call of every rank ends within ``BOUND_US`` of when it truly ended,
  so calls that end together on every rank (these barrier-like allreduces, where the machine
  lets them) end together there too: the merged ends' spread is the true one within
  ``BOUND_US``.

Every error must also lie within the file's own ``uncertainty_us`` for that rank (what the
measurement promises). A rank whose uncertainty is wider than the bound was measured while the
machine kept the ranks from answering promptly (other work on shared cores): the run is made
again, at most ``ATTEMPTS`` times in all. Otherwise it prints what differs.
"""
import json
import statistics
import sys

import numpy as np
from mpi4py import MPI

from allreduce_kit import allreduce
from allreduce_kit.trace import recorder, session

CALLS = 200
BOUND_US = 50.0
SAME_NODE_BOUND_US = 20.0
ATTEMPTS = 3
#: The file's times are rounded to the ns; the offsets it reports to 0.1 us here.
ROUNDING_US = 0.5

path, host, given_us = sys.argv[1], sys.argv[2], float(sys.argv[3])
world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
buf = np.ones(1)


def traced_run():
    """Trace ``CALLS`` allreduces; on rank 0, the file's object and every rank's true ends (ns)."""
    session.start(path)
    traced = recorder.CURRENT[0]
    for _ in range(CALLS):
        allreduce(buf, algorithm="mpi")
    true_ends = world.gather([end for name, _, _, end, *_ in traced.calls if name == "allreduce"], root=0)
    session.finish()
    if rank != 0:
        return None, None
    with open(path) as f:
        return json.load(f), true_ends


def judged(document, true_ends):
    """(problems that break the promise, ranks measured too loosely to judge, what was found)."""
    hosts = document["distributedInfo"]["hosts"]
    clock = document["otherData"]["clock"]
    uncertainty = clock["uncertainty_us"]
    broken, loose = [], set()
    if host not in hosts[1:] or host == hosts[0]:
        return [f"the offset was given to {host}, which must hold some ranks but not rank 0: {hosts}"], loose, ""

    def judge(r, what, error, bound):
        if abs(error) > uncertainty[r] + ROUNDING_US:
            broken.append(f"rank {r} on {hosts[r]}: {what} off by {error:.1f} us, beyond the file's uncertainty "
                          f"{uncertainty[r]:.1f} us")
        elif abs(error) > bound:
            loose.add(r)

    for r, where in enumerate(hosts):
        if where in (host, hosts[0]):
            expected, bound = (given_us, BOUND_US) if where == host else (0.0, SAME_NODE_BOUND_US)
            for moment in ("offset_start_us", "offset_end_us"):
                judge(r, moment, clock[moment][r] - expected, bound)
    ends = [[e["ts"] + e["dur"] for e in sorted((e for e in document["traceEvents"]
                                                  if e.get("ph") == "X" and e["pid"] == r and e["name"] == "allreduce"),
                                                 key=lambda e: e["ts"])] for r in range(size)]
    if any(len(mine) != CALLS for mine in ends + true_ends):
        broken.append(f"calls per rank {[len(mine) for mine in ends]} in the file, {[len(t) for t in true_ends]} "
                      f"recorded, expected {CALLS}")
        return broken, loose, ""
    merged_ns = np.array(ends) * 1e3                     # ns from the trace's start on rank 0's clock
    truth = np.array(true_ends, dtype=np.float64)
    truth -= truth[0, 0] - merged_ns[0, 0]               # rank 0's clock is the true one, offset 0 by definition
    worst = np.abs(merged_ns - truth).max(axis=1) / 1e3
    for r in range(size):
        judge(r, "an allreduce's end", worst[r], BOUND_US)
    found = (f"offsets found {[round(o, 1) for o in clock['offset_start_us']]} us at the start, "
             f"{[round(o, 1) for o in clock['offset_end_us']]} at the end (uncertainty "
             f"{[round(u, 1) for u in uncertainty]}); merged ends within {[round(float(w), 1) for w in worst]} us of "
             f"the true ones; median spread of a call's ends {statistics.median(np.ptp(merged_ns, axis=0)) / 1e3:.1f} "
             f"us merged, {statistics.median(np.ptp(truth, axis=0)) / 1e3:.1f} us true")
    return broken, loose, found


for _ in range(20):                                   # the connections between the nodes, set up untraced
    allreduce(buf, algorithm="mpi")
for attempt in range(1, ATTEMPTS + 1):
    document, true_ends = traced_run()
    verdict = judged(document, true_ends) if rank == 0 else None
    if world.bcast(rank == 0 and not verdict[0] and bool(verdict[1]) and attempt < ATTEMPTS, root=0):
        continue                                      # measured too loosely to judge: once more
    break
if rank == 0:
    broken, loose, found = verdict
    if broken:
        print("\n".join(broken), flush=True)
    elif loose:
        print(f"the machine was too busy to measure within {BOUND_US:g} us in {ATTEMPTS} attempts (ranks "
              f"{sorted(loose)}): {found}", flush=True)
    else:
        print(f"aligned: {host} given {given_us:g} us (attempt {attempt}); {found}", flush=True)
