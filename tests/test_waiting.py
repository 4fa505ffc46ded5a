"""How ranks wait on a node's shared flags: the choice of mode, and a sleeping wait that the
raise of its flag wakes (threads stand in for ranks; no MPI)."""
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from allreduce_kit import config
from allreduce_kit.algorithms import spin


@pytest.mark.parametrize("oversubscribed,requested,blocking,expected", [
    (False, "auto", True, "spin"),     # a core each: nothing to hand over
    (True, "auto", True, "block"),     # yields first, sleeps only once a wait has lasted NAP_AFTER_NS
    (True, "auto", False, "yield"),    # no futex here
    (True, "block", False, "yield"),   # no futex here
    (True, "yield", True, "yield"),
    (False, "block", True, "block"),
    (True, "spin", True, "spin"),
])
def test_wait_mode(oversubscribed, requested, blocking, expected):
    assert spin.wait_mode(oversubscribed, requested, blocking) == expected


def test_an_unknown_wait_mode_is_refused():
    with pytest.raises(ValueError, match="wait mode"):
        spin.wait_mode(True, "nap")
    with pytest.raises(ValueError, match="ALLREDUCE_KIT_WAIT='nap'"):
        config.read(config.WAIT, {"ALLREDUCE_KIT_WAIT": "nap"})
    assert config.read(config.WAIT, {"ALLREDUCE_KIT_WAIT": " Block "}) == "block"


def _autogroups_on() -> bool:
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as handle:
            return handle.read().strip() == "1" and os.path.exists("/proc/self/autogroup")
    except OSError:
        return False


@pytest.mark.skipif(not _autogroups_on(), reason="the kernel has no autogroups here")
def test_a_new_session_is_a_new_scheduler_group():
    code = "from allreduce_kit.algorithms.spin import scheduler_group; print(scheduler_group())"
    same = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    apart = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                           start_new_session=True)
    assert same.stdout.strip() == spin.scheduler_group()
    assert apart.stdout.strip() != spin.scheduler_group()


def test_only_autos_block_yields_for_a_time_before_it_sleeps():
    assert spin.nap_after("auto", "block") == spin.NAP_AFTER_NS > 0
    assert spin.nap_after("block", "block") == spin.nap_after("auto", "spin") == spin.nap_after("auto", "yield") == 0


@pytest.mark.skipif(not spin.can_block(), reason="no futex wait on this machine")
@pytest.mark.parametrize("budget_ns", [0, spin.NAP_AFTER_NS])
def test_a_sleeping_wait_is_woken_by_the_raise_of_its_flag(budget_ns):
    record = spin.wait_record("block", budget_ns)
    assert record[7] == budget_ns
    record[5] = 30  # a sleep times out after 30 s: only the raise's wake can end the wait in time
    wait = record.ctypes.data
    line = np.zeros(8, np.int64)  # a flag's cache line: the flag, and its sleeper count at WAITERS
    flag = line.ctypes.data
    spin.wait_on(flag, 0, wait)  # compiled before the clock starts; returns at once
    waiter = threading.Thread(target=spin.wait_on, args=(flag, 3, wait), daemon=True)
    waiter.start()
    deadline = time.monotonic() + 10
    while line[spin.WAITERS // 8] != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert line[spin.WAITERS // 8] == 1, "the wait never went to sleep"
    spin.raise_flag(flag, 2, wait)  # not yet the target: the waiter wakes, reads 2, sleeps again
    time.sleep(0.05)
    assert waiter.is_alive()
    started = time.monotonic()
    spin.raise_flag(flag, 3, wait)
    waiter.join(10)
    assert not waiter.is_alive() and time.monotonic() - started < 10
    assert line[0] == 3 and line[spin.WAITERS // 8] == 0


@pytest.mark.parametrize("mode", ["spin", "yield"])
def test_only_a_blocking_wait_sleeps(mode):
    assert spin.wait_record(mode)[4] == -1
    assert spin.wait_record(mode, spin.NAP_AFTER_NS)[7] == 0   # a budget only delays a sleep
    if spin.can_block():
        assert spin.wait_record("block")[4] == spin.BLOCK_AFTER
