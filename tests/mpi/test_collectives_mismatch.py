"""reduce_scatter, allgather, broadcast and their nonblocking forms, called with lengths, dtypes
or roots that differ between ranks, without ``check``: every rank raises the same ``ValueError``
naming the collective called and what each rank passed, no rank's memory outside its buffers
changes, nothing hangs or is left unreceived, and the next well-formed call is right.

As ``test_mismatch.py`` does for ``allreduce``: each algorithm with a one-node form (reading or
writing peers' memory) runs both ways (``direct``, and ``messages``: a communicator made with
``ALLREDUCE_KIT_DIRECT=0``, as across nodes). Uneven blocks are ``allgather``'s legal
``Allgatherv`` case; what must agree there is the list of lengths (``counts``), which here
differs between ranks with the same total.
"""
import numpy as np
import pytest
from mpi4py import MPI

from allreduce_kit import allgather, broadcast, iallgather, ibroadcast, ireduce_scatter, reduce_scatter, shard_bounds
from allreduce_kit.algorithms import allgather as allgathers
from allreduce_kit.algorithms import broadcast as broadcasts
from allreduce_kit.algorithms import reduce_scatter as reduce_scatters
from conftest import assert_quiet
from test_mismatch import GUARD, SENTINEL, _messages_only

#: (algorithm, way) per collective. ``mpi`` is MPI's own call for reduce_scatter and allgather:
#: MPICH ends the whole job on a length that differs ("Message truncated"), as for allreduce.
#: A broadcast agrees on the call before it sends anything, so its ``mpi`` is covered too.
#: ``shared_memory`` runs on the node's shared window either way (``direct`` here), and
#: ``hierarchical`` on one node takes its node's forms.
REDUCE_SCATTER = [("ring", "messages"), ("recursive_halving", "messages"), ("pairwise", "direct"),
                  ("pairwise", "messages"), ("shared_memory", "direct"), ("hierarchical", "direct"),
                  ("hierarchical", "messages")]
ALLGATHER = [("ring", "messages"), ("recursive_doubling", "messages"), ("pairwise", "direct"),
             ("pairwise", "messages"), ("shared_memory", "direct"), ("hierarchical", "direct"),
             ("hierarchical", "messages")]
BROADCAST = [("binomial", "messages"), ("scatter_allgather", "messages"), ("mpi", "messages"),
             ("direct", "direct"), ("direct", "messages"), ("shared_memory", "direct"), ("hierarchical", "direct"),
             ("hierarchical", "messages")]
NOT_TESTED = {"mpi"}

pytestmark = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() == 1, reason="a mismatch needs two ranks")


def test_every_algorithm_is_covered():
    assert {a for a, _ in REDUCE_SCATTER} | NOT_TESTED == set(reduce_scatters.ALGORITHMS)
    assert {a for a, _ in ALLGATHER} | NOT_TESTED == set(allgathers.ALGORITHMS)
    assert {a for a, _ in BROADCAST} == set(broadcasts.ALGORITHMS)


@pytest.fixture(scope="module")
def ways():
    from allreduce_kit import library_comm
    from allreduce_kit.algorithms import direct

    made = {"direct": MPI.COMM_WORLD.Dup(), "messages": _messages_only()}
    assert direct.peers_for(library_comm(made["direct"])) is not None, "direct transfers work on one node"
    yield made
    for comm in made.values():
        comm.Free()


class Guarded:
    """Buffers inside larger arrays whose ends hold ``SENTINEL``: a write past any of them, by
    this rank or a peer, shows."""

    def __init__(self):
        self.arenas = []

    def __call__(self, n: int, dtype, value) -> np.ndarray:
        arena = np.full(n + 2 * GUARD, SENTINEL, dtype=dtype)
        self.arenas.append((arena, n))
        buf = arena[GUARD:GUARD + n]
        buf[:] = value
        return buf

    def intact(self) -> bool:
        return all(np.all(a[:GUARD] == SENTINEL) and np.all(a[GUARD + n:] == SENTINEL) for a, n in self.arenas)


def run_mismatched(comm, call) -> str:
    """``call(guarded)`` on every rank; return its error message, after checking (on every rank
    together) that every rank raised ``ValueError``, the same one, that no rank's memory outside
    its buffers changed and that no message was left unreceived."""
    guarded = Guarded()
    try:
        call(guarded)
        outcome = ("returned", "")
    except ValueError as error:
        outcome = ("ValueError", str(error))
    except Exception as error:  # anything else is a failure too, reported with the rest
        outcome = (type(error).__name__, str(error))
    outcomes = comm.allgather((outcome, guarded.intact()))
    assert all(kind == "ValueError" for (kind, _), _ in outcomes), f"every rank raises ValueError: {outcomes}"
    assert len({message for (_, message), _ in outcomes}) == 1, f"the same message everywhere: {outcomes}"
    assert all(ok for _, ok in outcomes), "no rank's memory outside its buffers changed"
    assert_quiet(comm)
    return outcome[1]


def per_rank(values) -> str:
    return ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))


#: (base length, how much longer one rank's buffer is, which rank): a long buffer (past the
#: eager limits: MPI's rendezvous) one element longer, and a short one far longer.
LENGTHS = [(2**16, 1, "last"), (100, 10_000, "first")]
#: Another size of element, and the same size (only the signature tells those apart).
DTYPES = [("float32", "float64", "last"), ("float32", "int32", "first")]


def odd_rank(p: int, who: str) -> int:
    return p - 1 if who == "last" else 0


# -- reduce_scatter -------------------------------------------------------------------------------
def assert_reduce_scatter_works(comm, algorithm: str, n: int) -> None:
    p, rank = comm.Get_size(), comm.Get_rank()
    out = reduce_scatter(np.full(n, rank + 1.0), algorithm=algorithm, comm=comm)
    right = bool(out.size == np.diff(shard_bounds(n, p))[rank] and np.all(out == p * (p + 1) / 2))
    assert all(comm.allgather(right)), "the next well-formed call is right on every rank"
    assert_quiet(comm)


@pytest.mark.mpi
@pytest.mark.parametrize("base,extra,who", LENGTHS, ids=[f"{b}+{e}-{w}" for b, e, w in LENGTHS])
@pytest.mark.parametrize("algorithm,way", REDUCE_SCATTER, ids=[f"{a}-{w}" for a, w in REDUCE_SCATTER])
def test_reduce_scatter_length_differs(ways, algorithm, way, base, extra, who):
    comm = ways[way]
    p, rank = comm.Get_size(), comm.Get_rank()
    lengths = [base + (extra if r == odd_rank(p, who) else 0) for r in range(p)]

    def call(guarded):
        buf = guarded(lengths[rank], "float32", rank + 1)
        out = guarded(np.diff(shard_bounds(lengths[rank], p))[rank], "float32", 0)
        reduce_scatter(buf, out, algorithm=algorithm, comm=comm, check=False)

    message = run_mismatched(comm, call)
    assert message.startswith(f"reduce_scatter: buf length differs between ranks ({per_rank(lengths)})"), message
    assert message.endswith("every rank's out is left undefined")
    assert_reduce_scatter_works(comm, algorithm, base)


@pytest.mark.mpi
@pytest.mark.parametrize("common,other,who", DTYPES, ids=[f"{c}-{o}" for c, o, _ in DTYPES])
@pytest.mark.parametrize("algorithm,way", REDUCE_SCATTER, ids=[f"{a}-{w}" for a, w in REDUCE_SCATTER])
def test_reduce_scatter_dtype_differs(ways, algorithm, way, common, other, who):
    comm = ways[way]
    p, rank = comm.Get_size(), comm.Get_rank()
    dtypes = [other if r == odd_rank(p, who) else common for r in range(p)]

    def call(guarded):
        reduce_scatter(guarded(1000, dtypes[rank], rank + 1), algorithm=algorithm, comm=comm, check=False)

    message = run_mismatched(comm, call)
    assert message.startswith(f"reduce_scatter: buf dtype differs between ranks ({per_rank(dtypes)})"), message
    assert_reduce_scatter_works(comm, algorithm, 1000)


# -- allgather ------------------------------------------------------------------------------------
def assert_allgather_works(comm, algorithm: str, n: int) -> None:
    p, rank = comm.Get_size(), comm.Get_rank()
    lo, hi = shard_bounds(n, p)[rank:rank + 2]
    out = allgather(np.arange(lo, hi, dtype=np.float64), np.empty(n), algorithm=algorithm, comm=comm)
    assert all(comm.allgather(bool(np.array_equal(out, np.arange(n))))), "the next well-formed call is right"
    assert_quiet(comm)


def blocks_of(lengths) -> str:
    return per_rank(tuple(lengths_r) for lengths_r in lengths)


@pytest.mark.mpi
@pytest.mark.parametrize("base,extra,who", LENGTHS, ids=[f"{b}+{e}-{w}" for b, e, w in LENGTHS])
@pytest.mark.parametrize("algorithm,way", ALLGATHER, ids=[f"{a}-{w}" for a, w in ALLGATHER])
def test_allgather_out_length_differs(ways, algorithm, way, base, extra, who):
    """``out`` given, ``counts`` not: the blocks are the block rule's of ``out``'s length, which
    differs between ranks."""
    comm = ways[way]
    p, rank = comm.Get_size(), comm.Get_rank()
    totals = [base + (extra if r == odd_rank(p, who) else 0) for r in range(p)]
    views = [tuple(int(c) for c in np.diff(shard_bounds(n, p))) for n in totals]

    def call(guarded):
        out = guarded(totals[rank], "float32", 0)
        allgather(guarded(views[rank][rank], "float32", rank + 1), out, algorithm=algorithm, comm=comm, check=False)

    message = run_mismatched(comm, call)
    assert message.startswith(f"allgather: block lengths differs between ranks ({per_rank(views)})"), message
    assert message.endswith("every rank's out is left undefined")
    assert_allgather_works(comm, algorithm, base)


@pytest.mark.mpi
@pytest.mark.parametrize("who", ["first", "last"])
@pytest.mark.parametrize("algorithm,way", ALLGATHER, ids=[f"{a}-{w}" for a, w in ALLGATHER])
def test_allgather_counts_differ_with_the_same_total(ways, algorithm, way, who):
    """``counts`` (uneven blocks, legal) that differ between ranks: one rank's block is one
    element longer and the next rank's one shorter, in its list only; every list has the same
    total, so only the blocks tell the calls apart."""
    comm = ways[way]
    p, rank = comm.Get_size(), comm.Get_rank()
    common = [100 + 3 * r for r in range(p)]
    odd = odd_rank(p, who)
    views = [list(common) for _ in range(p)]
    views[odd][odd] += 1
    views[odd][(odd + 1) % p] -= 1

    def call(guarded):
        counts = views[rank]
        out = guarded(sum(counts), "float64", 0)
        allgather(guarded(counts[rank], "float64", rank + 1), out, counts=counts, algorithm=algorithm, comm=comm,
                  check=False)

    message = run_mismatched(comm, call)
    assert message.startswith(f"allgather: block lengths differs between ranks ({blocks_of(views)})"), message
    assert_allgather_works(comm, algorithm, sum(common))


@pytest.mark.mpi
@pytest.mark.parametrize("common,other,who", DTYPES, ids=[f"{c}-{o}" for c, o, _ in DTYPES])
@pytest.mark.parametrize("algorithm,way", ALLGATHER, ids=[f"{a}-{w}" for a, w in ALLGATHER])
def test_allgather_dtype_differs(ways, algorithm, way, common, other, who):
    """Neither ``out`` nor ``counts``: the lengths are exchanged, the dtypes differ."""
    comm = ways[way]
    p, rank = comm.Get_size(), comm.Get_rank()
    dtypes = [other if r == odd_rank(p, who) else common for r in range(p)]

    def call(guarded):
        allgather(guarded(300 + rank, dtypes[rank], rank + 1), algorithm=algorithm, comm=comm, check=False)

    message = run_mismatched(comm, call)
    assert message.startswith(f"allgather: block dtype differs between ranks ({per_rank(dtypes)})"), message
    assert_allgather_works(comm, algorithm, 1000)


# -- broadcast ------------------------------------------------------------------------------------
def assert_broadcast_works(comm, algorithm: str, n: int) -> None:
    p, rank = comm.Get_size(), comm.Get_rank()
    buf = broadcast(np.full(n, rank, np.int64), p - 1, algorithm=algorithm, comm=comm)
    assert all(comm.allgather(bool(np.all(buf == p - 1)))), "the next well-formed call is right on every rank"
    assert_quiet(comm)


@pytest.mark.mpi
@pytest.mark.parametrize("base,extra,who", LENGTHS, ids=[f"{b}+{e}-{w}" for b, e, w in LENGTHS])
@pytest.mark.parametrize("algorithm,way", BROADCAST, ids=[f"{a}-{w}" for a, w in BROADCAST])
def test_broadcast_length_differs(ways, algorithm, way, base, extra, who):
    comm = ways[way]
    p, rank = comm.Get_size(), comm.Get_rank()
    lengths = [base + (extra if r == odd_rank(p, who) else 0) for r in range(p)]

    def call(guarded):
        broadcast(guarded(lengths[rank], "float32", rank + 1), 0, algorithm=algorithm, comm=comm, check=False)

    message = run_mismatched(comm, call)
    assert message.startswith(f"broadcast: buf length differs between ranks ({per_rank(lengths)})"), message
    assert_broadcast_works(comm, algorithm, base)


@pytest.mark.mpi
@pytest.mark.parametrize("common,other,who", DTYPES, ids=[f"{c}-{o}" for c, o, _ in DTYPES])
@pytest.mark.parametrize("algorithm,way", BROADCAST, ids=[f"{a}-{w}" for a, w in BROADCAST])
def test_broadcast_dtype_differs(ways, algorithm, way, common, other, who):
    comm = ways[way]
    p, rank = comm.Get_size(), comm.Get_rank()
    dtypes = [other if r == odd_rank(p, who) else common for r in range(p)]

    def call(guarded):
        broadcast(guarded(1000, dtypes[rank], rank + 1), p - 1, algorithm=algorithm, comm=comm, check=False)

    message = run_mismatched(comm, call)
    assert message.startswith(f"broadcast: buf dtype differs between ranks ({per_rank(dtypes)})"), message
    assert_broadcast_works(comm, algorithm, 1000)


#: Which root each rank names: one rank another root than the rest, and each rank itself.
ROOTS = {"one": lambda r, p: 1 if r == p // 2 else 0, "own": lambda r, p: r}


@pytest.mark.mpi
@pytest.mark.parametrize("roots", sorted(ROOTS))
@pytest.mark.parametrize("algorithm,way", BROADCAST, ids=[f"{a}-{w}" for a, w in BROADCAST])
def test_broadcast_root_differs(ways, algorithm, way, roots):
    comm = ways[way]
    p, rank = comm.Get_size(), comm.Get_rank()
    named = [ROOTS[roots](r, p) for r in range(p)]

    def call(guarded):
        broadcast(guarded(70_000, "float32", rank + 1), named[rank], algorithm=algorithm, comm=comm, check=False)

    message = run_mismatched(comm, call)
    assert message.startswith(f"broadcast: root differs between ranks ({per_rank(named)})"), message
    assert_broadcast_works(comm, algorithm, 1000)


# -- the nonblocking forms ------------------------------------------------------------------------
NONBLOCKING = {
    "ireduce_scatter": lambda comm, guarded, n, algorithm: ireduce_scatter(
        guarded(n, "float32", 1), algorithm=algorithm, comm=comm, check=False),
    "iallgather": lambda comm, guarded, n, algorithm: iallgather(
        guarded(np.diff(shard_bounds(n, comm.Get_size()))[comm.Get_rank()], "float32", 1), guarded(n, "float32", 0),
        algorithm=algorithm, comm=comm, check=False),
    "ibroadcast": lambda comm, guarded, n, algorithm: ibroadcast(
        guarded(n, "float32", 1), 0, algorithm=algorithm, comm=comm, check=False),
}
#: (nonblocking form, algorithm, way): each form's one-node path and a message path.
NONBLOCKING_CASES = [("ireduce_scatter", "pairwise", "direct"), ("ireduce_scatter", "ring", "messages"),
                     ("iallgather", "pairwise", "direct"), ("iallgather", "recursive_doubling", "messages"),
                     ("ibroadcast", "direct", "direct"), ("ibroadcast", "binomial", "messages")]


@pytest.mark.mpi
@pytest.mark.parametrize("form,algorithm,way", NONBLOCKING_CASES, ids=["-".join(c) for c in NONBLOCKING_CASES])
def test_nonblocking_length_differs(ways, form, algorithm, way):
    """``wait()`` raises what the blocking collective raises, on every rank."""
    comm = ways[way]
    p, rank = comm.Get_size(), comm.Get_rank()
    lengths = [1000 + (7 if r == p // 2 else 0) for r in range(p)]
    message = run_mismatched(comm, lambda guarded: NONBLOCKING[form](comm, guarded, lengths[rank], algorithm).wait())
    blocking = form[1:]
    assert message.startswith(f"{blocking}: "), message
    if blocking == "allgather":
        views = [tuple(int(c) for c in np.diff(shard_bounds(n, p))) for n in lengths]
        assert f"block lengths differs between ranks ({per_rank(views)})" in message
    else:
        assert f"buf length differs between ranks ({per_rank(lengths)})" in message
    NONBLOCKING[form](comm, Guarded(), 1000, algorithm).wait()
    assert_quiet(comm)
