"""``algorithm="auto"`` is collective: rank 0 reads the table once per communicator and
broadcasts it, so every rank makes the same choice, or raises the same error, whatever the other
ranks' own settings and files say. (The rules of choosing: ``tests/test_selection.py``.)
"""
import json
import os

import numpy as np
import pytest
from mpi4py import MPI

from allreduce_kit import (ALGORITHMS, allgather, allreduce, broadcast, config, library_comm, online,
                           reduce_scatter, selection)
from conftest import assert_quiet

#: Message sizes (bytes) on which the ranks' own files below disagree.
SIZES = (4, 1500, 5000, 1 << 20)


def shared_dir(comm, tmp_path_factory) -> str:
    """A directory every rank can see, made by rank 0."""
    return comm.bcast(str(tmp_path_factory.mktemp("tuning")) if comm.Get_rank() == 0 else None, root=0)


def each_rank_points_at_its_own_file(comm, tmp_path_factory, monkeypatch) -> dict:
    """Rank r's $ALLREDUCE_KIT_TUNING names a file whose rules for this rank count differ from
    every other rank's (by switching algorithm at 2**(10 + 2r) bytes); returns rank 0's table."""
    p, rank = comm.Get_size(), comm.Get_rank()
    path = os.path.join(shared_dir(comm, tmp_path_factory), f"rank{rank}.json")
    rules = [[0, "naive"], [1 << (10 + 2 * rank), "tree"], [1 << (11 + 2 * rank), "recursive_doubling"]]
    with open(path, "w") as out:
        json.dump({"rules": {str(p): rules}}, out)
    monkeypatch.setenv(selection.ENV, path)
    return comm.bcast({"path": path, "rules": rules}, root=0)


@pytest.mark.mpi(min_size=2)
def test_every_rank_follows_rank_zeros_table(comm, tmp_path_factory, monkeypatch):
    zero = each_rank_points_at_its_own_file(comm, tmp_path_factory, monkeypatch)
    table = {comm.Get_size(): tuple(map(tuple, zero["rules"]))}
    lib = library_comm(comm)
    choices = [selection.choose_for(lib, n) for n in SIZES]
    assert choices == [selection.choose(n, comm.Get_size(), table) for n in SIZES], "not rank 0's table"
    assert len({tuple(c) for c in comm.allgather(choices)}) == 1, "ranks chose differently"
    assert selection.source_for(lib) == zero["path"]
    p, rank = comm.Get_size(), comm.Get_rank()
    for n in SIZES:
        x = np.full(n // 8, rank + 1, dtype=np.float64)
        allreduce(x, algorithm="auto", comm=comm)
        assert np.all(x == p * (p + 1) / 2)
    assert_quiet(comm)


@pytest.mark.mpi(min_size=2)
def test_only_rank_zero_reads_the_file(comm, tmp_path_factory, monkeypatch):
    """Rank 0 names a good file; every other rank a missing one, which it would fail to read."""
    directory = shared_dir(comm, tmp_path_factory)
    good = os.path.join(directory, "good.json")
    if comm.Get_rank() == 0:
        with open(good, "w") as out:
            json.dump({"rules": {str(comm.Get_size()): [[0, "tree"]]}}, out)
    comm.Barrier()
    monkeypatch.setenv(selection.ENV, good if comm.Get_rank() == 0 else os.path.join(directory, "missing.json"))
    x = np.ones(10)
    allreduce(x, algorithm="auto", comm=comm)
    assert np.all(x == comm.Get_size())
    assert selection.choose_for(library_comm(comm), 80) == "tree"
    assert_quiet(comm)


BROKEN = {
    "not JSON": ("{not json", "not JSON"),
    "bad rule": (json.dumps({"rules": {"2": [[0, "butterfly"]]}}), "bad rule [0, 'butterfly'] for 2 ranks"),
    "missing": (None, "No such file or directory"),
}


#: each collective's first ``auto`` call, on a fresh communicator (the name its errors give)
FIRST_AUTO_CALL = {
    "allreduce": lambda comm: allreduce(np.ones(4), algorithm="auto", comm=comm),
    "reduce_scatter": lambda comm: reduce_scatter(np.ones(4 * comm.Get_size()), comm=comm),
    "allgather": lambda comm: allgather(np.ones(2), comm=comm),
    "broadcast": lambda comm: broadcast(np.ones(4), comm=comm),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("fault, collective", [(f, "allreduce") for f in sorted(BROKEN)]
                         + [(sorted(BROKEN)[0], c) for c in ("reduce_scatter", "allgather", "broadcast")])
def test_a_broken_table_on_rank_zero_raises_on_every_rank(comm, tmp_path_factory, monkeypatch, fault, collective):
    """Only rank 0 reads the file, yet every rank raises the same error naming it and the
    collective whose ``auto`` call read it, and nothing is left in flight; the other ranks' own
    setting ('builtin') would have worked."""
    text, words = BROKEN[fault]
    path = os.path.join(shared_dir(comm, tmp_path_factory), "tuning.json")
    if comm.Get_rank() == 0 and text is not None:
        with open(path, "w") as out:
            out.write(text)
    comm.Barrier()
    monkeypatch.setenv(selection.ENV, path if comm.Get_rank() == 0 else "builtin")
    with pytest.raises(ValueError) as raised:
        FIRST_AUTO_CALL[collective](comm)
    message = str(raised.value)
    assert message.startswith(f"{collective}(algorithm='auto'): tuning file " + path), message
    assert words in message, message
    assert len(set(comm.allgather(message))) == 1, "ranks raised different errors"
    assert_quiet(comm)


@pytest.mark.mpi
def test_the_table_is_read_once_per_communicator(comm, tmp_path_factory, monkeypatch):
    """Changing the file after the first ``auto`` call changes nothing on that communicator;
    a new communicator reads it again."""
    if comm.Get_size() == 1:
        pytest.skip("auto is never consulted on one rank, and a tuning file holds no rules for it")
    path = os.path.join(shared_dir(comm, tmp_path_factory), "tuning.json")
    p = comm.Get_size()

    def write(name):
        if comm.Get_rank() == 0:
            with open(path, "w") as out:
                json.dump({"rules": {str(p): [[0, name]]}}, out)
        comm.Barrier()

    monkeypatch.setenv(selection.ENV, path)
    write("tree")
    assert selection.choose_for(library_comm(comm), 64) == "tree"
    write("naive")
    assert selection.choose_for(library_comm(comm), 64) == "tree"
    assert selection.choose_for(library_comm(comm), 128) == "tree", "an unseen size, the same table"
    fresh = comm.Dup()
    try:
        assert selection.choose_for(library_comm(fresh), 64) == "naive"
    finally:
        fresh.Free()


# -- online tuning -----------------------------------------------------------------------------
#: Sizes (bytes) in classes with different candidate lists and turn lengths.
ONLINE_SIZES = (8, 1000, 96 << 10, (1 << 20) + 4)
#: Sizes explored in full: the longest turns (8 calls, 2 candidates) and the most candidates
#: of the lists below 1 MiB (3 calls, 3); small, so that 8 ranks on 2 cores stay quick.
EXPLORED_SIZES = (8, 96 << 10)


def record_runs(monkeypatch) -> list:
    """Every registered algorithm, wrapped to append its name to the list returned when it runs."""
    ran = []

    def wrapped(name, fn):
        def run(lib, buf, op):
            ran.append(name)
            fn(lib, buf, op)
        return run

    for name, fn in list(ALGORITHMS.items()):
        monkeypatch.setitem(ALGORITHMS, name, wrapped(name, fn))
    return ran


@pytest.fixture
def online_on(monkeypatch):
    """Online tuning on and the built-in table, whatever the environment says."""
    monkeypatch.setenv(config.ONLINE_TUNING.name, "on")
    monkeypatch.setenv(selection.ENV, "builtin")


def integer_input(n: int, rank: int, seed: int) -> np.ndarray:
    """Small integers as float32: every algorithm's order of summing gives the exact sum."""
    return np.random.default_rng([n, rank, seed]).integers(-8, 9, n // 4).astype(np.float32)


@pytest.mark.mpi(min_size=2)
def test_online_tuning_explores_a_bounded_schedule_the_same_on_every_rank(comm, online_on, monkeypatch):
    """Every call's result is the exact sum; every rank runs the same algorithm on the same call; the
    exploration takes ``exploration_calls`` calls, or whole sets of more rounds when those were too
    quick to trust, never more than ``MAX_EXTENSIONS`` sets, each candidate its share; then every
    rank runs the one winner, the fastest by the agreed figures."""
    lib = library_comm(comm)
    ran = record_runs(monkeypatch)
    p = comm.Get_size()
    for nbytes in EXPLORED_SIZES:
        prior = selection.choose_for(lib, nbytes)
        direct = online.tuner_for(lib).direct
        candidates, block = online.candidates_for(nbytes, prior, direct)
        budget = online.exploration_calls(nbytes, prior, direct=direct)
        assert budget == len(candidates) * (online.ROUNDS + 1) * block
        most = online.exploration_calls(nbytes, prior, online.MAX_EXTENSIONS, direct)
        del ran[:]
        calls = 0
        while calls == 0 or online.exploring(lib, nbytes):
            x = integer_input(nbytes, comm.Get_rank(), calls)
            expected = sum(integer_input(nbytes, r, calls) for r in range(p))  # every rank's input, summed here
            allreduce(x, algorithm="auto", comm=comm)
            assert np.array_equal(x, expected), f"call {calls} at {nbytes} B ({ran[-1]}) is not the sum"
            calls += 1
            assert calls <= most, f"still exploring after {calls} calls at {nbytes} B"
        extra_set = len(candidates) * online.ROUNDS * block
        assert calls >= budget and (calls - budget) % extra_set == 0, (nbytes, calls, budget)
        assert sorted(set(ran)) == sorted(candidates) and all(ran.count(c) == calls // len(candidates)
                                                            for c in candidates), ran
        report = online.report(lib, nbytes)
        assert report["exploration_calls"] == calls
        winner = report["algorithm"]
        times = report["times_us"]
        fastest = min(times, key=times.get)
        assert winner == (prior if times[prior] <= times[fastest] * (1 + online.PRIOR_MARGIN) else fastest), times
        assert selection.choose_for(lib, nbytes) == winner
        for _ in range(3):
            allreduce(np.ones(nbytes // 4, np.float32), algorithm="auto", comm=comm)
        assert ran[calls:] == [winner] * 3
        everyone = comm.allgather((ran, report))
        assert all(other == (ran, report) for other in everyone), "ranks ran different algorithms or agreed on different figures"
    assert_quiet(comm)


@pytest.mark.mpi(min_size=2)
def test_online_tuning_explores_again_when_the_winner_drifts(comm, online_on, monkeypatch):
    """A settled class checks its winner's time after one window; a time far from what exploration
    measured (here: a measured time made tiny on every rank) sends it back to exploring, on every rank."""
    lib = library_comm(comm)
    nbytes = 64
    while online.exploring(lib, nbytes):
        allreduce(np.ones(nbytes // 4, np.float32), comm=comm)
    tuner = lib.state[online.Tuner]
    size_class = tuner.class_for(nbytes)
    size_class.reference, size_class.quiet = 1e-12, 0  # the window and check come next
    for _ in range(online.ROUNDS * size_class.block):
        assert not online.exploring(lib, nbytes)
        allreduce(np.ones(nbytes // 4, np.float32), comm=comm)
    assert online.exploring(lib, nbytes)
    assert all(comm.allgather(online.exploring(lib, nbytes)))
    assert_quiet(comm)


@pytest.mark.mpi(min_size=2)
def test_online_tuning_off_leaves_auto_to_its_table_rank_zero_deciding(comm, monkeypatch):
    """Rank 0 turns it off; the others' 'on' does not count: every call runs the table's choice."""
    monkeypatch.setenv(selection.ENV, "builtin")
    monkeypatch.setenv(config.ONLINE_TUNING.name, "0" if comm.Get_rank() == 0 else "on")
    lib = library_comm(comm)
    ran = record_runs(monkeypatch)
    for nbytes in ONLINE_SIZES:
        for _ in range(3):
            allreduce(np.ones(nbytes // 4, np.float32), comm=comm)
        assert not online.exploring(lib, nbytes)
        assert ran[-3:] == [selection.choose(nbytes, comm.Get_size())] * 3
    assert lib.state[online.Tuner] is None and online.report(lib, 8) is None
    assert_quiet(comm)


@pytest.mark.mpi(min_size=2)
def test_a_saved_online_result_is_read_back_by_the_next_communicator(comm, tmp_path_factory, monkeypatch):
    """``save``: rank 0 writes the agreed result into the tuning file, its other contents kept; a
    new communicator starts with the class settled on it, running the saved winner from its first call."""
    path = os.path.join(shared_dir(comm, tmp_path_factory), "tuning.json")
    p = comm.Get_size()
    if comm.Get_rank() == 0:
        with open(path, "w") as out:
            json.dump({"rules": {str(p + 1): [[0, "tree"]]}}, out)
    comm.Barrier()
    monkeypatch.setenv(selection.ENV, path)
    monkeypatch.setenv(config.ONLINE_TUNING.name, "save")
    lib = library_comm(comm)
    nbytes = 3000
    while online.exploring(lib, nbytes):
        allreduce(np.ones(nbytes // 4, np.float32), comm=comm)
    report = online.report(lib, nbytes)
    comm.Barrier()
    saved = json.load(open(path))
    assert saved["rules"] == {str(p + 1): [[0, "tree"]]}, "the file's rules were not kept"
    entry = saved["online"][f"{p}/{lib.layout.nodes}"]["2048"]
    assert entry["algorithm"] == report["algorithm"] and entry["sizes"] == [2048, 4095] and entry["ranks"] == p
    assert set(entry["times_us"]) == set(report["times_us"])

    fresh = comm.Dup()
    try:
        ran = record_runs(monkeypatch)
        assert not online.exploring(library_comm(fresh), 2500), "the saved class explored again"
        allreduce(np.ones(2500 // 4, np.float32), comm=fresh)
        assert ran == [entry["algorithm"]]
        assert online.exploring(library_comm(fresh), 100), "a class not saved explores"
    finally:
        fresh.Free()
    assert_quiet(comm)


# -- online tuning of reduce_scatter, allgather and broadcast -----------------------------------
def _collective_call(name: str, comm, nbytes: int, seed: int, arrays=None):
    """(call, arrays, expected): collective ``name`` on ``nbytes`` of float32 small integers
    (input ``seed``), the arrays it takes (input, output) and the result it must leave in the
    output; ``arrays`` given: reused, on ``COMM_WORLD`` with ``comm`` not given (so that the
    call repeated on the same arrays takes the short path)."""
    from allreduce_kit import allgather, broadcast, reduce_scatter, shard_bounds
    p, rank, n = comm.Get_size(), comm.Get_rank(), max(1, nbytes // 4)
    inputs = [integer_input(4 * n, r, seed) for r in range(p)]
    bounds = shard_bounds(n, p)
    lo, hi = bounds[rank], bounds[rank + 1]
    where = None if arrays is not None else comm
    if name == "reduce_scatter":
        buf, out = arrays or (np.empty(n, np.float32), np.empty(hi - lo, np.float32))
        buf[:] = inputs[rank]
        return lambda: reduce_scatter(buf, out, comm=where), (buf, out), sum(inputs)[lo:hi]
    if name == "allgather":
        block, out = arrays or (np.empty(hi - lo, np.float32), np.empty(n, np.float32))
        block[:] = inputs[rank][lo:hi]
        whole = np.concatenate([inputs[r][bounds[r]:bounds[r + 1]] for r in range(p)])
        return lambda: allgather(block, out, comm=where), (block, out), whole
    buf = arrays[0] if arrays else np.empty(n, np.float32)
    buf[:] = inputs[rank]
    return lambda: broadcast(buf, root=0, comm=where), (buf, buf), inputs[0]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", ["reduce_scatter", "allgather", "broadcast"])
def test_reduce_scatter_allgather_and_broadcast_auto_tune_online_as_allreduce_does(comm, online_on, monkeypatch, name):
    """``auto`` times its collective's candidates on the first calls of a size class, the same on
    every rank, every call's result right; then every rank runs the agreed winner, also on the
    short path of a call repeated on the same arrays."""
    lib = library_comm(comm)
    spec = online.spec_of(name)
    ran = []
    for algorithm, fn in list(spec.algorithms.items()):
        def run(*args, algorithm=algorithm, fn=fn):
            ran.append(algorithm)
            fn(*args)
        monkeypatch.setitem(spec.algorithms, algorithm, run)
    for nbytes in EXPLORED_SIZES:
        prior = spec.table(lib, nbytes)
        tuner = online.tuner_for(lib, spec)
        candidates, _ = online.candidates_for(nbytes, prior, tuner.direct, spec=spec)
        assert len(candidates) >= 2 and candidates[0] == prior
        del ran[:]
        calls = 0
        while calls == 0 or online.exploring(lib, nbytes, spec):
            call, arrays, expected = _collective_call(name, comm, nbytes, calls)
            call()
            assert np.array_equal(arrays[1], expected), f"call {calls} at {nbytes} B ({ran[-1]}) is wrong"
            calls += 1
            assert calls <= online.exploration_calls(nbytes, prior, online.MAX_EXTENSIONS, tuner.direct, spec)
        assert sorted(set(ran)) == sorted(candidates), ran
        report = online.report(lib, nbytes, spec)
        assert report["exploration_calls"] == calls and report["algorithm"] in candidates
        call, arrays, expected = _collective_call(name, comm, nbytes, calls)
        call()
        assert ran[-1] == report["algorithm"] and np.array_equal(arrays[1], expected)
        everyone = comm.allgather((ran, report))
        assert all(other == (ran, report) for other in everyone), "ranks ran different algorithms or agreed on different figures"
    assert_quiet(comm)
    if comm.Get_size() == MPI.COMM_WORLD.Get_size():
        # the same arrays again and again on COMM_WORLD (the short path), exploring or settled
        world = MPI.COMM_WORLD
        _, held, _ = _collective_call(name, world, 96 << 10, 0)
        for seed in range(60):
            call, arrays, expected = _collective_call(name, world, 96 << 10, seed, held)
            call()
            assert np.array_equal(arrays[1], expected), f"repeated call {seed} ({ran[-1]}) is wrong"
        assert all(world.allgather(ran[-60:])[0] == r for r in world.allgather(ran[-60:]))
        assert_quiet(world)


@pytest.mark.mpi(min_size=2)
def test_a_collectives_saved_result_is_read_back_under_its_name_from_a_file_not_yet_written(
        comm, tmp_path_factory, monkeypatch):
    """``save`` with a tuning file that does not exist yet: reduce-scatter explores, rank 0 writes
    the file with the result under ``"reduce_scatter <ranks>/<nodes>"``; a new communicator starts
    with that class settled on the saved winner."""
    path = os.path.join(shared_dir(comm, tmp_path_factory), "new-tuning.json")
    monkeypatch.setenv(selection.ENV, path)
    monkeypatch.setenv(config.ONLINE_TUNING.name, "save")
    spec = online.spec_of("reduce_scatter")
    lib = library_comm(comm)
    nbytes = 3000
    calls = 0
    while calls == 0 or online.exploring(lib, nbytes, spec):
        call, arrays, expected = _collective_call("reduce_scatter", comm, nbytes, calls)
        call()
        assert np.array_equal(arrays[1], expected)
        calls += 1
    report = online.report(lib, nbytes, spec)
    comm.Barrier()
    entry = json.load(open(path))["online"][f"reduce_scatter {comm.Get_size()}/{lib.layout.nodes}"]["2048"]
    assert entry["algorithm"] == report["algorithm"] and entry["sizes"] == [2048, 4095]
    fresh = comm.Dup()
    try:
        tuner = online.tuner_for(library_comm(fresh), spec)
        assert not online.exploring(library_comm(fresh), 2500, spec), "the saved class explored again"
        assert tuner.class_for(2500).winner == entry["algorithm"]
        assert online.exploring(library_comm(fresh), 2500), "allreduce's own class is not the saved one"
    finally:
        fresh.Free()
    assert_quiet(comm)
