import hashlib

import numpy as np
import pytest
from mpi4py import MPI

from allreduce_kit import library_comm


def _communicators():
    world = MPI.COMM_WORLD
    return {
        "world": world,
        "self": MPI.COMM_SELF,
        "dup": world.Dup(),
        "split": world.Split(color=world.Get_rank() % 2, key=-world.Get_rank()),  # reversed order
    }


COMMS = _communicators()


@pytest.fixture(params=sorted(COMMS))
def any_comm(request):
    """Each of: COMM_WORLD, COMM_SELF, a Dup of the world, and a Split into odd and even ranks."""
    return COMMS[request.param]


@pytest.fixture
def comm():
    return MPI.COMM_WORLD


def assert_quiet(comm) -> None:
    """No message is left waiting on the library's communicator of ``comm``.

    The second barrier keeps a fast rank's next call from being probed by a slow rank.
    """
    lib = library_comm(comm)
    lib.Barrier()
    stray = lib.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)
    lib.Barrier()
    assert not stray, "a message was left unreceived"


def assert_same_everywhere(comm, buf: np.ndarray) -> None:
    """Every rank of ``comm`` holds bitwise the same ``buf`` (compared by digest)."""
    digests = comm.allgather(hashlib.blake2b(buf.data, digest_size=16).digest())
    assert all(d == digests[0] for d in digests), "ranks ended with different bits"
