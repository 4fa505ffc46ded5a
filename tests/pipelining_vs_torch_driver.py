"""``allreduce_kit.torch.pipelining`` beside ``torch.distributed.pipelining`` over Gloo, in one MPI job (a test helper).

``mpiexec -n P python -m mpi4py pipelining_vs_torch_driver.py``: the same float64 MLP cut into P
stages (stage i on rank i), the same batch cut into 4 micro-batches, trained K SGD steps (with
momentum) from the same start by ``ScheduleGPipe`` and ``Schedule1F1B`` of each library: ours over
MPI, PyTorch's over a Gloo process group on the same ranks. It raises (``python -m mpi4py`` then
aborts the job) unless the first step's gradients, the last stage's losses and outputs, and the
parameters after K steps agree (allclose); rank 0 prints ``same gradients and parameters`` per schedule.
"""
import copy
import datetime
import socket

import torch
import torch.distributed as dist
import torch.distributed.pipelining as theirs
import torch.nn as nn
from mpi4py import MPI

import allreduce_kit.torch.pipelining as ours

STEPS, M = 3, 4


def stage_of(rank: int, size: int) -> nn.Module:
    """Stage ``rank`` of a 12-16-...-5 MLP of ``size`` linear layers (a ReLU after all but the last)."""
    torch.manual_seed(0)
    widths = [12] + [16 - i for i in range(size - 1)] + [5]
    layers = [nn.Sequential(nn.Linear(a, b), *([nn.ReLU()] if i < size - 1 else []))
              for i, (a, b) in enumerate(zip(widths[:-1], widths[1:]))]
    return layers[rank].double()


def start_gloo(comm) -> None:
    port = None
    if comm.Get_rank() == 0:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
    port = comm.bcast(port, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.Get_rank(),
                            world_size=comm.Get_size(), timeout=datetime.timedelta(seconds=60))


def train(make_schedule, module: nn.Module, rank: int, size: int):
    """(first step's gradients, each step's losses and outputs on the last stage, final parameters)."""
    g = torch.Generator().manual_seed(1)
    X = torch.randn(16, 12, generator=g, dtype=torch.float64)
    y = torch.randint(0, 5, (16,), generator=g)
    schedule = make_schedule(module)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    grads, seen = None, []
    for step in range(STEPS):
        optimizer.zero_grad()
        losses = []
        out = schedule.step(X if rank == 0 else None, target=y if rank == size - 1 else None, losses=losses)
        if step == 0:
            grads = [p.grad.clone() for p in module.parameters()]
        if rank == size - 1:
            seen.append((torch.stack([loss.detach() for loss in losses]), out.detach()))
        optimizer.step()
    return grads, seen, [p.detach().clone() for p in module.parameters()]


def main() -> None:
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    torch.set_num_threads(1)
    start_gloo(comm)
    loss_fn = nn.functional.cross_entropy
    for name in ("ScheduleGPipe", "Schedule1F1B"):
        mine, reference = stage_of(rank, size), stage_of(rank, size)
        assert all(torch.equal(a, b) for a, b in zip(mine.parameters(), reference.parameters()))
        got = train(lambda m: getattr(ours, name)(ours.PipelineStage(m, rank, size), M, loss_fn=loss_fn),
                    mine, rank, size)
        want = train(lambda m: getattr(theirs, name)(theirs.PipelineStage(m, rank, size, torch.device("cpu")), M,
                                                     loss_fn=loss_fn), copy.deepcopy(reference), rank, size)
        for a, b in zip(got[0], want[0]):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name} gradient: {m}")
        for (la, oa), (lb, ob) in zip(got[1], want[1]):
            torch.testing.assert_close(la, lb, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name} losses: {m}")
            torch.testing.assert_close(oa, ob, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name} outputs: {m}")
        for a, b in zip(got[2], want[2]):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name} parameters: {m}")
        comm.Barrier()
        if rank == 0:
            print(f"{name} at {size} ranks: same gradients and parameters as torch.distributed.pipelining after "
                  f"{STEPS} steps", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
