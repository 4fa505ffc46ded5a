"""The nonblocking machinery in one process, with plain functions for collectives: handles,
the progress thread's order, the wait of a call made while others are in flight, the checks
made before anything starts."""
import threading

import pytest

from allreduce_kit import nonblocking, progress
from allreduce_kit.nonblocking import Handle, begin, start, wait_all


def test_a_handle_returns_the_result_and_the_calls_run_in_order_on_one_other_thread():
    ran = []

    def call(k):
        ran.append((k, threading.get_ident()))
        return k * k

    handles = [start(call, k) for k in range(20)]
    assert wait_all(handles) == [k * k for k in range(20)]
    assert [k for k, _ in ran] == list(range(20))
    assert len({ident for _, ident in ran}) == 1 and ran[0][1] != threading.get_ident()
    assert all(h.done and h.test() for h in handles)
    assert handles[3].wait() == 9 and handles[3].wait() == 9
    assert progress.IN_FLIGHT[0] == 0


def test_a_failure_on_the_progress_thread_is_raised_by_wait_and_test_every_time():
    def fails(message):
        raise ValueError(message)

    handle = start(fails, "rank 0 failed")
    with pytest.raises(ValueError, match="rank 0 failed"):
        handle.wait()
    with pytest.raises(ValueError, match="rank 0 failed"):
        handle.wait()
    with pytest.raises(ValueError, match="rank 0 failed"):
        handle.test()
    assert start(lambda: "next").wait() == "next"  # the thread goes on after a failure
    assert "failed" in repr(handle)


def test_wait_all_waits_for_every_handle_before_raising_the_first_failure():
    release = threading.Event()
    first = start(lambda: (_ for _ in ()).throw(ValueError("first")))
    slow = start(release.wait, 30)
    threading.Timer(0.2, release.set).start()
    with pytest.raises(ValueError, match="first"):
        wait_all([first, slow])
    assert slow.done
    with pytest.raises(TypeError, match="Handle"):
        wait_all([slow, "not a handle"])


def test_test_is_false_while_the_call_runs():
    release = threading.Event()
    handle = start(release.wait, 30)
    assert handle.test() is False and not handle.done and "in flight" in repr(handle)
    release.set()
    assert handle.wait() is True


def test_a_collective_on_another_thread_waits_for_the_calls_in_flight():
    """``wait_turn``, which every collective calls first while calls are in flight: it returns
    only once the call started before has finished; on the progress thread it returns at once."""
    release = threading.Event()
    in_flight = start(release.wait, 30)
    on_progress = start(progress.wait_turn)  # would wait for itself if it did not know its thread
    assert progress.IN_FLIGHT[0] == 2
    turned = threading.Event()
    waiter = threading.Thread(target=lambda: (progress.wait_turn(), turned.set()))
    waiter.start()
    assert not turned.wait(0.3), "a collective ran while a nonblocking call was in flight"
    release.set()
    assert turned.wait(30)
    waiter.join()
    assert in_flight.done and on_progress.done and on_progress.wait() is None


def test_without_thread_multiple_the_call_runs_at_once(monkeypatch):
    monkeypatch.setattr(nonblocking, "_threads", [False])
    ran = []
    handle = start(lambda: ran.append(threading.get_ident()) or "done")
    assert handle.done and ran == [threading.get_ident()] and handle.wait() == "done"


def test_begin_checks_on_the_calling_thread_and_starts_nothing_that_fails(monkeypatch):
    monkeypatch.delenv("ALLREDUCE_KIT_CHECK", raising=False)
    started = []

    def checks(x, *, check=None):
        if x < 0:
            raise ValueError("icollective: x must be >= 0")

    def collective(x, *, check=None):
        started.append(x)
        return x

    assert begin(checks, collective, 3).wait() == 3
    with pytest.raises(ValueError, match="x must be"):
        begin(checks, collective, -1)
    assert started == [3]
    # check=True: the other ranks wait for this one's part of the agreement, so the call starts
    with pytest.raises(ValueError, match="x must be"):
        begin(checks, collective, -2, check=True)
    progress.wait_turn()
    assert started == [3, -2]


def test_a_handle_is_what_iallreduce_returns():
    assert nonblocking.iallreduce.__annotations__["return"] is Handle


def test_on_the_progress_thread_a_spinning_window_yields_instead(monkeypatch):
    """A shared window whose ranks spin (each has a core) is waited on by yielding while a
    nonblocking call runs, so that the caller's computation keeps its core; and spins again after."""
    from mpi4py import MPI

    from allreduce_kit.algorithms.spin import SPIN, YIELD, NodeWindow

    monkeypatch.delenv("ALLREDUCE_KIT_WAIT", raising=False)
    window = NodeWindow(MPI.COMM_SELF.Dup(), 64, oversubscribed=False)
    try:
        assert window.record[0] == SPIN
        assert start(lambda: int(window.record[0])).wait() == YIELD
        assert window.record[0] == SPIN
    finally:
        window.free()
