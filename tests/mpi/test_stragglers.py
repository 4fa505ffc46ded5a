"""Inside an MPI job: backup workers and local SGD.

``--backup-workers 0`` and ``--local-sgd 1`` are plain sync, bit for bit; with one backup worker
and a slow rank the replicas stay bitwise identical, the slow rank's gradients are the ones
dropped and no message is left behind, with either protocol (the shared window on one node, and
the messages that ranks on several nodes use, forced here by a window limit of 0 bytes); local SGD keeps its steps local and averages every H
steps, which the communication count shows; impossible settings raise on every rank before
anything is sent.
"""
import numpy as np
import pytest
from mpi4py import MPI

from allreduce_kit.comm import library_comm
from allreduce_kit.train import backup, data
from allreduce_kit.train.trainer import Config, Trainer

from conftest import assert_quiet, assert_same_everywhere

DIGITS = data.digits(0.2, seed=0)


@pytest.fixture(params=["window", "messages"])
def protocol(request, monkeypatch):
    """The backup workers' protocol under test: the one-node shared window, or messages."""
    if request.param == "messages":
        monkeypatch.setattr(backup, "WINDOW_LIMIT", 0)
    return request.param


def assert_protocol(comm, trainer, protocol):
    window = protocol == "window" and library_comm(comm).layout.single_node
    assert (trainer.strategy.tickets is not None) == window


@pytest.fixture
def train():
    """``train(comm, steps, run=True, **config)``: a trainer (that has run); closed when the test ends."""
    made = []

    def make(comm, steps, run=True, **kw):
        kw.setdefault("batch_size", 8)
        config = Config(hidden=(16,), max_steps=steps, epochs=2, lr=0.1, seed=3, **kw)
        trainer = Trainer(config, comm, dataset=DIGITS)
        made.append(trainer)
        if run:
            trainer.run()
        return trainer

    yield make
    for trainer in made:
        trainer.close()


@pytest.mark.mpi
def test_zero_backup_workers_and_one_local_step_are_plain_sync_bitwise(comm, train):
    plain = train(comm, 7, bucket_mb=1e-3)
    backup = train(comm, 7, bucket_mb=1e-3, backup_workers=0)
    local = train(comm, 7, bucket_mb=1e-3, local_sgd=1, local_sgd_warmup=2)
    assert plain.step == backup.step == local.step == 7
    for other in (backup, local):
        assert other.strategy is None
        assert np.array_equal(other.model.params, plain.model.params)
        assert np.array_equal(other.optimizer.velocity, plain.optimizer.velocity)
        assert other.traffic == plain.traffic == [7 * plain.buckets, 7 * plain.model.grads.nbytes]
    assert_quiet(comm)


@pytest.mark.mpi
def test_one_backup_worker_drops_the_slow_rank_and_keeps_replicas_identical(comm, train, protocol):
    p = comm.Get_size()
    if p == 1:
        pytest.skip("a backup worker needs p >= 2")
    slow = p - 1
    steps = 10
    trainer = train(comm, steps, backup_workers=1, straggler=(slow, 150.0), gather_every=4)
    assert_protocol(comm, trainer, protocol)
    assert trainer.step == steps
    identical, _ = trainer.replicas_identical()
    assert identical
    assert_same_everywhere(comm, trainer.model.params)
    assert_same_everywhere(comm, trainer.optimizer.velocity)
    moved = np.abs(trainer.model.params - train(comm, 1, run=False).model.params).max()
    assert moved > 1e-3, "backup workers did not train"
    status = np.array([row[0] for row in trainer.strategy.rows])
    assert len(status) == steps
    result = trainer.results()
    # Nothing left in flight on the protocol's communicator once the run has ended.
    lib = trainer.strategy.comm
    lib.Barrier()
    assert not lib.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG), "a message was left unreceived"
    lib.Barrier()
    if comm.Get_rank() == slow:
        assert np.all(status != 0), "the slow rank's gradient made it into a step"
    if comm.Get_rank() == 0:
        b = result["straggler"]["backup_workers"]
        assert b["protocol"] == ("shared window" if trainer.strategy.tickets is not None else "messages")
        assert b["groups"] == 1
        assert b["most_dropped_rank"] == slow
        assert result["straggler"]["slowest_rank"] == slow and result["straggler"]["slowest_by"] == "compute"
        rows = b["ranks"]
        assert rows[slow]["dropped_share"] == 1.0
        assert rows[slow]["gradients_late"] + rows[slow]["steps_skipped"] == steps
        assert sum(r["dropped_share"] for r in rows) == pytest.approx(1.0)      # one rank out per step
        assert b["effective_global_batch_mean"] == pytest.approx((p - 1) * trainer.config.batch_size)
        assert b["sync_step_wait_ms_p50"] > b["step_wait_ms_p50"]
        assert sum(e["samples"] for e in result["epochs"]) == steps * (p - 1) * trainer.config.batch_size
        assert result["updates_applied"] == steps
    assert_quiet(comm)


@pytest.mark.mpi
def test_with_jitter_the_chosen_set_changes_and_every_step_drops_exactly_b_ranks(comm, train, protocol):
    """Any rank may be late, the coordinator too (it then leaves itself out): the replicas stay identical."""
    p = comm.Get_size()
    if p < 3:
        pytest.skip("needs p >= 3 for more than one backup worker")
    backups, steps = p // 2, 12
    trainer = train(comm, steps, backup_workers=backups, jitter_ms=4.0, gather_every=5)
    assert_protocol(comm, trainer, protocol)
    assert trainer.step == steps and trainer.replicas_identical()[0]
    assert_same_everywhere(comm, trainer.optimizer.velocity)
    out = np.array([row[0] != 0 for row in trainer.strategy.rows])
    per_step = np.zeros(steps, dtype=np.int64)
    comm.Allreduce(out.astype(np.int64), per_step)
    assert np.all(per_step == backups), per_step
    result = trainer.results()
    if comm.Get_rank() == 0:
        b = result["straggler"]["backup_workers"]
        assert sum(r["dropped_share"] for r in b["ranks"]) == pytest.approx(backups)
        assert b["effective_global_batch_mean"] <= (p - backups) * trainer.config.batch_size
    assert_quiet(comm)


@pytest.mark.mpi
def test_backup_workers_cross_epochs_and_checkpoints_together(comm, train, tmp_path_factory, protocol):
    """A slow rank that skips ahead stops at an epoch's end and at a checkpoint step, where all meet."""
    p = comm.Get_size()
    if p == 1:
        pytest.skip("a backup worker needs p >= 2")
    directory = comm.bcast(str(tmp_path_factory.mktemp("ckpt")) if comm.Get_rank() == 0 else None)
    per_epoch = data.steps_per_epoch(len(DIGITS.y_train), p, 64)
    steps = per_epoch + 3
    trainer = train(comm, steps, batch_size=64, backup_workers=p - 1, straggler=(0, 20.0),
                    checkpoint_dir=directory, checkpoint_every=2)
    assert_protocol(comm, trainer, protocol)
    assert trainer.step == steps and len(trainer.history) == 2
    assert trainer.history[0]["steps"] == per_epoch and trainer.history[1]["steps"] == 3
    assert trainer.replicas_identical()[0]
    assert_quiet(comm)


@pytest.mark.mpi
def test_local_sgd_steps_are_local_and_averages_come_every_h_steps(comm, train):
    p = comm.Get_size()
    plain = train(comm, 8)
    local = train(comm, 8, local_sgd=4)
    assert local.strategy.averages == 2
    grads = local.model.grads.nbytes
    assert plain.traffic == [8, 8 * grads]
    assert local.traffic == [2, 2 * 2 * grads]                 # parameters and momentum, in one buffer
    assert local.replicas_identical()[0]
    assert not np.array_equal(local.model.params, plain.model.params) or p == 1
    assert np.isfinite(local.model.params).all()
    lean = train(comm, 8, local_sgd=4, local_sgd_momentum="local", local_sgd_warmup=3)
    assert lean.strategy.averages == 2                          # after 3 plain steps: at steps 7 and 8 (the end)
    assert lean.traffic == [3 + 2, 3 * grads + 2 * grads]
    assert lean.replicas_identical()[0]
    # Between averages each rank moves on its own gradients.
    stepped = train(comm, 8, run=False, local_sgd=4)
    batch = data.epoch_batches(len(DIGITS.y_train), p, comm.Get_rank(), 8, 3, 0)[0]
    stepped.train_step(batch)
    digests = comm.allgather(stepped.model.params.tobytes())
    assert (len(set(digests)) == p) and stepped.traffic == [0, 0]
    assert_quiet(comm)


@pytest.mark.mpi
@pytest.mark.parametrize("field,value,error", [
    ("backup_workers", "p", ValueError), ("backup_workers", -1, ValueError), ("backup_workers", 1.0, TypeError),
    ("local_sgd", 0, ValueError), ("local_sgd_warmup", -2, ValueError), ("local_sgd_momentum", "none", ValueError),
])
def test_impossible_settings_raise_on_every_rank_before_any_message(comm, field, value, error):
    value = comm.Get_size() if value == "p" else value
    with pytest.raises(error, match=f"Config.{field}"):
        Trainer(Config(hidden=(16,), max_steps=1, **{field: value}), comm, dataset=DIGITS)
    both = Config(hidden=(16,), backup_workers=1, local_sgd=2) if comm.Get_size() > 1 else \
        Config(hidden=(16,), local_sgd=2, on_nonfinite="skip")
    with pytest.raises(ValueError, match="not combine"):
        Trainer(both, comm, dataset=DIGITS)
    assert_quiet(comm)
