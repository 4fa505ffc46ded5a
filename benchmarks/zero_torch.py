"""PyTorch sharded data parallelism: allreduce_kit.torch beside PyTorch's ZeroRedundancyOptimizer over Gloo.

The same training step (forward, backward, Adam update) of the same model on the same batch and
ranks, in turn, in the same processes:

- ``floor``: plain Adam, no communication: the least any data-parallel step can take;
- ``zero1``: ``allreduce_kit.torch.ZeroRedundancyOptimizer(stage=1)`` (gradients
  reduce-scattered in ``step()``, each rank updates its block, parameters allgathered);
- ``zero2``: the same with ``stage=2`` (gradient buckets reduce-scattered during backward, by
  default in backward's hook where no core is spare);
- ``zero2+overlap``: ``stage=2, overlap=True`` (each bucket's reduce-scatter on the progress
  thread while backward goes on);
- ``fully_shard``: ``allreduce_kit.torch.fully_shard`` on the model and plain Adam over its blocks
  (stage 3: each layer gathered before its forward and backward);
- ``torch_zero``: ``torch.nn.parallel.DistributedDataParallel`` over Gloo (its defaults) and
  ``torch.distributed.optim.ZeroRedundancyOptimizer``: PyTorch's stage 1 on CPUs.

Each round runs every version for ``--warmup`` untimed and ``--steps`` timed steps, in an order
that rotates between rounds. Two measures, as in ``torch_vs_ddp.py``: the median step (each
step's time the mean over ranks) and the wall time of a block of steps from a barrier to the last
rank's end, per step (median over rounds); beside them, the median time of ``optimizer.step()``
alone (where stage 1 averages the gradients; PyTorch's averages them in DDP's backward). The
target, by the whole step: ``zero1``'s and ``zero2``'s step at most
0.5x ``torch_zero``'s, on the model of about 10 M parameters (``10m``: 1024-2048-2048-2048-10,
batch 32 per rank). Run (one node; ``--json`` keeps the figures):

    for p in 2 4 8; do mpirun -n $p python benchmarks/zero_torch.py --json zero-torch-p$p.json; done
"""
from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import allreduce_kit.torch as hvd   # does not start MPI: hvd.init() does, in main()
from allreduce_kit.cli import RankZeroParser

VERSIONS = ("floor", "zero1", "zero2", "zero2+overlap", "fully_shard", "torch_zero")
OURS = ("zero1", "zero2", "zero2+overlap", "fully_shard")
#: ``version``'s step at most ``at_most`` x torch_zero's, by each measure
TARGETS = {"zero1": 0.5, "zero2": 0.5}


def _sibling():
    """``torch_vs_ddp.py``: the models, Gloo's start and the timed block are its."""
    spec = importlib.util.spec_from_file_location("torch_vs_ddp", Path(__file__).with_name("torch_vs_ddp.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def step_function(net, optimizer, x, y, in_step: List[float]) -> Callable[[], None]:
    """One training step; the time of its ``optimizer.step()`` appended to ``in_step`` (seconds)."""
    def step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(net(x), y).backward()
        begun = time.perf_counter()
        optimizer.step()
        in_step.append(time.perf_counter() - begun)
    return step


def measures(samples: Dict[str, List[np.ndarray]], walls: Dict[str, List[float]]) -> Dict[str, Dict]:
    """Each version's median step and wall time per step (ms), its overheads over the floor, and
    (but the floor's) both ratios to torch_zero's."""
    median = {v: float(np.median(np.concatenate(samples[v]))) * 1e3 for v in samples}
    wall = {v: float(np.median(walls[v])) for v in walls}
    rows = {}
    for v in samples:
        row = {"step_ms_p50": median[v], "overhead_ms_p50": median[v] - median["floor"],
               "step_ms_wall": wall[v], "overhead_ms_wall": wall[v] - wall["floor"], "step_ms_wall_rounds": list(walls[v])}
        if v != "floor":
            row["step_ratio_to_torch_zero"] = median[v] / median["torch_zero"]
            row["step_ratio_to_torch_zero_wall"] = wall[v] / wall["torch_zero"]
        rows[v] = row
    return rows


def run_model(name: str, args, comm, sibling) -> Dict:
    spec = sibling.MODELS[name]
    batch = args.batch or spec["batch"]
    steps, warmup = args.steps or spec["steps"], args.warmup if args.warmup is not None else spec["warmup"]
    generator = torch.Generator().manual_seed(comm.Get_rank())
    x = torch.randn(batch, spec["layers"][0], generator=generator)
    y = torch.randint(0, spec["layers"][-1], (batch,), generator=generator)
    torch.manual_seed(0)
    reference = sibling.mlp(spec["layers"])
    models = {v: sibling.mlp(spec["layers"]) for v in VERSIONS}
    for model in models.values():
        model.load_state_dict(reference.state_dict())
    adam = {"lr": 1e-4, **({"fused": True} if args.fused else {})}
    ddp = torch.nn.parallel.DistributedDataParallel(models["torch_zero"])
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
    sharded = hvd.fully_shard(models["fully_shard"], prefetch=args.prefetch)
    optimizers = {
        "floor": torch.optim.Adam(models["floor"].parameters(), **adam),
        "zero1": hvd.ZeroRedundancyOptimizer(models["zero1"].parameters(), torch.optim.Adam, stage=1, **adam),
        "zero2": hvd.ZeroRedundancyOptimizer(models["zero2"].parameters(), torch.optim.Adam, stage=2, **adam),
        "zero2+overlap": hvd.ZeroRedundancyOptimizer(models["zero2+overlap"].parameters(), torch.optim.Adam, stage=2,
                                                     overlap=True, **adam),
        "fully_shard": torch.optim.Adam(sharded.parameters(), **adam),
        "torch_zero": TorchZero(ddp.parameters(), torch.optim.Adam, **adam),
    }
    nets = {**models, "torch_zero": ddp}
    in_step: Dict[str, List[float]] = {v: [] for v in VERSIONS}
    steps_of = {v: step_function(nets[v], optimizers[v], x, y, in_step[v]) for v in VERSIONS}
    samples, walls = sibling.interleaved(comm, steps_of, VERSIONS, args.rounds, warmup, steps)
    rows = measures(samples, walls)
    for v in VERSIONS:   # this rank's optimizer.step() alone (ours averages the gradients there in stage 1)
        rows[v]["optimizer_step_ms_p50"] = float(np.median(in_step[v])) * 1e3
    goals = {v: {"at_most": at_most,
                 "met": bool(rows[v]["step_ratio_to_torch_zero"] <= at_most),
                 "met_wall": bool(rows[v]["step_ratio_to_torch_zero_wall"] <= at_most)}
             for v, at_most in TARGETS.items()}
    return {"model": name, "layers": list(spec["layers"]), "parameters": sum(p.numel() for p in reference.parameters()),
            "batch_per_rank": batch, "steps": steps, "warmup": warmup, "rounds": args.rounds,
            "prefetch": args.prefetch, "fused_adam": args.fused, "versions": rows, "targets": goals}


def lines(result: Dict, ranks: int) -> List[str]:
    adam = "Adam (fused=True)" if result.get("fused_adam") else "Adam"
    out = [f"{result['model']} ({result['parameters']:,d} parameters), {adam}, batch {result['batch_per_rank']} per rank, "
           f"{ranks} ranks; median of {result['rounds']} x {result['steps']} steps, and wall per step:"]
    for v, row in result["versions"].items():
        text = (f"  {v:<14} step {row['step_ms_p50']:9.3f} ms  wall {row['step_ms_wall']:9.3f} ms"
                f"  optimizer.step() {row['optimizer_step_ms_p50']:8.3f} ms")
        if v != "floor":
            text += (f"  overhead {row['overhead_ms_p50']:8.3f} ms  step/torch_zero {row['step_ratio_to_torch_zero']:5.2f}x"
                     f"  wall/torch_zero {row['step_ratio_to_torch_zero_wall']:5.2f}x")
        out.append(text)
    for v, goal in result["targets"].items():
        out.append(f"  target: {v} step/torch_zero <= {goal['at_most']:.1f}x: by the median step "
                   f"{'met' if goal['met'] else 'NOT met'}, by wall time {'met' if goal['met_wall'] else 'NOT met'}")
    return out


def main() -> int:
    hvd.init()   # first, as in a Horovod script: before anything imports mpi4py.MPI
    from mpi4py import MPI

    sibling = _sibling()
    parser = RankZeroParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=[*sibling.MODELS, "both"], default="10m",
                        help="the 10.5 M parameter MLP (the target's model, default), the MLP 64-256-10, or both")
    sibling.add_run_arguments(parser)
    parser.add_argument("--prefetch", type=int, default=1, help="fully_shard's layers gathered ahead (default: 1)")
    parser.add_argument("--fused", action="store_true",
                        help="every version's Adam (PyTorch's too) with fused=True, torch's one-pass CPU kernel")
    args = parser.parse_args()
    bad = sibling.bad_run_arguments(args, ("prefetch", args.prefetch))
    if bad:
        parser.error("; ".join(bad))   # rank 0 says it, every rank exits with status 2
    comm = MPI.COMM_WORLD
    rank, ranks = comm.Get_rank(), comm.Get_size()
    threads = sibling.start(args, comm)
    names = list(sibling.MODELS) if args.model == "both" else [args.model]
    results = [run_model(name, args, comm, sibling) for name in names]
    if rank == 0:
        print(f"{ranks} ranks, {threads} torch thread(s) each")
        for result in results:
            print("\n".join(lines(result, ranks)))
        if args.json:
            with open(args.json, "w", encoding="utf-8") as out:
                json.dump({"ranks": ranks, "threads": threads, "results": results}, out, indent=2)
            print(f"wrote {args.json}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
