"""The trainer's parts, each alone in one process: model gradients, sharding, schedule, timing
analysis, checkpoints and bucket splits (no mpiexec needed)."""
import os

import numpy as np
import pytest

from allreduce_kit.params import FlatParameters, bucket_bounds
from allreduce_kit.train import checkpoint, data
from allreduce_kit.train.model import MLP
from allreduce_kit.train.optimizer import SGD, learning_rate
from allreduce_kit.train.timing import analyse


def test_flat_views_share_one_buffer():
    flat = FlatParameters([(3, 4), (4,), (4, 2), (2,)])
    views = flat.views(flat.params)
    views[2][...] = 7
    assert flat.size == 12 + 4 + 8 + 2
    assert np.all(flat.params[16:24] == 7) and np.count_nonzero(flat.params) == 8
    assert all(np.shares_memory(v, flat.params) for v in views)


def test_backward_matches_finite_differences():
    rng = np.random.default_rng(0)
    model = MLP(5, (7, 6), 4, dtype=np.float64)
    model.init(rng)
    model.params += 0.1 * rng.standard_normal(model.size)       # non-zero biases too
    X, y = rng.standard_normal((9, 5)), rng.integers(0, 4, 9)
    model.forward_backward(X, y)
    analytic = model.grads.copy()
    eps = 1e-6
    for i in rng.choice(model.size, 40, replace=False):
        old = model.params[i]
        model.params[i] = old + eps
        up, _ = model.forward_backward(X, y)
        model.params[i] = old - eps
        down, _ = model.forward_backward(X, y)
        model.params[i] = old
        numeric = (up - down) / (2 * eps) / len(y)              # loss sum -> mean
        assert numeric == pytest.approx(analytic[i], rel=1e-5, abs=1e-8), f"parameter {i}"


@pytest.mark.parametrize("samples,ranks,batch", [(1438, 8, 32), (100, 3, 7), (10, 4, 32), (97, 1, 10)])
def test_shards_disjoint_equal_and_interleave_into_the_global_batch(samples, ranks, batch):
    shards = [data.epoch_batches(samples, ranks, r, batch, seed=1, epoch=2) for r in range(ranks)]
    steps = data.steps_per_epoch(samples, ranks, batch)
    assert all(len(s) == steps for s in shards)                            # nobody waits at the end
    for t in range(steps):
        assert len({len(s[t]) for s in shards}) == 1                       # equal batch sizes
    flat = np.concatenate([np.concatenate(s) for s in shards])
    assert len(flat) == samples - samples % ranks == len(set(flat.tolist()))  # disjoint, remainder < p
    single = data.epoch_batches(samples - samples % ranks, 1, 0, batch * ranks, seed=1, epoch=2)
    order = np.random.default_rng([1, 3, 2]).permutation(samples)
    for t in range(steps - 1):                                             # union of step t == 1-rank batch t
        union = sorted(np.concatenate([s[t] for s in shards]).tolist())
        assert union == sorted(order[t * batch * ranks:(t + 1) * batch * ranks].tolist())
    assert len(single) >= steps - 1


def test_shuffles_differ_between_epochs_but_not_between_ranks():
    a = data.epoch_batches(100, 2, 0, 10, seed=0, epoch=0)
    b = data.epoch_batches(100, 2, 0, 10, seed=0, epoch=1)
    assert not np.array_equal(np.concatenate(a), np.concatenate(b))
    assert np.array_equal(np.concatenate(a), np.concatenate(data.epoch_batches(100, 2, 0, 10, seed=0, epoch=0)))


def test_synthetic_is_reproducible_and_learnable_shape():
    one = data.synthetic(200, 12, 5, seed=3)
    two = data.synthetic(200, 12, 5, seed=3)
    assert np.array_equal(one.X_train, two.X_train) and np.array_equal(one.y_test, two.y_test)
    assert one.features == 12 and len(one.y_train) + len(one.y_test) == 200
    assert len(np.unique(one.y_train)) >= 3


def test_digits_split_is_held_out():
    d = data.digits(0.2, seed=0)
    assert len(d.y_train) + len(d.y_test) == 1797 and len(d.y_test) == 359
    assert d.X_train.max() <= 1.0


def test_digits_read_from_the_bundled_file_are_scikit_learns_digits():
    from sklearn.datasets import load_digits

    X, y = data.load_digits_arrays()
    X_ref, y_ref = load_digits(return_X_y=True)
    assert X.dtype == X_ref.dtype and y.dtype == y_ref.dtype
    assert np.array_equal(X, X_ref) and np.array_equal(y, y_ref)


@pytest.mark.parametrize("samples,ranks,batch,expected", [(1438, 2, 100000, 719), (1438, 2, 719, 719),
                                                          (1438, 2, 32, 32), (1438, 3, 480, 479)])
def test_a_batch_is_at_most_the_shard(samples, ranks, batch, expected):
    assert data.shard_batch(samples, ranks, batch) == expected


def test_linear_scaling_warms_up_from_base_to_p_times_base():
    assert learning_rate(0.1, 8, "linear", 10, 0) == pytest.approx(0.1)
    assert learning_rate(0.1, 8, "linear", 10, 5) == pytest.approx(0.45)
    assert learning_rate(0.1, 8, "linear", 10, 10) == pytest.approx(0.8)
    assert learning_rate(0.1, 8, "linear", 0, 0) == pytest.approx(0.8)
    assert learning_rate(0.1, 8, "none", 10, 3) == pytest.approx(0.1)


def test_sgd_momentum_and_weight_decay():
    opt = SGD(2, np.float64, momentum=0.5, weight_decay=0.1)
    w, g = np.array([1.0, -2.0]), np.array([0.5, 0.5])
    opt.step(w, g, lr=1.0)          # v = g + 0.1 w
    assert np.allclose(w, [1.0 - 0.6, -2.0 - 0.3])
    opt.step(w, np.zeros(2), lr=1.0)  # v = 0.5 v + 0.1 w
    assert np.allclose(opt.velocity, [0.5 * 0.6 + 0.04, 0.5 * 0.3 - 0.23])


def test_analysis_names_the_late_rank_and_its_waits():
    steps, ranks = 20, 4
    rec = np.zeros((steps, ranks, 3))
    rec[..., 0] = 0.010                 # compute 10 ms
    rec[:, 2, 0] = 0.030                # rank 2 computes 20 ms longer
    rec[..., 1] = 0.002 + 0.020         # the others wait 20 ms on top of a 2 ms transfer
    rec[:, 2, 1] = 0.002
    rec[..., 2] = 0.001
    s = analyse(rec, ["a", "a", "b", "b"])
    assert s["slowest_rank"] == 2
    assert [r["slowest_share"] for r in s["ranks"]] == [0, 0, 1, 0]
    assert s["ranks"][2]["wait_p50_ms"] == pytest.approx(0) and s["ranks"][0]["wait_p50_ms"] == pytest.approx(20)
    assert s["transfer_ms_p50"] == pytest.approx(2) and s["slowest_compute_ms_p50"] == pytest.approx(30)
    assert s["step_ms_p50"] == pytest.approx(33) and s["other_ms_p50"] == pytest.approx(0)
    assert s["ranks"][2]["score"] == pytest.approx(1 / 3) and s["ranks"][0]["score"] == pytest.approx(1)
    assert s["wait_share"] == pytest.approx(3 * 20 / (3 * 33 + 33))
    assert s["ranks"][2]["host"] == "b"


def _backup_run(steps: int = 12, ranks: int = 4, slow: int = 2, batch: int = 64):
    """Rows and records of a run with one backup worker where rank ``slow`` computes 31.6 ms and
    is never in: late in every third step and skipped in the others (as backup.py records them)."""
    rows = np.zeros((steps, ranks, 3))
    rows[..., 1] = 0.0003                            # status IN, 0.3 ms of compute
    rows[..., 2] = batch
    rows[:, slow, 0] = [1 if s % 3 == 0 else 2 for s in range(steps)]   # LATE, else SKIPPED
    rows[:, slow, 1] = [0.0316 if s % 3 == 0 else np.nan for s in range(steps)]
    rows[:, slow, 2] = 0
    records = np.zeros((steps, ranks, 3))
    records[..., 0] = rows[..., 1]
    records[..., 1] = 0.012                          # the ranks in wait for the third arrival ...
    records[:, 3, 1] = 0.003                         # ... rank 3, the last in
    records[:, 0, 1] = 0.0001                        # rank 0 quickest to leave (serves the late rank)
    records[:, slow, 1] = 0.0002                     # a late or skipping rank waits for nobody
    records[..., 2] = 0.0001
    return rows, records


def test_with_backup_workers_the_slowest_rank_is_the_slow_one_however_often_dropped():
    from allreduce_kit.train import backup, report
    rows, records = _backup_run()
    s = backup.report_of(rows, records, ["h"] * 4, 1, global_batch=4 * 64)
    assert s["slowest_rank"] == 2 and s["slowest_by"] == "compute"
    assert [r["slowest_share"] for r in s["ranks"]] == [0, 0, 1, 0]
    assert s["backup_workers"]["most_dropped_rank"] == 2
    # the step's parts are those of the rank it waited for: the last rank in (rank 3), not rank 2
    assert s["slowest_compute_ms_p50"] == pytest.approx(0.3)
    line = report.headline(s)
    assert line.endswith("most often slowest: rank 2 (longest compute)") and "last rank in's compute 0.30 ms" in line
    assert report.straggler_table(s).splitlines()[4].split()[:1] == ["2"] and "100%" in report.straggler_table(s).splitlines()[4]


def test_plain_sync_still_names_the_rank_that_arrived_last():
    rec = np.zeros((6, 3, 3))
    rec[..., 0], rec[..., 1] = 0.001, 0.010
    rec[:, 1, 1] = 0.002                             # rank 1 arrives last, waits least
    s = analyse(rec, ["h"] * 3)
    assert s["slowest_rank"] == 1 and s["slowest_by"] == "arrival"
    from allreduce_kit.train import report
    assert report.headline(s).endswith("most often slowest: rank 1") and "slowest rank's compute" in report.headline(s)


def test_the_backup_report_counts_the_global_batch_as_given():
    from allreduce_kit.train import backup, modes
    rows, records = _backup_run(batch=64)            # 3 ranks in of 4, 2 x 32 samples each
    s = backup.report_of(rows, records, ["h"] * 4, 1, global_batch=4 * 32 * 2)
    b = s["backup_workers"]
    assert b["global_batch"] == 256 and b["effective_global_batch_mean"] == 192
    assert "effective global batch 192.0 of 256 " in modes.report_text({"straggler": s})


def _header_trainer(lr: float, accum: int = 1, lr_scaling: str = "none"):
    from types import SimpleNamespace
    config = SimpleNamespace(batch_size=32, dtype="float32", lr=lr, lr_scaling=lr_scaling, resume=False)
    return SimpleNamespace(config=config, model=MLP(64, (128, 64), 10, dtype=np.float32), plan=SimpleNamespace(accum=accum),
                           ranks=3, buckets=1, resize_note=None, step=0)


def test_the_model_line_prints_the_learning_rate_in_few_digits():
    from allreduce_kit.train import report
    rescaled = 0.05 * 48 / 128                       # --on-resize rescale-lr: 0.018750000000000003
    line = report.model_line(_header_trainer(rescaled, accum=2), 32, "auto, ran ring")
    assert "lr 0.01875," in line and "000000" not in line
    assert "batch 32/rank x 2 accumulation steps (192 global), lr 0.01875, algorithm auto, ran ring" in line
    assert "lr 0.05 x 3 (linear scaling)," in report.model_line(_header_trainer(0.05, lr_scaling="linear"), 32, "ring")
    assert "lr 0.1," in report.model_line(_header_trainer(0.1), 32, "ring")
    assert "--batch-size 40 is more than a rank's shard" in report.model_line(_header_trainer(0.1), 40, "ring")


def test_checkpoint_roundtrip_leaves_no_temporary_file(tmp_path):
    params = np.arange(10, dtype=np.float32)
    checkpoint.save(str(tmp_path), 7, {"params": params, "velocity": -params}, {"states": [{"a": 1}]}, keep=1)
    checkpoint.save(str(tmp_path), 9, {"params": params + 1, "velocity": -params}, {"states": []}, keep=1)
    arrays, meta = checkpoint.load(checkpoint.latest(str(tmp_path)))
    assert os.listdir(tmp_path) == [checkpoint.name_for(9)]
    assert meta["step"] == 9 and np.array_equal(arrays["params"], params + 1)


def test_failed_write_keeps_the_previous_checkpoint(tmp_path):
    checkpoint.save(str(tmp_path), 1, {"params": np.ones(3)}, {})
    with pytest.raises(Exception):
        checkpoint.save(str(tmp_path), 2, {"params": np.ones(3)}, {"bad": object()})   # not JSON
    arrays, meta = checkpoint.load(checkpoint.latest(str(tmp_path)))
    assert meta["step"] == 1 and os.listdir(tmp_path) == [checkpoint.name_for(1)]


@pytest.mark.parametrize("count,mb,expected", [(10, 0, [(0, 10)]), (10, 16e-6, [(0, 4), (4, 8), (8, 10)]),
                                               (0, 1, []), (3, 1e-9, [(0, 1), (1, 2), (2, 3)])])
def test_bucket_bounds(count, mb, expected):
    assert bucket_bounds(count, 4, mb) == expected
