"""Inside an MPI job: ``DistributedOptimizer(..., compression=Compression.powersgd(...))`` averages
each bucket's gradients as the numpy ``PowerSGD`` does (to rounding), replicas stay bitwise identical, and
arguments that cannot work raise before anything is sent."""
import warnings

import numpy as np
import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")
import allreduce_kit.torch as hvd  # noqa: E402
from allreduce_kit import allreduce  # noqa: E402
from allreduce_kit.compression.powersgd import PowerSGD  # noqa: E402
from conftest import assert_same_everywhere  # noqa: E402

RANK, P = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


@pytest.fixture(scope="module", autouse=True)
def initialized():
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="allreduce_kit.torch.init: MPI started before init",
                                category=RuntimeWarning)
        hvd.init()
    yield
    hvd.shutdown()


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 12), torch.nn.ReLU(), torch.nn.Linear(12, 7))


@pytest.mark.skipif(P < 2, reason="at one rank DistributedOptimizer reduces nothing: its gradients stay the rank's own")
@pytest.mark.skipif(P > 4, reason="the wiring: 2-4 ranks show it (the suite is near its limit)")
def test_powersgd_averages_as_the_numpy_state_and_replicas_stay_identical(comm):
    net = model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), named_parameters=net.named_parameters(),
                                   compression=hvd.Compression.powersgd(rank=2, start_iter=1), overlap=False)
    assert len(opt._buckets) == 1
    order = opt._buckets[0].params  # the bucket's order, in which PowerSGD draws Q and packs P and Q
    mirror = PowerSGD([tuple(p.shape) for p in order],
                      lambda a: allreduce(a, op="sum", comm=comm), P, matrix_approximation_rank=2, start_powerSGD_iter=1)
    rng = np.random.default_rng([RANK, 5])
    for step in range(3):
        opt.zero_grad()
        x = torch.from_numpy(rng.standard_normal((8, 20)).astype(np.float32))
        net(x).square().mean().backward()
        local = [p.grad.detach().numpy().copy() for p in order]
        opt.step()
        mirror.average(local)
        for p, expected in zip(order, local):  # auto may settle on other algorithms on the two communicators
            np.testing.assert_allclose(p.grad.numpy(), expected, rtol=1e-5, atol=1e-6, err_msg=f"step {step}")
    assert_same_everywhere(comm, torch.cat([p.detach().reshape(-1) for p in net.parameters()]).numpy())
    assert opt._compression.states[0].iter == 3


def test_powersgd_arguments_are_checked_before_anything_is_sent():
    with pytest.raises(ValueError, match="Compression.powersgd: rank must be >= 1, got 0"):
        hvd.Compression.powersgd(rank=0)
    with pytest.raises(TypeError, match="start_iter must be an int"):
        hvd.Compression.powersgd(start_iter=1.5)
    net = model()
    with pytest.raises(ValueError, match="rank 13 is above the smaller side of every gradient matrix .at most 12"):
        hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), named_parameters=net.named_parameters(),
                                 compression=hvd.Compression.powersgd(rank=13))
    with pytest.raises(ValueError, match="op must be Average"):
        hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), named_parameters=net.named_parameters(),
                                 compression=hvd.Compression.powersgd(rank=2), op=hvd.Sum)
    with pytest.raises(TypeError, match="Compression.powersgd averages a DistributedOptimizer's gradients"):
        hvd.allreduce(torch.ones(4), compression=hvd.Compression.powersgd())
