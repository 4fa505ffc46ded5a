"""The library keeps to its own communicator: users' messages and communicators are untouched."""
import numpy as np
import pytest
from mpi4py import MPI

from allreduce_kit import ALGORITHMS, allreduce, library_comm


@pytest.mark.mpi
def test_library_comm_is_a_clone_made_once(any_comm):
    lib = library_comm(any_comm)
    assert lib is library_comm(any_comm), "cloned once, then cached on the communicator"
    assert MPI.Comm.Compare(lib, any_comm) == MPI.CONGRUENT, "same group, different context"


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_user_messages_around_the_call_are_not_disturbed(comm, algorithm):
    """A user's message in flight on the same communicator, with any tag, arrives intact."""
    p, rank = comm.Get_size(), comm.Get_rank()
    right, left = (rank + 1) % p, (rank - 1) % p
    for tag in (0, 7, 101, 102, 103):  # including the tags the algorithms use internally
        outgoing = np.full(10, 1000 * tag + rank, dtype=np.int64)
        incoming = np.empty(10, dtype=np.int64)
        requests = [comm.Irecv(incoming, source=left, tag=tag), comm.Isend(outgoing, dest=right, tag=tag)]
        x = np.full(5, rank, dtype=np.int64)
        allreduce(x, op="sum", algorithm=algorithm, comm=comm)
        MPI.Request.Waitall(requests)
        assert np.all(incoming == 1000 * tag + left)
        assert np.all(x == p * (p - 1) // 2)


@pytest.mark.mpi
def test_freeing_a_communicator_frees_its_clone():
    sub = MPI.COMM_WORLD.Dup()
    x = np.ones(4)
    allreduce(x, comm=sub)
    sub.Free()  # must not raise, and must not leak the clone
    assert np.all(x == MPI.COMM_WORLD.Get_size())
