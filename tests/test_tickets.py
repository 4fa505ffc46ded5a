"""The one-node backup-worker protocol (``allreduce_kit/train/tickets.py``) without MPI.

Threads stand for ranks (the compiled step releases the GIL) on one block of memory, as ranks
on one window: every step must have exactly P - B ranks in, with tickets 0 to P - B - 1, and each
of them must hold bitwise the average of exactly those ranks' gradients, folded in rank order;
a late rank's gradient is left as it was. Over many steps the records and slots are reused, so
a slot overwritten too early or a record read after its reuse shows up as a wrong average.
"""
import threading

import numpy as np
import pytest

from allreduce_kit.algorithms.spin import address_of_sched_yield
from allreduce_kit.train import tickets


def gradient(rank: int, step: int, n: int) -> np.ndarray:
    rng = np.random.default_rng(1000 * step + rank)
    return rng.standard_normal(n).astype(np.float32)


def expected(ranks, step: int, n: int, need: int) -> np.ndarray:
    out = gradient(sorted(ranks)[0], step, n).copy()
    for r in sorted(ranks)[1:]:
        out += gradient(r, step, n)
    return out / np.float32(need)


@pytest.mark.parametrize("ranks,backups,n", [(2, 1, 5), (5, 2, 4099)])
def test_every_step_takes_the_first_p_minus_b_and_they_hold_their_average(ranks, backups, n):
    need, steps = ranks - backups, 24
    like = np.zeros(n, dtype=np.float32)
    raw = np.zeros(tickets.window_bytes(ranks, need, like) + 64, dtype=np.uint8)
    memory = raw[(-raw.ctypes.data) % 64:][:tickets.window_bytes(ranks, need, like)]
    records = tickets.RECORDS * tickets._layout(ranks, need, like)[0]
    slots = memory[records:].view(np.float32)
    results = {}

    def rank_loop(rank: int) -> None:
        state = tickets.state_of(memory, rank, ranks, need, like, address_of_sched_yield())
        chosen = np.zeros(need, dtype=np.int64)
        for k in range(steps):
            grads = gradient(rank, k, n)
            ticket = tickets._step(grads, slots, state, k, chosen)
            results[(rank, k)] = (ticket, chosen.copy(), grads)

    threads = [threading.Thread(target=rank_loop, args=(r,)) for r in range(ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
        assert not thread.is_alive(), "a rank is still waiting"
    state = tickets.state_of(memory, 0, ranks, need, like, 0)
    for k in range(steps):
        assert tickets.decided(state, k)
        inside = [r for r in range(ranks) if results[(r, k)][0] >= 0]
        assert len(inside) == need, (k, inside)
        assert sorted(results[(r, k)][0] for r in inside) == list(range(need))
        want = expected(inside, k, n, need)
        for r in range(ranks):
            ticket, chosen, grads = results[(r, k)]
            if ticket >= 0:
                assert sorted(chosen) == inside and chosen[ticket] == r
                assert np.array_equal(grads, want), (k, r)
            else:
                assert np.array_equal(grads, gradient(r, k, n))
    assert not tickets.decided(state, steps)
