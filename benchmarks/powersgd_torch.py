"""PowerSGD in PyTorch: allreduce_kit.torch's Compression.powersgd beside DDP's powerSGD_hook over Gloo, in one run.

The same training step (forward, backward, SGD update) of the same model on the same batch and
ranks, from the same initial weights, in turn, in the same processes:

- ``floor``: no communication at all, the least any data-parallel step can take;
- ``allreduce_kit``: ``allreduce_kit.torch.DistributedOptimizer``, uncompressed, its defaults;
- ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` over Gloo, uncompressed, its defaults;
- ``allreduce_kit+powersgd``: ``DistributedOptimizer(..., compression=Compression.powersgd(...))``;
- ``ddp+powersgd``: DDP with ``powerSGD_hook`` registered (``ddp_comm_hooks.powerSGD_hook``).

Both PowerSGD sides get the same ``PowerSGDState`` settings: ``matrix_approximation_rank``
(``--rank``), ``start_powerSGD_iter`` (``--start``; DDP needs at least 2), ``min_compression_rate``
2, ``use_error_feedback`` and ``warm_start`` on, ``orthogonalization_epsilon`` 0, ``random_seed``
0. Every version first takes ``--start`` untimed steps, so that every timed step of the PowerSGD
versions is compressed. Then each round runs every version for ``--warmup`` untimed and
``--steps`` timed steps, in an order that rotates between rounds; a step's time is measured as in
``torch_vs_ddp.py``: the median step (each step the mean over ranks) and the wall time of a block
of steps from a barrier to the last rank's end, per step (median over rounds).

Each allreduce_kit version is set against DDP with the same compression: the ratio of the steps,
and of the overheads (step minus floor). The target: ``allreduce_kit+powersgd``'s step at most
0.5x ``ddp+powersgd``'s. Models: ``5m`` (64-2048-2048-512-10, 5.38 M parameters, batch 32 per
rank: the trainer's digits model of docs/compression.md), and ``torch_vs_ddp.py``'s ``mlp`` and
``10m``. Run (one node; ``--json`` keeps the figures):

    for p in 2 4; do mpirun -n $p python benchmarks/powersgd_torch.py --rank 4 --json powersgd-torch-p$p.json; done

``--accuracy`` instead trains Horovod's MNIST-style example (``examples/horovod_pytorch_mnist.py``,
unchanged) with ``Compression.none`` and with ``Compression.powersgd(rank=--rank,
start_iter=--start)``, for each seed of ``--seeds`` (``powersgd_accuracy.py``), and prints the
final test accuracy of every run and the median over seeds. Its defaults are the suite's run of
the example at 4 ranks (5 epochs, batch 16 per rank, ``--lr`` 0.025 times the rank count: the
global batch and step of one process at batch 64 and 0.1):

    mpirun -n 4 python benchmarks/powersgd_torch.py --accuracy --json powersgd-accuracy-p4.json
"""
from __future__ import annotations   # MPI in annotations: mpi4py.MPI is imported after hvd.init()

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

import allreduce_kit.torch as hvd   # does not start MPI: hvd.init() does, in main()
from allreduce_kit.cli import RankZeroParser

sys.path.insert(0, str(Path(__file__).resolve().parent))
import powersgd_accuracy  # noqa: E402  --accuracy: Horovod's example with and without PowerSGD
import torch_vs_ddp as sibling  # noqa: E402  the models, Gloo's start, the timed interleaved blocks

if TYPE_CHECKING:
    from mpi4py import MPI

MODELS = {"5m": {"layers": (64, 2048, 2048, 512, 10), "batch": 32, "steps": 20, "warmup": 3}, **sibling.MODELS}
VERSIONS = ("floor", "allreduce_kit", "ddp", "allreduce_kit+powersgd", "ddp+powersgd")
#: each allreduce_kit version and the DDP version it is set against
PAIRS = {"allreduce_kit": "ddp", "allreduce_kit+powersgd": "ddp+powersgd"}
#: ``allreduce_kit+powersgd``'s step at most this times ``ddp+powersgd``'s
TARGET = 0.5


def powersgd_settings(rank: int, start: int) -> Dict:
    """The ``PowerSGDState`` arguments both sides get (PyTorch's defaults but rank and start)."""
    return dict(matrix_approximation_rank=rank, start_powerSGD_iter=start, min_compression_rate=2,
                use_error_feedback=True, warm_start=True, orthogonalization_epsilon=0.0, random_seed=0)


def measures(samples: Dict[str, List[np.ndarray]], walls: Dict[str, List[float]]) -> Dict[str, Dict]:
    """Each version's median step and wall time per step (ms) and overheads over the floor; for
    each allreduce_kit version, the ratios of its step and overhead to its DDP pair's, by both measures."""
    median = {v: float(np.median(np.concatenate(samples[v]))) * 1e3 for v in samples}
    wall = {v: float(np.median(walls[v])) for v in walls}
    rows = {}
    for v in samples:
        rows[v] = {"step_ms_p50": median[v], "overhead_ms_p50": median[v] - median["floor"],
                   "step_ms_wall": wall[v], "overhead_ms_wall": wall[v] - wall["floor"],
                   "step_ms_wall_rounds": list(walls[v])}
    for ours, theirs in PAIRS.items():
        row = rows[ours]
        row["against"] = theirs
        for measure, of, over in (("", median, "overhead_ms_p50"), ("_wall", wall, "overhead_ms_wall")):
            row["step_ratio" + measure] = of[ours] / of[theirs]
            their_over = rows[theirs][over]
            row["overhead_ratio" + measure] = row[over] / their_over if their_over > 0 else float("nan")
    return rows


def run_model(name: str, args, comm: MPI.Intracomm) -> Dict:
    spec = MODELS[name]
    batch = args.batch or spec["batch"]
    steps, warmup = args.steps or spec["steps"], args.warmup if args.warmup is not None else spec["warmup"]
    generator = torch.Generator().manual_seed(comm.Get_rank())
    x = torch.randn(batch, spec["layers"][0], generator=generator)
    y = torch.randint(0, spec["layers"][-1], (batch,), generator=generator)
    torch.manual_seed(0)                                  # the same initial model in every version
    reference = sibling.mlp(spec["layers"])
    models = {v: sibling.mlp(spec["layers"]) for v in VERSIONS}
    for model in models.values():
        model.load_state_dict(reference.state_dict())
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
    settings = powersgd_settings(args.rank, args.start)
    ddp = torch.nn.parallel.DistributedDataParallel(models["ddp"])
    # One bucket on both PowerSGD sides: DDP's hook over Gloo with more buckets chains each bucket's
    # allreduces from Gloo's threads, in an order that can differ between ranks (Gloo then aborts).
    gradient_bytes = 4 * sum(p.numel() for p in reference.parameters())
    ddp_powersgd = torch.nn.parallel.DistributedDataParallel(models["ddp+powersgd"],
                                                             bucket_cap_mb=gradient_bytes / 2**20 + 1)
    ddp_powersgd.register_comm_hook(powerSGD_hook.PowerSGDState(process_group=None, **settings),
                                    powerSGD_hook.powerSGD_hook)
    compression = hvd.Compression.powersgd(
        args.rank, args.start, **{k: v for k, v in settings.items()
                                  if k not in ("matrix_approximation_rank", "start_powerSGD_iter")})
    ours = {"allreduce_kit": hvd.DistributedOptimizer(sgd(models["allreduce_kit"]),
                                                      named_parameters=models["allreduce_kit"].named_parameters()),
            "allreduce_kit+powersgd": hvd.DistributedOptimizer(
                sgd(models["allreduce_kit+powersgd"]),
                named_parameters=models["allreduce_kit+powersgd"].named_parameters(), compression=compression,
                bucket_mb=gradient_bytes / 1e6 + 1)}
    steps_of = {"floor": sibling.step_function(models["floor"], sgd(models["floor"]), x, y),
                "ddp": sibling.step_function(ddp, sgd(ddp), x, y),
                "ddp+powersgd": sibling.step_function(ddp_powersgd, sgd(ddp_powersgd), x, y)}
    steps_of.update({v: sibling.step_function(models[v], ours[v], x, y) for v in ours})
    for version in VERSIONS:   # past --start: every timed step of the PowerSGD versions is compressed
        for _ in range(args.start):
            steps_of[version]()
    samples, walls = sibling.interleaved(comm, steps_of, VERSIONS, args.rounds, warmup, steps)
    rows = measures(samples, walls)
    for v, opt in ours.items():
        report = opt.report(file=None)
        rows[v].update({"reduction_ms_p50": report["overlap"]["reduction_ms_p50"], "buckets": report["buckets"]})
    rows["ddp+powersgd"]["buckets"] = len(ddp_powersgd._get_ddp_logging_data().get("bucket_sizes", "x").split(","))
    ratio = rows["allreduce_kit+powersgd"]
    goal = {"field": "step_ratio", "version": "allreduce_kit+powersgd", "at_most": TARGET,
            "met": bool(ratio["step_ratio"] <= TARGET), "met_wall": bool(ratio["step_ratio_wall"] <= TARGET)}
    shapes = [tuple(p.shape) for p in reference.parameters()]
    return {"model": name, "layers": list(spec["layers"]), "parameters": sum(p.numel() for p in reference.parameters()),
            "batch_per_rank": batch, "steps": steps, "warmup": warmup, "rounds": args.rounds,
            "powersgd": settings, "compressed_matrices": compressed(shapes, args.rank),
            "versions": rows, "target": goal}


def compressed(shapes: List[tuple], rank: int) -> List[List[int]]:
    """``[n, m, R']`` of each gradient matrix that PowerSGD compresses at ``rank`` (both sides alike)."""
    from allreduce_kit.compression.powersgd import matrix_shape, should_compress

    out = []
    for shape in shapes:
        n, m = matrix_shape(shape)
        r = min(n, m, rank)
        if len(shape) >= 2 and should_compress(n, m, r, 2):
            out.append([n, m, r])
    return out


def lines(result: Dict, ranks: int) -> List[str]:
    s = result["powersgd"]
    out = [f"{result['model']} ({result['parameters']:,d} parameters), SGD, batch {result['batch_per_rank']} per rank, "
           f"{ranks} ranks; PowerSGD rank {s['matrix_approximation_rank']} from step {s['start_powerSGD_iter']} "
           f"({len(result['compressed_matrices'])} matrices compressed); median of {result['rounds']} x "
           f"{result['steps']} steps, and wall per step:"]
    for v, row in result["versions"].items():
        text = (f"  {v:<23} step {row['step_ms_p50']:9.3f} ms  wall {row['step_ms_wall']:9.3f} ms"
                f"  overhead {row['overhead_ms_p50']:8.3f} ms")
        if "against" in row:
            text += (f"  step/{row['against']} {row['step_ratio']:5.2f}x  overhead/{row['against']} "
                     f"{row['overhead_ratio']:5.2f}x  wall/{row['against']} {row['step_ratio_wall']:5.2f}x")
        if "reduction_ms_p50" in row:
            text += f"  averaging {row['reduction_ms_p50']:.2f} ms"
        out.append(text)
    goal = result["target"]
    out.append(f"  target: {goal['version']} step/ddp+powersgd <= {goal['at_most']:.1f}x: by the median step "
               f"{'met' if goal['met'] else 'NOT met'}, by wall time {'met' if goal['met_wall'] else 'NOT met'}")
    return out


def write(path, result: Dict) -> None:
    """``result`` as JSON to ``path``, if one was given (rank 0)."""
    if path:
        with open(path, "w", encoding="utf-8") as out:
            json.dump(result, out, indent=2)
        print(f"wrote {path}")


def main() -> int:
    hvd.init()   # first, as in a Horovod script: before anything imports mpi4py.MPI
    from mpi4py import MPI

    parser = RankZeroParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=[*MODELS, "all"], default="5m",
                        help="5m: 64-2048-2048-512-10; mlp: 64-256-10; 10m: 1024-2048-2048-2048-10; or all in turn "
                             "(default: 5m)")
    parser.add_argument("--rank", type=int, default=4, help="PowerSGD's matrix_approximation_rank (default: 4)")
    parser.add_argument("--start", type=int, default=10,
                        help="PowerSGD's start_powerSGD_iter, at least 2 when timing (DDP's need); untimed steps "
                             "(default: 10)")
    sibling.add_run_arguments(parser)
    accuracy = parser.add_argument_group("--accuracy: Horovod's MNIST-style example, with and without PowerSGD")
    accuracy.add_argument("--accuracy", action="store_true",
                          help="train the example with each compression and seed instead of timing steps")
    accuracy.add_argument("--seeds", default="42,43,44", help="the example's --seed of each run (default: 42,43,44)")
    accuracy.add_argument("--epochs", type=int, default=5, help="the example's --epochs (default: 5)")
    accuracy.add_argument("--lr", type=float, default=0.025,
                          help="the example's --lr, which it multiplies by the rank count (default: 0.025)")
    accuracy.add_argument("--batch-size", type=int, default=16, help="the example's --batch-size per rank (default: 16)")
    args = parser.parse_args()
    bad = sibling.bad_run_arguments(args)
    bad += ["--rank must be >= 1"] if args.rank < 1 else []
    bad += ["--start must be >= 2 (DDP's PowerSGD needs it)"] if args.start < 2 and not args.accuracy else []
    bad += [f"--{name} must be >= 1" for name, value in (("epochs", args.epochs), ("batch-size", args.batch_size))
            if value < 1]
    try:
        args.seeds = [int(seed) for seed in args.seeds.split(",")]
    except ValueError:
        bad.append(f"--seeds must be integers separated by commas, got {args.seeds!r}")
    if bad:
        parser.error("; ".join(bad))   # rank 0 says it, every rank exits with status 2
    comm = MPI.COMM_WORLD
    rank, ranks = comm.Get_rank(), comm.Get_size()
    if args.accuracy:
        result = powersgd_accuracy.run(args)
        if rank == 0:
            print("\n".join(powersgd_accuracy.lines(result)))
            write(args.json, result)
        return 0
    threads = sibling.start(args, comm)
    results = [run_model(name, args, comm) for name in (MODELS if args.model == "all" else [args.model])]
    if rank == 0:
        print(f"{ranks} ranks, {threads} torch thread(s) each")
        for result in results:
            print("\n".join(lines(result, ranks)))
        write(args.json, {"ranks": ranks, "threads": threads, "results": results})
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
