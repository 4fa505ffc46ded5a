"""Plumbing for the tests that run inside an MPI job: every rank runs every test.

Each test gets communicators of its own (``comm``, ``any_comm``, ``comms``), made when it starts
and freed when it ends; the library's clone of each must be freed with it (``release``). At the
end, no library clone may be left alive but the one of ``COMM_WORLD``, which lives as long as
the process.
"""
import gc
import hashlib
import itertools
from typing import Callable, Dict, List, Sequence, Tuple

import numpy as np
import pytest
from mpi4py import MPI

from allreduce_kit import library_comm
from allreduce_kit.comm import LibraryComm


def _split() -> MPI.Intracomm:
    rank = MPI.COMM_WORLD.Get_rank()
    return MPI.COMM_WORLD.Split(color=rank % 2, key=-rank)  # odd and even ranks, in reversed order


#: name -> how to make a fresh communicator of that kind (collective).
MAKERS: Dict[str, Callable[[], MPI.Intracomm]] = {
    "world": lambda: MPI.COMM_WORLD.Clone(),
    "self": lambda: MPI.COMM_SELF.Clone(),
    "dup": lambda: MPI.COMM_WORLD.Dup(),
    "split": _split,
}


def release(comm: MPI.Intracomm) -> None:
    """Free a test's communicator and check that the library's clone of it went too (collective)."""
    lib = library_comm(comm)  # the clone the test used (made here if it used none)
    comm.Free()
    assert lib == MPI.COMM_NULL, "the library's clone outlived the communicator it was made for"


@pytest.fixture
def comm():
    """A clone of ``COMM_WORLD`` for this test alone, freed when it ends."""
    new = MPI.COMM_WORLD.Clone()
    yield new
    release(new)


@pytest.fixture(params=sorted(MAKERS))
def any_comm(request):
    """Each of: a clone of ``COMM_WORLD``, a clone of ``COMM_SELF``, a ``Dup`` of the world, and a
    ``Split`` into odd and even ranks; made for this test and freed when it ends."""
    new = MAKERS[request.param]()
    yield new
    release(new)


@pytest.fixture
def comms():
    """``{"world": ..., "split": ...}``: a clone of the world and a split of it, for this test."""
    made = {"world": MAKERS["world"](), "split": MAKERS["split"]()}
    yield made
    for new in made.values():
        release(new)


def live_library_clones() -> int:
    """How many of the library's clones of communicators this process holds, not yet freed."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, LibraryComm) and o != MPI.COMM_NULL)


@pytest.fixture(scope="session", autouse=True)
def no_library_clone_left():
    """The tests leave no library clone behind (the world's is made first: it stays)."""
    library_comm(MPI.COMM_WORLD)
    before = live_library_clones()
    yield
    after = live_library_clones()
    assert after <= before, f"{after - before} library clone(s) of communicators left alive by the tests"


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


#: Up to this many ranks the matching tests check every combination of their axes (dtype, op,
#: length, root); with more (5 and 8 ranks, oversubscribed on the suite's 2 cores) every value of
#: every axis at least once (``cases``): the schedule at a rank count is what is new there, and
#: dtypes and ops are orthogonal to it.
EVERY_COMBINATION_UP_TO = 4


def cases(comm, *axes: Sequence) -> List[Tuple]:
    """The tuples of ``axes`` a matching test checks at ``comm``'s size: the whole product up to
    ``EVERY_COMBINATION_UP_TO`` ranks; beyond it a cover in which every value of every axis
    appears (the k-th tuple takes value k of each axis, cycling)."""
    if comm.Get_size() <= EVERY_COMBINATION_UP_TO:
        return list(itertools.product(*axes))
    return [tuple(axis[k % len(axis)] for axis in axes) for k in range(max(len(axis) for axis in axes))]
