"""Inside an MPI job: the rest of Horovod's ``horovod.torch`` names, against closed forms.

Rank ``r`` holds values every rank can compute (``r + 1``, ``10 * r + j``, ...), so each result
is checked against a formula: reducescatter's blocks (any length, even fewer rows than ranks),
alltoall's rows and received splits, the grouped and asynchronous forms, process sets, the
exception types Horovod's callers catch, integer scale factors, and ``DistributedOptimizer``'s
Horovod arguments and warning.
"""
import warnings

import numpy as np
import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")

import allreduce_kit.torch as hvd  # noqa: E402
from allreduce_kit.torch import mpi_ops  # noqa: E402
from allreduce_kit.torch.scatter_rows import row_blocks  # noqa: E402

WORLD = MPI.COMM_WORLD
RANK, P = WORLD.Get_rank(), WORLD.Get_size()
TRIANGLE = P * (P + 1) // 2          # the sum over the ranks of r + 1


@pytest.fixture(scope="module", autouse=True)
def initialized():
    torch.set_num_threads(1)
    hvd.init()
    yield
    hvd.shutdown()


def test_the_build_queries_say_cpu_and_mpi_only():
    assert hvd.mpi_built() and not hvd.ccl_built() and not hvd.ddl_built() and not hvd.nccl_built()


def test_row_blocks_give_the_first_ranks_one_row_more():
    assert row_blocks(7, 3) == [(0, 3), (3, 2), (5, 2)]
    assert row_blocks(2, 4) == [(0, 1), (1, 1), (2, 0), (2, 0)]
    assert row_blocks(0, 2) == [(0, 0), (0, 0)]


@pytest.mark.mpi
@pytest.mark.parametrize("rows", [2 * P + 1, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.float16])
def test_reducescatter_gives_each_rank_its_block_of_the_sum(rows, dtype):
    base = torch.arange(rows * 3, dtype=torch.float64).reshape(rows, 3)
    mine = (base * (RANK + 1)).to(dtype)
    start, count = row_blocks(rows, P)[RANK]
    summed = hvd.reducescatter(mine, op=hvd.Sum)
    assert summed.dtype == dtype and tuple(summed.shape) == (count, 3)
    assert torch.equal(summed.double(), base[start:start + count] * TRIANGLE)
    averaged = hvd.reducescatter(mine)                     # Average, the default
    expected = base[start:start + count] * TRIANGLE / P
    if not dtype.is_floating_point:
        expected = torch.trunc(expected)
    np.testing.assert_allclose(averaged.double().numpy(), expected.numpy(), rtol=1e-3)


@pytest.mark.mpi
def test_reducescatter_gradient_is_the_allgather_of_the_gradient_times_the_size_for_sum():
    x = torch.ones(2 * P, 2, requires_grad=True)
    hvd.reducescatter(x, op=hvd.Sum).sum().backward()
    assert torch.equal(x.grad, torch.full((2 * P, 2), float(P)))


@pytest.mark.mpi
def test_reducescatter_refuses_scalars_adasum_and_shapes_that_differ():
    with pytest.raises(ValueError, match="at least one dimension"):
        hvd.reducescatter(torch.tensor(1.0))
    with pytest.raises(RuntimeError, match="Adasum"):
        hvd.reducescatter(torch.ones(P), op=hvd.Adasum)
    if P > 1:
        with pytest.raises(hvd.CollectiveError, match="differs between ranks"):
            hvd.reducescatter(torch.ones(P + RANK))


@pytest.mark.mpi
def test_alltoall_sends_each_rank_its_rows_and_returns_the_received_splits():
    # rank r sends j + 1 rows of value 10 r + j to rank j
    rows = torch.cat([torch.full((j + 1, 2), float(10 * RANK + j)) for j in range(P)])
    splits = torch.tensor([j + 1 for j in range(P)], dtype=torch.int32)
    out, received = hvd.alltoall(rows, splits)
    assert received.dtype == torch.int32 and received.tolist() == [RANK + 1] * P
    expected = torch.cat([torch.full((RANK + 1, 2), float(10 * i + RANK)) for i in range(P)])
    assert torch.equal(out, expected)
    equal = hvd.alltoall(torch.arange(P, dtype=torch.int32) + 100 * RANK)   # one row to each rank
    assert equal.tolist() == [100 * i + RANK for i in range(P)]


@pytest.mark.mpi
def test_alltoall_refuses_bad_splits_on_every_rank():
    with pytest.raises(ValueError, match="int32"):
        hvd.alltoall(torch.ones(P), torch.ones(P))
    with pytest.raises(ValueError, match="more than the first dimension"):
        hvd.alltoall(torch.ones(P - 1), torch.ones(P, dtype=torch.int32))
    if P > 1:
        with pytest.raises(ValueError, match="divide"):
            hvd.alltoall(torch.ones(P + 1))


@pytest.mark.mpi
def test_grouped_forms_are_the_single_calls_in_list_order():
    a, b = torch.full((3,), RANK + 1.0), torch.full((2, 2), RANK + 1, dtype=torch.int32)
    summed = hvd.grouped_allreduce([a, b], op=hvd.Sum)
    assert torch.equal(summed[0], torch.full((3,), float(TRIANGLE)))
    assert torch.equal(summed[1], torch.full((2, 2), TRIANGLE, dtype=torch.int32))
    in_place = [a.clone(), b.clone()]
    hvd.grouped_allreduce_(in_place, op=hvd.Sum)
    assert all(torch.equal(x, y) for x, y in zip(in_place, summed))
    gathered = hvd.grouped_allgather([a, b])
    assert gathered[0].tolist() == [float(r + 1) for r in range(P) for _ in range(3)]
    scattered = hvd.grouped_reducescatter([torch.ones(P, 2)], op=hvd.Sum)
    assert torch.equal(scattered[0], torch.full((1, 2), float(P)))


@pytest.mark.mpi
def test_async_forms_return_at_once_and_synchronize_returns_the_result():
    x = torch.full((5,), RANK + 1.0)
    handles = [hvd.allreduce_async(x, op=hvd.Sum, name="a"), hvd.allgather_async(x),
               hvd.broadcast_async(x, root_rank=P - 1), hvd.reducescatter_async(torch.ones(P), op=hvd.Sum),
               hvd.alltoall_async(torch.arange(P, dtype=torch.float32))]
    with pytest.raises(ValueError, match="in use"):
        hvd.allreduce_async(x, name="a")
    y = x.clone()
    in_place = hvd.allreduce_async_(y, op=hvd.Sum)
    assert all(isinstance(hvd.poll(h), bool) for h in handles)
    summed, gathered, broadcast, scattered, (exchanged, received) = [hvd.synchronize(h) for h in handles]
    assert torch.equal(summed, torch.full((5,), float(TRIANGLE)))
    assert gathered.tolist() == [float(r + 1) for r in range(P) for _ in range(5)]
    assert torch.equal(broadcast, torch.full((5,), float(P)))
    assert scattered.tolist() == [float(P)]
    assert exchanged.tolist() == [float(RANK)] * P and received.tolist() == [1] * P
    assert hvd.synchronize(in_place) is y and torch.equal(y, summed)
    with pytest.raises(ValueError, match="not a handle"):
        hvd.synchronize(handles[0])              # spent
    hvd.synchronize(hvd.allreduce_async(x, name="a"))   # the name is free again


@pytest.mark.mpi
def test_process_sets_reduce_over_their_members_only():
    evens, odds = list(range(0, P, 2)), list(range(1, P, 2))
    even_set = hvd.add_process_set(evens)
    odd_set = hvd.add_process_set(odds) if odds else None
    try:
        mine, members = (even_set, evens) if RANK % 2 == 0 else (odd_set, odds)
        assert mine.included() and mine.size() == len(members) and mine.rank() == members.index(RANK)
        assert hvd.global_process_set.size() == P and hvd.global_process_set.rank() == RANK
        summed = hvd.allreduce(torch.tensor([RANK + 1.0]), op=hvd.Sum, process_set=mine)
        assert summed.item() == sum(r + 1 for r in members)
        assert hvd.allgather(torch.tensor([RANK]), process_set=mine).tolist() == members
        assert hvd.broadcast(torch.tensor([RANK]), root_rank=members[-1], process_set=mine).item() == members[-1]
        handle = hvd.allreduce_async(torch.tensor([1.0]), op=hvd.Sum, process_set=mine)
        assert hvd.synchronize(handle).item() == len(members)
        hvd.barrier(process_set=mine)
        other = odd_set if RANK % 2 == 0 else even_set
        if other is not None:
            with pytest.raises(ValueError, match="not in"):
                hvd.allreduce(torch.ones(1), process_set=other)
        with pytest.raises(ValueError, match="already added"):
            hvd.add_process_set(evens)
    finally:
        assert hvd.remove_process_set(even_set)
        if odd_set is not None:
            assert hvd.remove_process_set(odd_set)
    assert not hvd.remove_process_set(hvd.global_process_set)
    with pytest.raises(ValueError, match="not been added"):
        hvd.allreduce(torch.ones(1), process_set=even_set)


@pytest.mark.mpi
def test_a_difference_between_ranks_raises_what_horovods_callers_catch():
    if P == 1:
        pytest.skip("needs two ranks")
    with pytest.raises(hvd.CollectiveError) as raised:
        hvd.allreduce(torch.ones(3 + RANK), check=True)
    assert isinstance(raised.value, RuntimeError) and isinstance(raised.value, ValueError)
    with pytest.raises(RuntimeError):
        hvd.allgather(torch.ones(2, 1 + RANK))


@pytest.mark.mpi
def test_integer_tensors_are_scaled_in_float64_and_cast_back():
    x = torch.full((4,), 3, dtype=torch.int32)
    out = hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=1.5)
    assert out.dtype == torch.int32 and out.tolist() == [int(P * 1 * 1.5)] * 4   # trunc(3 * 0.5) = 1 per rank


@pytest.mark.mpi
def test_distributed_optimizer_takes_horovods_arguments_and_warns_on_step_after_synchronize():
    model = torch.nn.Linear(2, 1)
    model.register_parameter("index", torch.nn.Parameter(torch.tensor([1, 0]), requires_grad=False))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), num_groups=2, sparse_as_dense=True)
    with pytest.raises(TypeError, match="num_groups"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), num_groups="2")
    model(torch.ones(1, 2)).sum().backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    if P > 1:
        assert any("skip_synchronize" in str(w.message) for w in caught)
    model(torch.ones(1, 2)).sum().backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught, opt.skip_synchronize():
        warnings.simplefilter("always")
        opt.step()
    assert not caught
    mpi_ops.state().drain()


@pytest.mark.mpi
def test_sparse_allreduce_async_is_the_allreduce_of_the_dense_forms():
    dense = torch.zeros(4, 3)
    dense[RANK % 4, RANK % 3] = RANK + 1.0
    handle = hvd.sparse_allreduce_async(dense.to_sparse(), name="s", op=hvd.Sum)
    expected = torch.zeros(4, 3)
    for r in range(P):
        expected[r % 4, r % 3] += r + 1.0
    assert torch.equal(handle().to_dense(), expected)


@pytest.mark.mpi
def test_a_gradient_through_a_call_on_a_process_set_is_reduced_on_the_same_set():
    members = [r for r in range(P) if r % 2 == RANK % 2]
    sets = [hvd.add_process_set([r for r in range(P) if r % 2 == parity]) for parity in (0, 1) if parity < P]
    try:
        mine = sets[RANK % 2]
        x = torch.ones(3, requires_grad=True)
        hvd.allreduce(x, op=hvd.Sum, process_set=mine).sum().backward()
        assert torch.equal(x.grad, torch.full((3,), float(len(members))))
        y = torch.ones(2, 2, requires_grad=True)
        hvd.grouped_allreduce([y], op=hvd.Sum, process_set=mine)[0].sum().backward()
        assert torch.equal(y.grad, torch.full((2, 2), float(len(members))))
    finally:
        for s in sets:
            hvd.remove_process_set(s)


@pytest.mark.mpi
def test_distributed_optimizer_names_its_parameters_as_horovods_does():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([{"params": model[0].parameters()},
                                                    {"params": model[1].parameters()}], lr=0.1))
    names = opt._parameter_names
    assert set(names) == set(model.parameters()) and len(set(names.values())) == 4
    assert hvd.allgather_object(sorted(names.values())) == [sorted(names.values())] * P


@pytest.mark.mpi
@pytest.mark.parametrize("first", sorted({0, P - 1}))
def test_join_lets_the_others_reduce_with_zeros_refuses_the_rest_and_returns_the_last_rank_to_join(first):
    mine = torch.full((3,), RANK + 1.0)
    if RANK == first:
        last = hvd.join()
    else:
        others = [r for r in range(P) if r != first]
        summed = hvd.allreduce(mine, op=hvd.Sum, check=True)
        assert torch.equal(summed, torch.full((3,), float(sum(r + 1 for r in others))))
        in_place = hvd.allreduce_(mine.clone(), op=hvd.Average, check=True)
        assert torch.allclose(in_place, torch.full((3,), sum(r + 1 for r in others) / P))   # the joined rank counts
        with pytest.raises(RuntimeError, match="join"):
            hvd.allgather(mine)
        with pytest.raises(RuntimeError, match="join"):
            hvd.broadcast(mine, root_rank=others[0], check=True)
        with pytest.raises(RuntimeError, match="join"):
            hvd.allreduce(mine, op=hvd.Max, check=True)
        last = hvd.join()
    assert last == (max(r for r in range(P) if r != first) if P > 1 else 0)
    assert hvd.allgather_object(last) == [last] * P


@pytest.mark.mpi
def test_distributed_optimizer_on_a_process_set_averages_over_its_members_and_others_step_alone():
    evens = list(range(0, P, 2))
    even_set = hvd.add_process_set(evens)
    try:
        model = torch.nn.Linear(2, 1, bias=False)
        torch.nn.init.zeros_(model.weight)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                       named_parameters=model.named_parameters(), process_set=even_set)
        model(torch.full((1, 2), RANK + 1.0)).sum().backward()
        opt.step()
        mean = sum(r + 1 for r in evens) / len(evens) if RANK in evens else RANK + 1.0
        assert torch.equal(model.weight, torch.full((1, 2), -mean))
    finally:
        hvd.remove_process_set(even_set)


@pytest.mark.mpi
def test_distributed_optimizer_averages_sparse_gradients_and_gives_them_back_sparse():
    embedding = torch.nn.Embedding(P + 1, 2, sparse=True)
    torch.nn.init.zeros_(embedding.weight)
    for optimizer in (torch.optim.SGD(embedding.parameters(), lr=1.0),
                      torch.optim.SparseAdam(list(embedding.parameters()), lr=0.1)):
        opt = hvd.DistributedOptimizer(optimizer)
        opt.zero_grad()
        embedding(torch.tensor([RANK, P])).sum().backward()
        opt.synchronize()
        grad = embedding.weight.grad
        assert grad.is_sparse and grad.sparse_dim() == 1
        expected = torch.zeros(P + 1, 2)
        expected[:P] = 1.0 / P
        expected[P] = 1.0
        assert torch.allclose(grad.to_dense(), expected)
        with opt.skip_synchronize():
            opt.step()


@pytest.mark.mpi
def test_broadcast_optimizer_state_makes_an_empty_state_by_a_step_with_zero_gradients():
    model = torch.nn.Linear(2, 1)
    model.weight.requires_grad_(False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert model.weight.grad is None
    assert torch.equal(model.bias.grad, torch.zeros(1))
    assert torch.equal(opt.state[model.bias]["momentum_buffer"], torch.zeros(1))


@pytest.mark.mpi
def test_a_checked_call_that_meets_another_call_names_the_rank_in_it():
    if P == 1:
        pytest.skip("needs two ranks")
    if RANK == 0:
        with pytest.raises(ValueError, match="rank 1 is in another call"):
            hvd.allreduce(torch.ones(2), check=True)
    else:
        gathered = hvd.allgather_object([RANK])
        assert gathered[1:] == [[r] for r in range(1, P)]
