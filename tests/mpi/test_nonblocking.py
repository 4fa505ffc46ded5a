"""Nonblocking collectives: ``iallreduce`` gives what ``allreduce`` gives; ``test()`` turns true,
``wait()`` may be repeated, ``wait_all`` waits for many; calls reach a communicator in program
order, with blocking calls between nonblocking ones; a malformed call raises at the call, a
``check=True`` mismatch at ``wait()`` on every rank.
"""
import time

import numpy as np
import pytest
from mpi4py import MPI

import allreduce_kit
from allreduce_kit import ALGORITHMS, Handle, allreduce, broadcast_parameters, iallreduce, plan, wait_all
from allreduce_kit.progress import IN_FLIGHT
from conftest import assert_quiet, assert_same_everywhere
from test_allreduce import float_tolerance, local_values, oracle


@pytest.mark.mpi
def test_the_nonblocking_names_are_exported():
    from allreduce_kit import nonblocking

    assert allreduce_kit.iallreduce is nonblocking.iallreduce
    assert allreduce_kit.Handle is nonblocking.Handle and allreduce_kit.wait_all is nonblocking.wait_all


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS) + ["auto"])
def test_iallreduce_gives_what_allreduce_gives(comm, algorithm):
    """Bitwise what the blocking call gives with the same algorithm (``auto``: within rounding
    of MPI's answer, its choice may move with online tuning), returned by ``wait()``."""
    rank, p = comm.Get_rank(), comm.Get_size()
    for dtype, op in (("float32", "sum"), ("float64", "mean"), ("int64", "max"), ("int32", "prod")):
        for n in sorted({0, 1, p + 1, 1000}):
            fresh = local_values(n, dtype, rank)
            x = fresh.copy()
            handle = iallreduce(x, op=op, algorithm=algorithm, comm=comm)
            assert isinstance(handle, Handle)
            assert handle.wait() is x
            case = f"{algorithm} {dtype} {op} n={n}"
            if algorithm == "auto":
                expected = oracle(comm, fresh, op)
                if x.dtype.kind == "f":
                    assert np.all(np.abs(x - expected) <= float_tolerance(comm, fresh, op)), case
                else:
                    assert np.array_equal(x, expected), case
            else:
                blocking = allreduce(fresh.copy(), op=op, algorithm=algorithm, comm=comm)
                assert np.array_equal(x, blocking), case
            assert_same_everywhere(comm, x)
    assert_quiet(comm)


@pytest.mark.mpi
def test_test_turns_true_and_wait_may_be_repeated(comm):
    p = comm.Get_size()
    x = np.full(1 << 18, comm.Get_rank() + 1, np.float32)
    handle = iallreduce(x, comm=comm)
    deadline = time.monotonic() + 60
    while not handle.test():
        assert time.monotonic() < deadline, "test() never turned true"
        time.sleep(0.001)
    assert handle.done and handle.test()
    assert handle.wait() is x and handle.wait() is x
    assert np.all(x == p * (p + 1) / 2)


@pytest.mark.mpi
def test_many_in_flight_on_two_communicators_then_wait_all(comms):
    """Calls on a clone of the world and on a split of it, in flight together, in one order on
    every rank; ``wait_all`` returns each result in the order of its handles."""
    rank = MPI.COMM_WORLD.Get_rank()
    bufs, handles, sizes = [], [], []
    for k in range(6):
        comm = comms["world" if k % 2 else "split"]
        buf = np.full(1000 * k + 1, rank + k, np.float64)
        bufs.append(buf)
        sizes.append(comm.Get_size())
        expected_sum = sum(r + k for r in comm.allgather(rank))  # before the handle: a blocking user call
        handles.append((iallreduce(buf, op="max" if k == 3 else "sum", comm=comm), expected_sum, comm))
    results = wait_all(h for h, _, _ in handles)
    for k, (buf, result, (_, expected_sum, comm)) in enumerate(zip(bufs, results, handles)):
        assert result is buf
        expected = max(comm.allgather(rank)) + k if k == 3 else expected_sum
        assert np.all(buf == expected), f"call {k}"
    for comm in comms.values():
        assert_quiet(comm)


@pytest.mark.mpi
def test_a_blocking_call_made_while_one_is_in_flight_runs_after_it(comm):
    """``iallreduce`` then ``allreduce``, a plan and ``broadcast_parameters`` on the same
    communicator before ``wait()``: each blocking call starts only after the nonblocking one has
    finished, so every result is right and the handle is done when the blocking call returns."""
    rank, p = comm.Get_rank(), comm.Get_size()
    total = p * (p + 1) // 2
    first = np.full(1 << 16, rank + 1, np.float32)
    handle = iallreduce(first, comm=comm)
    second = np.full(100, rank + 1, np.int64)
    assert allreduce(second, comm=comm) is second
    assert handle.done, "the blocking call ran before the nonblocking one finished"
    assert np.all(second == total) and np.all(first == total)

    third = np.full(5000, rank + 1, np.float64)
    seventh = np.full(7, rank + 1.0)
    planned = plan(seventh, comm=comm)  # made with nothing in flight (collective for auto)
    handle = iallreduce(third, op="max", algorithm="ring", comm=comm)
    assert planned() is seventh
    assert handle.done and np.all(seventh == total)
    handle = iallreduce(third, op="min", comm=comm)
    params = np.full(10, float(rank))
    broadcast_parameters(params, root=0, comm=comm)
    assert handle.done and np.all(params == 0.0)
    assert np.all(handle.wait() == p)
    assert_quiet(comm)


@pytest.mark.mpi
def test_a_malformed_call_raises_at_the_call_before_anything_starts(comm):
    """The same checks as ``allreduce``, named ``iallreduce``, and nothing left in flight."""
    x = np.ones(10)
    read_only = np.ones(10)
    read_only.flags.writeable = False
    cases = [(lambda: iallreduce(read_only, comm=comm), ValueError, "read-only"),
             (lambda: iallreduce([1.0, 2.0], comm=comm), TypeError, "numpy.ndarray"),
             (lambda: iallreduce(np.ones(4, np.float16), comm=comm), TypeError, "dtype"),
             (lambda: iallreduce(x, op="average", comm=comm), ValueError, "op"),
             (lambda: iallreduce(x, algorithm="fastest", comm=comm), ValueError, "algorithm"),
             (lambda: iallreduce(x, stall_timeout=-1, comm=comm), ValueError, "stall_timeout"),
             (lambda: iallreduce(x, comm="world"), TypeError, "comm")]
    for call, kind, word in cases:
        with pytest.raises(kind, match=word) as raised:
            call()
        assert "iallreduce" in str(raised.value)
        assert IN_FLIGHT[0] == 0, "a malformed call started something"
    assert np.all(x == 1.0)
    assert_quiet(comm)


@pytest.mark.mpi
def test_a_mismatch_that_check_finds_raises_at_wait_on_every_rank(comm):
    if comm.Get_size() == 1:
        pytest.skip("a mismatch needs two ranks")
    rank = comm.Get_rank()
    handle = iallreduce(np.ones(10 + rank), comm=comm, check=True)  # lengths differ between ranks
    with pytest.raises(ValueError, match="buf length differs between ranks"):
        handle.wait()
    with pytest.raises(ValueError, match="buf length differs"):
        handle.test()  # a failure is raised again, by either
    x = np.ones(4)
    assert iallreduce(x, comm=comm).wait() is x and np.all(x == comm.Get_size())  # and the next call works
    assert_quiet(comm)


@pytest.mark.mpi
def test_with_check_a_rank_that_fails_locally_raises_at_the_call_and_the_others_at_wait(comm):
    if comm.Get_size() == 1:
        pytest.skip("needs two ranks")
    x = np.ones(10)
    if comm.Get_rank() == 0:
        x.flags.writeable = False
        with pytest.raises(ValueError, match="iallreduce: buf is read-only"):
            iallreduce(x, comm=comm, check=True)
    else:
        handle = iallreduce(x, comm=comm, check=True)
        with pytest.raises(ValueError, match="rank 0 failed"):
            handle.wait()
    allreduce(np.ones(3), comm=comm)  # waits for rank 0's part of the agreement, still in flight
    assert_quiet(comm)


@pytest.mark.mpi
def test_the_other_collectives_nonblocking_give_what_the_blocking_calls_give(comm):
    """``ireduce_scatter``, ``iallgather`` and ``ibroadcast``, several in flight at once, each
    bitwise the blocking call's result with the same algorithm; ``wait()`` returns ``out``
    (made by the call where none was given) or ``buf``."""
    from allreduce_kit import allgather, broadcast, iallgather, ibroadcast, ireduce_scatter, reduce_scatter, shard_bounds

    rank, p = comm.Get_rank(), comm.Get_size()
    for n in sorted({0, 1, p + 1, 1000}):
        values = local_values(n, "float64", rank)
        bounds = shard_bounds(n, p)
        mine = local_values(bounds[rank + 1] - bounds[rank], "int64", rank)
        source = np.arange(n, dtype=np.float32) + (rank == p - 1) * 7
        handles = [ireduce_scatter(values, op="sum", algorithm="ring", comm=comm),
                   iallgather(mine, np.empty(n, np.int64), algorithm="ring", comm=comm),
                   ibroadcast(source.copy(), root=p - 1, comm=comm)]
        scattered, gathered, broadcast_result = wait_all(handles)
        assert np.array_equal(scattered, reduce_scatter(values, op="sum", algorithm="ring", comm=comm)), n
        assert np.array_equal(gathered, allgather(mine, np.empty(n, np.int64), algorithm="ring", comm=comm)), n
        assert np.array_equal(broadcast_result, broadcast(source.copy(), root=p - 1, comm=comm)), n
        assert np.array_equal(broadcast_result, np.arange(n, dtype=np.float32) + 7), n
    assert_quiet(comm)


@pytest.mark.mpi
def test_the_other_collectives_nonblocking_check_at_the_call_under_their_own_names(comm):
    from allreduce_kit import iallgather, ibroadcast, ireduce_scatter

    p = comm.Get_size()
    cases = [(lambda: ireduce_scatter(np.ones(4), op="average", comm=comm), ValueError, "ireduce_scatter: .*op"),
             (lambda: ireduce_scatter(np.ones(4), np.empty(99), comm=comm), ValueError, "ireduce_scatter: out"),
             (lambda: iallgather(np.ones(4), counts=[1] * p, comm=comm), ValueError, "iallgather: block"),
             (lambda: ibroadcast(np.ones(4), root=p, comm=comm), ValueError, "ibroadcast: root"),
             (lambda: ibroadcast(np.ones(4), stall_timeout=-1, comm=comm), ValueError, "ibroadcast: stall_timeout")]
    for call, kind, pattern in cases:
        with pytest.raises(kind, match=pattern):
            call()
        assert IN_FLIGHT[0] == 0, "a malformed call started something"
    assert_quiet(comm)
