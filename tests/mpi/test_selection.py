"""``algorithm="auto"`` is collective: rank 0 reads the table once per communicator and
broadcasts it, so every rank makes the same choice, or raises the same error, whatever the other
ranks' own settings and files say. (The rules of choosing: ``tests/test_selection.py``.)
"""
import json
import os

import numpy as np
import pytest

from allreduce_kit import allreduce, library_comm, selection
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


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("fault", sorted(BROKEN))
def test_a_broken_table_on_rank_zero_raises_on_every_rank(comm, tmp_path_factory, monkeypatch, fault):
    """Only rank 0 reads the file, yet every rank raises the same error naming it, and nothing
    is left in flight; the other ranks' own setting ('builtin') would have worked."""
    text, words = BROKEN[fault]
    path = os.path.join(shared_dir(comm, tmp_path_factory), "tuning.json")
    if comm.Get_rank() == 0 and text is not None:
        with open(path, "w") as out:
            out.write(text)
    comm.Barrier()
    monkeypatch.setenv(selection.ENV, path if comm.Get_rank() == 0 else "builtin")
    with pytest.raises(ValueError) as raised:
        allreduce(np.ones(4), algorithm="auto", comm=comm)
    message = str(raised.value)
    assert message.startswith("allreduce(algorithm='auto'): tuning file " + path), message
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
