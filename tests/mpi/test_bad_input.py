"""A malformed call raises on every rank that makes it, naming the argument, before any
message is sent: afterwards the next good call still works (nothing half-sent is in flight).

Calls that differ between ranks are caught by ``check=True``: every rank raises.
"""
import numpy as np
import pytest
from mpi4py import MPI

from allreduce_kit import allreduce
from conftest import assert_quiet


def read_only():
    x = np.ones(4)
    x.setflags(write=False)
    return x


BAD_CALLS = [
    # (description, buffer factory, keyword arguments, exception, words the message must hold)
    ("a list", lambda: [1.0, 2.0], {}, TypeError, "buf must be a numpy.ndarray"),
    ("float16", lambda: np.ones(4, np.float16), {}, TypeError, "unsupported dtype"),
    ("complex", lambda: np.ones(4, np.complex128), {}, TypeError, "unsupported dtype"),
    ("big-endian", lambda: np.ones(4, ">f8"), {}, TypeError, "unsupported dtype"),
    ("non-contiguous", lambda: np.ones(8)[::2], {}, ValueError, "must be contiguous"),
    ("masked", lambda: np.ma.ones(4), {}, TypeError, "masked array"),
    ("op of another type", lambda: np.ones(4), {"op": 1}, TypeError, "op must be a name"),
    ("an MPI op with no equivalent", lambda: np.ones(4), {"op": MPI.BAND}, ValueError, "is not supported"),
    ("a bad stall_timeout", lambda: np.ones(4), {"stall_timeout": "5"}, TypeError, "stall_timeout: expected a number"),
    ("read-only", read_only, {}, ValueError, "read-only"),
    ("unknown op", lambda: np.ones(4), {"op": "avg"}, ValueError, "unknown op 'avg'"),
    ("unknown algorithm", lambda: np.ones(4), {"algorithm": "butterfly"}, ValueError, "unknown algorithm 'butterfly'"),
]


@pytest.mark.mpi
@pytest.mark.parametrize("description, make, kwargs, error, words", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_call_raises_on_every_rank(comm, description, make, kwargs, error, words):
    for check in (False, True):
        with pytest.raises(error, match=words):
            allreduce(make(), comm=comm, check=check, **kwargs)
        good = np.ones(3)
        allreduce(good, comm=comm, algorithm="ring")
        assert np.all(good == comm.Get_size()), f"check={check}"
        assert_quiet(comm)


@pytest.mark.mpi(min_size=2)
def test_check_catches_a_bad_buffer_on_one_rank_only(comm):
    x = np.ones(4) if comm.Get_rank() != 1 else read_only()
    with pytest.raises(ValueError, match="read-only" if comm.Get_rank() == 1 else "rank 1 failed: .*read-only"):
        allreduce(x, comm=comm, check=True)
    assert_quiet(comm)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", ["ring", "tree", "naive", "mpi"])
def test_check_catches_lengths_that_differ(comm, algorithm):
    x = np.ones(17 + comm.Get_rank())  # a different length on every rank, as Horovod's tests do
    with pytest.raises(ValueError, match="buf length differs between ranks"):
        allreduce(x, comm=comm, check=True, algorithm=algorithm)
    assert_quiet(comm)


@pytest.mark.mpi(min_size=2)
def test_check_catches_dtypes_that_differ(comm):
    x = np.ones(8, dtype=np.float32 if comm.Get_rank() % 2 else np.float64)
    with pytest.raises(ValueError, match="buf dtype differs between ranks"):
        allreduce(x, comm=comm, check=True)


@pytest.mark.mpi(min_size=2)
def test_check_catches_ops_that_differ(comm):
    with pytest.raises(ValueError, match="op differs between ranks"):
        allreduce(np.ones(8), op="sum" if comm.Get_rank() else "max", comm=comm, check=True)


@pytest.mark.mpi(min_size=2)
def test_intercommunicator_is_refused_before_anything_is_sent(comm):
    half = comm.Split(comm.Get_rank() % 2, comm.Get_rank())
    inter = half.Create_intercomm(0, comm, 1 - comm.Get_rank() % 2, tag=77)
    try:
        with pytest.raises(TypeError, match="comm must be an intracommunicator"):
            allreduce(np.ones(2), comm=inter)
    finally:
        inter.Free()
        half.Free()
    assert_quiet(comm)
