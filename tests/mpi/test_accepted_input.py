"""What users of the field write is accepted where it is unambiguous: op names in any case and
MPI's own op objects, Fortran-ordered arrays and ndarray subclasses such as ``np.matrix``; and
the parameter helpers take what ``allreduce`` takes. A ``comm`` that is not one is refused by
name, before anything is sent."""
import numpy as np
import pytest
from mpi4py import MPI

from allreduce_kit import allreduce, average_arrays, average_buffer, broadcast_parameters
from conftest import assert_quiet


@pytest.mark.mpi
@pytest.mark.parametrize("op,expected", [("SUM", "sum"), ("Max", "max"), (MPI.SUM, "sum"), (MPI.PROD, "prod"),
                                         (MPI.MIN, "min"), (MPI.MAX, "max")])
def test_op_names_in_any_case_and_mpi_ops(comm, op, expected):
    p, rank = comm.Get_size(), comm.Get_rank()
    x = np.full(5, rank + 1, np.int64)
    allreduce(x, op=op, comm=comm, algorithm="ring")
    want = {"sum": p * (p + 1) // 2, "prod": int(np.prod(np.arange(1, p + 1))), "min": 1, "max": p}[expected]
    assert np.all(x == want)
    assert_quiet(comm)


@pytest.mark.mpi
@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # np.matrix, which users still pass
@pytest.mark.parametrize("algorithm", ["auto", "ring", "shared_memory", "two_shot", "tree", "mpi"])
def test_fortran_ordered_and_matrix_buffers_are_reduced_in_place(comm, algorithm):
    p, rank = comm.Get_size(), comm.Get_rank()
    f = np.asfortranarray(np.arange(12, dtype=np.float64).reshape(3, 4) * (rank + 1))
    allreduce(f, comm=comm, algorithm=algorithm)
    assert f.flags.f_contiguous and np.array_equal(f, np.arange(12).reshape(3, 4) * p * (p + 1) / 2)
    m = np.matrix(np.full((2, 3), rank + 1, np.float32))
    out = allreduce(m, comm=comm, algorithm=algorithm)
    assert out is m and isinstance(m, np.matrix) and np.all(m == p * (p + 1) / 2)
    assert_quiet(comm)


@pytest.mark.mpi
@pytest.mark.parametrize("comm_value,error,words", [(1, TypeError, "comm must be an mpi4py intracommunicator, got int"),
                                                    (MPI.COMM_NULL, ValueError, "comm is MPI.COMM_NULL")])
def test_a_comm_that_is_not_one_is_refused_by_name(comm, comm_value, error, words):
    with pytest.raises(error, match=words):
        allreduce(np.ones(4), comm=comm_value)
    good = np.ones(3)
    allreduce(good, comm=comm)
    assert np.all(good == comm.Get_size())


@pytest.mark.mpi
def test_the_parameter_helpers_take_what_allreduce_takes(comm):
    p, rank = comm.Get_size(), comm.Get_rank()
    grid = np.full((4, 5), rank + 1, np.float64)                        # 2-D: averaged as a whole
    average_buffer(grid, comm=comm, bucket_mb=1e-4)
    assert np.allclose(grid, (p + 1) / 2)
    ints = np.full(7, 2 * (rank + 1), np.int32)
    average_arrays([ints, np.asfortranarray(np.ones((2, 2)))], comm=comm)
    assert np.all(ints == p + 1)                                         # (2 + 4 + ... + 2p) / p
    params = np.full(6, rank, np.int64)
    broadcast_parameters(params, root=p - 1, comm=comm)
    assert np.all(params == p - 1)
    assert_quiet(comm)


@pytest.mark.mpi
@pytest.mark.parametrize("call,error,words", [
    (lambda c: average_arrays(np.ones(3), comm=c), TypeError, "arrays must be a list or tuple"),
    (lambda c: average_arrays([np.ones(3), [1.0]], comm=c), TypeError, r"arrays\[1\] must be a numpy.ndarray"),
    (lambda c: average_arrays([np.ones(3, np.float16)], comm=c), TypeError, r"arrays\[0\] has unsupported dtype"),
    (lambda c: average_arrays([np.ones(3)], comm=c, bucket_mb=-1), ValueError, "bucket_mb must be >= 0"),
    (lambda c: average_buffer(np.ones(3), comm=c, bucket_mb=float("nan")), ValueError, "bucket_mb must be >= 0"),
    (lambda c: average_buffer(np.ones(3), comm=c, algorithm="butterfly"), ValueError, "unknown algorithm"),
    (lambda c: broadcast_parameters(np.ones(3, np.float16), comm=c), TypeError, "unsupported dtype"),
    (lambda c: broadcast_parameters(np.ones(3), root=c.Get_size(), comm=c), ValueError, "is not a rank of comm"),
    (lambda c: broadcast_parameters(np.ones(3), root=0.0, comm=c), TypeError, "root must be an int"),
])
def test_the_parameter_helpers_refuse_what_allreduce_refuses(comm, call, error, words):
    with pytest.raises(error, match=words):
        call(comm)
    assert_quiet(comm)
