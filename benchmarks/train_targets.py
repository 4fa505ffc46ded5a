"""Measure where ``python -m allreduce_kit.train`` spends its time, interleaving runs.

    python benchmarks/train_targets.py [--repeat 5] [--only wall,yield,overhead,scaling,jitter]

Each configuration is run ``--repeat`` times, in turn with the others (so a burst of load from
elsewhere hits all of them alike); the script prints the median and range of each figure.
Runs use the ``mpiexec`` and Python of the current environment.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent
MPIEXEC = str(BIN / "mpiexec") if (BIN / "mpiexec").exists() else "mpiexec"
TRAIN = [sys.executable, "-m", "allreduce_kit.train", "--progress", "lines"]

# name: (ranks, extra args, extra environment)
CONFIGS = {
    "wall": [("default 8 ranks", 8, [], {})],
    "yield": [("8 ranks, heavy yield (default)", 8, [], {}),
              ("8 ranks, no heavy yield", 8, [], {"ALLREDUCE_KIT_YIELD": "0"})],
    # Random delays, uniform in [0, 10] ms on every rank: waiting grows with p.
    "jitter": [(f"p={p} jitter 5 ms", p, ["--epochs", "10", "--jitter-ms", "5"], {}) for p in (2, 4, 8)],
    # A 1,011,010-parameter model (4.04 MB float32 gradient) at p = 2, with auto's choice and
    # with shared_memory, whose time depends least on cache state.
    "overhead": [(f"1M params p=2{label}", 2, ["--dataset", "synthetic", "--samples", "20000", "--features", "1000",
                                               "--hidden", "1000", "--classes", "10", "--max-steps", "150",
                                               "--bench-allreduce", "150", *algorithm], {})
                 for label, algorithm in (("", []), (", shared_memory", ["--algorithm", "shared_memory"]))],
    # Compute-heavy: 256 samples per rank per step through 512-2048-2048-10.
    "scaling": [(f"p={p}{label}", p, ["--dataset", "synthetic", "--samples", "40000", "--features", "512",
                                      "--hidden", "2048,2048", "--classes", "10", "--batch-size", "256",
                                      "--max-steps", "20"], env)
                for p, label, env in ((1, ", 2 threads (its share)", {}),
                                      (1, ", 1 thread", {"OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}),
                                      (2, ", 1 thread each", {}))],
}


def run(ranks, args, env, workdir):
    out = Path(workdir) / "run.json"
    start = time.perf_counter()
    done = subprocess.run([MPIEXEC, "-n", str(ranks), *TRAIN, *args, "--json", str(out)], capture_output=True,
                          text=True, env=dict(os.environ, **env), cwd=workdir)
    wall = time.perf_counter() - start
    if done.returncode:
        sys.exit(f"failed: {args}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    result = json.loads(out.read_text())
    later = result["epochs"][1:] or result["epochs"]
    return {"wall_s": wall, "test_accuracy": result["test_accuracy"],
            "samples_per_s": result["samples_per_second"],
            "samples_per_s_after_epoch_1": sum(e["samples"] for e in later) / sum(e["seconds"] for e in later),
            "step_ms_p50": result["straggler"]["step_ms_p50"],
            "samples_per_s_at_median_step": (result["ranks"] * result["config"]["batch_size"]
                                             / (result["straggler"]["step_ms_p50"] / 1e3)),
            "trainer_transfer_ms": result["straggler"]["transfer_ms_p50"],
            "wait_ms_mean": result["straggler"]["wait_ms_mean"],
            "wait_share": result["straggler"]["wait_share"],
            **({"alone_transfer_ms": result["allreduce_alone"]["transfer_ms_p50"],
                "ratio_trainer_over_alone": result["allreduce_alone"]["ratio"],
                "bare_loop_transfer_ms": result["allreduce_alone"]["bare_loop_transfer_ms_p50"],
                "ratio_trainer_over_bare_loop": result["allreduce_alone"]["bare_loop_ratio"]} if result.get("allreduce_alone") else {})}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5,
                        help="runs of each configuration, interleaved with the others'")
    parser.add_argument("--only", default=",".join(CONFIGS), metavar="NAME,...",
                        help=f"comma-separated groups of configurations to run, from: {', '.join(CONFIGS)} "
                             f"(wall: the default run at 8 ranks; yield: with and without heavy yield; "
                             f"overhead: the allreduce in the trainer against alone; scaling: 1 and 2 ranks on a "
                             f"compute-heavy model; jitter: random delays at 2, 4 and 8 ranks)")
    args = parser.parse_args()
    names = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = [name for name in names if name not in CONFIGS]
    if unknown or not names:
        parser.error(f"argument --only: unknown {', '.join(map(repr, unknown)) or 'empty list'}; "
                     f"choose from {', '.join(CONFIGS)}")
    if args.repeat < 1:
        parser.error(f"argument --repeat: must be >= 1, got {args.repeat}")
    chosen = [c for name in dict.fromkeys(names) for c in CONFIGS[name]]
    figures = {c[0]: [] for c in chosen}
    with tempfile.TemporaryDirectory() as workdir:
        for i in range(args.repeat):
            for label, ranks, extra, env in chosen:
                figures[label].append(run(ranks, extra, env, workdir))
                print(f"[{i + 1}/{args.repeat}] {label}: {json.dumps(figures[label][-1])}", flush=True)
    print("\nmedian [min - max] over", args.repeat, "runs")
    for label, runs in figures.items():
        print(f"{label}:")
        for key in runs[0]:
            values = [r[key] for r in runs]
            print(f"  {key:28s} {statistics.median(values):10.4g}  [{min(values):.4g} - {max(values):.4g}]")
    if any(c[0].startswith("p=") for c in chosen):
        # Ratios of runs made one after the other in the same round, then the median over rounds.
        for key in ("samples_per_s", "samples_per_s_at_median_step"):
            two = figures["p=2, 1 thread each"]
            for base in ("p=1, 2 threads (its share)", "p=1, 1 thread"):
                ratios = [a[key] / b[key] for a, b in zip(two, figures[base])]
                print(f"scaling ({key}): p=2 / {base}: median {statistics.median(ratios):.2f}x "
                      f"[{min(ratios):.2f} - {max(ratios):.2f}] over {len(ratios)} paired rounds")

if __name__ == "__main__":
    main()
