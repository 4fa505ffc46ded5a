"""Run on the emulated cluster (``test_cluster.py``) with ``ALLREDUCE_KIT_TRACE_CLOCK_SKEW_US``
moving one node's clock: a trace finds the offset given and takes it out.

    python -m mpi4py trace_check.py PATH.json HOST US

Every rank traces ``CALLS`` allreduces of 8 bytes (warmed up first): each call ends on every rank
within a message's flight of the others, so on one clock the calls end together. Rank 0 reads
the file it wrote and reports ``aligned: ...`` only if all of this holds:

- the ranks on ``HOST`` were found ``US`` microseconds ahead, within ``OFFSET_BOUND_US``, at the
  start and at the end; the ranks on rank 0's node within ``SAME_NODE_BOUND_US`` of zero;
- in the merged file, every rank's calls end with rank 0's: the median over the calls of the
  difference between a rank's end and rank 0's is within ``OFFSET_BOUND_US`` (a median, so that
  a call that one rank leaves late, descheduled on shared cores, does not decide it).

Otherwise it prints what differs.
"""
import json
import statistics
import sys

import numpy as np
from mpi4py import MPI

from allreduce_kit import allreduce
from allreduce_kit.trace import session

CALLS = 200
OFFSET_BOUND_US = 50.0
SAME_NODE_BOUND_US = 20.0

path, host, given_us = sys.argv[1], sys.argv[2], float(sys.argv[3])
world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
buf = np.ones(1)
for _ in range(20):                                   # the connections between the nodes, set up untraced
    allreduce(buf, algorithm="mpi")
session.start(path)
for _ in range(CALLS):
    allreduce(buf, algorithm="mpi")
session.finish()

if rank == 0:
    with open(path) as f:
        document = json.load(f)
    hosts = document["distributedInfo"]["hosts"]
    clock = document["otherData"]["clock"]
    problems = []
    for r, where in enumerate(hosts):
        expected, bound = (given_us, OFFSET_BOUND_US) if where == host else (0.0, SAME_NODE_BOUND_US)
        if where not in (host, hosts[0]):
            continue
        for moment in ("offset_start_us", "offset_end_us"):
            if abs(clock[moment][r] - expected) > bound:
                problems.append(f"rank {r} on {where}: {moment} {clock[moment][r]:.1f} us, given {expected:g} "
                                f"(bound {bound:g})")
    if host not in hosts[1:] or hosts.count(host) == len(hosts):
        problems.append(f"the offset was given to {host}, which must hold some ranks but not rank 0: {hosts}")
    ends = [[e["ts"] + e["dur"] for e in sorted((e for e in document["traceEvents"]
                                                  if e.get("ph") == "X" and e["pid"] == r and e["name"] == "allreduce"),
                                                 key=lambda e: e["ts"])] for r in range(size)]
    if any(len(mine) != CALLS for mine in ends):
        problems.append(f"calls per rank {[len(mine) for mine in ends]}, expected {CALLS}")
    else:
        late = [statistics.median(ends[r][k] - ends[0][k] for k in range(CALLS)) for r in range(size)]
        spread = statistics.median(max(ends[r][k] for r in range(size)) - min(ends[r][k] for r in range(size))
                                   for k in range(CALLS))
        if any(abs(d) > OFFSET_BOUND_US for d in late):
            problems.append(f"median end after rank 0's per rank (us): {[round(d, 1) for d in late]}")
    if problems:
        print("\n".join(problems), flush=True)
    else:
        print(f"aligned: {host} given {given_us:g} us, found "
              f"{[round(o, 1) for o in clock['offset_start_us']]} us at the start and "
              f"{[round(o, 1) for o in clock['offset_end_us']]} us at the end (uncertainty "
              f"{[round(u, 1) for u in clock['uncertainty_us']]}); median end after rank 0's "
              f"{[round(d, 1) for d in late]} us; median spread of a call's ends {spread:.1f} us", flush=True)
