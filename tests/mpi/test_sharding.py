"""Inside an MPI job: sharded data parallelism (``--zero 1|2|3``) trains what ``--zero 0`` trains.

Stages 1 and 2 end bitwise on the parameters of ``--zero 0`` wherever the reduce-scatter folds as
the allreduce does (``SAME_FOLDS``: ``ring``, ``two_shot``, ``rabenseifner``,
``recursive_doubling``); stage 3, which reduces per layer, agrees to 1e-6. The model has 1199
parameters, a count no rank count from 2 to 8 divides, in buckets of 250 elements that no rank
count from 3 up divides either. Each rank holds the model state the estimator says, and stages 1
and 2 send what ``--zero 0`` sends, stage 3 at most 1.5 times as much. Checkpoints resume at
another stage (bitwise, from a whole checkpoint and from a sharded one) and rank count.
"""
import numpy as np
import pytest
from mpi4py import MPI

from allreduce_kit import allreduce, reduce_scatter
from allreduce_kit.algorithms.reduce_scatter import SAME_FOLDS
from allreduce_kit.blocks import block
from allreduce_kit.train import data
from allreduce_kit.train.trainer import Config, Trainer

from conftest import assert_same_everywhere

DIGITS = data.digits(0.2, seed=0)
HIDDEN = (17, 3)                      # 64-17-3-10: 1199 parameters
BUCKET_MB = 1e-3                      # 250 float32 elements: buckets of 250, 250, 250, 250, 199
STEPS = 3


def trained(comm, **kw) -> Trainer:
    config = Config(**{"batch_size": 8, "hidden": HIDDEN, "max_steps": STEPS, "epochs": 1, "lr": 0.01, "seed": 3,
                       "bucket_mb": BUCKET_MB, **kw})
    trainer = Trainer(config, comm, dataset=DIGITS)
    trainer.result = trainer.run()
    return trainer


def parameters(trainer: Trainer) -> np.ndarray:
    params = trainer.strategy.full_parameters() if trainer.shards is not None else trainer.model.params
    return params.copy()


def run_and_close(comm, **kw):
    trainer = trained(comm, **kw)
    try:
        return parameters(trainer), trainer
    finally:
        trainer.close()


@pytest.mark.mpi
def test_each_reduce_scatter_of_same_folds_is_bitwise_its_allreduce_block(comm):
    p, r = comm.Get_size(), comm.Get_rank()
    for n in (1199, 250):
        x = np.random.default_rng([r, n]).standard_normal(n).astype(np.float32)
        for allreduce_name, reduce_scatter_name in SAME_FOLDS.items():
            full = x.copy()
            allreduce(full, op="mean", algorithm=allreduce_name, comm=comm)
            lo, hi = block(n, p, r)
            got = reduce_scatter(x, op="mean", algorithm=reduce_scatter_name, comm=comm)
            assert np.array_equal(got, full[lo:hi]), (allreduce_name, reduce_scatter_name, n)


def held_and_sent(trainer: Trainer):
    """The model state the rank holding most held (besides buffers), checked against the estimate,
    and the bytes a rank sent per step."""
    memory = trainer.result["memory"]
    assert memory["model_state_bytes"] == memory["model_state_estimate"], memory
    assert len(memory["model_state_bytes_per_rank"]) == trainer.ranks
    return memory["model_state_bytes"] - memory["model_state"]["buffers"], \
        trainer.result["communication"]["bytes_sent_per_step"]


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm,optimizer", [("ring", "adam"), ("rabenseifner", "sgd")])
def test_stages_1_and_2_end_bitwise_on_zero_0s_parameters_and_send_what_it_sends(comm, algorithm, optimizer):
    plain, reference = run_and_close(comm, zero=0, optimizer=optimizer, algorithm=algorithm)
    held, sent = held_and_sent(reference)
    n, p = 1199 * 4, comm.Get_size()
    assert held == n * (2 + (2 if optimizer == "adam" else 1))
    assert sent == pytest.approx(2 * n * (p - 1) / p)
    for stage in (1, 2):
        sharded, trainer = run_and_close(comm, zero=stage, optimizer=optimizer, algorithm=algorithm)
        assert trainer.step == STEPS
        assert np.array_equal(sharded, plain), f"--zero {stage} with {algorithm}, {optimizer}"
        assert_same_everywhere(comm, sharded)
        held_here, sent_here = held_and_sent(trainer)
        assert held_here < held or p == 1
        assert sent_here == pytest.approx(sent, rel=0.05)


@pytest.mark.mpi
def test_16_bit_reduce_scatters_end_bitwise_on_zero_0s_16_bit_allreduce_and_send_half_the_gradient_bytes(comm):
    """``--compression fp16`` with ``--zero 1`` and ``2``: the gradients' ring reduce-scatters send
    16-bit values, and their blocks are bitwise blocks of ``--zero 0``'s compressed ring allreduce
    (the same messages, stopped before its allgather), so the parameters end bitwise the same;
    the parameters' allgathers stay float32. Stage 3 trains to within fp16's rounding."""
    plain, _ = run_and_close(comm, zero=0, optimizer="adam", algorithm="ring", compression="fp16")
    n, p = 1199 * 4, comm.Get_size()
    for stage in (1, 2, 3):
        sharded, trainer = run_and_close(comm, zero=stage, optimizer="adam", algorithm="ring", compression="fp16")
        record = trainer.result["compression"]
        if stage < 3:
            assert np.array_equal(sharded, plain), f"--zero {stage} --compression fp16"
            assert record["bytes_sent_per_step"] == pytest.approx(1.5 * n * (p - 1) / p)  # half of the reduce-scatter's
            assert record["uncompressed_bytes_per_step"] == pytest.approx(2 * n * (p - 1) / p)
        else:
            assert np.allclose(sharded, plain, rtol=0, atol=1e-3), "--zero 3 --compression fp16"
        assert record["method"] == "fp16"
        assert_same_everywhere(comm, sharded)


@pytest.mark.mpi
def test_stage_3_agrees_with_zero_0_to_1e_6_holds_a_shard_and_sends_at_most_half_as_much_again(comm):
    plain, reference = run_and_close(comm, zero=0, optimizer="adam", algorithm="ring")
    sharded, trainer = run_and_close(comm, zero=3, optimizer="adam", algorithm="ring")
    np.testing.assert_allclose(sharded, plain, rtol=1e-6, atol=1e-6)
    assert_same_everywhere(comm, sharded)
    (held0, sent0), (held3, sent3) = held_and_sent(reference), held_and_sent(trainer)
    assert held3 <= -(-held0 // comm.Get_size()) + 4 * 4 * len(HIDDEN)   # 16 bytes a parameter / p, give or take a block
    assert sent3 <= 1.5 * sent0


@pytest.mark.mpi
@pytest.mark.parametrize("fields,named", [({"zero": 4}, "Config.zero"), ({"zero": 2, "accum_steps": 2}, "accum_steps"),
                                          ({"optimizer": "lamb"}, "Config.optimizer"),
                                          ({"zero": 1, "backup_workers": 1}, "backup_workers")])
def test_a_stage_on_a_run_it_does_not_fit_raises_on_every_rank_before_any_message(comm, fields, named):
    with pytest.raises(ValueError, match=named):
        Trainer(Config(hidden=HIDDEN, max_steps=1, **fields), comm, dataset=DIGITS)
    comm.Barrier()


def shared_directory(comm, tmp_path_factory) -> str:
    """One new directory every rank of ``comm`` names (rank 0's)."""
    return comm.bcast(str(tmp_path_factory.mktemp("zero_checkpoints")) if comm.Get_rank() == 0 else None, root=0)


@pytest.mark.mpi
def test_a_checkpoint_resumes_bitwise_at_another_stage(comm, tmp_path_factory):
    """Two steps, a checkpoint, two more steps at another stage: bitwise four steps of ``--zero 0``,
    from a whole checkpoint into a sharded run and from a sharded one (per-rank files) into ``--zero 0``."""
    straight, _ = run_and_close(comm, zero=0, optimizer="adam", algorithm="ring", max_steps=4)
    for first, then in ((0, 2), (1, 0)):
        directory = shared_directory(comm, tmp_path_factory)
        run_and_close(comm, zero=first, optimizer="adam", algorithm="ring", max_steps=2, checkpoint_dir=directory)
        resumed, trainer = run_and_close(comm, zero=then, optimizer="adam", algorithm="ring", max_steps=4,
                                         checkpoint_dir=directory, resume=True)
        assert trainer.resumed_from is not None and trainer.step == 4
        assert np.array_equal(resumed, straight), f"--zero {first} then --zero {then}"


@pytest.mark.mpi
def test_a_sharded_checkpoint_resumes_at_another_rank_count_and_stage_with_the_same_state(comm, tmp_path_factory):
    from allreduce_kit.train import checkpoint

    directory = shared_directory(comm, tmp_path_factory)
    run_and_close(comm, zero=2, optimizer="adam", algorithm="ring", max_steps=2, checkpoint_dir=directory)
    path = checkpoint.latest(directory)
    _, meta = checkpoint.load(path)
    assert meta["sharded"]["stage"] == 2 and meta["sharded"]["ranks"] == comm.Get_size()
    whole = checkpoint.read_sharded(path, meta, ["params", "exp_avg", "exp_avg_sq"])
    fewer = comm.Split(0 if comm.Get_rank() < max(1, comm.Get_size() - 1) else MPI.UNDEFINED, comm.Get_rank())
    if fewer != MPI.COMM_NULL:
        try:
            trainer = Trainer(Config(batch_size=8, hidden=HIDDEN, max_steps=2, epochs=1, lr=0.01, seed=3,
                                     bucket_mb=BUCKET_MB, zero=3, optimizer="adam", checkpoint_dir=directory,
                                     resume=True), fewer, dataset=DIGITS)
            try:
                assert trainer.step == 2 and trainer.optimizer.steps == 2
                assert np.array_equal(trainer.strategy.full_parameters(), whole["params"])
                layout = trainer.shards.layout
                for u in range(len(layout.units)):
                    assert np.array_equal(layout.part(trainer.optimizer.exp_avg_sq, u), layout.of(whole["exp_avg_sq"], u))
            finally:
                trainer.close()
        finally:
            fewer.Free()
    comm.Barrier()
