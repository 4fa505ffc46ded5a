"""Inside an MPI job: pipeline parallelism (S stages x D replicas) trains what one rank trains.

For every schedule (GPipe, 1F1B, interleaved with V = 2; with V = 1 it is 1F1B's list), S stages, M in {1, S, 4S}
micro-batches (and 2S - 1, one round, for interleaved) and D replicas, the parameters after a few steps agree with one rank's training on
the same global batch to 1e-6 (float64; bitwise at M = 1 and D = 1, where no addition is
reordered), every replica of a stage holds bitwise the same parameters, and no message is left
behind; 1F1B runs on the replica-major placement of the grid, the others stage-major. Grids (S x D) per rank count: 2: 2x1; 3: 3x1; 4: 4x1; 5: 2x2 (on 4 of the 5); 8: 4x2 and
3x2 (on 6 of the 8).
The model, 64-9-8-7-6-5-4-3-10, has 8 layers (S x V up to 8) and about 900 parameters.
"""
import numpy as np
import pytest
from mpi4py import MPI

from allreduce_kit.pipeline.train import PipelineError, PipelineSettings, PipelineTrainer
from allreduce_kit.train import data
from allreduce_kit.train.trainer import Config, Trainer

DIGITS = data.digits(0.2, seed=0, dtype="float64")
HIDDEN = (9, 8, 7, 6, 5, 4, 3)
STEPS = 2
GRIDS = {2: [(2, 1)], 3: [(3, 1)], 4: [(4, 1)], 5: [(2, 2)], 8: [(4, 2), (3, 2)]}
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)]


def config(S: int, **kw) -> Config:
    return Config(**{"batch_size": 4 * S, "hidden": HIDDEN, "max_steps": STEPS, "epochs": 1, "lr": 0.05,
                     "seed": 3, "dtype": "float64", **kw})


def one_rank(cfg: Config, replicas: int) -> np.ndarray:
    ref = Trainer(Config(**{**cfg.as_dict(), "batch_size": cfg.batch_size * replicas}), MPI.COMM_SELF,
                  dataset=DIGITS)
    try:
        ref.run()
        return ref.model.params.copy()
    finally:
        ref.close()


def grid_comm(comm, size: int):
    """The first ``size`` ranks of ``comm`` (COMM_NULL on the others)."""
    return comm.Split(0 if comm.Get_rank() < size else MPI.UNDEFINED, comm.Get_rank())


@pytest.mark.mpi
@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() not in GRIDS, reason="no S x D grid of the spec fits here")
def test_every_schedule_trains_what_one_rank_trains(comm):
    for S, D in GRIDS[comm.Get_size()]:
        sub = grid_comm(comm, S * D)
        if sub == MPI.COMM_NULL:
            continue
        try:
            want = one_rank(config(S), D)
            for schedule, V in SCHEDULES:
                if S * V > len(HIDDEN) + 1:
                    continue
                for M in (1, S, 4 * S):
                    placement = "replica-major" if schedule == "1f1b" else "stage-major"
                    trainer = PipelineTrainer(config(S), PipelineSettings(S, M, schedule, V, placement=placement), sub,
                                              dataset=DIGITS)
                    try:
                        result = trainer.run()
                        got = trainer.full_parameters()
                        assert not trainer.runtime.comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG), "a message left behind"
                    finally:
                        trainer.close()
                    where = (S, D, schedule, V, M)
                    assert result["replicas_identical"], where
                    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9, err_msg=str(where))
                    if M == 1 and D == 1:
                        assert np.array_equal(got, want), where
                    peak = result["pipeline"]["peak_live"]
                    if schedule == "gpipe":
                        assert peak == [M] * S, where
                    elif schedule == "1f1b":
                        assert peak == [min(S - s, M) for s in range(S)], where
                    assert all(0 <= share < 1 for share in result["pipeline"]["idle_share"]), where
            if S * 2 <= len(HIDDEN) + 1:   # interleaved in one round of 2S - 1 micro-batches, as torch takes them
                M = 2 * S - 1
                odd = config(S, batch_size=2 * M)
                trainer = PipelineTrainer(odd, PipelineSettings(S, M, "interleaved", 2), sub, dataset=DIGITS)
                try:
                    result = trainer.run()
                    got = trainer.full_parameters()
                finally:
                    trainer.close()
                assert result["replicas_identical"]
                np.testing.assert_allclose(got, one_rank(odd, D), rtol=1e-6, atol=1e-9, err_msg=str((S, D, M)))
        finally:
            sub.Free()


@pytest.mark.mpi
@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 2, reason="two stages suffice")
def test_stages_that_do_not_fit_together_fail_on_every_rank_before_the_first_step(comm):
    """Rank 1 builds its stage for 8 inputs where rank 0's stage puts out 9."""
    hidden = (9, 7) if comm.Get_rank() == 0 else (8, 7)
    with pytest.raises(PipelineError, match="stage 0 puts out 9 features of float64, stage 1 takes 8"):
        PipelineTrainer(config(2, hidden=hidden), PipelineSettings(2, 2, "1f1b", split=(1,)), comm, dataset=DIGITS)


@pytest.mark.mpi
@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() not in (2, 4), reason="2 x 1 and 2 x 2 grids suffice")
def test_a_resumed_pipeline_run_ends_where_the_uninterrupted_run_ends(comm):
    """Six steps straight against three, a checkpoint (one file per stage and a manifest), and a
    --resume for the other three: bitwise the same parameters, the same epoch record. The
    checkpoint consolidates to the whole model, and a data-parallel run on D ranks resumes from it
    (here at D = 1, on one rank) to the same parameters, to rounding."""
    import tempfile

    from allreduce_kit.train import checkpoint

    D = comm.Get_size() // 2
    directory = comm.bcast(tempfile.mkdtemp(prefix="pipeline-ckpt-") if comm.Get_rank() == 0 else None)
    settings = PipelineSettings(2, 2, "1f1b")

    def run(**kw):
        trainer = PipelineTrainer(config(2, **{"max_steps": 6, **kw}), settings, comm, dataset=DIGITS)
        try:
            return trainer.run(), trainer.full_parameters()
        finally:
            trainer.close()

    want, want_params = run()
    first, at_3 = run(max_steps=3, checkpoint_dir=directory, checkpoint_every=2)
    got, got_params = run(checkpoint_dir=directory, resume=True)
    assert np.array_equal(got_params, want_params)
    assert got["epochs"] == [dict(e, seconds=g["seconds"], samples_per_second=g["samples_per_second"],
                                  step_ms=g["step_ms"]) for e, g in zip(want["epochs"], got["epochs"])]
    if comm.Get_rank() == 0:
        steps = [found.step for found in checkpoint.survey(directory)]
        assert steps == [2, 3, 6]
        manifest = checkpoint.latest(directory)
        whole = checkpoint.read_pipeline(manifest, checkpoint.load(manifest)[1], ["params"])["params"]
        assert np.array_equal(whole, got_params)
        if D == 1:
            for path in checkpoint.listing(directory)[2:]:
                checkpoint.os.unlink(path[1])                 # the data-parallel run resumes from step 3
            ref = Trainer(config(2, batch_size=8, max_steps=6, checkpoint_dir=directory, resume=True), MPI.COMM_SELF,
                          dataset=DIGITS)
            try:
                assert ref.step == 3
                ref.run()
                np.testing.assert_allclose(ref.model.params, want_params, rtol=1e-6, atol=1e-9)
            finally:
                ref.close()
        import shutil
        shutil.rmtree(directory)
    del first, at_3
