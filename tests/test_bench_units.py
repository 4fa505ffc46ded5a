"""The bench's pieces that need no MPI job: sizes, crossover points, the cost-model fit, timing.

(Tuning files and ``auto``'s choice from them: ``test_selection.py``.)
"""
import pytest

from allreduce_kit.bench import fit
from allreduce_kit.bench.__main__ import message_sizes, parse_bytes
from allreduce_kit.bench.sweep import Row
from allreduce_kit.bench.tune import crossovers


def row(size, algorithm, time_us, p=4):
    return Row(size, size // 4, "float32", "sum", algorithm, algorithm, p, time_us, time_us, time_us, 0, 0, 0, 1, 1)


def test_sizes_parse_with_binary_suffixes_and_step_by_the_factor():
    assert parse_bytes("4") == 4 and parse_bytes("64K") == 65536 and parse_bytes("16MiB") == 16 << 20
    assert parse_bytes("1g") == 1 << 30
    for bad in ("0", "-4", "4X", ""):
        with pytest.raises(ValueError):
            parse_bytes(bad)
    assert message_sizes(4, 64, 2, 4) == [4, 8, 16, 32, 64]
    assert message_sizes(1, 16, 4, 8) == [8, 16], "rounded to whole elements, at least one"


def test_crossovers_cut_sizes_into_few_runs_and_ignore_a_noisy_row():
    times = {  # size: (recursive_doubling, ring, tree)
        8: (10, 30, 20), 64: (11, 31, 22), 512: (14, 35, 9),  # tree wins one row by noise
        4096: (30, 32, 60), 32768: (90, 40, 120), 1 << 20: (900, 300, 1500), 1 << 22: (4000, 1000, 6000)}
    rows = [row(s, a, t) for s, ts in times.items() for a, t in zip(("recursive_doubling", "ring", "tree"), ts)]
    rows.append(row(8, "auto", 1))  # auto's own rows are not candidates
    assert crossovers(rows, min_run=2) == [(0, "recursive_doubling"), (32768, "ring")]
    assert crossovers(rows, max_rules=1) == [(0, "ring")]
    assert crossovers(rows, min_run=1, max_rules=5) == [(0, "recursive_doubling"), (512, "tree"),
                                                        (4096, "recursive_doubling"), (32768, "ring")]


def test_crossovers_hand_sizes_where_mpi_is_fastest_to_mpi():
    times = {8: (10, 30, 4), 64: (11, 31, 5), 512: (14, 35, 20), 4096: (30, 32, 60), 1 << 20: (900, 300, 500)}
    rows = [row(s, a, t) for s, ts in times.items() for a, t in zip(("recursive_doubling", "ring", "mpi"), ts)]
    assert crossovers(rows, min_run=1) == [(0, "mpi"), (512, "recursive_doubling"), (1 << 20, "ring")]


def test_fit_recovers_the_parameters_that_made_the_times():
    truth = {"alpha": 3e-6, "beta": 2e-10, "gamma": 5e-10}
    points = [(a, p, n, fit.predict(truth, a, p, n)) for a in fit.MODELLED for p in (2, 3, 4, 8)
              for n in (8, 1024, 1 << 16, 1 << 22)]
    got = fit.fit(points)
    for key in truth:
        assert got[key] == pytest.approx(truth[key], rel=1e-6)
    assert got["max_abs_rel_error"] < 1e-6


def test_cost_model_matches_the_textbook_at_a_power_of_two():
    n, p = 1000.0, 8
    assert fit.coefficients("ring", p, n) == (14, 2 * 7 / 8 * n, 7 / 8 * n)
    assert fit.coefficients("rabenseifner", p, n) == (6, 2 * 7 / 8 * n, 7 / 8 * n)
    assert fit.coefficients("recursive_doubling", p, n) == (3, 3 * n, 3 * n)
    assert fit.coefficients("tree", p, n) == (6, 6 * n, 3 * n)
    assert fit.coefficients("recursive_doubling", 5, n) == (2 + 2, 2 * n + 2 * n, 2 * n + n), "5 ranks fold to 4"


def test_a_sample_is_restore_barrier_timed_calls_barrier():
    """Nothing of the bench's own runs while any rank may still be in a timed call: each sample
    restores the input, waits for every rank, makes its calls, and waits for every rank again
    before the next restore (where ranks share cores, a restore would take a core from them)."""
    from allreduce_kit.bench.timing import time_calls

    events = []

    class OneRank:
        def Barrier(self):
            events.append("barrier")

        def Allreduce(self, sendbuf, recvbuf, op=None):
            pass

    calls = {"a": lambda: events.append("a"), "b": lambda: events.append("b")}
    times, batches = time_calls(calls, lambda: events.append("restore"), OneRank(), samples=3, warmup=2, batch=2)
    assert batches == {"a": 2, "b": 2} and all(t.shape == (3,) and (t >= 0).all() for t in times.values())
    warm_up, timed = events[:6], events[6:]
    assert warm_up == ["restore", "a", "a", "restore", "b", "b"], "untimed; no barrier needed"
    samples = [timed[i:i + 5] for i in range(0, len(timed), 5)]
    assert len(samples) == 3 * 2
    for sample in samples:
        assert sample in (["restore", "barrier", "a", "a", "barrier"], ["restore", "barrier", "b", "b", "barrier"])


def test_the_batch_follows_the_quickest_warm_up_call():
    """A one-off cost in one warm-up call (a first use, a rank that arrives late) does not shrink
    the batch: it is set by the quickest warm-up call of the fastest algorithm."""
    import time

    from allreduce_kit.bench.timing import MAX_BATCH, time_calls

    class OneRank:
        def Barrier(self):
            pass

        def Allreduce(self, sendbuf, recvbuf, op=None):
            pass

    first = [True]

    def slow_once():
        if first[0]:
            first[0] = False
            time.sleep(0.02)

    _, batches = time_calls({"a": slow_once}, lambda: None, OneRank(), samples=1, warmup=2)
    assert batches == {"a": MAX_BATCH}


def test_a_result_reduced_again_is_predicted_only_where_exact_and_an_error_would_carry():
    """``again``: what the next call makes of a result every rank holds, where any order of
    folding gives it bitwise and a wrong value on one rank would change it; ``None`` otherwise,
    so that the input is restored first."""
    import numpy as np

    from allreduce_kit.bench.sweep import again, results_in_a_row

    r = np.array([-3, 0, 5], np.float32)
    assert np.array_equal(again(r, "sum", 3), r * 3) and again(r, "sum", 3).dtype == np.float32
    assert np.array_equal(again(np.array([-1, 1], np.int32), "prod", 5), [-1, 1])
    assert again(r, "mean", 2) is None, "a mean divides: it may round"
    assert again(r, "max", 2) is None and again(r, "min", 2) is None, "a wrong value may be folded away"
    assert again(np.array([2.0 ** 23], np.float32), "sum", 2) is not None
    assert again(np.array([2.0 ** 23], np.float32), "sum", 3) is None, "past float32's exact integers"
    assert again(np.array([2 ** 30], np.int32), "sum", 2) is None, "past int32"
    assert again(np.array([2.0 ** 30], np.float64), "sum", 8) is not None
    big = np.array([32.0], np.float32)
    assert len(results_in_a_row(big, "sum", 8, 64)) == 7, "32 * 8**6 = 2**23; once more is past 2**24"
    assert len(results_in_a_row(r, "max", 8, 64)) == 1 and len(results_in_a_row(r, "sum", 2, 5)) == 5


def test_exploring_calls_run_as_the_samples_do_and_each_is_checked(monkeypatch):
    """auto's exploring calls come in runs as long as a timed sample's, each run on a restored
    input and between two barriers with nothing else in them; a call that is wrong mid-run is
    found in the run's last result, checked after it."""
    import numpy as np

    from allreduce_kit import online
    from allreduce_kit.bench import sweep

    events = []

    class TwoRanks:  # as if the other rank held the same input
        def Get_size(self):
            return 2

        def Barrier(self):
            events.append("barrier")

        def allreduce(self, value, op=None):
            return value

    left = [23]
    monkeypatch.setattr(online, "exploring", lambda lib, size: left[0] > 0)
    x = np.array([1, -2, 3], np.float32)
    buf = np.empty_like(x)

    def call():
        left[0] -= 1
        events.append("call")
        buf[:] = buf * (3 if left[0] == 10 else 2)  # the 13th call is wrong

    def restore():
        events.append("restore")
        np.copyto(buf, x)

    calls, wrong = sweep.explore(TwoRanks(), None, 12, call, buf, restore, 2 * x, "sum", batch=5)
    assert calls == 23 and wrong == 3, "the 13th call's three elements, found once, at the end of its run"
    runs = "".join({"restore": "r", "barrier": "b", "call": "c"}[e] for e in events).split("r")[1:]
    assert runs == ["bcccccb"] * 4 + ["bcccb"], runs
    for op in ("mean", "max"):
        left[0], events[:] = 4, []
        calls, wrong = sweep.explore(TwoRanks(), None, 12, call, buf, restore, 2 * x, op, batch=5)
        assert calls == 4 and events == ["restore", "barrier", "call", "barrier"] * 4, op


@pytest.mark.parametrize("extra, named", [
    (["-d", "float64"], "-d/--datatype float64"), (["-o", "prod"], "-o/--op prod"),
    (["--collective", "allgather"], "--collective allgather"), (["--tune"], "--tune"),
])
def test_bench_compression_refuses_what_it_cannot_compress(extra, named, capsys):
    from allreduce_kit.bench.__main__ import build_parser, check_args
    parser = build_parser()
    args = parser.parse_args(["--compression", "fp16", *extra])
    with pytest.raises(SystemExit) as exited:
        check_args(parser, args)
    assert exited.value.code == 2
    assert f"--compression fp16 cannot go with {named}" in capsys.readouterr().err


def test_bench_compression_runs_only_the_algorithms_that_compress():
    from allreduce_kit.bench.__main__ import build_parser, check_args
    from allreduce_kit.compression import COMPRESSED
    parser = build_parser()
    args = parser.parse_args(["--compression", "bf16"])
    check_args(parser, args)
    assert sorted(args.names) == sorted([*COMPRESSED, "auto", "mpi"])
