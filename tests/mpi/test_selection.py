"""``algorithm="auto"`` makes the same choice on every rank, from the table rank 0 reads."""
import json
import os

import numpy as np
import pytest

from allreduce_kit import allreduce, library_comm, selection
from conftest import assert_quiet


@pytest.fixture
def fresh(comm):
    """A new communicator, so ``auto`` loads its table again (it is read once per communicator)."""
    new = comm.Dup()
    yield new
    new.Free()


def shared_dir(comm, tmp_path_factory) -> str:
    return comm.bcast(str(tmp_path_factory.mktemp("tuning")) if comm.Get_rank() == 0 else None, root=0)


@pytest.mark.mpi
def test_every_rank_follows_rank_zeros_table(fresh, tmp_path_factory, monkeypatch):
    """Rank 0 points at a file that says 'naive'; the others would use the built-in table."""
    p, rank = fresh.Get_size(), fresh.Get_rank()
    if p == 1:
        pytest.skip("auto is never consulted on one rank")
    path = os.path.join(shared_dir(fresh, tmp_path_factory), "naive.json")
    if rank == 0:
        with open(path, "w") as out:
            json.dump({"rules": {str(p): [[0, "naive"]]}}, out)
    fresh.Barrier()
    monkeypatch.setenv(selection.ENV, path if rank == 0 else "builtin")
    x = np.full(1000, rank + 1, dtype=np.float64)
    allreduce(x, algorithm="auto", comm=fresh)
    assert np.all(x == p * (p + 1) / 2)
    lib = library_comm(fresh)
    auto = lib.state[selection.Auto]
    assert auto.source == path and auto.rules == ((0, "naive"),)
    assert_quiet(fresh)


@pytest.mark.mpi
def test_a_broken_table_raises_on_every_rank(fresh, tmp_path_factory, monkeypatch):
    if fresh.Get_size() == 1:
        pytest.skip("auto is never consulted on one rank")
    path = os.path.join(shared_dir(fresh, tmp_path_factory), "broken.json")
    if fresh.Get_rank() == 0:
        with open(path, "w") as out:
            out.write("{not json")
    fresh.Barrier()
    monkeypatch.setenv(selection.ENV, path)
    with pytest.raises(ValueError, match="not JSON"):
        allreduce(np.ones(4), algorithm="auto", comm=fresh)
    assert_quiet(fresh)


@pytest.mark.mpi
@pytest.mark.parametrize("nbytes", [4, 1024, 1 << 20, 64 << 20])
def test_builtin_choice_is_a_registered_algorithm_and_the_same_everywhere(comm, nbytes):
    choice = selection.choose(nbytes, comm.Get_size())
    assert choice in selection.ALGORITHMS
    assert len(set(comm.allgather(choice))) == 1
