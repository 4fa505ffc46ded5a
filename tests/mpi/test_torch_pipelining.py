"""Inside an MPI job: ``allreduce_kit.torch.pipelining`` trains what one process trains.

A 64-32-...-10 ``nn.Sequential`` cut into P stages (``ScheduleGPipe``, ``Schedule1F1B``) or 2P
(``ScheduleInterleaved1F1B``), 4 micro-batches (2P interleaved), float64: after two SGD steps every rank's stage
holds the parameters of the same layers of the whole model trained in one process on the whole
batch (allclose 1e-10), and the last stage returns the outputs and the micro-batches' losses.
Stages that do not fit together raise on every rank at the first step, naming the stage; a stage
that raises is named in its error; ``ScheduleGPipe`` and ``Schedule1F1B`` train as
``torch.distributed.pipelining``'s do over Gloo. At 2 and 3 ranks (suite time)."""
import copy

import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")

from allreduce_kit.comm import library_comm  # noqa: E402
from allreduce_kit.torch.pipelining import (PipelineShapeError, PipelineStage, Schedule1F1B,  # noqa: E402
                                            ScheduleGPipe, ScheduleInterleaved1F1B)

P, RANK = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()


def whole_model(parts: int) -> torch.nn.Sequential:
    torch.manual_seed(0)
    layers = []
    widths = [64] + [32 - 2 * i for i in range(parts - 1)] + [10]
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers += [torch.nn.Linear(a, b)] + ([torch.nn.ReLU()] if i < parts - 1 else [])
    return torch.nn.Sequential(*layers).double()


def part(model: torch.nn.Sequential, index: int, parts: int) -> torch.nn.Sequential:
    """Layer ``index`` (with its ReLU) of the model of ``parts`` linear layers."""
    return torch.nn.Sequential(*list(model)[2 * index:min(2 * index + 2, 2 * parts - 1)])


@pytest.mark.mpi
@pytest.mark.skipif(P not in (2, 3), reason="at 2 and 3 ranks")
@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "interleaved"])
def test_a_pipeline_of_stages_trains_what_one_process_trains(comm, kind):
    V = 2 if kind == "interleaved" else 1
    parts, M, steps = P * V, 2 * P if kind == "interleaved" else 4, 2
    model = whole_model(parts)
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    X = torch.randn(16, 64, generator=g, dtype=torch.float64)
    y = torch.randint(0, 10, (16,), generator=g)
    loss_fn = torch.nn.functional.cross_entropy
    mine = [part(model, RANK + j * P, parts) for j in range(V)]
    stages = [PipelineStage(m, RANK + j * P, parts, group=comm) for j, m in enumerate(mine)]
    schedule = {"gpipe": lambda: ScheduleGPipe(stages[0], M, loss_fn=loss_fn),
                "1f1b": lambda: Schedule1F1B(stages[0], M, loss_fn=loss_fn),
                "interleaved": lambda: ScheduleInterleaved1F1B(stages, M, loss_fn=loss_fn)}[kind]()
    params = [p for m in mine for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for _ in range(steps):
        opt.zero_grad()
        losses = []
        out = schedule.step(X if RANK == 0 else None, target=y if parts - 1 in schedule.stages else None,
                            losses=losses)
        opt.step()
        ref_opt.zero_grad()
        want = reference(X)
        chunks = [loss_fn(o, t) for o, t in zip(torch.tensor_split(want, M), torch.tensor_split(y, M))]
        (sum(chunks) / M).backward()
        if parts - 1 in schedule.stages:
            assert torch.allclose(out, want.detach(), rtol=1e-10, atol=1e-12)
            assert torch.allclose(torch.stack(losses), torch.stack(chunks).detach(), rtol=1e-10)
        else:
            assert out is None and losses == []
        ref_opt.step()
    for j, m in enumerate(mine):
        for got, expected in zip(m.parameters(), part(reference, RANK + j * P, parts).parameters()):
            assert torch.allclose(got, expected, rtol=1e-10, atol=1e-12), (kind, RANK + j * P)
    assert not schedule.lib.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)


@pytest.mark.mpi
@pytest.mark.skipif(P not in (2, 3), reason="at 2 and 3 ranks")
def test_a_stage_on_the_wrong_rank_is_refused_before_any_message(comm):
    with pytest.raises(ValueError, match=f"stage {(RANK + 1) % P} runs on rank {(RANK + 1) % P}"):
        PipelineStage(torch.nn.Linear(2, 2), (RANK + 1) % P, P, group=comm)
    stage = PipelineStage(torch.nn.Linear(2, 2), RANK, P, group=comm)
    with pytest.raises(ValueError, match="loss_fn is needed"):
        Schedule1F1B(stage, 2)
    with pytest.raises(ValueError, match="one stage per rank"):
        Schedule1F1B(PipelineStage(torch.nn.Linear(2, 2), RANK, 2 * P, group=comm), 2, loss_fn=sum)
    with pytest.raises(ValueError, match="ScheduleInterleaved1F1B: the interleaved schedule takes micro-batches"):
        ScheduleInterleaved1F1B([PipelineStage(torch.nn.Linear(2, 2), RANK + j * P, 2 * P, group=comm)
                                 for j in range(2)], 2 * P + 1, loss_fn=sum)


@pytest.mark.mpi
@pytest.mark.skipif(P not in (2, 3), reason="at 2 and 3 ranks")
def test_stages_that_do_not_fit_together_raise_on_every_rank_at_the_first_step(comm):
    """Stage 0 puts out 9 features where stage 1 takes 8; float32 where stage 1 is float64;
    input_args that stage 1's predecessor does not match: every rank raises the same error naming
    the stage, before any micro-batch runs (as torch.distributed.pipelining's first-step metadata
    inference checks). The last stage's rank forgetting the target: every rank raises its error.
    A pipeline that fits runs after them."""
    X, y = torch.randn(8, 4), torch.randint(0, 2, (8,))

    def run(pairs, dtype=torch.float32, input_args=None):
        module = torch.nn.Linear(*pairs[RANK]).to(dtype if RANK else torch.float32)
        stage = PipelineStage(module, RANK, P, group=comm, input_args=input_args if RANK == 1 else None)
        return Schedule1F1B(stage, 2, loss_fn=torch.nn.functional.cross_entropy).step(
            X if RANK == 0 else None, target=y if RANK == P - 1 else None)

    fit = [(4, 5)] + [(5, 5)] * (P - 2) + [(5, 2)]
    with pytest.raises(PipelineShapeError, match=r"^Schedule1F1B: stage 1's forward raised on stage 0's output, "
                                                 r"\(rows, 9\) of float32: RuntimeError: mat1 and mat2 shapes"):
        run([(4, 9)] + fit[1:])
    with pytest.raises(PipelineShapeError, match=r"stage 1's forward raised on stage 0's output, \(rows, 5\) of "
                                                 r"float32: RuntimeError: mat1 and mat2 must have the same dtype"):
        run(fit, torch.float64)
    with pytest.raises(PipelineShapeError, match=r"stage 1 expects input \(rows, 6\) of float32 \(input_args\), "
                                                 r"stage 0's output is \(rows, 5\) of float32"):
        run(fit, input_args=torch.zeros(1, 6))
    with pytest.raises(ValueError, match=r"^Schedule1F1B.step: the last stage needs target for loss_fn$"):
        stage = PipelineStage(torch.nn.Linear(*fit[RANK]), RANK, P, group=comm)
        Schedule1F1B(stage, 2, loss_fn=torch.nn.functional.cross_entropy).step(X if RANK == 0 else None)
    out = run(fit)
    assert (out is not None) == (RANK == P - 1)
    assert not library_comm(comm).Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)


@pytest.mark.mpi
@pytest.mark.skipif(P != 2, reason="two stages suffice")
def test_a_stage_that_raises_is_named_in_the_error(comm):
    """Stage 0 raises in the forward of micro-batch 1, stage 1 in that of micro-batch 0 (each after
    the first step's shape check): each error carries a note naming the schedule, the stage, the
    rank and the micro-batch. (Both raise, so that neither waits for the other.)"""
    class Fails(torch.nn.Linear):
        calls = 0

        def forward(self, x):
            self.calls += 1
            if self.calls == 3 - RANK:
                raise ValueError("injected fault")
            return super().forward(x)

    stage = PipelineStage(Fails(4, 4), RANK, 2, group=comm)
    schedule = ScheduleGPipe(stage, 2, loss_fn=torch.nn.functional.cross_entropy)
    with pytest.raises(ValueError, match="injected fault") as raised:
        schedule.step(torch.randn(4, 4) if RANK == 0 else None, target=torch.randint(0, 4, (4,)) if RANK else None)
    assert raised.value.__notes__ == [f"in ScheduleGPipe's stage {RANK} on rank {RANK}: the forward of micro-batch "
                                      f"{1 - RANK}"]
    comm.Barrier()
    assert not library_comm(comm).Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)


def _gloo_stage(rank: int, size: int) -> torch.nn.Module:
    """Stage ``rank`` of a 12-16-...-5 MLP of ``size`` linear layers (a ReLU after all but the last)."""
    torch.manual_seed(0)
    widths = [12] + [16 - i for i in range(size - 1)] + [5]
    layers = [torch.nn.Sequential(torch.nn.Linear(a, b), *([torch.nn.ReLU()] if i < size - 1 else []))
              for i, (a, b) in enumerate(zip(widths[:-1], widths[1:]))]
    return layers[rank].double()


def _train(schedule, module, steps=3):
    """(first step's gradients, each step's losses and outputs on the last stage, final parameters)."""
    g = torch.Generator().manual_seed(1)
    X, y = torch.randn(16, 12, generator=g, dtype=torch.float64), torch.randint(0, 5, (16,), generator=g)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    grads, seen = None, []
    for step in range(steps):
        optimizer.zero_grad()
        losses = []
        out = schedule.step(X if RANK == 0 else None, target=y if RANK == P - 1 else None, losses=losses)
        grads = grads or [p.grad.clone() for p in module.parameters()]
        if RANK == P - 1:
            seen.append((torch.stack([loss.detach() for loss in losses]), out.detach()))
        optimizer.step()
    return grads, seen, [p.detach().clone() for p in module.parameters()]


@pytest.mark.mpi
@pytest.mark.skipif(P != 2, reason="at 2 ranks (suite time)")
def test_gpipe_and_1f1b_train_as_torch_distributed_pipelining_does_over_gloo(comm):
    """The same split float64 MLP, the same 4 micro-batches, three SGD steps with momentum, by our
    ScheduleGPipe and Schedule1F1B over MPI and torch.distributed.pipelining's over a Gloo process
    group on the same ranks: the same first-step gradients, losses, outputs and parameters (1e-10)."""
    import datetime
    import socket

    import torch.distributed as dist
    import torch.distributed.pipelining as theirs

    import allreduce_kit.torch.pipelining as ours

    port = None
    if RANK == 0:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{comm.bcast(port, root=0)}", rank=RANK,
                            world_size=P, timeout=datetime.timedelta(seconds=60))
    try:
        loss_fn = torch.nn.functional.cross_entropy
        for name in ("ScheduleGPipe", "Schedule1F1B"):
            mine, reference = _gloo_stage(RANK, P), _gloo_stage(RANK, P)
            got = _train(getattr(ours, name)(ours.PipelineStage(mine, RANK, P, group=comm), 4, loss_fn=loss_fn), mine)
            want = _train(getattr(theirs, name)(theirs.PipelineStage(reference, RANK, P, torch.device("cpu")), 4,
                                                loss_fn=loss_fn), reference)
            for a, b in zip(got[0] + got[2], want[0] + want[2]):
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")
            assert len(got[1]) == len(want[1]) == (3 if RANK == P - 1 else 0)
            for (la, oa), (lb, ob) in zip(got[1], want[1]):
                torch.testing.assert_close(la, lb, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name} losses: {m}")
                torch.testing.assert_close(oa, ob, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name} outputs: {m}")
    finally:
        dist.destroy_process_group()


@pytest.mark.mpi
@pytest.mark.skipif(P != 4, reason="2 stages x 2 replicas")
def test_pipelines_side_by_side_with_distributed_optimizer_train_what_one_process_trains(comm):
    """Data parallelism beside the pipeline, as the docs say to combine them: 2 stages x 2
    replicas, each replica's pipeline on a process set of its two ranks (``group=``), each stage's
    gradients averaged over its replicas by ``DistributedOptimizer(process_set=,
    backward_passes_per_step=M)`` (the schedule runs a backward per micro-batch), each replica
    on its half of the batch. Every rank's stage holds what one process training the whole model
    on the whole batch holds (float64, 1e-10), and the two replicas of a stage are bitwise equal."""
    import allreduce_kit.torch as hvd

    S, D, M, steps = 2, 2, 2, 2
    stage, replica = divmod(RANK, D)
    hvd.init()
    try:
        pipelines = [hvd.add_process_set([d + D * s for s in range(S)]) for d in range(D)]
        replicas = [hvd.add_process_set([s * D + d for d in range(D)]) for s in range(S)]
        model = whole_model(S)
        reference = copy.deepcopy(model)
        g = torch.Generator().manual_seed(2)
        X = torch.randn(16, 64, generator=g, dtype=torch.float64)
        y = torch.randint(0, 10, (16,), generator=g)
        rows = slice(replica * 16 // D, (replica + 1) * 16 // D)
        loss_fn = torch.nn.functional.cross_entropy
        mine = part(model, stage, S)
        schedule = Schedule1F1B(PipelineStage(mine, stage, S, group=pipelines[replica]), M, loss_fn=loss_fn)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(mine.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=mine.named_parameters(), process_set=replicas[stage],
                                       backward_passes_per_step=M)   # a backward per micro-batch
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
        for _ in range(steps):
            opt.zero_grad()
            schedule.step(X[rows] if stage == 0 else None, target=y[rows] if stage == S - 1 else None)
            opt.step()
            ref_opt.zero_grad()
            loss_fn(reference(X), y).backward()
            ref_opt.step()
        for got, expected in zip(mine.parameters(), part(reference, stage, S).parameters()):
            assert torch.allclose(got, expected, rtol=1e-10, atol=1e-12), stage
        flat = torch.cat([p.detach().reshape(-1) for p in mine.parameters()])
        same = hvd.allgather(flat.unsqueeze(0), process_set=replicas[stage])
        assert torch.equal(same[0], same[1]), "the replicas of a stage differ"
        for ps in pipelines + replicas:
            hvd.remove_process_set(ps)
    finally:
        hvd.shutdown()
