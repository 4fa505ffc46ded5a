"""reduce_scatter, allgather and broadcast: every algorithm matches MPI's own collective for
every op, dtype and awkward length; blocks follow the one block rule; a malformed call raises
before anything is sent, naming the argument; with ``check=True`` a call that differs between
ranks raises the same ``ValueError`` on every rank; nothing is left unreceived.
"""
import itertools

import numpy as np
import pytest
from mpi4py import MPI

from allreduce_kit import OPS, allgather, blocks, broadcast, reduce_scatter, shard_bounds
from allreduce_kit.algorithms import allgather as allgathers
from allreduce_kit.algorithms import broadcast as broadcasts
from allreduce_kit.algorithms import reduce_scatter as reduce_scatters
from allreduce_kit.comm import library_comm
from allreduce_kit.stall import INSPECTOR
from conftest import EVERY_COMBINATION_UP_TO, assert_quiet, assert_same_everywhere, cases, release
from test_allreduce import DTYPES, float_tolerance, local_values, oracle


#: A large-ish odd length: several pieces per block, and past ``auto``'s small-message tables.
LARGE = 2**15 + 3


def lengths(p: int, large: bool = True):
    """Lengths that break naive splitting: empty, fewer than p, around p, odd, and large-ish."""
    return sorted({0, 1, max(p - 1, 0), p + 1, 1000} | ({LARGE} if large else set()))


def own_block(x: np.ndarray, comm) -> np.ndarray:
    lo, hi = blocks.block(x.size, comm.Get_size(), comm.Get_rank())
    return x[lo:hi]


def test_every_collective_has_mpi_and_the_schedules_it_promises():
    assert {"mpi", "ring", "recursive_halving", "pairwise"} <= set(reduce_scatters.ALGORITHMS)
    assert {"mpi", "ring", "recursive_doubling", "pairwise"} <= set(allgathers.ALGORITHMS)
    assert {"mpi", "binomial", "scatter_allgather", "direct"} <= set(broadcasts.ALGORITHMS)


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", sorted(reduce_scatters.ALGORITHMS) + ["auto"])
def test_reduce_scatter_matches_mpi(comm, algorithm):
    ops = OPS if algorithm != "auto" else ("sum",)  # auto runs one of the others
    for (dtype, op), n in cases(comm, list(itertools.product(DTYPES, ops)), lengths(comm.Get_size())):
        if n == LARGE and op != "sum" and comm.Get_size() <= EVERY_COMBINATION_UP_TO:
            continue  # the large length once per dtype: time
        case = f"{dtype} {op} n={n}"
        x = local_values(n, dtype, comm.Get_rank())
        before = x.copy()
        expected = own_block(oracle(comm, x, op), comm)
        out = np.full(expected.size, 7, x.dtype)
        result = reduce_scatter(x, out, op=op, algorithm=algorithm, comm=comm)
        assert result is out, "reduce_scatter returns out"
        assert np.array_equal(x, before), f"{case}: buf was modified"
        if x.dtype.kind == "i" or op in ("max", "min"):
            assert np.array_equal(out, expected), f"{case}: integers, max and min must match MPI exactly"
        else:
            error = np.abs(out.astype(np.float64) - expected)
            assert np.all(error <= own_block(float_tolerance(comm, x, op), comm)), f"{case}: {error.max()}"
    assert_quiet(comm)


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", sorted(allgathers.ALGORITHMS) + ["auto"])
def test_allgather_matches_mpi(comm, algorithm):
    p, rank = comm.Get_size(), comm.Get_rank()
    for dtype, n in cases(comm, DTYPES, lengths(p)):
        whole = local_values(n, dtype, 0)  # the same on every rank
        out = np.zeros(n, dtype)
        assert allgather(own_block(whole, comm).copy(), out, algorithm=algorithm, comm=comm) is out
        assert np.array_equal(out, whole), f"{dtype} n={n}: blocks of the rule"
        counts = [(n + 3 * r) % 7 for r in range(p)]  # uneven, some empty: Allgatherv's case
        mine = local_values(counts[rank], dtype, rank)
        expected = np.empty(sum(counts), dtype)
        comm.Allgatherv(mine, [expected, (counts, list(np.cumsum([0] + counts[:-1])))])
        assert np.array_equal(allgather(mine, counts=counts, algorithm=algorithm, comm=comm), expected)
        assert np.array_equal(allgather(mine, algorithm=algorithm, comm=comm), expected), "lengths exchanged"
        assert_same_everywhere(comm, out)
    assert_quiet(comm)


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", sorted(broadcasts.ALGORITHMS) + ["auto"])
def test_broadcast_matches_mpi(comm, algorithm):
    p, rank = comm.Get_size(), comm.Get_rank()
    for dtype, n, root in cases(comm, DTYPES, lengths(p), sorted({0, p - 1, p // 2})):
        x = local_values(n, dtype, rank)
        expected = x.copy()
        comm.Bcast(expected, root)
        assert broadcast(x, root, algorithm=algorithm, comm=comm) is x
        assert np.array_equal(x, expected), f"{dtype} n={n} root={root}"
    assert_quiet(comm)


@pytest.mark.mpi
def test_closed_forms_on_every_communicator(any_comm):
    p, rank = any_comm.Get_size(), any_comm.Get_rank()
    n = 3 * p + 2
    reduced = reduce_scatter(np.full(n, rank + 1, np.int64), comm=any_comm)
    assert reduced.size == blocks.counts(n, p)[rank] and np.all(reduced == p * (p + 1) // 2)
    lo, hi = shard_bounds(n, p)[rank:rank + 2]
    assert np.array_equal(allgather(np.arange(lo, hi, dtype=np.float64), np.empty(n), comm=any_comm), np.arange(n))
    assert np.array_equal(broadcast(np.full(n, rank, np.int32), root=p - 1, comm=any_comm), np.full(n, p - 1))
    assert_quiet(any_comm)


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", sorted(reduce_scatters.ALGORITHMS))
def test_reduce_scatter_into_buf_own_block(comm, algorithm):
    """``out`` may be ``buf``'s own block: the reduced block replaces it (the sharded step's case)."""
    p, rank = comm.Get_size(), comm.Get_rank()
    x = np.arange(10 * p + 3, dtype=np.float64) + rank
    expected = own_block(oracle(comm, x, "sum"), comm)
    mine = own_block(x, comm)
    assert reduce_scatter(x, mine, algorithm=algorithm, comm=comm) is mine
    assert np.array_equal(mine, expected)
    assert_quiet(comm)


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", sorted(allgathers.ALGORITHMS))
def test_allgather_from_out_own_block(comm, algorithm):
    """``block`` may be ``out``'s own slot: nothing is copied, the others' blocks fill in around it."""
    p = comm.Get_size()
    out = np.zeros(4 * p + 1, np.int32)
    mine = own_block(out, comm)
    mine[:] = comm.Get_rank() + 1
    allgather(mine, out, algorithm=algorithm, comm=comm)
    assert np.array_equal(out, np.repeat(np.arange(1, p + 1), blocks.counts(out.size, p)))
    assert_quiet(comm)


@pytest.mark.mpi
@pytest.mark.parametrize("call", ["reduce_scatter", "allgather", "broadcast"])
def test_every_call_is_watched_by_the_stall_inspector(comm, call, monkeypatch):
    registry = {"reduce_scatter": reduce_scatters, "allgather": allgathers, "broadcast": broadcasts}[call]
    seen = []
    ring = registry.ALGORITHMS["mpi"]
    monkeypatch.setitem(registry.ALGORITHMS, "mpi", lambda *args: (seen.append(INSPECTOR.current), ring(*args)))
    x = np.ones(comm.Get_size() * 2)
    {"reduce_scatter": lambda: reduce_scatter(x, algorithm="mpi", comm=comm, stall_timeout=30),
     "allgather": lambda: allgather(own_block(x, comm).copy(), x, algorithm="mpi", comm=comm, stall_timeout=30),
     "broadcast": lambda: broadcast(x, algorithm="mpi", comm=comm, stall_timeout=30)}[call]()
    if comm.Get_size() > 1:
        watch, timeout, what, _ = seen[0]
        assert watch is not None and timeout == 30 and what.startswith(f"{call}(algorithm='mpi'")
    assert INSPECTOR.current is None
    assert_quiet(comm)


def read_only(n=4):
    x = np.ones(n)
    x.setflags(write=False)
    return x


#: A buffer whose other part a bad call passes as ``out``.
WHOLE = np.ones(16)


def _block_len(comm):
    return blocks.counts(8, comm.Get_size())[comm.Get_rank()]


def _shifted_block(comm):
    """A slice of ``WHOLE`` as long as this rank's block of ``WHOLE[:8]``, one element off, still
    overlapping ``WHOLE[:8]``."""
    lo, hi = blocks.block(8, comm.Get_size(), comm.Get_rank())
    shift = 1 if lo + 1 < 8 else -1
    return WHOLE[lo + shift:hi + shift]


BAD_CALLS = [
    # (description, call(comm, check), exception, words the message must hold)
    ("reduce_scatter of a list", lambda c, k: reduce_scatter([1.0], comm=c, check=k), TypeError,
     "reduce_scatter: buf must be a numpy.ndarray"),
    ("reduce_scatter of float16", lambda c, k: reduce_scatter(np.ones(4, np.float16), comm=c, check=k), TypeError,
     "reduce_scatter: buf has unsupported dtype"),
    ("reduce_scatter of a strided buf", lambda c, k: reduce_scatter(np.ones(8)[::2], comm=c, check=k), ValueError,
     "reduce_scatter: buf must be C-contiguous"),
    ("reduce_scatter with an unknown op", lambda c, k: reduce_scatter(np.ones(8), op="avg", comm=c, check=k),
     ValueError, "reduce_scatter: unknown op 'avg'"),
    ("reduce_scatter with an unknown algorithm", lambda c, k: reduce_scatter(np.ones(8), algorithm="x", comm=c,
                                                                            check=k), ValueError, "unknown algorithm 'x'"),
    ("reduce_scatter into out of another length", lambda c, k: reduce_scatter(np.ones(8), np.ones(9), comm=c, check=k),
     ValueError, "reduce_scatter: out has 9 elements, but rank"),
    ("reduce_scatter into out of another dtype", lambda c, k: reduce_scatter(
        np.ones(8), np.ones(_block_len(c), np.float32), comm=c, check=k), TypeError, "out has dtype float32"),
    ("reduce_scatter into read-only out", lambda c, k: reduce_scatter(np.ones(8), read_only(_block_len(c)), comm=c,
                                                                      check=k), ValueError, "out is read-only"),
    ("reduce_scatter into another part of buf", lambda c, k: reduce_scatter(
        WHOLE[:8], _shifted_block(c), comm=c, check=k), ValueError, "out overlaps buf"),
    ("reduce_scatter with a bad stall_timeout", lambda c, k: reduce_scatter(np.ones(8), comm=c, check=k,
                                                                            stall_timeout=-1), ValueError, "stall_timeout"),
    ("allgather of a list", lambda c, k: allgather([1.0], comm=c, check=k), TypeError,
     "allgather: block must be a numpy.ndarray"),
    ("allgather of a block of another length than the rule's", lambda c, k: allgather(np.ones(9), np.ones(8), comm=c,
                                                                                       check=k),
     ValueError, "allgather: block has 9 elements"),
    ("allgather with counts of another length", lambda c, k: allgather(np.ones(1), counts=[1], comm=c, check=k)
     if c.Get_size() != 1 else allgather(np.ones(1), counts=[1, 1], comm=c, check=k), ValueError,
     "counts must have one length per rank"),
    ("allgather with a negative count", lambda c, k: allgather(np.ones(0), counts=[-1] * c.Get_size(), comm=c,
                                                               check=k), ValueError, "counts must be >= 0"),
    ("allgather into out of another dtype", lambda c, k: allgather(np.ones(2), np.ones(2 * c.Get_size(), np.int32),
                                                                   comm=c, check=k), TypeError, "out has dtype int32"),
    ("allgather into read-only out", lambda c, k: allgather(np.ones(4), read_only(4 * c.Get_size()), comm=c, check=k),
     ValueError, "out is read-only"),
    ("broadcast from a root out of range", lambda c, k: broadcast(np.ones(4), root=c.Get_size(), comm=c, check=k),
     ValueError, "broadcast: root must be a rank in 0.."),
    ("broadcast from a root that is not an int", lambda c, k: broadcast(np.ones(4), root=0.0, comm=c, check=k),
     TypeError, "broadcast: root must be an int"),
    ("broadcast into read-only buf", lambda c, k: broadcast(read_only(), root=c.Get_size() - 1, comm=c, check=k)
     if c.Get_rank() != c.Get_size() - 1 else broadcast(read_only(), root=0, comm=c, check=k)
     if c.Get_size() > 1 else broadcast(np.ones(2), algorithm=1, comm=c, check=k),
     (ValueError, TypeError), "read-only|algorithm must be a name"),
    ("broadcast with an unknown algorithm", lambda c, k: broadcast(np.ones(4), algorithm="flood", comm=c, check=k),
     ValueError, "broadcast: unknown algorithm 'flood'"),
]


@pytest.mark.mpi
@pytest.mark.parametrize("description, call, error, words", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_call_raises_on_every_rank_before_sending(comm, description, call, error, words):
    for check in (False, True):
        with pytest.raises(error, match=words):
            call(comm, check)
        assert_quiet(comm)
        good = reduce_scatter(np.ones(3 * comm.Get_size()), comm=comm)
        assert np.all(good == comm.Get_size()), f"check={check}"


MISMATCHES = [
    # (description, call(comm), words the message must hold)
    ("reduce_scatter lengths", lambda c: reduce_scatter(np.ones(17 + c.Get_rank()), comm=c, check=True),
     "reduce_scatter(check=True): buf length differs between ranks (rank 0: 17, rank 1: 18"),
    ("reduce_scatter dtypes", lambda c: reduce_scatter(np.ones(8, np.float32 if c.Get_rank() % 2 else np.float64),
                                                       comm=c, check=True), "buf dtype differs between ranks"),
    ("reduce_scatter ops", lambda c: reduce_scatter(np.ones(8), op="sum" if c.Get_rank() else "max", comm=c, check=True),
     "op differs between ranks"),
    ("reduce_scatter algorithms", lambda c: reduce_scatter(np.ones(8), algorithm="ring" if c.Get_rank() else "mpi",
                                                           comm=c, check=True), "algorithm differs between ranks"),
    ("allgather total lengths", lambda c: allgather(np.ones(blocks.counts(17 + c.Get_rank(), c.Get_size())[c.Get_rank()]),
                                                    np.ones(17 + c.Get_rank()), comm=c, check=True),
     "allgather(check=True): block lengths differs between ranks"),
    ("allgather counts", lambda c: allgather(np.ones(1), counts=[1] * (c.Get_size() - 1) + [2 + c.Get_rank()]
                                             if c.Get_rank() != c.Get_size() - 1 else [1] * c.Get_size(),
                                             comm=c, check=True), "block lengths differs between ranks"),
    ("allgather dtypes", lambda c: allgather(np.ones(2, np.int32 if c.Get_rank() else np.int64), comm=c, check=True),
     "block dtype differs between ranks"),
    ("broadcast lengths", lambda c: broadcast(np.ones(17 + c.Get_rank()), comm=c, check=True),
     "broadcast(check=True): buf length differs between ranks"),
    ("broadcast roots", lambda c: broadcast(np.ones(4), root=c.Get_rank() % 2, comm=c, check=True),
     "root differs between ranks"),
]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("description, call, words", MISMATCHES, ids=[c[0] for c in MISMATCHES])
def test_check_raises_the_same_error_on_every_rank(comm, description, call, words):
    with pytest.raises(ValueError) as raised:
        call(comm)
    assert words in str(raised.value)
    messages = comm.allgather(str(raised.value))
    assert all(m == messages[0] for m in messages), "every rank raises the same error"
    assert_quiet(comm)


@pytest.mark.mpi(min_size=2)
def test_check_catches_a_bad_call_on_one_rank_only(comm):
    x = np.ones(8) if comm.Get_rank() != 1 else np.ones(8, np.float16)
    words = "unsupported dtype" if comm.Get_rank() == 1 else r"reduce_scatter\(check=True\): rank 1 failed: .*unsupported"
    with pytest.raises(TypeError, match=words):
        reduce_scatter(x, comm=comm, check=True)
    assert_quiet(comm)


@pytest.mark.mpi
def test_pairwise_reduce_scatter_gives_the_bits_of_two_shot(comm):
    """Rank r folds its own copy of block r and then ranks r+1, r+2, ... in order, as
    ``two_shot`` folds segment r: bitwise the same block, floats included."""
    from allreduce_kit import allreduce

    for n in (5, 1000, LARGE):
        x = local_values(n, "float32", comm.Get_rank())
        reduced = allreduce(x.copy(), algorithm="two_shot", comm=comm)
        assert np.array_equal(reduce_scatter(x, algorithm="pairwise", comm=comm), own_block(reduced, comm))
    assert_quiet(comm)


@pytest.mark.mpi
def test_reduce_scatter_of_parts_is_pairwise_on_the_parts_laid_end_to_end(comm):
    """``reduce_scatter_parts``, a model's gradients reduced where they lie: for parts of awkward
    lengths (empty ones, parts that a block starts or ends inside, more parts than elements per
    rank), small and large, every op and float dtype, block r is bitwise ``pairwise``'s on the
    concatenation where ``auto`` would run ``pairwise`` on one node (read from the parts, no
    buffer asked for), else MPI's result (the parts copied into the buffer, then
    ``reduce_scatter``)."""
    from allreduce_kit.collectives.reduce_scatter import reduce_scatter_parts

    p, rank = comm.Get_size(), comm.Get_rank()
    for sizes in ((3, 0, 7, 1, 2), (LARGE, 0, 1, 2 * LARGE + 1, 5), (40000, 40000)):
        for dtype, op in itertools.product(("float32", "float64"), ("sum", "mean", "max")):
            parts = [local_values(n, dtype, rank * 31 + i) for i, n in enumerate(sizes)]
            whole = np.concatenate(parts)
            lo, hi = shard_bounds(whole.size, p)[rank:rank + 2]
            asked = []

            def buffer(n):
                asked.append(n)
                return np.empty(n, dtype)

            got = reduce_scatter_parts(parts, np.empty(hi - lo, dtype), buffer, op=op, comm=comm)
            direct = p > 1 and reduce_scatters.choose(library_comm(comm), whole.nbytes) == "pairwise"
            if direct:
                assert np.array_equal(got, reduce_scatter(whole, op=op, algorithm="pairwise", comm=comm))
            else:
                assert np.all(np.abs(got - own_block(oracle(comm, whole, op), comm))
                              <= own_block(float_tolerance(comm, whole, op), comm)), (sizes, dtype, op)
            assert asked == ([] if direct else [whole.size]), (sizes, dtype, op)
    assert_quiet(comm)


@pytest.mark.mpi(min_size=2)
def test_one_node_forms_give_the_bits_of_their_messages(comm):
    """``pairwise`` and broadcast's ``direct`` read and write peers' memory on one node, and send
    messages where they cannot (a communicator made with ``ALLREDUCE_KIT_DIRECT=0``): the same
    folds in the same order either way."""
    from test_mismatch import _messages_only

    messages = _messages_only()
    try:
        p, rank = comm.Get_size(), comm.Get_rank()
        for n in (3, 1000, LARGE):
            x = local_values(n, "float64", rank)
            for op in ("sum", "mean", "max"):
                assert np.array_equal(reduce_scatter(x, op=op, algorithm="pairwise", comm=comm),
                                      reduce_scatter(x, op=op, algorithm="pairwise", comm=messages))
            lo, hi = shard_bounds(n, p)[rank:rank + 2]
            assert np.array_equal(allgather(x[lo:hi], np.empty(n), algorithm="pairwise", comm=comm),
                                  allgather(x[lo:hi], np.empty(n), algorithm="pairwise", comm=messages))
            assert np.array_equal(broadcast(x.copy(), p - 1, algorithm="direct", comm=comm),
                                  broadcast(x.copy(), p - 1, algorithm="direct", comm=messages))
        assert_quiet(messages)
    finally:
        release(messages)


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ["auto", "shared_memory", "mpi"])
def test_the_same_call_again_follows_new_values_and_rechecks_what_changed(algorithm):
    """A loop that calls a collective on the same arrays (on ``COMM_WORLD``, which keeps the call
    to skip its checks) gets each call's own result, for each dtype, and a call with another
    array, shape or dtype is checked again."""
    world = MPI.COMM_WORLD
    p, rank = world.Get_size(), world.Get_rank()
    n = 3 * p + 1
    lo, hi = blocks.block(n, p, rank)
    bounds = shard_bounds(n, p)
    for dtype in (np.float64, np.int64, np.float32):
        buf, gathered = np.empty(n, dtype), np.empty(n, dtype)
        reduced, block = np.empty(hi - lo, dtype), np.empty(hi - lo, dtype)
        for step in range(4):
            comm = None if step % 2 else world  # comm not given, or COMM_WORLD: the same call
            buf[:] = np.arange(n) * (rank + 1) + step
            reduce_scatter(buf, reduced, algorithm=algorithm, comm=comm)
            sums = np.arange(n) * p * (p + 1) // 2 + p * step
            assert np.array_equal(reduced, sums[lo:hi]), f"{dtype} step {step}"
            block[:] = reduced + rank
            allgather(block, gathered, algorithm=algorithm, comm=comm)
            expected = np.concatenate([sums[a:b] + r for r, (a, b) in enumerate(zip(bounds, bounds[1:]))])
            assert np.array_equal(gathered, expected), f"{dtype} step {step}"
            root = step % p
            buf[:] = step * 10 + rank
            broadcast(buf, root, algorithm=algorithm, comm=comm)
            assert np.all(buf == step * 10 + root), f"{dtype} step {step}"
    with pytest.raises(TypeError, match="out has dtype float64"):
        reduce_scatter(buf, reduced.astype(np.float64), algorithm=algorithm)
    with pytest.raises(ValueError, match="block has"):
        allgather(block, np.empty(n + p, np.float32), algorithm=algorithm)
    with pytest.raises(ValueError, match="root must be a rank"):
        broadcast(buf, p, algorithm=algorithm)
    assert_quiet(world)
