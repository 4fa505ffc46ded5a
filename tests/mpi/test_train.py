"""Inside an MPI job: data-parallel training on p ranks is the same maths as one rank with a
p times larger batch, replicas stay bitwise identical, and the public helpers average and
broadcast correctly."""
import numpy as np
import pytest
from mpi4py import MPI

from allreduce_kit import average_arrays, broadcast_parameters
from allreduce_kit.train import data
from allreduce_kit.train.trainer import Config, Trainer

from conftest import assert_quiet, assert_same_everywhere

DIGITS = data.digits(0.2, seed=0)


@pytest.fixture
def train():
    """``train(comm, batch, steps, **config)``: a trainer that has run; closed when the test ends."""
    made = []

    def run(comm, batch, steps, **kw):
        config = Config(batch_size=batch, hidden=(16,), max_steps=steps, epochs=1, lr=0.1, seed=3, **kw)
        trainer = Trainer(config, comm, dataset=DIGITS)
        made.append(trainer)
        trainer.run()
        return trainer

    yield run
    for trainer in made:
        trainer.close()


@pytest.mark.mpi
@pytest.mark.parametrize("dtype,rtol", [("float32", 2e-4), ("float64", 1e-10)])
def test_p_ranks_match_one_rank_with_p_times_the_batch(comm, train, dtype, rtol):
    p = comm.Get_size()
    if p == 1:
        pytest.skip("compares p ranks with one rank; needs p >= 2")
    batch, steps = 8, 6
    parallel = train(comm, batch, steps, dtype=dtype, weight_decay=1e-3)
    # The reference: this rank alone (a clone of COMM_SELF) with batch p*b over the same data and seed.
    alone_comm = MPI.COMM_SELF.Clone()
    try:
        alone = train(alone_comm, batch * p, steps, dtype=dtype, weight_decay=1e-3)
        assert parallel.step == alone.step == steps
        moved = np.abs(alone.model.params - train(alone_comm, batch * p, 0, dtype=dtype).model.params).max()
        assert moved > 1e-3, "the reference did not train"
        np.testing.assert_allclose(parallel.model.params, alone.model.params, rtol=rtol, atol=rtol * 1e-2)
        assert_same_everywhere(comm, parallel.model.params)
        assert_quiet(comm)
    finally:
        alone_comm.Free()


@pytest.mark.mpi
def test_replicas_start_from_rank_zero_and_stay_identical(comm, train):
    trainer = train(comm, 4, 3, bucket_mb=1e-3)           # several buckets
    identical, _ = trainer.replicas_identical()
    assert identical and trainer.buckets > 1
    assert_same_everywhere(comm, trainer.model.params)
    result = trainer.results()
    if comm.Get_rank() == 0:
        s = result["straggler"]
        assert s["steps"] == 3 and len(s["ranks"]) == comm.Get_size()
    else:
        assert "straggler" not in result


@pytest.mark.mpi
def test_average_arrays_mixed_shapes_and_dtypes(comm):
    rank, p = comm.Get_rank(), comm.Get_size()
    a = np.full((3, 4), rank + 1, dtype=np.float32)
    b = np.arange(5, dtype=np.float64) * (rank + 1)
    c = np.full(2, rank, dtype=np.float32)
    out = average_arrays([a, b, c], comm=comm, bucket_mb=8e-6)
    assert out[0] is a and a.shape == (3, 4)
    mean = (p + 1) / 2
    assert np.all(a == mean) and np.allclose(b, np.arange(5) * mean) and np.all(c == (p - 1) / 2)
    assert_quiet(comm)


@pytest.mark.mpi
def test_broadcast_parameters(comm):
    rank, p = comm.Get_rank(), comm.Get_size()
    buf = np.full(7, rank, dtype=np.float32)
    root = p - 1
    broadcast_parameters(buf, root=root, comm=comm)
    assert np.all(buf == root)
    with pytest.raises(ValueError, match="root"):
        broadcast_parameters(buf, root=p, comm=comm)
    assert_quiet(comm)
