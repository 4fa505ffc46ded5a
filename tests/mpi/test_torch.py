"""Inside an MPI job: ``allreduce_kit.torch`` against references at every rank count.

Every collective against MPI's own or a computation every rank can do alone (each rank can
make every rank's input from its seed); ``DistributedOptimizer`` on p ranks with batch b
against one process with batch p*b; replicas bitwise identical; bad input raising on every
rank without a hang.
"""
import copy
import hashlib
import json
import os
import warnings
import weakref

import numpy as np
import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")

import allreduce_kit.torch as hvd  # noqa: E402
from allreduce_kit.torch import mpi_ops, shared_buckets  # noqa: E402

from conftest import assert_same_everywhere  # noqa: E402

WORLD = MPI.COMM_WORLD
RANK, P = WORLD.Get_rank(), WORLD.Get_size()
THREADED = MPI.Query_thread() == MPI.THREAD_MULTIPLE


@pytest.fixture(scope="module", autouse=True)
def initialized():
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        # this module imported mpi4py.MPI before init(): where ranks outnumber cores, init says
        # it could not set MPI's yield (tests/test_import.py checks that warning)
        warnings.filterwarnings("ignore", message="allreduce_kit.torch.init: MPI started before init", category=RuntimeWarning)
        hvd.init()
    yield
    hvd.shutdown()          # frees init's communicators: the suite's leak check counts them


def assert_quiet() -> None:
    """No message is left on the communicator ``allreduce_kit.torch`` sends on, nor in flight."""
    lib = mpi_ops.state().lib
    mpi_ops.state().drain()
    lib.Barrier()
    stray = lib.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)
    lib.Barrier()
    assert not stray, "a message was left unreceived"


def same_everywhere(tensor) -> None:
    assert_same_everywhere(WORLD, np.ascontiguousarray(tensor.detach().reshape(-1).view(torch.uint8).numpy()))


#: torch.testing.assert_close's default tolerances (rtol, atol); integers compare exactly.
_TOLERANCE = {torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5), torch.float32: (1.3e-6, 1e-5),
              torch.float64: (1e-7, 1e-7)}


def close(actual, expected, rtol=None, atol=None, msg: str = "") -> None:
    """``torch.testing.assert_close`` for CPU tensors, through numpy: the first call of torch's
    imports for seconds on every rank, which the MPI suite would pay at every rank count."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, \
        f"{msg}: {actual.dtype} {tuple(actual.shape)} against {expected.dtype} {tuple(expected.shape)}"
    default = _TOLERANCE.get(actual.dtype, (0.0, 0.0))
    np.testing.assert_allclose(actual.detach().double().numpy(), expected.detach().double().numpy(),
                               rtol=default[0] if rtol is None else rtol, atol=default[1] if atol is None else atol,
                               err_msg=msg)


def data_of(rank: int, shape, dtype, low=-4, high=5):
    """Rank ``rank``'s input: any rank can make any rank's."""
    g = torch.Generator().manual_seed(1000 + rank)
    if dtype.is_floating_point:
        return (torch.rand(shape, generator=g, dtype=torch.float64) * (high - low) + low).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.randint(max(low, 0) if dtype == torch.uint8 else low, high, shape, generator=g).to(dtype)


# -- ranks ---------------------------------------------------------------------------------------

@pytest.mark.mpi
def test_rank_size_local_rank_local_size_match_mpi():
    node = WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        assert (hvd.rank(), hvd.size()) == (RANK, P)
        assert (hvd.local_rank(), hvd.local_size()) == (node.Get_rank(), node.Get_size())
        leaders = set(WORLD.allgather(node.allreduce(RANK, op=MPI.MIN)))
        assert hvd.cross_size() == len(leaders) and 0 <= hvd.cross_rank() < len(leaders)
    finally:
        node.Free()
    assert hvd.is_initialized() and hvd.mpi_threads_supported() == (MPI.Query_thread() == MPI.THREAD_MULTIPLE)


# -- allreduce -----------------------------------------------------------------------------------

MPI_OPS = {hvd.Sum: MPI.SUM, hvd.Average: MPI.SUM, hvd.Min: MPI.MIN, hvd.Max: MPI.MAX, hvd.Product: MPI.PROD}


def reference(x: torch.Tensor, op: str) -> np.ndarray:
    """MPI's own Allreduce of this rank's input (mean: sum / p, truncated toward zero for integers)."""
    mine = np.ascontiguousarray(x.numpy())
    out = np.empty_like(mine)
    WORLD.Allreduce(mine, out, op=MPI_OPS[op])
    if op == hvd.Average:
        out = out / P if mine.dtype.kind == "f" else np.trunc(out / P).astype(mine.dtype)
    return out


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.int64])
def test_allreduce_and_allreduce_in_place_match_mpi(dtype):
    for op in (hvd.Average, hvd.Sum, hvd.Min, hvd.Max, hvd.Product):   # one test per dtype: the suite's time
        low, high = (0.5, 1.5) if op == hvd.Product and dtype.is_floating_point else (-4, 5)
        if op == hvd.Product and not dtype.is_floating_point:
            low, high = -1, 3
        x = data_of(RANK, (37, 29), dtype, low, high)
        original = x.clone()
        out = hvd.allreduce(x, op=op, name="reference")
        expected = reference(x, op)
        rtol = {torch.float32: 1e-5, torch.float64: 1e-12}.get(dtype, 0)
        assert out.dtype == dtype and out.shape == x.shape
        np.testing.assert_allclose(out.numpy(), expected, rtol=rtol, atol=rtol, err_msg=f"op {op}")
        assert torch.equal(x, original), f"allreduce modified its input (op {op})"
        same_everywhere(out)
        inplace = x.clone()
        assert hvd.allreduce_(inplace, op=op) is inplace
        assert torch.equal(inplace, out), f"allreduce_ differs from allreduce (op {op})"
    assert_quiet()


@pytest.mark.mpi
def test_allreduce_in_place_shares_memory_with_numpy():
    backing = np.full(1000, RANK + 1, dtype=np.float32)
    tensor = torch.from_numpy(backing)
    hvd.allreduce_(tensor, op=hvd.Sum)
    assert np.all(backing == P * (P + 1) / 2), "the reduction did not land in the numpy array's memory"


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.uint8, torch.int8, torch.int16])
def test_allreduce_of_small_dtypes(dtype):
    for op in (hvd.Sum, hvd.Average, hvd.Max):
        if dtype.is_floating_point:
            everyone = torch.stack([data_of(r, (1001,), dtype) for r in range(P)]).float()
            expected = {hvd.Sum: everyone.sum(0), hvd.Average: everyone.sum(0) / P,
                        hvd.Max: everyone.amax(0)}[op].to(dtype)
            tolerance = {"rtol": 1e-2, "atol": 1e-2}
        else:
            everyone = torch.stack([data_of(r, (1001,), dtype, 0, 9) for r in range(P)]).long()
            expected = {hvd.Sum: everyone.sum(0), hvd.Average: torch.div(everyone.sum(0), P, rounding_mode="trunc"),
                        hvd.Max: everyone.amax(0)}[op].to(dtype)
            tolerance = {"rtol": 0, "atol": 0}
        mine = data_of(RANK, (1001,), dtype, *((-4, 5) if dtype.is_floating_point else (0, 9)))
        out = hvd.allreduce(mine, op=op)
        assert out.dtype == dtype
        close(out, expected, **tolerance, msg=f"op {op}")
        same_everywhere(out)
    assert_quiet()


@pytest.mark.mpi
def test_op_spellings_scale_factors_and_fp16_compression():
    x = data_of(RANK, (513,), torch.float32)
    total = torch.from_numpy(reference(x, hvd.Sum))
    close(hvd.allreduce(x, average=False), total)
    close(hvd.allreduce(x, op=MPI.SUM), total)
    close(hvd.allreduce(x, op="Sum"), total)
    close(hvd.allreduce(x, average=True), total / P)
    close(hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0), total * 1.5)
    squeezed = hvd.allreduce(x, compression=hvd.Compression.fp16)
    assert squeezed.dtype == torch.float32
    close(squeezed, total / P, rtol=2e-3, atol=2e-3)
    assert not torch.equal(squeezed, total / P) or P == 1, "fp16 compression did not round anything"
    same_everywhere(squeezed)
    scalar = hvd.allreduce(torch.tensor(float(RANK)), name="a scalar")
    assert scalar.shape == () and scalar.item() == pytest.approx((P - 1) / 2)
    assert hvd.allreduce(torch.zeros(0)).shape == (0,)
    assert_quiet()


@pytest.mark.mpi
def test_allreduce_is_differentiable():
    x = data_of(RANK, (6,), torch.float64).requires_grad_()
    (hvd.allreduce(x, op=hvd.Sum) * torch.arange(6.0, dtype=torch.float64)).sum().backward()
    # d/dx_q sum_r w . (sum_s x_s) = p * w
    close(x.grad, P * torch.arange(6.0, dtype=torch.float64))
    y = data_of(RANK, (6,), torch.float64).requires_grad_()
    hvd.allreduce(y).sum().backward()
    close(y.grad, torch.ones(6, dtype=torch.float64))


# -- allgather and broadcast -----------------------------------------------------------------------

@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool, torch.bfloat16, torch.uint8])
def test_allgather_concatenates_in_rank_order(dtype):
    rows = lambda r: (r % 3) + 1 if r != 1 else 0   # a rank with no rows at all
    mine = data_of(RANK, (rows(RANK), 3, 2), dtype)
    out = hvd.allgather(mine, name="rows")
    expected = torch.cat([data_of(r, (rows(r), 3, 2), dtype) for r in range(P)])
    assert out.dtype == dtype and torch.equal(out, expected)
    assert_quiet()


#: Horovod's test_horovod_allgather_grad's rows per rank (rank r has ROWS[r % 7]).
ROWS = [3, 2, 7, 4, 6, 8, 10]


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_allgather_gradient_is_horovods(dtype):
    """Horovod's test_horovod_allgather_grad: rank r's rows of the output's gradient hold r on
    every rank, so each rank's gradient holds its rank (the average over ranks of the same
    gradient), not ``size`` times it."""
    rows = [ROWS[r % len(ROWS)] for r in range(P)]
    for dim in (1, 2, 3):
        x = torch.full([rows[RANK]] + [17] * (dim - 1), float(RANK), dtype=dtype, requires_grad=True)
        grad_ys = torch.cat([torch.full([n] + [17] * (dim - 1), float(r), dtype=dtype) for r, n in enumerate(rows)])
        hvd.allgather(x).backward(grad_ys)
        assert torch.equal(x.grad, torch.full_like(x, float(RANK))), f"dim {dim}"
    assert_quiet()


@pytest.mark.mpi
def test_allgather_gradient_averages_the_ranks_gradients():
    x = data_of(RANK, (RANK + 1, 2), torch.float64).requires_grad_()
    out = hvd.allgather(x)
    weights = lambda r: data_of(100 + r, tuple(out.shape), torch.float64)   # a different gradient on each rank
    (out * weights(RANK)).sum().backward()
    start = sum(r + 1 for r in range(RANK))
    close(x.grad, sum(weights(r) for r in range(P))[start:start + RANK + 1] / P)


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.bool, torch.bfloat16])
def test_broadcast_gives_the_roots_tensor(dtype):
    root = P - 1
    x = data_of(RANK, (5, 7), dtype)
    original = x.clone()
    out = hvd.broadcast(x, root_rank=root)
    assert torch.equal(out, data_of(root, (5, 7), dtype)) and torch.equal(x, original)
    assert hvd.broadcast_(x, root) is x and torch.equal(x, out)
    assert_quiet()


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_broadcast_gradient_is_horovods(dtype):
    """Horovod's test_horovod_broadcast_grad: with a gradient of ones on every rank, the root's
    gradient is ones (their average over ranks, not ``size`` times it), every other rank's zero."""
    for dim in (1, 2, 3):
        for root in range(P):
            x = torch.full([17] * dim, float(RANK), dtype=dtype, requires_grad=True)
            hvd.broadcast(x, root).backward(torch.ones([17] * dim, dtype=dtype))
            assert torch.equal(x.grad, torch.full_like(x, 1.0 if RANK == root else 0.0)), f"dim {dim}, root {root}"
    assert_quiet()


@pytest.mark.mpi
def test_broadcast_gradient_averages_the_ranks_gradients_and_objects_travel():
    x = torch.ones(3, dtype=torch.float64, requires_grad=True)
    out = hvd.broadcast(x, root_rank=P - 1)
    (out * data_of(100 + RANK, (3,), torch.float64)).sum().backward()   # a different gradient on each rank
    mean = sum(data_of(100 + r, (3,), torch.float64) for r in range(P)) / P
    close(x.grad, mean if RANK == P - 1 else torch.zeros(3, dtype=torch.float64))
    assert hvd.broadcast_object({"epoch": RANK}, root_rank=P - 1) == {"epoch": P - 1}
    assert hvd.allgather_object(("rank", RANK)) == [("rank", r) for r in range(P)]
    hvd.barrier()


# -- broadcast_parameters and broadcast_optimizer_state ---------------------------------------------

class Net(torch.nn.Module):
    def __init__(self, hidden: int = 16, extra: bool = False):
        super().__init__()
        self.fc1 = torch.nn.Linear(20, hidden)
        self.bn = torch.nn.BatchNorm1d(hidden)   # running statistics and an int64 counter
        self.fc2 = torch.nn.Linear(hidden, 8)
        self.fc3 = torch.nn.Linear(8, 5)
        self.extra = torch.nn.Linear(5, 5) if extra else None

    def forward(self, x, use_extra: bool = False):
        out = self.fc3(torch.relu(self.fc2(torch.relu(self.bn(self.fc1(x))))))
        return self.extra(out) if use_extra else out


def made_on(rank: int, dtype=torch.float32, **kw) -> Net:
    torch.manual_seed(rank)
    net = Net(**kw).to(dtype)
    net.bn.num_batches_tracked.fill_(rank)
    with torch.no_grad():
        net.bn.running_mean.add_(rank)
    return net


def digest(tensors) -> str:
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@pytest.mark.mpi
@pytest.mark.parametrize("form", ["state_dict", "named_parameters", "list"])
def test_broadcast_parameters_gives_every_rank_the_roots_model(form):
    root = P // 2
    net = made_on(RANK)
    params = {"state_dict": lambda: net.state_dict(), "named_parameters": lambda: net.named_parameters(),
              "list": lambda: list(net.parameters())}[form]()
    hvd.broadcast_parameters(params, root_rank=root)
    reference = made_on(root)
    if form == "state_dict":
        assert digest(net.state_dict().values()) == digest(reference.state_dict().values())
    else:
        assert digest(net.parameters()) == digest(reference.parameters())
        assert net.bn.num_batches_tracked.item() == RANK   # buffers are not parameters
    assert_quiet()


@pytest.mark.mpi
@pytest.mark.parametrize("root_has_state", [True, False])
def test_broadcast_optimizer_state_gives_every_rank_the_roots_state(root_has_state):
    root = 0
    net = made_on(0)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3 * (RANK + 1))
    steps = RANK + 1 if (root_has_state or RANK != root) else 0
    for i in range(steps):
        opt.zero_grad()
        net(data_of(RANK * 10 + i, (4, 20), torch.float32)).sum().backward()
        opt.step()
    hvd.broadcast_optimizer_state(opt, root_rank=root)
    mine = opt.state_dict()
    flat = [t for state in mine["state"].values() for t in state.values()]
    everyone = hvd.allgather_object((len(mine["state"]), digest(flat), mine["param_groups"][0]["lr"]))
    assert all(e == everyone[root] for e in everyone), everyone
    assert everyone[root][0] == len(list(net.parameters()))   # a root without state made it by a zero step
    assert everyone[root][2] == pytest.approx(1e-3)
    assert_quiet()


# -- DistributedOptimizer ------------------------------------------------------------------------------

STEPS = 4


def batches(p: int, b: int, dtype):
    """STEPS global batches of p*b samples, the same on every rank."""
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(p * b, 20, generator=g, dtype=torch.float64).to(dtype), torch.randint(0, 5, (p * b,), generator=g))
            for _ in range(STEPS)]


def train(net, opt, data, share: slice, passes: int = 1, set_to_none: bool = True):
    loss_fn = torch.nn.CrossEntropyLoss()
    for x, y in data:
        opt.zero_grad(set_to_none=set_to_none)
        xs, ys = x[share], y[share]
        for chunk_x, chunk_y in zip(xs.chunk(passes), ys.chunk(passes)):
            (loss_fn(net(chunk_x), chunk_y) / passes).backward()
        opt.step()
    return net


def sgd(net, lr=0.1):
    return torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9, weight_decay=1e-3)


@pytest.mark.mpi
@pytest.mark.parametrize("bucket_mb, overlap", [(None, None), (0.0005, True), (0.0005, False)],
                         ids=["defaults", "buckets-during-backward", "buckets-in-step"])
@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_p_ranks_with_batch_b_match_one_process_with_batch_pb(dtype, passes, bucket_mb, overlap):
    trains_as_one_process(dtype, passes, bucket_mb, overlap)


_stream_copy = shared_buckets.stream_copy


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gradients_streamed_into_the_window_train_as_in_one_process(dtype, monkeypatch):
    """The gradients of a large bucket reach the node's window by stores around the caches
    (``kernels.stream``, from ``shared_buckets.STREAM_ROWS``); with every gradient taking that
    path, p ranks still match one process, accumulating over two passes."""
    streamed = []
    monkeypatch.setattr(shared_buckets, "STREAM_ROWS", 0)
    monkeypatch.setattr(shared_buckets, "STREAM_MIN", 0)
    monkeypatch.setattr(shared_buckets, "stream_copy",
                        lambda dst, src: (streamed.append(src.size), _stream_copy(dst, src)))
    trains_as_one_process(dtype, 2, None, None)
    assert bool(streamed) == (P > 1 and mpi_ops.state().layout.single_node)



def trains_as_one_process(dtype, passes, bucket_mb, overlap):
    b = 4
    data = batches(P, b, dtype)
    alone = made_on(0, dtype)
    alone.bn.eval()                  # batch statistics would differ between b and p*b samples
    train(alone, sgd(alone), data, slice(None))
    net = made_on(RANK, dtype)
    net.bn.eval()
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(sgd(net), named_parameters=net.named_parameters(),
                                   backward_passes_per_step=passes, bucket_mb=bucket_mb, overlap=overlap)
    assert isinstance(opt, torch.optim.SGD)
    assert len(opt._buckets) == (1 if bucket_mb is None else 4)
    assert opt._background == (bool(overlap) and P > 1 and THREADED)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)   # schedulers take it
    train(net, opt, data, slice(RANK * b, (RANK + 1) * b), passes)
    schedule.step()
    before = made_on(0, dtype)
    assert (alone.fc1.weight - before.fc1.weight).abs().max() > 1e-3, "the reference did not train"
    tolerance = {torch.float32: 1e-5, torch.float64: 1e-12}[dtype]
    for mine, ref in zip(net.parameters(), alone.parameters()):
        close(mine, ref, rtol=tolerance, atol=tolerance)
    same_everywhere(torch.cat([p.detach().reshape(-1) for p in net.parameters()]))
    assert_quiet()


@pytest.mark.mpi
@pytest.mark.parametrize("variant", ["sum", "predivide", "fp16"])
def test_op_sum_predivide_and_fp16_compression(variant):
    b = 4
    data = batches(P, b, torch.float32)
    alone = made_on(0)
    alone.bn.eval()
    # Sum adds p per-rank averages: p times the gradient, i.e. p times the learning rate (no weight decay)
    lr = 0.05 * (P if variant == "sum" else 1)
    train(alone, torch.optim.SGD(alone.parameters(), lr=lr, momentum=0.9), data, slice(None))
    net = made_on(RANK)
    net.bn.eval()
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    kwargs = {"sum": {"op": hvd.Sum}, "predivide": {"gradient_predivide_factor": 2.0},
              "fp16": {"compression": hvd.Compression.fp16}}[variant]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=net.named_parameters(), bucket_mb=0.0005, overlap=True, **kwargs)
    # predivide also zeroes the gradients in place: they stay views of the buckets' memory
    train(net, opt, data, slice(RANK * b, (RANK + 1) * b), set_to_none=variant != "predivide")
    tolerance = 2e-3 if variant == "fp16" else 1e-5
    for mine, ref in zip(net.parameters(), alone.parameters()):
        close(mine, ref, rtol=tolerance, atol=tolerance)
    same_everywhere(torch.cat([p.detach().reshape(-1) for p in net.parameters()]))
    assert_quiet()


@pytest.mark.mpi
def test_a_parameter_unused_on_some_ranks_is_averaged_as_zero_there():
    net = made_on(0, extra=True)
    net.bn.eval()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), named_parameters=net.named_parameters(),
                                   bucket_mb=0.0005, overlap=True)
    before = net.extra.weight.detach().clone()
    x = data_of(RANK, (4, 20), torch.float32)
    opt.zero_grad()
    net(x, use_extra=(RANK == 0)).sum().backward()
    opt.step()
    same_everywhere(torch.cat([p.detach().reshape(-1) for p in net.parameters()]))
    assert not torch.equal(net.extra.weight, before), "rank 0's gradient of the extra layer was not applied"
    assert_quiet()


@pytest.mark.mpi
def test_synchronize_then_step_in_skip_synchronize_and_report(tmp_path_factory):
    net = made_on(0)
    net.bn.eval()
    opt = hvd.DistributedOptimizer(sgd(net), named_parameters=net.named_parameters(), bucket_mb=0.0005, overlap=True)
    data = batches(P, 4, torch.float32)
    loss_fn = torch.nn.CrossEntropyLoss()
    for x, y in data:
        opt.zero_grad()
        loss_fn(net(x[RANK * 4:(RANK + 1) * 4]), y[RANK * 4:(RANK + 1) * 4]).backward()
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)   # on the averaged gradients: the same everywhere
        with opt.skip_synchronize():
            opt.step()
    same_everywhere(torch.cat([p.detach().reshape(-1) for p in net.parameters()]))
    path = str(tmp_path_factory.mktemp("report") / "report.json") if RANK == 0 else None
    result = opt.report(file=None, json_path=path)
    s = result["straggler"]
    assert s["steps"] == STEPS - 1 and len(s["ranks"]) == P
    assert [r["rank"] for r in s["ranks"]] == list(range(P))
    assert all(r["compute_p50_ms"] > 0 for r in s["ranks"])
    overlap = result["overlap"]
    assert len(overlap["hidden_share"]) == STEPS - 1
    assert all(0.0 <= share <= 1.0 for share in overlap["hidden_share"])
    assert result["buckets"] == 4
    assert result["background"] == (P > 1 and THREADED)
    if P > 1:
        assert overlap["reduction_ms_p50"] > 0
    if RANK == 0:
        with open(path) as saved:
            assert json.load(saved) == result
    assert hvd.allgather_object(result) == [result] * P


@pytest.mark.mpi
def test_by_default_buckets_are_reduced_during_backward_only_with_a_core_to_spare():
    node = WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    local = node.Get_size()
    cores = len(set().union(*node.allgather(os.sched_getaffinity(0))))
    node.Free()
    spare = all(WORLD.allgather(cores >= local * (torch.get_num_threads() + 1)))
    net = Net()
    opt = hvd.DistributedOptimizer(sgd(net), named_parameters=net.named_parameters())
    background = P > 1 and THREADED and spare
    assert opt._timing.extra["bucket_mb"] == (hvd.BUCKET_MB if background else 0.0)
    assert len(opt._buckets) == 1 and not opt._background   # a small model is one bucket either way
    reason = opt._timing.extra["background_reason"]
    assert ("one bucket" in reason) if background else ("no core to spare" in reason or P == 1 or not THREADED)
    assert_quiet()


@pytest.mark.mpi
def test_by_default_gradients_of_more_than_one_bucket_are_reduced_during_backward():
    from allreduce_kit.torch.optimizer import overlap_choice
    spare = overlap_choice(None, 0)[0]          # a core to spare on this node, or not
    small = overlap_choice(None, int(hvd.BUCKET_MB * 1e6))
    large = overlap_choice(None, int(hvd.BUCKET_MB * 1e6) + 1)
    assert small[0] == spare
    assert large[0] == (P > 1 and THREADED), large[1]
    if P > 1 and THREADED and not spare:
        assert "one 25 MB bucket at most" in small[1] and "more than one 25 MB bucket" in large[1]
    assert overlap_choice(False, 10 ** 9)[0] is False
    assert overlap_choice(True, 0)[0] == (P > 1 and THREADED)
    assert_quiet()


@pytest.mark.mpi
def test_torch_threads_are_lowered_to_the_share_of_the_cores_unless_the_user_set_them(monkeypatch):
    from allreduce_kit.topology import Topology
    before = torch.get_num_threads()
    four_on_two = Topology.from_parts(0, [0, 0, 0, 0], [2])
    two_on_eight = Topology.from_parts(0, [0, 0], [8])
    try:
        for name in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS"):
            monkeypatch.delenv(name, raising=False)
        torch.set_num_threads(3)
        assert mpi_ops.share_cores(four_on_two) == 1 and torch.get_num_threads() == 1
        torch.set_num_threads(3)
        assert mpi_ops.share_cores(two_on_eight) == 3 and torch.get_num_threads() == 3   # 6 <= 8: left alone
        torch.set_num_threads(2)
        assert mpi_ops.share_cores(Topology.from_parts(0, [0, 0, 0], [4])) == 1   # 3 x 2 > 4: 4 // 3
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        torch.set_num_threads(3)
        assert mpi_ops.share_cores(four_on_two) == 3 and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


@pytest.mark.mpi
def test_timing_for_a_loop_of_ones_own():
    timing = hvd.Timing()
    grad = torch.ones(100)
    for step in range(3):
        with timing.compute():
            grad.mul_(1.0)
        with timing.allreduce():
            hvd.allreduce_(grad)
        with timing.update():
            pass
        timing.step()
    result = timing.report(file=None)
    assert result["straggler"]["steps"] == 2 and len(result["straggler"]["ranks"]) == P


# -- bad input -------------------------------------------------------------------------------------------

class _OnCuda(torch.Tensor):
    """A CPU tensor that says it is on a GPU: what a CUDA tensor looks like to the checks."""

    @property
    def device(self):
        return torch.device("cuda", 0)


BAD_TENSORS = [
    ("cuda", lambda: torch.Tensor._make_subclass(_OnCuda, torch.ones(4)), TypeError, "tensor is on device cuda:0"),
    ("meta", lambda: torch.empty(4, device="meta"), TypeError, "tensor is on device meta"),
    ("non-contiguous", lambda: torch.ones(4, 6).t(), ValueError, "tensor is not contiguous"),
    ("complex", lambda: torch.ones(4, dtype=torch.complex64), TypeError, "tensor has unsupported dtype complex64"),
    ("sparse", lambda: torch.ones(4).to_sparse(), TypeError, "tensor is a sparse_coo tensor"),
    ("a list", lambda: [1.0, 2.0], TypeError, "tensor must be a torch.Tensor"),
]


@pytest.mark.mpi
@pytest.mark.parametrize("check", [False, True])
@pytest.mark.parametrize("description, make, error, words", BAD_TENSORS, ids=[b[0] for b in BAD_TENSORS])
def test_bad_tensor_raises_on_every_rank_naming_the_argument(description, make, error, words, check):
    with pytest.raises(error, match=f"allreduce: {words}"):
        hvd.allreduce(make(), check=check)
    with pytest.raises(error, match=f"allreduce_: {words}"):
        hvd.allreduce_(make(), check=check)
    if description != "complex":      # any dtype travels in a broadcast
        with pytest.raises(error, match=f"broadcast_: {words}"):
            hvd.broadcast_(make(), 0, check=check)
    good = torch.ones(3)
    hvd.allreduce_(good, op=hvd.Sum)
    assert torch.equal(good, torch.full((3,), float(P)))
    assert_quiet()


@pytest.mark.mpi
@pytest.mark.parametrize("kwargs, error, words", [
    ({"op": hvd.Adasum}, ValueError, "op Adasum is not supported"),
    ({"op": "avg"}, ValueError, "unknown op 'avg'"),
    ({"op": hvd.Sum, "average": True}, ValueError, "give op or average, not both"),
    ({"prescale_factor": "2"}, TypeError, "prescale_factor must be a number"),
    ({"compression": "fp16"}, TypeError, "compression must be"),
    ({"check": "yes"}, TypeError, "check must be True, False or None"),
], ids=["adasum", "unknown-op", "op-and-average", "prescale", "compression", "check"])
def test_bad_argument_raises_on_every_rank(kwargs, error, words):
    with pytest.raises(error, match=words):
        hvd.allreduce(torch.ones(3), **kwargs)
    assert_quiet()


@pytest.mark.mpi(min_size=2)
def test_check_catches_shapes_that_differ_between_ranks():
    x = torch.ones([17 + RANK] * 3)
    with pytest.raises(ValueError, match=r"allreduce: shape differs between ranks \(rank 0: \(17, 17, 17\), rank 1: "
                                         r"\(18, 18, 18\)"):
        hvd.allreduce(x, check=True)
    with pytest.raises(ValueError, match="broadcast: shape differs between ranks"):
        hvd.broadcast(x, 0, check=True)
    with pytest.raises(ValueError, match=r"allgather: shape after the first dimension differs between ranks"):
        hvd.allgather(x)                                   # always compared: shapes are exchanged anyway
    assert_quiet()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int8, torch.float16, torch.bfloat16])
def test_a_length_that_differs_between_ranks_raises_on_every_rank_without_check(dtype):
    """Every dtype's reduction finds the difference itself, the 2-byte floats too (their
    segments are counted from the length, so they agree on it first): the same error everywhere.
    The lengths stay in one of ``auto``'s size classes, so that every rank runs one algorithm."""
    with pytest.raises(ValueError, match=r"allreduce: buf length differs between ranks"):
        hvd.allreduce(torch.ones(1000 + RANK, dtype=dtype), check=False)
    assert_quiet()
    assert torch.equal(hvd.allreduce(torch.ones(4, dtype=dtype), op=hvd.Sum), torch.full((4,), P, dtype=dtype))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case, words", [
    ("length", r"broadcast: shape differs between ranks \(rank 0: \(4,\), rank 1: \(5,\)"),
    ("dtype", r"broadcast: dtype differs between ranks \(rank 0: 'float32', rank 1: 'float64'"),
    ("shape", r"broadcast: shape differs between ranks \(rank 0: \(2, 3\), rank 1: \(3, 2\)"),
    ("root", r"broadcast: root_rank differs between ranks \(rank 0: 0, rank 1: 1"),
    ("in-place-root", r"broadcast_: root_rank differs between ranks \(rank 0: 0, rank 1: 1"),
    ("object-root", r"broadcast_object: root_rank differs between ranks \(rank 0: 0, rank 1: 1"),
])
def test_a_broadcast_that_differs_between_ranks_raises_on_every_rank_without_check(case, words):
    """Horovod's test_horovod_broadcast_rank_error (each rank its own root) and tensors that
    differ: the same ``ValueError`` on every rank instead of an MPI error on some or a hang."""
    with pytest.raises(ValueError, match=words):
        if case == "length":
            hvd.broadcast(torch.ones(4 + RANK), 0, check=False)
        elif case == "dtype":
            hvd.broadcast(torch.ones(4, dtype=torch.float32 if RANK == 0 else torch.float64), 0)
        elif case == "shape":
            hvd.broadcast(torch.ones((2, 3) if RANK == 0 else (3, 2)), 0)
        elif case == "root":
            hvd.broadcast(torch.ones(4), RANK)
        elif case == "in-place-root":
            hvd.broadcast_(torch.ones(4), RANK)
        else:
            hvd.broadcast_object("x", RANK)
    assert_quiet()
    assert torch.equal(hvd.broadcast(torch.full((4,), float(RANK)), 1), torch.ones(4))


@pytest.mark.mpi(min_size=2)
def test_check_catches_a_bad_tensor_on_one_rank_only():
    x = torch.ones(4) if RANK != 1 else torch.ones(4, 2).t()
    expected = "allreduce: tensor is not contiguous" if RANK == 1 else "allreduce: rank 1 failed: allreduce: tensor is not"
    with pytest.raises(ValueError, match=expected):
        hvd.allreduce(x, check=True)
    assert_quiet()


@pytest.mark.mpi(min_size=2)
def test_distributed_optimizer_refuses_models_that_differ_between_ranks():
    net = Net(hidden=8 + (RANK == 1))
    with pytest.raises(ValueError, match=r"DistributedOptimizer: parameters \(name, shape, dtype\) differs between "
                                         r"ranks \(item \d+: rank 0: \('fc"):
        hvd.DistributedOptimizer(sgd(net), named_parameters=net.named_parameters())
    assert_quiet()


@pytest.mark.mpi
@pytest.mark.parametrize("kwargs, error, words", [
    ({"op": hvd.Adasum}, ValueError, "op Adasum is not supported"),
    ({"op": hvd.Max}, ValueError, "op must be Average or Sum"),
    ({"backward_passes_per_step": 0}, ValueError, "backward_passes_per_step must be >= 1"),
    ({"compression": "fp16"}, TypeError, "compression must be"),
    ({"bucket_mb": -1}, ValueError, "bucket_mb must be >= 0"),
    ({"named_parameters": [("fc1.weight", None)]}, ValueError, "does not name"),
], ids=["adasum", "max", "passes", "compression", "bucket", "unnamed"])
def test_distributed_optimizer_bad_arguments_raise_on_every_rank(kwargs, error, words):
    net = Net()
    kwargs = {"named_parameters": net.named_parameters(), **kwargs}
    with pytest.raises(error, match=f"DistributedOptimizer: .*{words}"):
        hvd.DistributedOptimizer(sgd(net), **kwargs)
    assert_quiet()


@pytest.mark.mpi
def test_distributed_optimizer_refuses_a_gpu_parameter_on_every_rank():
    net = Net()
    fake = torch.nn.Parameter(torch.Tensor._make_subclass(_OnCuda, torch.ones(3)))
    opt = torch.optim.SGD([*net.parameters(), fake], lr=0.1)
    with pytest.raises(TypeError, match="DistributedOptimizer: parameter 'allreduce.noname.0.8' is on device cuda:0"):
        hvd.DistributedOptimizer(opt)
    assert_quiet()


@pytest.mark.mpi
def test_too_many_backward_passes_and_zero_grad_too_early_are_refused():
    net = made_on(0)
    net.bn.eval()
    opt = hvd.DistributedOptimizer(sgd(net), named_parameters=net.named_parameters(), bucket_mb=0.0005, overlap=True)
    x = data_of(0, (4, 20), torch.float32)
    alone = copy.deepcopy(net)
    alone(x).sum().backward()        # every rank's gradient: the same input on every rank
    net(x).sum().backward()
    if P > 1:
        with pytest.raises(RuntimeError, match="zero_grad\\(\\) was called after backward\\(\\) and before step"):
            opt.zero_grad()
        with pytest.raises(RuntimeError, match="computed 2 times before step\\(\\), but backward_passes_per_step is 1"):
            net(x).sum().backward()
    opt.synchronize()                # what was in flight finishes; the refused pass added nothing
    for name, p in net.named_parameters():
        close(p.grad, dict(alone.named_parameters())[name].grad, msg=name)
    with opt.skip_synchronize():
        opt.step()
    for _ in range(2):
        opt.zero_grad()
        net(x).sum().backward()
        opt.step()
    same_everywhere(torch.cat([p.detach().reshape(-1) for p in net.parameters()]))
    assert_quiet()


@pytest.mark.mpi
@pytest.mark.parametrize("overlap", [False, True])
def test_the_gradients_backward_produced_live_until_zero_grad_as_with_a_plain_optimizer(overlap):
    """After the reduction ``.grad`` is a view of the bucket, but the tensors backward produced
    stay alive until ``zero_grad``, so that the next backward reuses their memory instead of
    memory the allocator may have handed back to the system."""
    net = made_on(0)
    net.bn.eval()
    params = list(net.parameters())
    produced = {}  # what backward left in each .grad, seen before the optimizer's hooks hand it on
    for index, p in enumerate(params):  # registered first, so they run first
        p.register_post_accumulate_grad_hook(lambda p, index=index: produced.__setitem__(index, weakref.ref(p.grad)))
    opt = hvd.DistributedOptimizer(sgd(net), named_parameters=net.named_parameters(), bucket_mb=0.0005,
                                   overlap=overlap)
    x = data_of(0, (4, 20), torch.float32)
    for _ in range(2):
        last = list(produced.values())
        opt.zero_grad()
        assert all(ref() is None for ref in last), "zero_grad releases the last backward's gradients"
        produced.clear()
        net(x).sum().backward()
        opt.step()
        assert sorted(produced) == list(range(len(params)))
        assert all(ref() is not None for ref in produced.values()), "dropped before zero_grad"
        if P > 1:
            assert all(p.grad is not produced[i]() for i, p in enumerate(params)), ".grad is the bucket's view"
    assert_quiet()


@pytest.mark.mpi
def test_on_one_node_float_buckets_live_in_a_shared_window_and_shutdown_gives_the_gradients_back():
    half = torch.nn.Linear(3, 2).to(torch.float16)     # a float16 bucket stays a private buffer
    net = made_on(0)
    named = list(net.named_parameters()) + [(f"half.{n}", p) for n, p in half.named_parameters()]
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in named], lr=0.1), named_parameters=named,
                                   bucket_mb=0.0005, overlap=False)
    shared = P > 1 and mpi_ops.state().layout.single_node
    kinds = [(b.flat.dtype, b.shared is not None) for b in opt._buckets]
    assert (torch.float16, False) in kinds and (torch.float32, shared) in kinds and (torch.float32, not shared) not in kinds
    x, y = batches(P, 4, torch.float32)[0]
    opt.zero_grad()
    (torch.nn.functional.cross_entropy(net(x[RANK::P]), y[RANK::P]) + half(x[RANK::P, :3].half()).float().sum()).backward()
    mine = {n: p.grad.clone() for n, p in named}
    opt.synchronize()
    everyone = hvd.allgather_object(mine)
    for n, p in named:
        close(p.grad, sum(e[n].double() for e in everyone).to(p.dtype) / P, rtol=1e-2 if p.dtype == torch.float16 else 1e-5,
              atol=1e-3 if p.dtype == torch.float16 else 1e-6, msg=n)
        same_everywhere(p.grad)
    averaged = {n: p.grad.clone() for n, p in named}
    hvd.shutdown()                   # frees the window: every .grad that was a view of it gets a copy
    try:
        assert all(b.shared is None for b in opt._buckets)
        for n, p in named:
            assert torch.equal(p.grad, averaged[n]), n
            flat = opt._buckets[opt._bucket_of[opt._names.index(n)]].flat
            assert P == 1 or flat.data_ptr() <= p.grad.data_ptr() < flat.data_ptr() + flat.numel() * flat.element_size(), n
    finally:
        hvd.init()
    with opt.skip_synchronize():
        opt.step()                   # the update reads the gradients from the private buffers
    assert_quiet()


@pytest.mark.mpi
def test_calls_before_init_raise_and_init_again_works():
    net = made_on(0)
    hvd.DistributedOptimizer(sgd(net), named_parameters=net.named_parameters(), bucket_mb=0.0005, overlap=True)
    s = mpi_ops.state()
    worker = s._worker
    assert (worker is not None) == (P > 1 and THREADED)
    hvd.shutdown()
    assert s.lib == MPI.COMM_NULL and s.dup == MPI.COMM_NULL, "shutdown left init's communicators alive"
    assert worker is None or not worker._thread.is_alive(), "shutdown left the background thread running"
    try:
        with pytest.raises(ValueError, match="has not been initialized; call init\\(\\) first"):
            hvd.rank()
        with pytest.raises(ValueError, match="has not been initialized"):
            hvd.allreduce(torch.ones(2))
        with pytest.raises(TypeError, match="init: comm must be an mpi4py intracommunicator"):
            hvd.init([0, 1])
    finally:
        hvd.init()
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [P, P]
