"""Inside an MPI job: ``python -m allreduce_kit.train``'s ``--compression`` (``Config.compression``)
averages plain sync steps compressed, keeps the replicas bitwise identical, and reports the bytes
each rank sent per step beside what uncompressed would have sent."""
import pytest
from mpi4py import MPI


@pytest.mark.mpi
@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 4, reason="the trainer's wiring: 1-4 ranks show it")
@pytest.mark.parametrize("method", ["powersgd", "fp16"])
def test_the_trainer_averages_compressed_keeps_replicas_identical_and_counts_the_bytes(comm, method):
    from allreduce_kit.train import data
    from allreduce_kit.train.trainer import Config, Trainer

    p = comm.Get_size()
    config = Config(batch_size=8, hidden=(16,), max_steps=5, epochs=1, lr=0.1, seed=3, compression=method,
                    compression_rank=2, compression_start=2)
    trainer = Trainer(config, comm, dataset=data.digits(0.2, seed=0))
    try:
        trainer.run()
        result = trainer.results()
    finally:
        trainer.close()
    assert result["replicas_identical"]
    c = result["compression"]
    total = 64 * 16 + 16 + 16 * 10 + 10
    share = 2 * (p - 1) / p
    assert c["uncompressed_bytes_per_step"] == pytest.approx(share * total * 4)
    if method == "fp16":
        sent = share * total * 2
    else:  # two plain steps, then biases (26) and 64x16, 16x10 as rank-2 factors
        sent = share * 4 * (2 * total + 3 * (26 + (64 + 16) * 2 + (16 + 10) * 2)) / 5
        assert c["compressed_steps"] == 3 and c["compressed_matrices"] == [[64, 16, 2], [16, 10, 2]]
    assert c["bytes_sent_per_step"] == pytest.approx(sent)
    assert c["ratio"] == (pytest.approx(total * 4 * share / sent) if p > 1 else 1.0)
