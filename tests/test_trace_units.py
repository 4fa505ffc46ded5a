"""allreduce_kit.trace without MPI: the window, the clock model, the file's form, the summary."""
import json

import numpy as np
import pytest

from allreduce_kit.trace import merge, recorder
from allreduce_kit.trace.__main__ import main as trace_main
from allreduce_kit.trace.clock import Alignment, Sample
from allreduce_kit.trace.session import TraceError, path_problem, steps_window
from allreduce_kit.trace.summary import summarise
from trace_schema import problems


# -- the window of steps ---------------------------------------------------------------------------
def test_a_window_is_steps_a_to_b_minus_1_and_an_open_end_runs_to_the_end():
    assert steps_window("10:20") == (10, 20)
    assert steps_window("0:1") == (0, 1)
    assert steps_window("5:") == (5, None)


@pytest.mark.parametrize("text, says", [("3:3", "empty"), ("5:2", "inverted"), ("x:3", "expected A:B"),
                                        ("7", "expected A:B"), ("-1:4", "expected A:B")])
def test_an_empty_inverted_or_malformed_window_is_refused(text, says):
    with pytest.raises(TraceError, match=says):
        steps_window(text)


def test_a_path_that_cannot_be_written_is_named(tmp_path):
    assert path_problem(str(tmp_path / "t.json")) is None
    assert "does not exist" in path_problem(str(tmp_path / "missing" / "t.json"))
    assert "is a directory" in path_problem(str(tmp_path))


def test_the_recorder_records_only_inside_the_window():
    rec = recorder.Recorder(window=(2, 4))
    try:
        seen = []
        for step in range(6):
            rec.begin(step)
            seen.append(recorder.ACTIVE[0] is rec)
            rec.step(step, 1.0 + step, 1.5 + step, (("forward_backward", 1.0 + step, 1.2 + step),))
        assert seen == [False, False, True, True, False, False]
        assert sorted({e[0] for e in rec.events}) == ["ProfilerStep#2", "ProfilerStep#3", "forward_backward"]
        assert len(rec.events) == 4
    finally:
        recorder.ACTIVE[0] = None


def test_a_recorded_collective_is_named_with_its_bytes_op_and_algorithm():
    rec = recorder.Recorder()
    buf = np.zeros(10, dtype=np.float64)
    calls = []

    def allreduce(buf, op="sum", algorithm="auto", comm=None, check=None, stall_timeout=None, compression="none"):
        calls.append(rec.records_here())                      # the call it wraps is not recorded again
        return buf

    assert rec.allreduce(allreduce, buf, "mean", "ring", None, None, None, "none") is buf
    assert calls == [False] and rec.records_here()
    # while the program runs, a call is a tuple of what it was given; converted at the end
    assert rec.events == [] and len(rec.calls) == 1
    (name, category, _, start, end, args), = rec.recorded()
    args = recorder.described(args)
    assert (name, category) == ("allreduce", "collective") and end >= start
    assert args == {"algorithm": "ring", "bytes": 80, "comm_size": rec.world_size, "op": "mean"}


def test_a_clock_offset_given_to_a_host_moves_every_reading_when_converted():
    from allreduce_kit import config
    assert config.read(config.TRACE_CLOCK_SKEW_US, {}) == {}
    assert config.read(config.TRACE_CLOCK_SKEW_US, {"ALLREDUCE_KIT_TRACE_CLOCK_SKEW_US": "node2:5000,node3:-1.5"}) \
        == {"node2": 5_000_000, "node3": -1_500}
    with pytest.raises(ValueError, match="ALLREDUCE_KIT_TRACE_CLOCK_SKEW_US='node2'"):
        config.read(config.TRACE_CLOCK_SKEW_US, {"ALLREDUCE_KIT_TRACE_CLOCK_SKEW_US": "node2"})
    rec = recorder.Recorder()
    rec.skew_ns = 5_000_000
    rec.span("forward_backward", "compute", 100, 200)
    rec.allreduce(lambda buf, **kwargs: buf, np.zeros(1), "sum", "auto", None, None, None, "none")
    (span, call) = rec.recorded()
    assert span[3:5] == (5_000_100, 5_000_200)
    assert call[3] == rec.calls[0][2] + 5_000_000 and call[4] == rec.calls[0][3] + 5_000_000


# -- the clock model -------------------------------------------------------------------------------
def _alignment(offsets_start, offsets_end, at_start, at_end, spread=(0, 2000)):
    p = len(offsets_start)
    return Alignment(Sample(np.array(at_start, dtype=np.int64), np.array(offsets_start, float), np.array(spread[:p])),
                     Sample(np.array(at_end, dtype=np.int64), np.array(offsets_end, float), np.array(spread[:p])))


def test_drift_between_the_two_measurements_is_corrected_linearly():
    # rank 1's clock reads 1 ms ahead at its 1e9 ns and 1.1 ms ahead at its 2e9 ns: 100 ppm fast
    a = _alignment([0, 1e6], [0, 1.1e6], [0, 1_000_000_000], [0, 2_000_000_000])
    assert a.to_reference(1, np.array([1_000_000_000]))[0] == pytest.approx(999_000_000)
    assert a.to_reference(1, np.array([1_500_000_000]))[0] == pytest.approx(1_500_000_000 - 1.05e6)
    assert a.drift_ppm()[1] == pytest.approx(100.0)
    assert a.uncertainty_us() == [0.0, 1.0]


# -- the file ----------------------------------------------------------------------------------------
def _document(straggler=2, steps=10, p=3, offset_ns=0):
    """A synthetic run: each step, compute (straggler's 30 ms longer), then one allreduce that
    every rank leaves at the same instant (rank 0's clock); rank 1's clock ``offset_ns`` ahead."""
    per_rank = []
    for rank in range(p):
        events, t = [], 0
        skew = offset_ns if rank == 1 else 0
        for n in range(steps):
            compute = 10_000_000 + (30_000_000 if rank == straggler else 0)
            done = t + 40_000_000 + 1_000_000                 # everyone leaves 1 ms after the straggler arrives
            events.append((f"ProfilerStep#{n}", "user_annotation", 7, t + skew, done + skew, {"step": n}))
            events.append(("forward_backward", "compute", 7, t + skew, t + compute + skew, None))
            events.append(("allreduce", "collective", 7, t + compute + skew, done + skew, {"bytes": 8}))
            t = done
        per_rank.append((f"host{rank}", events, {7: "MainThread"}, 7))
    alignment = _alignment([0] * p, [0] * p, [0] * p, [0] * p, spread=[0] * p)
    if offset_ns:
        offsets = [0.0, float(offset_ns)] + [0.0] * (p - 2)
        alignment = _alignment(offsets, offsets, [0] * p, [0] * p, spread=[0] * p)
    return merge.trace_document(per_rank, alignment, (0, None), 0.0)


def test_the_merged_file_passes_the_schema_check_and_names_each_rank_with_its_host():
    document = _document()
    assert problems(document) == []
    names = {e["pid"]: e["args"]["name"] for e in document["traceEvents"] if e["name"] == "process_name"}
    assert names == {0: "rank 0 (host0)", 1: "rank 1 (host1)", 2: "rank 2 (host2)"}
    assert document["distributedInfo"]["world_size"] == 3
    assert json.loads(json.dumps(document)) == document


def test_the_schema_check_catches_overlap_on_one_thread_and_a_missing_dur():
    document = _document()
    x = [e for e in document["traceEvents"] if e["ph"] == "X" and e["pid"] == 0]
    x[1]["dur"] += 50_000                            # forward_backward now runs past its step's end
    assert any("without nesting" in p for p in problems(document))
    del x[2]["dur"]
    assert any("dur" in p for p in problems(document))


def test_a_rank_whose_clock_is_ahead_is_moved_onto_rank_0s():
    document = _document(offset_ns=5_000_000)
    ends = {e["pid"]: e["ts"] + e["dur"] for e in document["traceEvents"]
            if e["ph"] == "X" and e["name"] == "allreduce"}
    assert max(ends.values()) - min(ends.values()) < 1e-3


def test_the_summary_names_the_straggler_and_attributes_the_waits_to_it(tmp_path, capsys):
    summary = summarise(_document(straggler=2))
    rows = summary["ranks"]
    assert [r["slowest_steps"] for r in rows] == [0, 0, 10]
    assert rows[0]["waiting_ms"] == pytest.approx(300.0) and rows[2]["waiting_ms"] == pytest.approx(0.0)
    assert rows[2]["others_waited_ms"] == pytest.approx(600.0)
    assert rows[0]["compute_ms"] == pytest.approx(100.0) and rows[2]["compute_ms"] == pytest.approx(400.0)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_document(straggler=1)))
    assert trace_main(["summary", str(path)]) == 0
    assert "slowest rank: rank 1 (host1), in 10 of 10 steps (100%)" in capsys.readouterr().out


def test_summary_of_a_file_that_is_not_a_trace_exits_2_with_one_message(tmp_path, capsys):
    path = tmp_path / "t.json"
    path.write_text("[]")
    with pytest.raises(SystemExit) as exited:
        trace_main(["summary", str(path)])
    assert exited.value.code == 2
    assert capsys.readouterr().err.count("is not a trace file") == 1


def test_a_rank_that_records_many_events_warns_once_naming_the_window(monkeypatch, capsys):
    monkeypatch.setattr(recorder, "WARN_EVENTS", 5)
    rec = recorder.Recorder()
    try:
        for step in range(8):
            rec.begin(step)
            rec.step(step, 1.0, 2.0, (("forward_backward", 1.0, 1.5),))
    finally:
        recorder.ACTIVE[0] = None
    err = capsys.readouterr().err
    assert err.count("allreduce_kit.trace: this rank has recorded") == 1 and "--trace-steps A:B" in err


# -- one file per rank (trace split) -----------------------------------------------------------------
def test_split_writes_one_file_per_rank_that_passes_the_schema_check_and_names_its_rank(tmp_path, capsys):
    import re
    from allreduce_kit.trace.split import CORRELATION_BASE, STREAM
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_document(p=3)))
    assert trace_main(["split", str(path), str(tmp_path / "ranks")]) == 0
    assert "wrote 3 files" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "ranks").iterdir()) == ["rank-0.json", "rank-1.json", "rank-2.json"]
    for rank in range(3):
        text = (tmp_path / "ranks" / f"rank-{rank}.json").read_text()
        # readers find a file's rank by the first '"rank": N' in it (a space after the colon)
        assert int(re.search(r'"rank":\s+(\d+)', text).group(1)) == rank
        document = json.loads(text)
        assert problems(document) == []
        assert document["distributedInfo"] == {"backend": "allreduce_kit", "rank": rank, "world_size": 3,
                                               "host": f"host{rank}"}
        host = [e for e in document["traceEvents"] if e["ph"] == "X" and e["pid"] == rank]
        kernels = [e for e in document["traceEvents"] if e["ph"] == "X" and e.get("cat") == "kernel"]
        assert {e["cat"] for e in host} == {"user_annotation", "cpu_op"}
        assert {e["args"]["category"] for e in host} == {"user_annotation", "compute", "collective"}
        # one kernel per compute and collective event, at its times, linked to it by correlation
        launched = {e["args"]["correlation"]: e for e in host if "correlation" in e["args"]}
        assert len(kernels) == len(launched) == 20 and min(launched) >= CORRELATION_BASE
        for k in kernels:
            e = launched[k["args"]["correlation"]]
            assert (k["ts"], k["dur"], k["tid"], k["args"]["stream"]) == (e["ts"], e["dur"], STREAM, STREAM)
            assert k["name"] == {"compute": e["name"], "collective": f"ncclKernel_{e['name']}"}[e["args"]["category"]]
            assert k["pid"] == 3 + rank


def test_split_puts_a_threads_calls_on_its_own_stream():
    from allreduce_kit.trace.split import STREAM, rank_documents
    events = [("ProfilerStep#0", "user_annotation", 7, 0, 10_000, {"step": 0}),
              ("allreduce", "collective", 7, 1_000, 5_000, {"bytes": 8}),
              ("allreduce", "collective", 9, 2_000, 8_000, {"bytes": 8})]       # the progress thread
    alignment = _alignment([0], [0], [0], [0], spread=[0])
    document = merge.trace_document([("h", events, {7: "MainThread", 9: "progress"}, 7)], alignment, (0, None), 0.0)
    (only,) = rank_documents(document).values()
    assert problems(only) == []
    kernels = sorted((e["ts"], e["args"]["stream"]) for e in only["traceEvents"] if e.get("cat") == "kernel")
    assert kernels == [(1.0, STREAM), (2.0, STREAM + 1)]


def test_split_into_a_path_that_is_a_file_exits_2_with_one_message(tmp_path, capsys):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_document()))
    with pytest.raises(SystemExit) as exited:
        trace_main(["split", str(path), str(path / "below")])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("argument OUTDIR") == 1 and "Traceback" not in err
