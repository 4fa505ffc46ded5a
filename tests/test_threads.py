"""Each rank's share of its node's cores: ``max(1, cores // ranks_on_node)`` threads, unless the
user set ``NUMBA_NUM_THREADS`` or ``OMP_NUM_THREADS``, so p ranks never start p x cores threads.

The inputs are set here: the cores this process may run on (its affinity mask, faked), the
ranks on the node (given), and the environment. No MPI job: the count of ranks is passed in.
(``tests/mpi/test_allreduce.py`` checks what a library communicator takes, with real affinity.)
"""
import os

import pytest

from allreduce_kit.topology import Topology, affinity, node_cores


def thread_share(ranks: int) -> int:
    """The threads a rank gets with ``ranks`` ranks on its node, each with this process's mask."""
    return Topology.from_parts(0, [0] * ranks, [node_cores([affinity()] * ranks)]).threads()

USER_SETTINGS = ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS")


@pytest.fixture
def node(monkeypatch):
    """``node(cores)``: this process may run on ``cores`` cores; no thread setting, no Slurm."""
    for name in list(os.environ):
        if name in USER_SETTINGS or name.startswith("SLURM_"):
            monkeypatch.delenv(name)

    def cores(count: int) -> None:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(count)))

    return cores


@pytest.mark.parametrize("cores", [1, 2, 3, 8, 12, 64])
@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5, 8, 16, 100])
def test_unset_each_rank_gets_its_share_and_at_least_one(node, cores, ranks):
    node(cores)
    share = thread_share(ranks=ranks)
    assert share == max(1, cores // ranks)
    assert share * ranks <= cores or share == 1, "the ranks of a node would start more threads than it has cores"


@pytest.mark.parametrize("name", USER_SETTINGS)
@pytest.mark.parametrize("value", [1, 3, 16])
def test_the_users_setting_wins_whatever_the_cores_and_ranks(node, monkeypatch, name, value):
    node(8)
    monkeypatch.setenv(name, str(value))
    assert [thread_share(ranks=r) for r in (1, 4, 16)] == [value] * 3


def test_numba_num_threads_is_read_before_omp_num_threads(node, monkeypatch):
    node(8)
    monkeypatch.setenv("NUMBA_NUM_THREADS", "3")
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert thread_share(ranks=2) == 3


def test_an_empty_setting_counts_as_unset(node, monkeypatch):
    """``export OMP_NUM_THREADS=`` in a job script sets nothing."""
    node(8)
    for name in USER_SETTINGS:
        monkeypatch.setenv(name, "")
    assert thread_share(ranks=2) == 4
