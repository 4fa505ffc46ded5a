"""PyTorch data-parallel step time: allreduce_kit.torch beside DDP over Gloo, in one run.

Five versions of the same training step run in turn, in the same processes, on the same
model, batch and ranks:

- ``floor``: forward, backward and SGD update with no communication at all, the least any
  data-parallel implementation can take;
- ``allreduce_kit``: ``allreduce_kit.torch.DistributedOptimizer`` with its defaults (gradients
  reduced during backward where a node has a core to spare or they fill more than one bucket,
  else in ``step()``);
- ``allreduce_kit+overlap``: the same with ``overlap=True``: buckets of ``--bucket-mb`` reduced
  on the background thread while backward runs;
- ``allreduce_kit+in_step``: the same with ``overlap=False``: one bucket reduced in ``step()``;
- ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` over the Gloo backend, its defaults.

Each round runs every version for ``--warmup`` untimed and ``--steps`` timed steps, in an order
that rotates between rounds. Two measures of a step, side by side:

- *median*: a step's time is the mean over ranks of each rank's wall time for that step; the
  median over all timed steps of all rounds. It leaves out the steps where a rank waited for a
  core (more ranks than cores), which a user's training still pays;
- *wall*: the time of a whole block of ``--steps`` steps, from a barrier to the rank that
  finishes last, divided by the steps; the median over rounds. It is what a training loop of
  that many steps takes per step, waits included.

For each, the overhead (step minus floor) and the ratios to DDP's; for allreduce_kit the share
of its reduction time hidden behind backward (``DistributedOptimizer.report``). Beside them,
the median time of ``allreduce_kit.allreduce`` on a private buffer the size of the gradients:
the least that reducing a private copy after backward adds. Models: ``mlp`` (64-256-10, batch
128 per rank, 500 steps a block) and ``10m`` (1024-2048-2048-2048-10, 10.5 M parameters, batch
32 per rank).

Each model's table ends with the target it is held to, by each measure: the MLP's step at most
0.4x DDP's at 2 ranks and 0.3x at more; the 10 M model's overhead at most 0.3x DDP's.

``hvd.init()`` runs before anything imports ``mpi4py.MPI``, as in a Horovod script, so that plain
``mpirun`` gets what ``python -m allreduce_kit.run`` sets before MPI starts (MPI's yield where
ranks outnumber cores; the first line says what it is). Run (one node; both models by default;
``--json`` keeps the figures):

    for p in 2 4 8; do mpirun -n $p python benchmarks/torch_vs_ddp.py --json torch-p$p.json; done
"""
from __future__ import annotations   # MPI in annotations: mpi4py.MPI is imported after hvd.init()

import datetime
import json
import os
import socket
import sys
import time
from typing import TYPE_CHECKING, Callable, Dict, List, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import allreduce_kit.torch as hvd   # does not start MPI: hvd.init() does, in main()
from allreduce_kit import run
from allreduce_kit.cli import RankZeroParser

if TYPE_CHECKING:
    from mpi4py import MPI

MODELS = {
    "mlp": {"layers": (64, 256, 10), "batch": 128, "steps": 500, "warmup": 20},
    "10m": {"layers": (1024, 2048, 2048, 2048, 10), "batch": 32, "steps": 20, "warmup": 3},
}
VERSIONS = ("floor", "allreduce_kit", "allreduce_kit+overlap", "allreduce_kit+in_step", "ddp")
OURS = ("allreduce_kit", "allreduce_kit+overlap", "allreduce_kit+in_step")


def target(model: str, ranks: int, measure: str = "") -> Dict:
    """What allreduce_kit's default version should reach against DDP on this model and rank
    count: the MLP's step at most 0.4x DDP's at 2 ranks and 0.3x beyond; the 10 M model's
    communication overhead (step minus floor) at most 0.3x DDP's. ``measure`` "" is by the
    median step, "_wall" by the wall time of a block of steps."""
    if model == "mlp":
        return {"field": "step_ratio_to_ddp" + measure, "at_most": 0.4 if ranks <= 2 else 0.3}
    return {"field": "overhead_ratio_to_ddp" + measure, "at_most": 0.3}


def mlp(layers) -> nn.Sequential:
    parts: List[nn.Module] = []
    for i, (a, b) in enumerate(zip(layers[:-1], layers[1:])):
        parts.append(nn.Linear(a, b))
        if i < len(layers) - 2:
            parts.append(nn.ReLU())
    return nn.Sequential(*parts)


def start_gloo(comm: MPI.Intracomm, address: str) -> None:
    """A Gloo process group over the same ranks, rendezvous at rank 0 (port chosen there)."""
    port = None
    if comm.Get_rank() == 0:
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
    port = comm.bcast(port, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=comm.Get_rank(),
                            world_size=comm.Get_size(), timeout=datetime.timedelta(seconds=120))


def step_function(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> Callable:
    def step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return step


def timed(comm: MPI.Intracomm, step: Callable[[], None], warmup: int, steps: int) -> Tuple[np.ndarray, float]:
    """Per timed step, the mean over ranks of each rank's wall time; and the block's wall time
    per step: from a barrier to the end of the last step on the rank that ends last, divided by
    ``steps`` (seconds)."""
    from mpi4py import MPI

    for _ in range(warmup):
        step()
    comm.Barrier()
    times = np.empty(steps)
    block = time.perf_counter()
    for i in range(steps):
        start = time.perf_counter()
        step()
        times[i] = time.perf_counter() - start
    wall = time.perf_counter() - block
    total = np.empty_like(times)
    comm.Allreduce(times, total, op=MPI.SUM)
    return total / comm.Get_size(), comm.allreduce(wall, op=MPI.MAX) / steps


def interleaved(comm: MPI.Intracomm, steps_of: Dict[str, Callable[[], None]], versions: Sequence[str], rounds: int,
                warmup: int, steps: int) -> Tuple[Dict[str, List[np.ndarray]], Dict[str, List[float]]]:
    """``rounds`` rounds of every version's ``timed`` block in turn, in an order that rotates
    between rounds: per version, its per-step times of every round (seconds) and its rounds'
    wall times per step (ms)."""
    samples: Dict[str, List[np.ndarray]] = {v: [] for v in versions}
    walls: Dict[str, List[float]] = {v: [] for v in versions}
    for r in range(rounds):
        order = tuple(versions[r % len(versions):]) + tuple(versions[:r % len(versions)])
        for version in order:
            times, wall = timed(comm, steps_of[version], warmup, steps)
            samples[version].append(times)
            walls[version].append(wall * 1e3)
    return samples, walls


def add_run_arguments(parser) -> None:
    """The options every side-by-side torch benchmark takes: batch, steps, warm-up, rounds,
    threads, Gloo's address, JSON output."""
    parser.add_argument("--batch", type=int, default=0, help="samples per rank per step (default: the model's)")
    parser.add_argument("--steps", type=int, default=0, help="timed steps per version per round (default: the model's)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps before each timed block")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of every version in turn; each figure is the median over them (default: 3)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads per rank (default: this rank's share of its node's cores)")
    parser.add_argument("--address", default="", help="Gloo's rendezvous address (default: rank 0's host name)")
    parser.add_argument("--json", metavar="PATH", help="also write every figure and the targets as JSON to PATH")


def bad_run_arguments(args, *more: Tuple[str, float]) -> List[str]:
    """What is wrong with ``add_run_arguments``' options and ``more`` (``(name, value)`` pairs that
    must be >= 0), one phrase each."""
    bad = [f"--{name} must be >= 1" for name, value in (("rounds", args.rounds),) if value < 1]
    return bad + [f"--{name} must be >= 0" for name, value in (("batch", args.batch), ("steps", args.steps),
                                                                ("warmup", args.warmup or 0), ("threads", args.threads),
                                                                *more) if value < 0]


def start(args, comm: MPI.Intracomm) -> int:
    """Set this rank's torch threads (``--threads`` or its share of the node's cores) and start Gloo
    over ``comm``'s ranks; the thread count."""
    threads = args.threads or max(1, (os.cpu_count() or 1) // hvd.local_size())
    torch.set_num_threads(threads)
    address = args.address or comm.bcast(socket.gethostname() if comm.Get_rank() == 0 else None, root=0)
    start_gloo(comm, address)
    return threads


def raw_allreduce_ms(comm: MPI.Intracomm, count: int, repeats: int) -> float:
    """Median over ``repeats`` calls (each the mean over ranks) of ``allreduce_kit.allreduce`` of
    ``count`` float32 (``auto``, mean) on a private buffer, once online tuning of that size has
    settled: what reducing the gradients after backward costs without a shared window."""
    from mpi4py import MPI

    from allreduce_kit import allreduce, library_comm, online

    buf = np.ones(count, np.float32)
    lib = library_comm(comm)
    while online.exploring(lib, buf.nbytes):
        allreduce(buf, op="mean", comm=comm)
    allreduce(buf, op="mean", comm=comm)
    times = np.empty(repeats)
    for i in range(repeats):
        comm.Barrier()
        start = time.perf_counter()
        allreduce(buf, op="mean", comm=comm)
        times[i] = time.perf_counter() - start
    total = np.empty_like(times)
    comm.Allreduce(times, total, op=MPI.SUM)
    return float(np.median(total / comm.Get_size())) * 1e3


def measures(samples: Dict[str, List[np.ndarray]], walls: Dict[str, List[float]]) -> Dict[str, Dict]:
    """Each version's row: from its per-step times of every round (``samples``, seconds) the
    median step and overhead over the floor, from its rounds' wall times per step (``walls``,
    ms) their median and overhead; for every version but the floor, the ratios of both to DDP's."""
    median = {v: float(np.median(np.concatenate(samples[v]))) * 1e3 for v in samples}
    wall = {v: float(np.median(walls[v])) for v in walls}
    versions = {}
    for v in samples:
        row = {"step_ms_p50": median[v], "overhead_ms_p50": median[v] - median["floor"],
               "step_ms_wall": wall[v], "overhead_ms_wall": wall[v] - wall["floor"],
               "step_ms_wall_rounds": list(walls[v])}
        if v != "floor":
            for measure, of, over in (("", median, "overhead_ms_p50"), ("_wall", wall, "overhead_ms_wall")):
                row["step_ratio_to_ddp" + measure] = of[v] / of["ddp"]
                ddp_over = of["ddp"] - of["floor"]
                row["overhead_ratio_to_ddp" + measure] = row[over] / ddp_over if ddp_over > 0 else float("nan")
        versions[v] = row
    return versions


def run_model(name: str, args, comm: MPI.Intracomm) -> Dict:
    spec = MODELS[name]
    batch = args.batch or spec["batch"]
    steps, warmup = args.steps or spec["steps"], args.warmup if args.warmup is not None else spec["warmup"]
    rank = comm.Get_rank()
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, spec["layers"][0], generator=generator)
    y = torch.randint(0, spec["layers"][-1], (batch,), generator=generator)
    torch.manual_seed(0)                                  # the same initial model in every version
    reference = mlp(spec["layers"])
    models = {v: mlp(spec["layers"]) for v in VERSIONS}
    for model in models.values():
        model.load_state_dict(reference.state_dict())
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
    ours = {
        "allreduce_kit": hvd.DistributedOptimizer(sgd(models["allreduce_kit"]),
                                                  named_parameters=models["allreduce_kit"].named_parameters()),
        "allreduce_kit+overlap": hvd.DistributedOptimizer(
            sgd(models["allreduce_kit+overlap"]), named_parameters=models["allreduce_kit+overlap"].named_parameters(),
            bucket_mb=args.bucket_mb, overlap=True),
        "allreduce_kit+in_step": hvd.DistributedOptimizer(
            sgd(models["allreduce_kit+in_step"]), named_parameters=models["allreduce_kit+in_step"].named_parameters(),
            overlap=False),
    }
    ddp = nn.parallel.DistributedDataParallel(models["ddp"])
    steps_of = {"floor": step_function(models["floor"], sgd(models["floor"]), x, y),
                "ddp": step_function(ddp, sgd(ddp), x, y)}
    steps_of.update({v: step_function(models[v], ours[v], x, y) for v in OURS})
    samples, walls = interleaved(comm, steps_of, VERSIONS, args.rounds, warmup, steps)
    versions = measures(samples, walls)
    for v, row in versions.items():
        if v in ours:
            report = ours[v].report(file=None)
            row.update({"hidden_share_p50": report["overlap"]["hidden_share_p50"],
                        "reduction_ms_p50": report["overlap"]["reduction_ms_p50"],
                        "buckets": report["buckets"], "bucket_mb": report["bucket_mb"],
                        "background": report["background"], "background_reason": report["background_reason"]})
    raw = raw_allreduce_ms(comm, sum(p.numel() for p in reference.parameters()), max(steps, 5))
    goals = {}
    for key, measure in (("target", ""), ("target_wall", "_wall")):
        goal = target(name, comm.Get_size(), measure)
        goal["met"] = bool(versions["allreduce_kit"][goal["field"]] <= goal["at_most"])
        goals[key] = goal
    return {
        "model": name, "layers": list(spec["layers"]), **goals,
        "parameters": sum(p.numel() for p in reference.parameters()),
        "batch_per_rank": batch, "steps": steps, "warmup": warmup, "rounds": args.rounds,
        "versions": versions, "raw_allreduce_ms_p50": raw,
    }


def lines(result: Dict, ranks: int) -> List[str]:
    out = [f"{result['model']} ({result['parameters']:,d} parameters), batch {result['batch_per_rank']} per rank, "
           f"{ranks} ranks; median of {result['rounds']} x {result['steps']} steps, and wall: a block of "
           f"{result['steps']} steps from a barrier to the last rank's end, per step (median of {result['rounds']}):"]
    for v, row in result["versions"].items():
        text = f"  {v:<22} step {row['step_ms_p50']:9.3f} ms  wall {row['step_ms_wall']:9.3f} ms"
        if v != "floor":
            text += (f"  overhead {row['overhead_ms_p50']:8.3f} ms  step/ddp {row['step_ratio_to_ddp']:5.2f}x"
                     f"  overhead/ddp {row['overhead_ratio_to_ddp']:5.2f}x"
                     f"  wall/ddp {row['step_ratio_to_ddp_wall']:5.2f}x"
                     f"  wall overhead/ddp {row['overhead_ratio_to_ddp_wall']:5.2f}x")
        if "hidden_share_p50" in row:
            text += (f"  hidden {100 * row['hidden_share_p50']:3.0f}% of {row['reduction_ms_p50']:.2f} ms"
                     f"  ({row['buckets']} bucket{'s' if row['buckets'] != 1 else ''}, "
                     f"{'during backward' if row['background'] else 'in step()'})")
        out.append(text)
    out.append(f"  allreduce_kit.allreduce of the gradients ({4 * result['parameters'] / 1e6:.1f} MB float32, auto) "
               f"on a private buffer: {result['raw_allreduce_ms_p50']:.3f} ms")
    for key, by in (("target", "the median step"), ("target_wall", "wall time")):
        goal = result[key]
        what = "step/ddp" if goal["field"].startswith("step_ratio_to_ddp") else "overhead/ddp"
        out.append(f"  target by {by}: allreduce_kit {what} <= {goal['at_most']:.1f}x: "
                   f"{'met' if goal['met'] else 'NOT met'}")
    return out


def main() -> int:
    hvd.init()   # first, as in a Horovod script: before anything imports mpi4py.MPI
    from mpi4py import MPI

    parser = RankZeroParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=[*MODELS, "both"], default="both",
                        help="the MLP 64-256-10, the 10.5 M parameter MLP, or both in turn (default: both)")
    add_run_arguments(parser)
    parser.add_argument("--bucket-mb", type=float, default=hvd.BUCKET_MB,
                        help="bucket size of allreduce_kit+overlap (MB of 10^6 bytes)")
    args = parser.parse_args()
    bad = bad_run_arguments(args, ("bucket-mb", args.bucket_mb))
    if bad:
        parser.error("; ".join(bad))   # rank 0 says it, every rank exits with status 2
    comm = MPI.COMM_WORLD
    rank, ranks = comm.Get_rank(), comm.Get_size()
    threads = start(args, comm)
    results = [run_model(name, args, comm) for name in (MODELS if args.model == "both" else [args.model])]
    if rank == 0:
        print(f"{ranks} ranks, {threads} torch thread(s) each, MPI thread level "
              f"{'multiple' if hvd.mpi_threads_supported() else 'below multiple'}, {run.heavy_yield_state()}")
        for result in results:
            print("\n".join(lines(result, ranks)))
        if args.json:
            with open(args.json, "w", encoding="utf-8") as out:
                json.dump({"ranks": ranks, "threads": threads, "yield": run.heavy_yield_state(), "results": results},
                          out, indent=2)
            print(f"wrote {args.json}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
