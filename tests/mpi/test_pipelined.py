"""The streamed ring (``algorithms/pipelined.py``), which ``ring`` and ``hierarchical`` run across
nodes, called directly on one node: MPI's ``Allreduce`` as the oracle for lengths that cut into
uneven segments and pieces, every rank bitwise the same, nothing left unreceived; a length that
differs raises the same ``ValueError`` on every rank. (``test_cluster.py`` runs it across nodes.)
"""
import numpy as np
import pytest
from mpi4py import MPI

from allreduce_kit import library_comm
from allreduce_kit.algorithms import pipelined
from conftest import assert_quiet, assert_same_everywhere


def test_pieces_are_counted_from_the_segment():
    assert pipelined.piece_count(0) == 1
    assert pipelined.piece_count(pipelined.MIN_PIECE) == 1
    assert pipelined.piece_count(4 * pipelined.MIN_PIECE) == 4  # at least MIN_PIECE each
    assert pipelined.piece_count(64 * pipelined.MIN_PIECE) == pipelined.MIN_PIECES
    big = 10 * pipelined.PIECE + 1
    assert pipelined.piece_count(big) == 11  # at most PIECE each


@pytest.mark.mpi
def test_streamed_ring_matches_mpi(comm):
    lib = library_comm(comm)
    p, rank = lib.nranks, lib.myrank
    if p == 1:
        pytest.skip("the ring needs two ranks")
    # the last: segments of MIN_PIECES uneven pieces (float64), more units than the window from 3 ranks
    lengths = [1, p - 1, p + 1, 1000, pipelined.MIN_PIECES * pipelined.MIN_PIECE // 8 * p + 2 * p + 3]
    for dtype, op, mpi_op in (("float64", "sum", MPI.SUM), ("int32", "max", MPI.MAX), ("float64", "mean", MPI.SUM)):
        for n in lengths:
            rng = np.random.default_rng([n, rank])
            x = (rng.standard_normal(n) if dtype == "float64" else rng.integers(-99, 100, n)).astype(dtype)
            expected = x.copy()
            comm.Allreduce(MPI.IN_PLACE, expected, op=mpi_op)
            if op == "mean":
                expected /= p
            pipelined.allreduce(lib, x, lib.reductions[op])
            if dtype == "float64":
                assert np.allclose(x, expected, rtol=1e-12, atol=1e-12 * p * np.abs(expected).max(initial=1)), (op, n)
            else:
                assert np.array_equal(x, expected), (op, n)
            assert_same_everywhere(comm, x)
    assert_quiet(comm)


@pytest.mark.mpi
def test_streamed_ring_refuses_lengths_that_differ_on_every_rank(comm):
    lib = library_comm(comm)
    if lib.nranks == 1:
        pytest.skip("a mismatch needs two ranks")
    x = np.ones(1000 + lib.myrank, np.float32)
    with pytest.raises(ValueError, match="buf length differs between ranks"):
        pipelined.allreduce(lib, x, lib.reductions["sum"])
    assert_quiet(comm)
    y = np.full(1000, lib.myrank + 1, np.float32)  # the next call is right
    pipelined.allreduce(lib, y, lib.reductions["sum"])
    assert np.all(y == lib.nranks * (lib.nranks + 1) / 2)
