"""A buffer whose length or dtype differs between ranks, without ``check=True``: every rank
raises the same ``ValueError`` naming what each rank passed, no rank writes outside any rank's
buffer, nothing hangs or is left unreceived, and the next well-formed call is right.

Each algorithm runs both ways it can move data on one node: reading and writing its peers'
memory or a shared window (``direct``), and by messages only (``messages``: a communicator made
with ``ALLREDUCE_KIT_DIRECT=0`` and no shared window, as across nodes).
"""
import os

import numpy as np
import pytest
from mpi4py import MPI

from allreduce_kit import ALGORITHMS, allreduce, library_comm
from conftest import assert_quiet

#: Every algorithm, by name. ``mpi`` is MPI's own ``Allreduce``: MPICH aborts the whole job on
#: a length that differs ("Message truncated"), which no test inside the job can survive.
TESTED = ("naive", "tree", "ring", "recursive_doubling", "rabenseifner", "shared_memory", "two_shot", "hierarchical")
NOT_TESTED = {"mpi"}
#: Room on either side of every buffer, filled with a value no call writes: a write past a
#: peer's buffer (by up to the largest difference in length tested) lands here.
GUARD = 16_384
SENTINEL = -12345.0

pytestmark = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() == 1, reason="a mismatch needs two ranks")


def test_every_algorithm_is_covered():
    assert set(TESTED) | NOT_TESTED == set(ALGORITHMS)


def _messages_only() -> MPI.Intracomm:
    """A communicator whose library clone keeps to messages: no direct transfers, no window."""
    from allreduce_kit.algorithms import direct, shared_memory

    comm = MPI.COMM_WORLD.Dup()
    saved_env, saved_window = os.environ.get(direct.ENV), shared_memory.window_for
    os.environ[direct.ENV] = "0"
    shared_memory.window_for = lambda comm: None
    try:
        lib = library_comm(comm)
        for name in ("ring", "shared_memory"):  # each makes its transport on its first call
            allreduce(np.ones(4, np.float32), algorithm=name, comm=comm)
    finally:
        shared_memory.window_for = saved_window
        if saved_env is None:
            del os.environ[direct.ENV]
        else:
            os.environ[direct.ENV] = saved_env
    assert direct.peers_for(lib) is None and lib.state[shared_memory.Window] is None
    return comm


@pytest.fixture(scope="module")
def comms():
    from allreduce_kit.algorithms import direct

    made = {"direct": MPI.COMM_WORLD.Dup(), "messages": _messages_only()}
    assert direct.peers_for(library_comm(made["direct"])) is not None, "direct transfers work on one node"
    yield made
    for comm in made.values():
        comm.Free()


def guarded(n: int, dtype: str, value: float) -> tuple:
    """A buffer of ``n`` elements inside a larger array whose ends hold ``SENTINEL``."""
    arena = np.full(n + 2 * GUARD, SENTINEL, dtype=dtype)
    buf = arena[GUARD:GUARD + n]
    buf[:] = value
    return arena, buf


def run_mismatched(comm, algorithm: str, n: int, dtype: str) -> str:
    """Call ``allreduce`` with this rank's ``n`` and ``dtype``; return its error message, after
    checking (on every rank together) that every rank raised ``ValueError``, the same one, and
    that no rank's memory outside its buffer changed."""
    arena, buf = guarded(n, dtype, comm.Get_rank() + 1)
    try:
        allreduce(buf, algorithm=algorithm, comm=comm)
        outcome = ("returned", "")
    except ValueError as error:
        outcome = ("ValueError", str(error))
    except Exception as error:  # anything else is a failure too, reported with the rest
        outcome = (type(error).__name__, str(error))
    intact = bool(np.all(arena[:GUARD] == SENTINEL) and np.all(arena[GUARD + n:] == SENTINEL))
    outcomes = comm.allgather((outcome, intact))
    assert all(kind == "ValueError" for (kind, _), _ in outcomes), f"every rank raises ValueError: {outcomes}"
    assert len({message for (_, message), _ in outcomes}) == 1, f"the same message everywhere: {outcomes}"
    assert all(ok for _, ok in outcomes), "no rank's memory outside its buffer changed"
    assert_quiet(comm)
    return outcome[1]


def assert_next_call_works(comm, algorithm: str, n: int) -> None:
    """A well-formed call right after a failed one gives the closed-form sum on every rank."""
    p = comm.Get_size()
    arena, buf = guarded(n, "float64", comm.Get_rank() + 1)
    allreduce(buf, algorithm=algorithm, comm=comm)
    right = bool(np.all(buf == p * (p + 1) / 2) and np.all(arena[:GUARD] == SENTINEL)
                 and np.all(arena[GUARD + n:] == SENTINEL))
    assert all(comm.allgather(right)), "the next well-formed call is right on every rank"
    assert_quiet(comm)


#: (base length, how much longer one rank's buffer is, which rank: "last" or "first"). Around
#: 2**18 float32 a step of ring, rabenseifner and two_shot at 2 ranks is about 512 KiB, so the
#: longer buffer's step goes in two pieces and the shorter's in one (when every rank has a core).
LENGTHS = [(2**18, 1, "last"), (2**18, 10_000, "first"), (100, 1, "first"), (100, 10_000, "last")]


@pytest.mark.mpi
@pytest.mark.parametrize("way", ["direct", "messages"])
@pytest.mark.parametrize("base,extra,who", LENGTHS, ids=[f"{b}+{e}-{w}" for b, e, w in LENGTHS])
@pytest.mark.parametrize("algorithm", TESTED)
def test_length_differs(comms, algorithm, base, extra, who, way):
    comm = comms[way]
    p, rank = comm.Get_size(), comm.Get_rank()
    odd = p - 1 if who == "last" else 0
    lengths = [base + (extra if r == odd else 0) for r in range(p)]
    message = run_mismatched(comm, algorithm, lengths[rank], "float32")
    expected = ", ".join(f"rank {r}: {n}" for r, n in enumerate(lengths))
    assert f"buf length differs between ranks ({expected})" in message
    assert_next_call_works(comm, algorithm, base)


#: Another size of element, and the same size (only the signature tells those apart).
DTYPE_CASES = [("float32", "float64", "last"), ("float32", "int32", "first")]


@pytest.mark.mpi
@pytest.mark.parametrize("way", ["direct", "messages"])
@pytest.mark.parametrize("common,other,who", DTYPE_CASES, ids=[f"{c}-{o}" for c, o, _ in DTYPE_CASES])
@pytest.mark.parametrize("algorithm", TESTED)
def test_dtype_differs(comms, algorithm, common, other, who, way):
    comm = comms[way]
    p, rank = comm.Get_size(), comm.Get_rank()
    odd = p - 1 if who == "last" else 0
    dtypes = [other if r == odd else common for r in range(p)]
    message = run_mismatched(comm, algorithm, 1000, dtypes[rank])
    expected = ", ".join(f"rank {r}: {d}" for r, d in enumerate(dtypes))
    assert f"buf dtype differs between ranks ({expected})" in message
    assert_next_call_works(comm, algorithm, 1000)


@pytest.mark.mpi
@pytest.mark.parametrize("way", ["direct", "messages"])
@pytest.mark.parametrize("algorithm", TESTED)
def test_every_rank_differs(comms, algorithm, way):
    comm = comms[way]
    rank = comm.Get_rank()
    message = run_mismatched(comm, algorithm, 5000 + 7 * rank, "float32")
    assert "rank 0: 5000, rank 1: 5007" in message
    assert_next_call_works(comm, algorithm, 5000)


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ["ring", "rabenseifner", "two_shot"])
@pytest.mark.parametrize("extra", [1, 10_000])
def test_piece_counts_differ(comms, algorithm, extra, monkeypatch):
    """By messages, a large step goes in pieces counted from the sender's own length (forced
    small here, at any rank count; ``128 p`` float32 make segments of exactly 8 pieces, so one
    more element makes 9): a rank that sends more pieces than its partner expects, or fewer,
    still ends the step with every message received."""
    from allreduce_kit.algorithms import pieces

    comm = comms["messages"]
    monkeypatch.setattr(library_comm(comm), "oversubscribed", False)
    monkeypatch.setattr(pieces, "PIECE", 64)
    p, rank = comm.Get_size(), comm.Get_rank()
    lengths = [128 * p + (extra if r == p // 2 else 0) for r in range(p)]
    message = run_mismatched(comm, algorithm, lengths[rank], "float32")
    assert f"rank {p // 2}: {lengths[p // 2]}" in message
    assert_next_call_works(comm, algorithm, 128 * p)


@pytest.mark.mpi
@pytest.mark.parametrize("pieced", [False, True], ids=["whole", "pieces"])
@pytest.mark.parametrize("who", ["first", "last"])
def test_shared_memory_fallback_split_between_ranks(comms, who, pieced, monkeypatch):
    """Without a window, ``shared_memory`` runs ``recursive_doubling`` up to ``FALLBACK_SPLIT``
    bytes and ``rabenseifner`` above: lengths on both sides of it run different schedules on
    different ranks, and still every rank raises."""
    from allreduce_kit.algorithms import pieces, shared_memory

    comm = comms["messages"]
    if pieced:  # rabenseifner's steps in pieces, against recursive doubling's whole buffers
        monkeypatch.setattr(library_comm(comm), "oversubscribed", False)
        monkeypatch.setattr(pieces, "PIECE", 4096)
    p, rank = comm.Get_size(), comm.Get_rank()
    split = shared_memory.FALLBACK_SPLIT // 4  # float32 elements
    odd = p - 1 if who == "last" else 0
    lengths = [split + (1 if r == odd else 0) for r in range(p)]
    message = run_mismatched(comm, "shared_memory", lengths[rank], "float32")
    assert "buf length differs between ranks" in message
    assert_next_call_works(comm, "shared_memory", split + 1)


#: Which ranks pass the longer buffer: one in the middle (at 3 and 5 ranks, one that folds a
#: partner in, or is folded in, for ``rabenseifner``), and every odd rank.
PATTERNS = {"middle": lambda r, p: r == p // 2, "odd": lambda r, p: r % 2 == 1}


@pytest.mark.mpi
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
@pytest.mark.parametrize("algorithm", ["ring", "rabenseifner", "two_shot"])
def test_direct_mismatch_reaches_every_rank(comms, algorithm, pattern):
    """By direct reads a rank checks only the peers it reads: the others learn of the mismatch
    from the ranks that found it, and raise the same error, without a hang."""
    comm = comms["direct"]
    p, rank = comm.Get_size(), comm.Get_rank()
    lengths = [1000 + (1 if PATTERNS[pattern](r, p) else 0) for r in range(p)]
    message = run_mismatched(comm, algorithm, lengths[rank], "float32")
    expected = ", ".join(f"rank {r}: {n}" for r, n in enumerate(lengths))
    assert f"buf length differs between ranks ({expected})" in message
    assert_next_call_works(comm, algorithm, 1000)
