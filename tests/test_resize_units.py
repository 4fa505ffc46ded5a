"""The position in the data, in samples, and its re-sharding at another rank count, without MPI."""
import types

import numpy as np
import pytest

from allreduce_kit.train import data, resize
from allreduce_kit.train.model import MLP
from allreduce_kit.train.resize import Plan


def _taken(plan: Plan, first: int, last: int):
    """Every rank's samples of steps ``first`` to ``last - 1`` of ``plan`` (same epoch), in order."""
    epoch, i = plan.position(first)
    out = []
    for rank in range(plan.ranks):
        batches = Plan(**{**plan.__dict__, "rank": rank}).batches(epoch)
        for step in range(i, i + last - first):
            out.extend(batches[step].tolist())
    return out


@pytest.mark.parametrize("samples,ranks,batch,accum", [(1437, 3, 16, 1), (1024, 4, 16, 2), (100, 7, 3, 1), (50, 1, 64, 1)])
def test_a_fresh_plan_is_the_trainers_old_sharding(samples, ranks, batch, accum):
    for rank in range(ranks):
        plan = Plan(samples, ranks, rank, batch, accum, seed=5)
        assert plan.steps_per_epoch == data.steps_per_epoch(samples, ranks, batch * accum)
        for epoch in (0, 3):
            got = plan.batches(epoch)
            want = data.epoch_batches(samples, ranks, rank, batch * accum, 5, epoch)
            assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want))
        spe = plan.steps_per_epoch
        for step in (0, 1, spe - 1, spe, 5 * spe + 2):
            assert plan.position(step) == divmod(step, spe)
        assert plan.total_steps(4) == 4 * spe


@pytest.mark.parametrize("before,after", [((4, 16, 1), (2, 16, 2)), ((4, 16, 1), (3, 11, 2)), ((3, 16, 1), (5, 7, 1)),
                                          ((2, 8, 3), (7, 16, 1)), ((4, 16, 1), (4, 16, 1))])
@pytest.mark.parametrize("stop", [0, 1, 7, 15])
def test_a_resized_epoch_takes_every_sample_once(before, after, stop):
    """P ranks take ``stop`` steps of epoch 2, P' ranks the rest: no sample twice, none skipped but
    the last ``rest mod P'``; and a second resume inside the resized epoch continues it exactly."""
    samples, seed = 1021, 9
    P, b, K = before
    old = Plan(samples, P, 0, b, K, seed)
    step = 2 * old.steps_per_epoch + stop
    taken = _taken(old, 2 * old.steps_per_epoch, step)
    epoch, offset = old.offset(step)
    assert (epoch, offset) == (2, stop * P * b * K)
    Q, c, L = after
    new = Plan(samples, Q, 0, c, L, seed, step0=step, epoch0=2, offset0=offset, before=stop)
    end = new.total_steps(3)
    assert new.position(end) == (3, 0) and new.position(step) == (2, stop)
    rest = _taken(new, step, end)
    both = taken + rest
    assert len(both) == len(set(both)), "a sample taken twice"
    order = np.random.default_rng([seed, 3, 2]).permutation(samples)
    assert sorted(both) == sorted(order[:len(both)].tolist()), "the samples taken are the order's prefix"
    assert samples - len(both) == (samples - offset) % Q
    # A checkpoint inside the resized epoch, resumed at the same configuration, continues it exactly.
    middle = step + (end - step) // 2
    e2, o2 = new.offset(middle)
    again = Plan(samples, Q, 0, c, L, seed, step0=middle, epoch0=e2, offset0=o2, before=new.position(middle)[1])
    for rank in range(Q):
        a = Plan(**{**new.__dict__, "rank": rank}).batches(2)
        z = Plan(**{**again.__dict__, "rank": rank}).batches(2)
        assert len(a) == len(z)
        i = new.position(middle)[1]
        assert all(np.array_equal(x, y) for x, y in zip(a[i:], z[i:]))
    assert again.total_steps(5) == new.total_steps(5)


def test_resize_config_keeps_the_global_batch_or_rescales_the_learning_rate():
    meta = {"ranks": 8, "batch_size": 32, "accum_steps": 1, "step": 10}
    assert resize.resize_config(meta, 4, 32, None, "keep-batch", 0.1)[:3] == (32, 2, 0.1)
    batch, accum, lr, note = resize.resize_config(meta, 3, 32, None, "keep-batch", 0.1)
    assert (batch, accum, lr) == (28, 3, 0.1) and "nearest to 256" in note and "global batch 252" in note
    batch, accum, lr, note = resize.resize_config(meta, 4, 32, None, "rescale-lr", 0.1)
    assert (batch, accum) == (32, 1) and lr == pytest.approx(0.05) and "was 256" in note
    # --lr is for the global batch the run started with, through any number of resizes.
    again = {**meta, "ranks": 4, "base_global_batch": 256}
    assert resize.resize_config(again, 2, 32, None, "rescale-lr", 0.1)[2] == pytest.approx(0.025)
    assert resize.resize_config(again, 4, 32, None, "rescale-lr", 0.1) == (32, 1, pytest.approx(0.05), None)
    assert resize.resize_config(meta, 8, 32, None, "keep-batch", 0.1) == (32, 1, 0.1, None)
    assert resize.resize_config(meta, 4, 32, 4, "keep-batch", 0.1)[:2] == (16, 4)       # --accum-steps given
    old = {"ranks": 4, "batch_size": 16, "step": 37}                                     # no position recorded
    assert resize.position_of(old, 1024) == {"epoch": 2, "offset": 5 * 64, "steps": 5}


def test_accumulated_micro_batches_give_the_whole_batchs_gradient():
    rng = np.random.default_rng(0)
    X = rng.standard_normal((200, 12)).astype(np.float64)
    y = rng.integers(0, 5, 200)
    model = MLP(12, (16,), 5, dtype=np.float64)
    model.init(np.random.default_rng(1))
    idx = rng.permutation(200)[:37]
    loss, correct = model.forward_backward(X[idx], y[idx])
    whole = model.grads.copy()
    trainer = types.SimpleNamespace(model=model, data=types.SimpleNamespace(X_train=X, y_train=y),
                                    plan=types.SimpleNamespace(accum=3))
    model.grads[...] = 0
    got = resize.accumulate(trainer, idx)
    assert got[1] == correct and got[0] == pytest.approx(loss)
    assert np.allclose(model.grads, whole, rtol=1e-12, atol=1e-14)
    assert not np.array_equal(model.grads, 0 * whole)
