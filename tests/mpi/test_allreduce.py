"""Every algorithm matches MPI's own Allreduce, for every op, dtype and awkward length.

Each rank fills its buffer with its own values, checks its own result against MPI's, and all
ranks must end with bitwise the same result.
"""
import itertools
import os
import time

import numpy as np
import pytest
from mpi4py import MPI

from allreduce_kit import ALGORITHMS, OPS, allreduce, library_comm, online
from conftest import assert_quiet, assert_same_everywhere, cases

DTYPES = ("float32", "float64", "int32", "int64")
#: The algorithms that read their peers' buffers directly on one node (``direct.py``).
DIRECT = ("ring", "rabenseifner", "two_shot")
MPI_OP = {"sum": MPI.SUM, "mean": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}


def lengths(p: int):
    """Lengths that break naive splitting: empty, fewer than p, around p, odd, and large."""
    return sorted({0, 1, max(p - 1, 0), p, p + 1, 1000, 2**20 + 3})


def local_values(n: int, dtype: str, rank: int) -> np.ndarray:
    rng = np.random.default_rng([n, rank])
    if dtype.startswith("int"):
        return rng.integers(-9, 10, n).astype(dtype)  # |prod| <= 9**8 fits in int32
    return rng.standard_normal(n).astype(dtype)


def oracle(comm, x: np.ndarray, op: str) -> np.ndarray:
    """MPI's answer; mean is MPI's sum divided by p (truncating toward zero for integers)."""
    expected = x.copy()
    comm.Allreduce(MPI.IN_PLACE, expected, op=MPI_OP[op])
    if op == "mean":
        p = comm.Get_size()
        expected = (expected / p).astype(x.dtype) if x.dtype.kind == "f" else np.trunc(expected / p).astype(x.dtype)
    return expected


def float_tolerance(comm, x: np.ndarray, op: str) -> np.ndarray:
    """Any summation order is within (p-1) eps sum|x_i| of the exact sum: allow twice that."""
    p, eps = comm.Get_size(), np.finfo(x.dtype).eps
    if op in ("sum", "mean"):
        total = np.abs(x).astype(np.float64)
        comm.Allreduce(MPI.IN_PLACE, total, op=MPI.SUM)
        return 2 * p * eps * total / (p if op == "mean" else 1)
    if op == "prod":
        return 2 * p * eps * np.abs(oracle(comm, x, op)).astype(np.float64)
    return np.zeros(x.shape)  # max and min are exact


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS) + ["auto"])
def test_matches_mpi_allreduce(comm, algorithm):
    """Every op, dtype and awkward length (``cases``), on one communicator per algorithm (each
    test's own communicator costs the library a clone and its set-up: a test per case would
    multiply it)."""
    for (dtype, op), n in cases(comm, list(itertools.product(DTYPES, OPS)), lengths(comm.Get_size())):
        case = f"{dtype} {op} n={n}"
        x = local_values(n, dtype, comm.Get_rank())
        expected = oracle(comm, x, op)
        tolerance = float_tolerance(comm, x, op) if x.dtype.kind == "f" else None
        result = allreduce(x, op=op, algorithm=algorithm, comm=comm)
        assert result is x, "allreduce works in place and returns its buffer"
        if tolerance is None:
            assert np.array_equal(x, expected), f"{case}: integers must match MPI exactly"
        else:
            error = np.abs(x.astype(np.float64) - expected)
            assert np.all(error <= tolerance), f"{case}: max error {error.max()} beyond tolerance"
        assert_same_everywhere(comm, x)
        assert_quiet(comm)


@pytest.mark.mpi
def test_closed_form_sum_on_every_communicator(any_comm):
    """On any communicator, ranks 0..p-1 holding rank+1 sum to p(p+1)/2 exactly."""
    p, rank = any_comm.Get_size(), any_comm.Get_rank()
    for algorithm in sorted(ALGORITHMS):
        for n in (1, p + 1, 1000):
            x = np.full(n, rank + 1, dtype=np.float64)
            allreduce(x, op="sum", algorithm=algorithm, comm=any_comm)
            assert np.all(x == p * (p + 1) / 2), f"{algorithm} n={n}"
            assert_quiet(any_comm)


@pytest.mark.mpi
def test_integer_overflow_wraps_as_in_mpi(comm):
    for algorithm in sorted(ALGORITHMS):
        x = np.full(7, np.iinfo(np.int32).max - comm.Get_rank(), dtype=np.int32)
        expected = oracle(comm, x, "sum")
        allreduce(x, op="sum", algorithm=algorithm, comm=comm)
        assert np.array_equal(x, expected), algorithm


@pytest.mark.mpi
def test_multidimensional_buffer_keeps_its_shape(comm):
    for algorithm in sorted(ALGORITHMS):
        x = np.ones((3, 5, 7), dtype=np.float32)
        allreduce(x, op="sum", algorithm=algorithm, comm=comm)
        assert x.shape == (3, 5, 7) and np.all(x == comm.Get_size()), algorithm


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ["ring", "rabenseifner", "two_shot"])
def test_reduce_scatter_in_pieces_gives_the_same_bits(comm, algorithm, monkeypatch):
    """Sent in cache-sized pieces (forced here with tiny pieces, at any rank count), the result
    is bitwise what the whole-range steps give, for lengths that do not split evenly. (On a
    communicator that keeps to messages: with direct reads there are no messages to cut.)"""
    from allreduce_kit.algorithms import pieces

    messages = _by_messages_too(comm)
    lib = library_comm(messages)
    try:
        for n in (comm.Get_size() + 1, 1000, 4099):
            x = local_values(n, "float32", comm.Get_rank())
            whole = allreduce(x.copy(), op="mean", algorithm=algorithm, comm=messages)
            monkeypatch.setattr(lib, "oversubscribed", False)
            monkeypatch.setattr(pieces, "PIECE", 64)  # bytes: 16 float32 per piece
            pieced = allreduce(x.copy(), op="mean", algorithm=algorithm, comm=messages)
            monkeypatch.undo()
            assert np.array_equal(pieced, whole)
            assert_same_everywhere(comm, pieced)
            assert_quiet(messages)
    finally:
        messages.Free()


@pytest.mark.mpi
def test_kernels_use_only_this_ranks_share_of_the_node(comm, monkeypatch):
    """p ranks on a node of c cores fold with max(1, c // p) threads each, unless the user set
    NUMBA_NUM_THREADS or OMP_NUM_THREADS: more would make the ranks fight for cores. Here c is
    set through every rank's affinity mask (all its cores, then one), p counted by host name."""
    for name in list(os.environ):
        if name in ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS") or name.startswith("SLURM_"):
            monkeypatch.delenv(name)
    hosts = comm.allgather(MPI.Get_processor_name())
    on_my_node = hosts.count(MPI.Get_processor_name())
    mine = os.sched_getaffinity(0)
    one = {min(comm.allgather(min(mine)))}  # the same core on every rank
    try:
        for cores in (mine, one):
            os.sched_setaffinity(0, cores)
            for setting in (None, "3"):
                if setting:
                    monkeypatch.setenv("NUMBA_NUM_THREADS", setting)
                fresh = comm.Dup()  # a new library communicator counts again
                try:
                    lib = library_comm(fresh)
                    want = int(setting) if setting else max(1, len(cores) // on_my_node)
                    assert lib.threads == want, (len(cores), on_my_node, setting)
                    assert lib.reductions["sum"].threads == want
                finally:
                    fresh.Free()
                    monkeypatch.delenv("NUMBA_NUM_THREADS", raising=False)
    finally:
        os.sched_setaffinity(0, mine)


@pytest.mark.mpi
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("algorithm", ["recursive_doubling", "naive", "tree"])
def test_compiled_message_loop_gives_the_bits_of_the_python_loop(comm, op, algorithm, monkeypatch):
    """Recursive doubling, naive and tree run a small buffer's messages in compiled code,
    calling the C ``MPI_Sendrecv``, ``MPI_Send`` and ``MPI_Recv`` of the MPI library mpi4py
    loaded; forced onto the Python loop (mpi4py's), each must give bitwise the same result, for
    every op and dtype."""
    from allreduce_kit.algorithms import native, signature

    if signature.PROBE_FIRST:
        pytest.skip("the compiled loops are off under Open MPI (see algorithms/native.py)")
    assert native.AVAILABLE, "the compiled path finds MPI's C functions in the MPI library mpi4py uses"
    for dtype in DTYPES:
        for n in (1, 3, comm.Get_size() + 1, 1000):
            x = local_values(n, dtype, comm.Get_rank())
            compiled = allreduce(x.copy(), op=op, algorithm=algorithm, comm=comm)
            monkeypatch.setattr(native, "MAX_BYTES", 0)  # every buffer takes the Python loop
            plain = allreduce(x.copy(), op=op, algorithm=algorithm, comm=comm)
            monkeypatch.undo()
            assert np.array_equal(compiled, plain), f"{dtype} n={n}"
            assert_same_everywhere(comm, compiled)
            assert_quiet(comm)


@pytest.mark.mpi
@pytest.mark.parametrize("scatter_from", [0, 1 << 40], ids=["scattered", "whole"])
def test_shared_memory_rounds_reuse_the_window_safely(comm, scatter_from, monkeypatch):
    """On one node, ``shared_memory`` reduces through a window, not messages. A buffer larger
    than a slot goes in rounds through two alternating sets of slots (forced here with 256-byte
    slots), each round reduced scattered or whole. Calls of many lengths and dtypes, back to
    back with nothing between them, each match MPI and end identical everywhere: no rank
    overwrites a slot that another is still reading."""
    from allreduce_kit.algorithms import shared_memory

    monkeypatch.setattr(shared_memory, "SLOT_BYTES", 256)  # before the test's communicator
    monkeypatch.setattr(shared_memory, "SCATTER_FROM", scatter_from)  # gets its window
    p, rank = comm.Get_size(), comm.Get_rank()
    cases = [(n, dtype) for n in (1, max(p - 1, 1), 31, 32, 33, 1000, 4099) for dtype in ("float64", "int32")]
    inputs = [local_values(n, dtype, rank) for n, dtype in cases]
    expected = [oracle(comm, x, "sum") for x in inputs]
    tolerance = [float_tolerance(comm, x, "sum") if x.dtype.kind == "f" else 0 for x in inputs]
    results = [allreduce(x.copy(), op="sum", algorithm="shared_memory", comm=comm) for x in inputs]
    for (n, dtype), got, want, tol in zip(cases, results, expected, tolerance):
        assert np.all(np.abs(got.astype(np.float64) - want) <= tol), f"n={n} {dtype}"
        assert_same_everywhere(comm, got)
    if p > 1:
        assert isinstance(library_comm(comm).state[shared_memory.Window], shared_memory.Window)
    assert_quiet(comm)


@pytest.mark.mpi
def test_shared_memory_without_a_window_gives_the_bits_of_its_fallbacks(comm, monkeypatch):
    """Where the ranks do not share one node (faked here), ``shared_memory`` has no window and
    runs ``recursive_doubling`` for small buffers and ``rabenseifner`` for large ones, bitwise."""
    from allreduce_kit.algorithms import shared_memory

    monkeypatch.setattr(shared_memory, "window_for", lambda comm: None)
    for n, fallback in ((comm.Get_size() + 1, "recursive_doubling"), (40000, "rabenseifner")):
        x = local_values(n, "float32", comm.Get_rank())
        want = allreduce(x.copy(), op="mean", algorithm=fallback, comm=comm)
        got = allreduce(x.copy(), op="mean", algorithm="shared_memory", comm=comm)
        assert np.array_equal(got, want), fallback
        assert_same_everywhere(comm, got)
    if comm.Get_size() > 1:
        assert library_comm(comm).state[shared_memory.Window] is None
    assert_quiet(comm)


def _by_messages_too(comm):
    """A duplicate of ``comm`` on which ``ring``, ``rabenseifner`` and ``two_shot`` keep to messages, as if direct
    reads had failed their check (as across nodes)."""
    from allreduce_kit.algorithms import direct

    fresh = comm.Dup()
    library_comm(fresh).state[direct.Peers] = None
    return fresh


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", DIRECT)
@pytest.mark.parametrize("op", ["sum", "mean", "max"])
def test_direct_reads_give_the_bits_of_messages(comm, algorithm, op, monkeypatch):
    """On one node ``ring``, ``rabenseifner`` and ``two_shot`` read straight out of their peers' buffers
    (``direct.py``) instead of receiving messages. The steps and the order of every fold are
    the same, so the results are bitwise those of the same algorithm by messages, for lengths
    from shorter than p to many read pieces (forced small here)."""
    from allreduce_kit.algorithms import direct

    monkeypatch.setattr(direct, "PIECE_BYTES", 64)  # many pieces per segment, for the ``Peers``
    by_messages = _by_messages_too(comm)             # of the test's communicator, made below
    try:
        p, rank = comm.Get_size(), comm.Get_rank()
        for n in (1, max(p - 1, 1), p + 1, 1000, 4099):
            for dtype in ("float32", "int64"):
                x = local_values(n, dtype, rank)
                got = allreduce(x.copy(), op=op, algorithm=algorithm, comm=comm)
                assert np.array_equal(got, allreduce(x.copy(), op=op, algorithm=algorithm, comm=by_messages)), (n, dtype)
                assert_same_everywhere(comm, got)
        if p > 1:
            assert isinstance(library_comm(comm).state[direct.Peers], direct.Peers)
            assert library_comm(by_messages).state[direct.Peers] is None
    finally:
        by_messages.Free()


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", DIRECT)
def test_direct_reads_never_see_a_buffer_its_owner_has_moved_on_from(comm, algorithm):
    """A rank may reuse its buffer the moment ``allreduce`` returns, and ranks run at different
    times (here, sharing cores, one rank also late on every other call): many calls back to
    back, each buffer overwritten with garbage right after, all match MPI on every rank. (A ring
    whose ranks returned without waiting for their right neighbour's last read failed this at
    3, 4 and 8 ranks.)"""
    p, rank = comm.Get_size(), comm.Get_rank()
    for call, n in enumerate((3001, 17, 200000, 5, 64, 100003) * 4):
        x = local_values(n, "int64", rank + call)
        want = oracle(comm, x, "sum")
        if rank == call % p and call % 2:
            time.sleep(0.005)
        got = allreduce(x, op="sum", algorithm=algorithm, comm=comm)
        assert got is x
        assert np.array_equal(got, want), f"call {call}, n={n}"
        x[:] = -(10**12)  # garbage, at once


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", DIRECT)
def test_keeps_to_messages_when_any_rank_cannot_read_the_others(comm, algorithm, monkeypatch):
    """Direct reads are checked once per communicator, collectively: if any rank cannot read
    its peers' memory (a PID namespace or seccomp filter; faked here on the last rank), or any
    rank has set ``ALLREDUCE_KIT_DIRECT=0``, every rank keeps to messages, and the results
    still match MPI."""
    from allreduce_kit.algorithms import direct

    p, rank = comm.Get_size(), comm.Get_rank()
    check = direct.Peers.readable  # collective: the faked rank takes part, then reports failure
    for how in ("unreadable", "turned off"):
        with monkeypatch.context() as patch:
            if rank == p - 1 and how == "unreadable":
                patch.setattr(direct.Peers, "readable", lambda self: check(self) and False)
            if rank == p - 1 and how == "turned off":
                patch.setenv(direct.ENV, "0")
            fresh = comm.Dup()
            try:
                x = local_values(1001, "float64", rank)
                got = allreduce(x.copy(), op="max", algorithm=algorithm, comm=fresh)
                assert np.array_equal(got, oracle(comm, x, "max")), how
                assert library_comm(fresh).state.get(direct.Peers) is None, how
            finally:
                fresh.Free()


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS) + ["auto"])
def test_repeated_calls_on_one_buffer_follow_every_change_to_it(algorithm):
    """A loop that reduces one buffer on COMM_WORLD (its second call on takes the short path,
    ``collective.Repeat``) gets MPI's answer each time, also after the op, the buffer's values,
    shape or dtype change (every dtype, each compiled for the short path of its own), and is
    refused once the buffer is read-only."""
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    buf = np.empty(1000, np.float64)
    while algorithm == "auto" and online.exploring(library_comm(world), buf.nbytes):  # until auto's choice stays
        allreduce(buf)
    for k, op in enumerate(("sum", "sum", "sum", "max", "max", "mean", "mean", "sum")):
        buf[:] = local_values(buf.size, "float64", rank + 7 * k)
        expected = oracle(world, buf, op)
        assert allreduce(buf, op=op, algorithm=algorithm) is buf
        np.testing.assert_allclose(buf, expected, rtol=1e-12, atol=1e-12)
        assert_same_everywhere(world, buf)
        if algorithm == "mpi" and size > 1 and k in (6, 7):  # MPI's own call, bound, except for a mean
            kept = library_comm(world).repeats[(id(buf), "mpi")]
            assert (kept.native is None) if op == "mean" else (kept.native_op == MPI.SUM)
    if size > 1:
        assert (id(buf), algorithm) in library_comm(world).repeats  # remembered for the next call
        turn = "tree" if algorithm == "naive" else "naive"
        for k in range(3):  # two algorithms taking turns on one buffer: each kept, each still right
            for name in (algorithm, turn):
                buf[:] = local_values(buf.size, "float64", rank + k)
                expected = oracle(world, buf, "sum")
                allreduce(buf, algorithm=name)
                np.testing.assert_allclose(buf, expected, rtol=1e-12, atol=1e-12)
        kept = library_comm(world).repeats
        assert kept.get((id(buf), turn)) is not None and (algorithm == "auto" or kept.get((id(buf), algorithm)) is not None)
        other = np.ones(10)
        for _ in range(2):  # a call with check or stall_timeout always takes the full path: nothing kept
            allreduce(other, algorithm=algorithm, check=False)
        assert not any(kept is not None and kept.ref() is other for kept in library_comm(world).repeats.values())
    buf.shape = (10, 100)  # the same memory, reshaped in place
    buf[...] = local_values(buf.size, "float64", rank).reshape(10, 100)
    expected = oracle(world, buf, "sum")
    allreduce(buf, algorithm=algorithm)
    np.testing.assert_allclose(buf, expected, rtol=1e-12, atol=1e-12)
    buf.shape = (1000,)
    buf.dtype = np.int64  # the same bytes, now int64, in place
    for _ in range(2):
        buf[:] = local_values(buf.size, "int64", rank) + (1 << 58)  # exact only as integers
        expected = oracle(world, buf, "sum")
        allreduce(buf, algorithm=algorithm)
        assert np.array_equal(buf, expected)
    for dtype in ("int32", "float32"):  # retyped again: half the bytes per element, twice the elements
        buf.dtype = dtype
        for op in ("sum", "mean", "mean", "prod"):
            buf[:] = local_values(buf.size, dtype, rank)
            expected = oracle(world, buf, op)
            allreduce(buf, op=op, algorithm=algorithm)
            np.testing.assert_allclose(buf, expected, rtol=1e-5, atol=1e-5)
        buf.dtype = np.int64
    buf.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        allreduce(buf, algorithm=algorithm)


@pytest.mark.mpi
def test_kept_calls_are_forgotten_together_and_kept_anew():
    """Once ``collective.Repeat.SIZE`` calls are kept, one more forgets them all, also the one
    used last: its buffer's next call takes the full path (and is noted), the one after is kept."""
    from allreduce_kit import collective

    world = MPI.COMM_WORLD
    if world.Get_size() == 1:
        pytest.skip("one rank returns before anything is kept")
    kept = library_comm(world).repeats
    kept.clear()
    fillers = [np.ones(4) for _ in range(collective.Repeat.SIZE - 1)]
    for filler in fillers:
        allreduce(filler, algorithm="naive")
    loop = np.ones(100)
    for _ in range(2):
        allreduce(loop, algorithm="ring")
    assert len(kept) == collective.Repeat.SIZE and collective.LAST[0] is kept[(id(loop), "ring")]
    allreduce(np.ones(100), algorithm="ring")  # one more: everything is forgotten
    assert len(kept) == 1 and collective.LAST[0] is None
    for sent in range(2):
        loop[:] = world.Get_rank() + sent
        allreduce(loop, algorithm="ring")
        assert np.array_equal(loop, np.full(100, sum(range(world.Get_size())) + world.Get_size() * sent, np.float64))
        assert (id(loop), "ring") in kept and (kept[(id(loop), "ring")] is None) == (sent == 0)
