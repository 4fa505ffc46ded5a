"""The library keeps to its own communicator: users' messages and communicators are untouched,
and its clone of a communicator lives exactly as long as that communicator."""
import numpy as np
import pytest
from mpi4py import MPI

from allreduce_kit import ALGORITHMS, allreduce, library_comm
from conftest import MAKERS, live_library_clones


@pytest.mark.mpi
def test_library_comm_is_a_clone_made_once(any_comm):
    lib = library_comm(any_comm)
    assert lib is library_comm(any_comm), "cloned once, then cached on the communicator"
    assert MPI.Comm.Compare(lib, any_comm) == MPI.CONGRUENT, "same group, different context"


@pytest.mark.mpi
def test_a_duplicate_gets_a_clone_of_its_own(comm):
    """``Dup`` of a communicator the library has used does not inherit (or free) its clone."""
    lib = library_comm(comm)
    dup = comm.Dup()
    try:
        assert library_comm(dup) is not lib
        assert MPI.Comm.Compare(library_comm(dup), lib) == MPI.CONGRUENT
    finally:
        dup.Free()
    assert lib != MPI.COMM_NULL, "freeing the duplicate freed the original's clone"
    x = np.ones(3)
    allreduce(x, comm=comm)
    assert np.all(x == comm.Get_size())


@pytest.mark.mpi
def test_the_default_communicator_is_the_world(comm):
    """``comm=None`` and ``comm=COMM_WORLD`` share one clone, which lives as long as the process."""
    assert library_comm() is library_comm(MPI.COMM_WORLD)
    assert MPI.Comm.Compare(library_comm(), MPI.COMM_WORLD) == MPI.CONGRUENT
    p, rank = comm.Get_size(), comm.Get_rank()
    x = np.full(4, rank + 1.0)
    assert allreduce(x) is x and np.all(x == p * (p + 1) / 2)


@pytest.mark.mpi
def test_user_messages_around_the_call_are_not_disturbed(comm):
    """A user's message in flight on the same communicator, with any tag, arrives intact."""
    p, rank = comm.Get_size(), comm.Get_rank()
    right, left = (rank + 1) % p, (rank - 1) % p
    for algorithm in sorted(ALGORITHMS):
        for tag in (0, 7, 101, 102, 103):  # including the tags the algorithms use internally
            outgoing = np.full(10, 1000 * tag + rank, dtype=np.int64)
            incoming = np.empty(10, dtype=np.int64)
            requests = [comm.Irecv(incoming, source=left, tag=tag), comm.Isend(outgoing, dest=right, tag=tag)]
            x = np.full(5, rank, dtype=np.int64)
            allreduce(x, op="sum", algorithm=algorithm, comm=comm)
            MPI.Request.Waitall(requests)
            assert np.all(incoming == 1000 * tag + left), (algorithm, tag)
            assert np.all(x == p * (p - 1) // 2), (algorithm, tag)


@pytest.mark.mpi
@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_freeing_a_communicator_frees_its_clone(kind):
    """After ``comm.Free()`` the library's clone of it, and the stall inspector's channel beside
    it, are freed too: their handles are ``COMM_NULL``."""
    user = MAKERS[kind]()
    lib = library_comm(user)
    p = user.Get_size()
    x = np.ones(4)
    allreduce(x, comm=user, algorithm="ring")
    allreduce(x, comm=user, algorithm="shared_memory")  # its shared window goes with the clone
    assert np.all(x == p * p)
    assert lib != MPI.COMM_NULL and lib.watch.channel != MPI.COMM_NULL
    user.Free()
    assert lib == MPI.COMM_NULL, "the library's clone outlived the user's communicator"
    assert lib.watch.channel == MPI.COMM_NULL, "the stall inspector's channel outlived the communicator"


@pytest.mark.mpi
def test_many_communicators_made_and_freed_leave_no_clone_behind():
    """Making, using and freeing communicators in a loop, as a job that splits its ranks anew for
    each phase would, holds no more library clones (nor MPI communicators) at the end than at the
    start: MPI hands the same handle to a new communicator each time, since none was leaked (a
    leak gives a new handle every round)."""
    def probe_handle() -> int:
        probe = MPI.COMM_WORLD.Dup()
        try:
            return probe.py2f()
        finally:
            probe.Free()

    before = live_library_clones()
    handles, clones = [], []
    for round_, algorithm in enumerate(sorted(ALGORITHMS)):  # each sets up what it keeps per communicator
        user = MAKERS["split" if round_ % 2 else "dup"]()
        x = np.full(100, float(round_))
        allreduce(x, comm=user, algorithm=algorithm)
        assert np.all(x == round_ * user.Get_size()), algorithm
        clones.append(library_comm(user))
        user.Free()
        handles.append(probe_handle())
    assert all(lib == MPI.COMM_NULL for lib in clones), "some clones were not freed with their communicator"
    assert live_library_clones() <= before
    assert len(set(handles)) <= 2, f"MPI handed out {len(set(handles))} different handles: communicators leak"
