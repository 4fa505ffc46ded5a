"""Inside an MPI job: ``allreduce_kit.torch.pipelining`` trains what one process trains.

A 64-32-...-10 ``nn.Sequential`` cut into P stages (``ScheduleGPipe``, ``Schedule1F1B``) or 2P
(``ScheduleInterleaved1F1B``), 4 micro-batches (2P interleaved), float64: after two SGD steps every rank's stage
holds the parameters of the same layers of the whole model trained in one process on the whole
batch (allclose 1e-10), and the last stage returns the outputs and the micro-batches' losses.
Stages that do not fit together raise on every rank at the first step, naming the stage; a stage
that raises is named in its error. At 2 and 3 ranks (suite time)."""
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
                                 for j in range(2)], P + 1, loss_fn=sum)


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
