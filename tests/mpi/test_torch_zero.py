"""Inside an MPI job: sharded data parallelism in ``allreduce_kit.torch`` at every rank count.

``ZeroRedundancyOptimizer`` (stages 1 and 2) and ``fully_shard`` (stage 3) on p ranks with batch b
against plain training in one process with batch p*b (every rank computes that reference
itself), on models whose parameter counts no rank count divides; the consolidated optimizer
state against the plain optimizer's, and loaded back; a model or an argument that differs
between ranks raising the same error on every rank, without a hang; nothing left in flight.
"""
import warnings

import numpy as np
import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")
nn = torch.nn

import allreduce_kit.torch as hvd  # noqa: E402
from allreduce_kit import progress  # noqa: E402

WORLD = MPI.COMM_WORLD
RANK, P = WORLD.Get_rank(), WORLD.Get_size()
BATCH, STEPS = 4, 3
SGD = (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9})
ADAM = (torch.optim.Adam, {"lr": 0.01})


@pytest.fixture(scope="module", autouse=True)
def initialized():
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="allreduce_kit.torch.init: MPI started before init",
                                category=RuntimeWarning)
        hvd.init()
    yield
    hvd.shutdown()


def mlp(width: int = 11) -> nn.Sequential:
    """5*11+11 + 11*7+7 + 7*3+3 = 174 parameters (with width 11): no rank count here divides it."""
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(5, width), nn.Tanh(), nn.Linear(width, 7), nn.ReLU(), nn.Linear(7, 3))


def batches():
    """Every rank's batches, the same on every rank: (x, y) of P * BATCH samples per step."""
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(P * BATCH, 5, generator=g), torch.randn(P * BATCH, 3, generator=g)) for _ in range(STEPS)]


def loss(net, x, y):
    return ((net(x) - y) ** 2).mean()


def mine(x):
    return x[RANK * BATCH:(RANK + 1) * BATCH]


def assert_close(actual, expected, what):
    """Through numpy: the first call of ``torch.testing.assert_close`` imports for seconds."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    np.testing.assert_allclose(actual.detach().double().numpy(), expected.detach().double().numpy(),
                               rtol=1e-5, atol=1e-6, err_msg=what)


def assert_nothing_in_flight():
    assert progress.IN_FLIGHT[0] == 0, "a nonblocking collective was left in flight"


# -- ZeroRedundancyOptimizer ---------------------------------------------------------------------

def train_side_by_side(opt, net, plain, reference, data, what=None, after_step=lambda: None):
    """Steps of ``opt`` over ``net`` on this rank's share of each batch beside ``plain`` over
    ``reference`` on the whole batch, nothing left in flight after each (and ``after_step()``);
    then, given ``what``, every parameter of ``net`` close to ``reference``'s."""
    for x, y in data:
        opt.zero_grad()
        plain.zero_grad()
        loss(net, mine(x), mine(y)).backward()
        loss(reference, x, y).backward()
        opt.step()
        plain.step()
        assert_nothing_in_flight()
        after_step()
    if what is not None:
        for (name, a), b in zip(net.named_parameters(), reference.parameters()):
            assert_close(a, b, f"{what}: {name}")


@pytest.mark.mpi
@pytest.mark.parametrize("stage,overlap", [(1, None), (2, True), (2, False)])
def test_zero_on_p_ranks_trains_as_one_process_and_its_state_is_the_plain_optimizers(stage, overlap):
    for optimizer_class, settings in (SGD, ADAM):
        net, reference = mlp(), mlp()
        zero = hvd.ZeroRedundancyOptimizer(net.parameters(), optimizer_class, stage=stage, bucket_mb=0.0003,
                                           overlap=overlap, **settings)
        assert len(zero._buckets) > 1, "the test means several buckets"
        plain = optimizer_class(reference.parameters(), **settings)
        train_side_by_side(zero, net, plain, reference, batches(), f"{optimizer_class.__name__} stage {stage}")
        to = P - 1
        zero.consolidate_state_dict(to=to)
        if RANK == to:
            state, expected = zero.state_dict(), plain.state_dict()
            assert state["param_groups"] == expected["param_groups"]
            assert sorted(state["state"]) == sorted(expected["state"])
            for i, entry in expected["state"].items():
                for key, value in entry.items():
                    assert_close(state["state"][i][key], value, f"state {i} {key}")
        else:
            with pytest.raises(RuntimeError, match=r"consolidate_state_dict\(to="):
                zero.state_dict()


class WithUnused(nn.Module):
    """17,030 + 393 parameters in use (a bucket past 64 KiB: on one node the ranks read each
    other's gradients where backward left them) and a layer whose gradient backward never makes."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(11)
        self.big, self.out, self.unused = nn.Linear(130, 130), nn.Linear(130, 3), nn.Linear(4, 4)

    def forward(self, x):
        return self.out(torch.tanh(self.big(x)))


@pytest.mark.mpi
@pytest.mark.parametrize("stage,overlap", [(1, None), (2, True), (2, False)])
def test_zero_with_a_large_bucket_and_a_gradient_never_made_trains_as_one_process(stage, overlap):
    net, reference = WithUnused(), WithUnused()
    zero = hvd.ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, stage=stage, overlap=overlap,
                                       lr=0.05, momentum=0.9)
    plain = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(P * BATCH, 130, generator=g), torch.randn(P * BATCH, 3, generator=g)) for _ in range(STEPS)]
    train_side_by_side(zero, net, plain, reference, data, f"stage {stage}")


@pytest.mark.mpi
def test_zero_loads_a_plain_optimizers_state_and_goes_on_as_it_does():
    net, reference = mlp(), mlp()
    plain = torch.optim.Adam(reference.parameters(), lr=0.01)
    data = batches()
    for x, y in data[:2]:
        plain.zero_grad()
        loss(reference, x, y).backward()
        plain.step()
    net.load_state_dict(reference.state_dict())
    zero = hvd.ZeroRedundancyOptimizer(net.parameters(), torch.optim.Adam, stage=2, bucket_mb=0.0003, lr=0.5)
    zero.load_state_dict(plain.state_dict())
    assert zero.param_groups[0]["lr"] == 0.01 and zero.optim.param_groups[0]["lr"] == 0.01
    train_side_by_side(zero, net, plain, reference, data[2:], "after loading")


@pytest.mark.mpi
@pytest.mark.parametrize("overlap", [True, False])
def test_zero_accumulates_backward_passes_in_stage_2(overlap):
    """Two backward passes, a step, then zero_grad() after a backward pass refused (its gradients
    are already on their way)."""
    net, reference = mlp(), mlp()
    zero = hvd.ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, stage=2, bucket_mb=0.0003,
                                       overlap=overlap, lr=0.1)
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    (x, y), (x2, y2), (x3, y3) = batches()[:3]
    for inputs, targets in ((x, y), (x2, y2)):
        loss(net, mine(inputs), mine(targets)).backward()
        loss(reference, inputs, targets).backward()
    zero.step()
    plain.step()
    for (name, a), b in zip(net.named_parameters(), reference.parameters()):
        assert_close(a, b, name)
    zero.zero_grad()
    plain.zero_grad()
    loss(net, mine(x3), mine(y3)).backward()
    loss(reference, x3, y3).backward()
    if P > 1:
        with pytest.raises(RuntimeError, match=r"zero_grad\(\) was called after backward\(\) and before step"):
            zero.zero_grad()
    zero.step()
    plain.step()
    for (name, a), b in zip(net.named_parameters(), reference.parameters()):
        assert_close(a, b, name)
    assert_nothing_in_flight()


@pytest.mark.mpi
def test_zero_with_shapes_that_differ_between_ranks_raises_on_every_rank():
    net = mlp(width=11 + (RANK == P - 1 and P > 1))
    if P == 1:
        with pytest.raises(ValueError, match="stage must be 1"):
            hvd.ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, stage=3, lr=0.1)
        return
    with pytest.raises(ValueError, match="parameters .* differs between ranks"):
        hvd.ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, lr=0.1)
    # a bad argument on one rank only: every rank raises, naming it
    stage = 3 if RANK == 0 else 1
    with pytest.raises(ValueError, match="stage must be 1"):
        hvd.ZeroRedundancyOptimizer(mlp().parameters(), torch.optim.SGD, stage=stage, lr=0.1)
    hvd.barrier()


# -- fully_shard ---------------------------------------------------------------------------------

class Stack(nn.Module):
    """Layers in an ``nn.ModuleList``, run by the module's own forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.layers = nn.ModuleList([nn.Linear(5, 9), nn.Linear(9, 9), nn.Linear(9, 3)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


@pytest.mark.mpi
@pytest.mark.parametrize("prefetch", [0, 2])
def test_fully_shard_on_p_ranks_trains_as_one_process(prefetch):
    for make, shard in ((mlp, lambda m: hvd.fully_shard(m, prefetch=prefetch)),
                        (Stack, lambda m: (hvd.fully_shard(m.layers, prefetch=prefetch), m)[1])):
        net, reference = shard(make()), make()
        sharding = (net.layers if isinstance(net, Stack) else net)._allreduce_kit_sharding
        live = []
        for layer in sharding.layers:   # after fully_shard's own hook: the layer and those ahead of it
            layer.module.register_forward_pre_hook(lambda *_: live.append(sharding._live()))
        opt = torch.optim.Adam(net.parameters(), lr=0.01)
        plain = torch.optim.Adam(reference.parameters(), lr=0.01)

        def freed():
            assert all(layer.full.untyped_storage().nbytes() == 0 for layer in sharding.layers), \
                "a layer's gathered parameters outlived backward"

        train_side_by_side(opt, net, plain, reference, batches(), after_step=freed)
        assert max(live) <= prefetch + 1, f"{max(live)} layers whole at once with prefetch={prefetch}"
        own = [n for n, _ in net.named_parameters()]
        assert own and all(n.endswith("flat_shard") for n in own)
        whole = hvd.full_state_dict(net.layers if isinstance(net, Stack) else net)
        expected = (reference.layers if isinstance(reference, Stack) else reference).state_dict()
        assert list(whole) == list(expected)
        for key, value in expected.items():
            assert_close(whole[key], value, f"{type(net).__name__} {key}")
        with torch.no_grad():
            x = batches()[0][0]
            assert_close(net(x), reference(x), "forward after training")


@pytest.mark.mpi
def test_fully_shard_with_shapes_that_differ_between_ranks_raises_on_every_rank():
    if P == 1:
        with pytest.raises(ValueError, match="prefetch must be >= 0"):
            hvd.fully_shard(mlp(), prefetch=-1)
        return
    with pytest.raises(ValueError, match="layers .* differs between ranks"):
        hvd.fully_shard(mlp(width=11 + (RANK == P - 1)))
    with pytest.raises(ValueError, match="prefetch must be >= 0"):
        hvd.fully_shard(mlp(), prefetch=-1 if RANK == P - 1 else 1)
    hvd.barrier()


@pytest.mark.mpi
def test_buckets_and_layers_smaller_than_the_rank_count_leave_some_blocks_empty_and_train_alike():
    def tiny():
        torch.manual_seed(1)   # layers of 2 and 4 parameters: at 3 ranks and more, some blocks are empty
        return nn.Sequential(nn.Linear(1, 1), nn.Tanh(), nn.Linear(1, 2))

    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(2 * P, 1, generator=g), torch.randn(2 * P, 2, generator=g)) for _ in range(2)]
    for stage in (1, 2, 3):
        net, reference = tiny(), tiny()
        if stage == 3:
            opt = torch.optim.Adam(hvd.fully_shard(net).parameters(), lr=0.1)
        else:
            opt = hvd.ZeroRedundancyOptimizer(net.parameters(), torch.optim.Adam, stage=stage, bucket_mb=0, lr=0.1)
        plain = torch.optim.Adam(reference.parameters(), lr=0.1)
        for x, y in data:
            opt.zero_grad()
            plain.zero_grad()
            loss(net, x[2 * RANK:2 * RANK + 2], y[2 * RANK:2 * RANK + 2]).backward()
            loss(reference, x, y).backward()
            opt.step()
            plain.step()
        trained = hvd.full_state_dict(net) if stage == 3 else net.state_dict()
        for key, value in reference.state_dict().items():
            assert_close(trained[key], value, f"stage {stage}: {key}")
