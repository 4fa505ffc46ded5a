"""When a pipeline wins: ``--pipeline 2`` against pure data parallelism on the same model and global batch.

A model whose gradient is large against its activations (an MLP of about 51 M parameters,
3584 wide, synthetic data, global batch 512), trained for a few steps two ways, in turn, each
``--repeat`` times:

- ``dp``: data parallelism over all P ranks, ``--batch-size 512/P`` each; every step allreduces
  the whole 206 MB gradient;
- ``pipeline``: ``--pipeline 2`` (two stages of two 3584 x 3584 layers each), D = P/2 replicas of
  ``--batch-size 512/D`` in ``--micro-batches`` micro-batches; a stage's gradient (103 MB) is
  averaged over its D replicas only, and between the stages go the activations of the boundary
  (512 x 3584 floats forward and their gradient backward per step).

``--where cluster`` runs both on the emulated cluster (as root; ``python -m allreduce_kit.cluster``),
2 nodes x 4 ranks at ``--link`` (default 250mbit): the pipeline's placement puts one stage on each
node, so its allreduces stay inside the nodes and only the activations cross the link, where data
parallelism sends its whole gradient across. ``--where node`` runs both on this machine's ranks.
Prints the median step of each (``straggler.step_ms_p50`` and ``step_ms.step_p50`` of the
trainer's ``--json``), their ratio, and the bytes each moves over a node's link per step.
"""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

WIDTH, LAYERS, CLASSES, GLOBAL_BATCH = 3584, 4, 10, 512
MODEL = ["--dataset", "synthetic", "--samples", "8000", "--features", str(WIDTH), "--classes", str(CLASSES),
         "--hidden", ",".join([str(WIDTH)] * LAYERS), "--epochs", "1"]
CLUSTER = [sys.executable, "-m", "allreduce_kit.cluster"]
BIN = Path(sys.executable).parent
MPIEXEC = str(BIN / "mpiexec") if (BIN / "mpiexec").exists() else "mpiexec"


def parameters() -> int:
    widths = [WIDTH] * (LAYERS + 1) + [CLASSES]
    return sum((a + 1) * b for a, b in zip(widths, widths[1:]))


def link_bytes(way: str, ranks: int, nodes: int) -> float:
    """Bytes one node's link carries per step, each way: a node-aware allreduce of the whole
    gradient (2 (N-1)/N of it), or the boundary's activations and their gradient."""
    if nodes < 2:
        return 0.0
    if way == "dp":
        return 2 * (nodes - 1) / nodes * 4 * parameters()
    return 4 * GLOBAL_BATCH * WIDTH                        # forward one way, the gradient back the other


def command(way: str, ranks: int, steps: int, micro: int, out: Path) -> List[str]:
    train = [sys.executable, "-m", "allreduce_kit.train", *MODEL, "--max-steps", str(steps), "--json", str(out)]
    if way == "dp":
        return train + ["--batch-size", str(GLOBAL_BATCH // ranks)]
    return train + ["--pipeline", "2", "--batch-size", str(GLOBAL_BATCH // (ranks // 2)), "--micro-batches", str(micro)]


def run(where: str, way: str, ranks: int, steps: int, micro: int, out: Path) -> Dict:
    """One run's median step in ms (``step_ms``) and where it went (``parts``)."""
    argv = command(way, ranks, steps, micro, out)
    full = [*CLUSTER, "run", "-n", str(ranks), "--timeout", "1800", "--", *argv] if where == "cluster" else \
        [MPIEXEC, "-n", str(ranks), *argv]
    done = subprocess.run(full, capture_output=True, text=True, timeout=2000, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise SystemExit(f"FAILED ({done.returncode}): {' '.join(full)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    report = json.loads(out.read_text())
    if way == "pipeline":
        return {"step_ms": float(report["step_ms"]["step_p50"]), "parts": report["step_ms"] | {"per_step": None},
                "idle_share": report["pipeline"]["idle_share"]}
    s = report["straggler"]
    return {"step_ms": float(s["step_ms_p50"]),
            "parts": {"compute_ms_p50_slowest": max(r["compute_ms_p50"] for r in s["ranks"]),
                      "allreduce_ms_p50_median": statistics.median(r["allreduce_ms_p50"] for r in s["ranks"])}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--where", choices=("cluster", "node"), default="cluster",
                        help="the emulated cluster (as root) or this machine's ranks (default: cluster)")
    parser.add_argument("--ranks", type=int, default=8, help="ranks in all (even; default 8)")
    parser.add_argument("--nodes", type=int, default=2, help="with --where cluster: nodes (default 2)")
    parser.add_argument("--link", default="250mbit", help="with --where cluster: each node's link (default 250mbit)")
    parser.add_argument("--steps", type=int, default=12, help="steps per run (default 12)")
    parser.add_argument("--micro-batches", type=int, default=2, help="the pipeline's M (default 2)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each, in turn (default 3)")
    parser.add_argument("--ways", default="dp,pipeline", help="which to run (default: dp,pipeline)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args()
    if args.ranks < 2 or args.ranks % 2 or GLOBAL_BATCH % (args.ranks // 2 * args.micro_batches) or args.repeat < 1:
        parser.error("--ranks even and >= 2, with 512 / (ranks/2) divisible by --micro-batches; --repeat >= 1")
    nodes = args.nodes if args.where == "cluster" else 1
    if args.where == "cluster":
        from allreduce_kit.cluster import why_not_here
        problem = why_not_here()
        if problem:
            parser.exit(2, f"{parser.prog}: error: {problem}\n")
        subprocess.run([*CLUSTER, "down"], capture_output=True)
        subprocess.run([*CLUSTER, "up", "--nodes", str(nodes), "--link", args.link], check=True)
    ways = [w.strip() for w in args.ways.split(",") if w.strip()]
    if not ways or not set(ways) <= {"dp", "pipeline"}:
        parser.error("--ways: dp, pipeline or both")
    steps: Dict[str, List[float]] = {way: [] for way in ways}
    parts: Dict[str, List[Dict]] = {way: [] for way in ways}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for k in range(args.repeat):
                for way in steps:                      # in turn, so load from elsewhere hits both alike
                    got = run(args.where, way, args.ranks, args.steps, args.micro_batches, Path(tmp) / f"{way}-{k}.json")
                    steps[way].append(got["step_ms"])
                    parts[way].append(got)
                    print(f"# {way} run {k + 1}: median step {steps[way][-1]:.0f} ms", flush=True)
    finally:
        if args.where == "cluster":
            subprocess.run([*CLUSTER, "down"], capture_output=True)
    medians = {way: statistics.median(v) for way, v in steps.items()}
    where = f"{nodes} nodes x {args.ranks // nodes} ranks at {args.link}" if nodes > 1 else f"one node, {args.ranks} ranks"
    print(f"{parameters():,d} parameters, global batch {GLOBAL_BATCH}, {where}; medians of {args.repeat} runs "
          f"of {args.steps} steps")
    print(f"{'way':<10} {'step (ms)':>10} {'runs (ms)':>28} {'link MB/step each way':>22}")
    for way, v in steps.items():
        print(f"{way:<10} {medians[way]:10.0f} {', '.join(f'{x:.0f}' for x in v):>28} "
              f"{link_bytes(way, args.ranks, nodes) / 1e6:22.1f}")
    ratio = medians["pipeline"] / medians["dp"] if len(medians) == 2 else None
    if ratio is not None:
        print(f"pipeline / dp: {ratio:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"where": args.where, "ranks": args.ranks, "nodes": nodes,
                                               "link": args.link, "parameters": parameters(),
                                               "micro_batches": args.micro_batches, "steps": steps,
                                               "median_ms": medians, "ratio": ratio, "runs": parts,
                                               "link_bytes_per_step": {w: link_bytes(w, args.ranks, nodes)
                                                                       for w in steps}}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
