"""allreduce_kit.trace inside an MPI job: the clocks' offsets, and a traced run's one file.

On one node every rank reads the same clock, so each measured offset must come out within 20
us of zero; a clock the test sets ahead on some ranks must be found ahead by that much, within
50 us. A traced run of every collective, blocking and not, gives one file that passes the
schema check, with each call's bytes, op and communicator size, nonblocking calls on their own
thread track, and the offset a rank's clock was given taken out of its timestamps (every rank's
part of one allreduce overlaps every other's on the merged clock).
"""
import json
import os
import tempfile
import time

import numpy as np
import pytest
from mpi4py import MPI

from allreduce_kit import allgather, allreduce, broadcast, iallreduce, reduce_scatter
from allreduce_kit.trace import clock, recorder, session
from allreduce_kit.topology import Topology
from trace_schema import problems

pytestmark = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() == 1, reason="offsets need two ranks")

#: What the test adds to the clock of every odd rank: 5 ms ahead.
AHEAD_NS = 5_000_000


def _one_node(comm) -> bool:
    return len(set(comm.allgather(MPI.Get_processor_name()))) == 1


def _skewed(rank: int):
    extra = AHEAD_NS if rank % 2 else 0
    return lambda: time.perf_counter_ns() + extra


def test_offsets_on_one_node_are_zero_and_an_offset_given_to_a_clock_is_found(comm):
    rank = comm.Get_rank()
    one_node = _one_node(comm)
    same = clock.measure(comm, time.perf_counter_ns)
    ahead = clock.measure(comm, _skewed(rank))
    if rank != 0:
        assert same is None and ahead is None
        return
    expected = np.array([AHEAD_NS if r % 2 else 0 for r in range(comm.Get_size())])
    if one_node:
        assert np.all(np.abs(same.offset) < 20_000), f"offsets (ns) on one shared clock: {same.offset}"
    assert np.all(np.abs(ahead.offset - expected) < 50_000), f"offsets (ns) {ahead.offset}, given {expected}"
    assert np.all(ahead.spread >= 0)


def test_a_traced_run_writes_one_file_with_every_call_on_rank_0s_clock(comm):
    rank, p = comm.Get_rank(), comm.Get_size()
    folder = comm.bcast(tempfile.mkdtemp(prefix="trace-") if rank == 0 else None, root=0)
    path = os.path.join(folder, "t.json")
    buf = np.full(1000, rank + 1.0)
    session.start(path, comm=comm, clock_ns=_skewed(rank))
    try:
        assert recorder.ACTIVE[0] is recorder.CURRENT[0] is not None
        allreduce(buf, comm=comm)
        out = reduce_scatter(np.ones(p * 4), op="max", comm=comm)
        allgather(out, comm=comm)
        broadcast(buf, root=p - 1, comm=comm)
        handle = iallreduce(np.ones(8, dtype=np.int64), comm=comm)
        handle.wait()
        halves = allreduce(np.full(5, 0.1, np.float32), comm=comm, compression="fp16")  # a traced call keeps every argument
    finally:
        written = session.finish()
    assert np.array_equal(halves, allreduce(np.full(5, 0.1, np.float32), comm=comm, compression="fp16"))
    assert recorder.ACTIVE[0] is None and recorder.CURRENT[0] is None and not session.tracing()
    if rank != 0:
        assert written is None
        return
    with open(path) as f:
        document = json.load(f)
    os.remove(path)
    os.rmdir(folder)
    assert written == os.path.getsize(path) if os.path.exists(path) else written > 0
    assert problems(document) == []
    assert document["distributedInfo"]["world_size"] == p
    calls = [e for e in document["traceEvents"] if e["ph"] == "X" and e["cat"] == "collective"]
    for r in range(p):
        mine = [e for e in calls if e["pid"] == r]
        assert [e["name"] for e in mine if e["tid"] == 1] == ["allreduce", "reduce_scatter", "allgather",
                                                              "broadcast", "allreduce"], mine
        blocking = [e for e in mine if e["tid"] == 1]
        assert blocking[0]["args"] == {"algorithm": "auto", "bytes": 8000, "comm_size": p, "op": "sum"}
        assert blocking[1]["args"]["op"] == "max" and blocking[3]["args"]["root"] == p - 1
        (nonblocking,) = [e for e in mine if e["tid"] != 1]   # on the progress thread's own track
        assert nonblocking["name"] == "allreduce" and nonblocking["args"]["bytes"] == 64
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in document["traceEvents"] if e["name"] == "thread_name"}
    assert all("nonblocking" in name for (_, tid), name in threads.items() if tid != 1)
    clock_meta = document["otherData"]["clock"]
    found = np.array(clock_meta["offset_start_us"])
    assert np.all(np.abs(found - [AHEAD_NS / 1e3 if r % 2 else 0 for r in range(p)]) < 50), clock_meta
    # the odd ranks' 5 ms is gone: no rank leaves an allreduce, a reduce-scatter or an allgather
    # before every rank has entered it, so on one clock the calls of every rank overlap
    for k, name in enumerate(["allreduce", "reduce_scatter", "allgather", "broadcast", "allreduce"]):
        if name == "broadcast":                          # the root may leave before the others enter
            continue
        call = [[e for e in calls if e["pid"] == r and e["tid"] == 1][k] for r in range(p)]
        entered = max(e["ts"] for e in call)
        left = min(e["ts"] + e["dur"] for e in call)
        assert entered <= left + 50, (name, [(e["ts"], e["dur"]) for e in call])


def test_a_path_rank_0_cannot_write_is_refused_on_every_rank_before_tracing(comm):
    with pytest.raises(session.TraceError, match="does not exist"):
        session.start("/nonexistent-folder/t.json", comm=comm)
    with pytest.raises(session.TraceError, match="empty or inverted"):
        session.start("t.json", steps=(4, 4), comm=comm)
    assert recorder.ACTIVE[0] is None and not session.tracing()
