"""``allreduce_kit.torch.ZeroRedundancyOptimizer`` beside PyTorch's over Gloo, in one MPI job (a test helper).

``mpiexec -n P python -m mpi4py zero_vs_gloo_driver.py``: every rank trains two copies of the same
model from the same start on the same batches, K steps, for SGD with momentum and for Adam:

- ``allreduce_kit``: the plain model and ``allreduce_kit.torch.ZeroRedundancyOptimizer`` (stage 1
  and stage 2), which averages the gradients itself;
- ``torch``: the model in ``DistributedDataParallel`` over a Gloo process group on the same
  ranks and ``torch.distributed.optim.ZeroRedundancyOptimizer``.

It raises (``python -m mpi4py`` then aborts the job) unless every parameter, and rank 0's
consolidated optimizer state, agree (allclose), and rank 0 prints ``same parameters`` per case.
"""
import datetime
import socket
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

import allreduce_kit.torch as hvd

STEPS = 5
BATCH = 6
CASES = [(torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}), (torch.optim.Adam, {"lr": 0.01})]


def model() -> nn.Module:
    torch.manual_seed(0)   # 13*29+29 + 29*7+7 = 619 parameters: divisible by none of 2, 3, 4, 5
    return nn.Sequential(nn.Linear(13, 29), nn.Tanh(), nn.Linear(29, 7))


def start_gloo(comm) -> None:
    port = None
    if comm.Get_rank() == 0:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
    port = comm.bcast(port, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.Get_rank(),
                            world_size=comm.Get_size(), timeout=datetime.timedelta(seconds=60))


def train(net: nn.Module, optimizer, rank: int) -> None:
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        x, y = torch.randn(BATCH, 13, generator=g), torch.randn(BATCH, 7, generator=g)
        optimizer.zero_grad()
        ((net(x) - y) ** 2).mean().backward()
        optimizer.step()


def main() -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="allreduce_kit.torch.init: MPI started before init")
        hvd.init()
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    torch.set_num_threads(1)
    start_gloo(comm)
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
    for optimizer_class, settings in CASES:
        theirs = model()
        ddp = nn.parallel.DistributedDataParallel(theirs)
        torch_zero = TorchZero(ddp.parameters(), optimizer_class, **settings)
        train(ddp, torch_zero, rank)
        torch_zero.consolidate_state_dict(to=0)
        for stage in (1, 2):
            ours = model()
            zero = hvd.ZeroRedundancyOptimizer(ours.parameters(), optimizer_class, stage=stage, bucket_mb=0.001,
                                               **settings)
            train(ours, zero, rank)
            for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
            zero.consolidate_state_dict(to=0)
            if rank == 0:
                mine, reference = zero.state_dict(), torch_zero.state_dict()
                assert sorted(mine["state"]) == sorted(reference["state"])
                for i, entry in reference["state"].items():
                    assert sorted(mine["state"][i]) == sorted(entry), (i, sorted(mine["state"][i]), sorted(entry))
                    for key, value in entry.items():
                        torch.testing.assert_close(mine["state"][i][key], value, rtol=1e-5, atol=1e-6)
                print(f"{optimizer_class.__name__} stage {stage} at {comm.Get_size()} ranks: same parameters and "
                      f"state after {STEPS} steps", flush=True)
    dist.destroy_process_group()
    hvd.shutdown()


if __name__ == "__main__":
    main()
