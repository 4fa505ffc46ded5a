"""Sharded data parallelism (``python -m allreduce_kit.train --zero``): memory, bytes sent, step time,
and a model that only a sharded run can train here (the tables of docs/sharding.md).

    python benchmarks/sharding.py memory       # model state and peak RSS per rank, stages 0-3, 2/4/8 ranks
    python benchmarks/sharding.py speed        # median step time of 3 runs per stage, 2/4/8 ranks
    python benchmarks/sharding.py big          # 250 M parameters with Adam at 8 ranks: --zero 0 refused, --zero 3 trains

``memory`` and ``speed`` train an MLP of about 10 M parameters (synthetic data, 1024 features,
hidden 2048,2048,1024) with Adam; ``big`` one of 235 M (4096 features, 14 hidden layers of 4096).
Exit status 1 if a target fails: the model state within 10% of the formulas (stage 0 16Ψ,
stage 1 8Ψ + 8Ψ/N, stage 2 4Ψ + 12Ψ/N, stage 3 16Ψ/N, each besides its buffers); the bytes a
rank sends per step at stages 1 and 2 within 5% of stage 0's, at stage 3 at most 1.5x; step time
at stages 1 and 2 at most 1.1x stage 0's, at stage 3 at most 1.6x; the big model refused at
``--zero 0`` before training and trained at ``--zero 3``.
"""
import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List

sys.path.insert(0, str(Path(__file__).resolve().parent))
from training_runs import MPIEXEC, TRAIN, check, train  # noqa: E402

MODEL = ["--dataset", "synthetic", "--samples", "4096", "--features", "1024", "--classes", "10",
         "--hidden", "2048,2048,1024", "--optimizer", "adam", "--lr", "0.001", "--batch-size", "32",
         "--bucket-mb", "4", "--algorithm", "ring"]
BIG = ["--dataset", "synthetic", "--samples", "256", "--features", "4096", "--classes", "10",
       "--hidden", ",".join(["4096"] * 14), "--optimizer", "adam", "--lr", "0.0001", "--batch-size", "4",
       "--bucket-mb", "16", "--max-steps", "3", "--gather-every", "1"]
RANKS = (2, 4, 8)


def formula(stage: int, psi: int, n: int) -> float:
    """The model-state bytes per rank of float32 Adam at ``stage`` (ZeRO's formulas, without buffers)."""
    return {0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n, 3: 16 * psi / n}[stage]


def memory(args, failures: List[str]) -> None:
    print("ranks  stage  model state (MB)  of which buffers  formula (MB)  estimate (MB)  peak RSS (MB)  "
          "sent per step (MB)")
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.ranks:
            sent = {}
            for stage in range(4):
                report = train(n, [*MODEL, "--max-steps", "3", "--zero", stage], Path(tmp) / "run.json", args.timeout)
                if report is None:
                    failures.append(f"--zero {stage} at {n} ranks ran")
                    continue
                m, psi = report["memory"], report["parameters"]
                held = m["model_state_bytes"] - m["model_state"]["buffers"]
                sent[stage] = report["communication"]["bytes_sent_per_step"]
                print(f"{n:5d}  {stage:5d}  {m['model_state_bytes'] / 1e6:16.1f}  "
                      f"{m['model_state']['buffers'] / 1e6:16.1f}  {formula(stage, psi, n) / 1e6:12.1f}  "
                      f"{m['model_state_estimate'] / 1e6:13.1f}  {m['peak_rss_bytes'] / 1e6:13.1f}  "
                      f"{sent[stage] / 1e6:18.2f}")
                check(f"{n} ranks, stage {stage}: model state within 10% of the formula",
                      abs(held - formula(stage, psi, n)) <= 0.1 * formula(stage, psi, n), failures)
            if len(sent) == 4:
                for stage in (1, 2):
                    check(f"{n} ranks, stage {stage} sends within 5% of stage 0",
                          abs(sent[stage] - sent[0]) <= 0.05 * sent[0], failures)
                check(f"{n} ranks, stage 3 sends at most 1.5x stage 0", sent[3] <= 1.5 * sent[0], failures)


def speed(args, failures: List[str]) -> None:
    print("ranks  stage  step ms (median of run medians)  runs  ratio to stage 0")
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.ranks:
            times = {stage: [] for stage in range(4)}
            for _ in range(args.runs):                              # the stages interleaved, run by run
                for stage in range(4):
                    report = train(n, [*MODEL, "--max-steps", str(args.steps), "--zero", stage],
                                   Path(tmp) / "run.json", args.timeout)
                    if report is not None:
                        times[stage].append(report["straggler"]["step_ms_p50"])
            if not all(times.values()):
                failures.append(f"every stage ran at {n} ranks")
                continue
            median = {stage: statistics.median(t) for stage, t in times.items()}
            for stage in range(4):
                print(f"{n:5d}  {stage:5d}  {median[stage]:31.2f}  {len(times[stage]):4d}  "
                      f"{median[stage] / median[0]:16.2f}")
            for stage in (1, 2):
                check(f"{n} ranks, stage {stage} step at most 1.1x stage 0's", median[stage] <= 1.1 * median[0], failures)
            check(f"{n} ranks, stage 3 step at most 1.6x stage 0's", median[3] <= 1.6 * median[0], failures)


def big(args, failures: List[str]) -> None:
    command = [MPIEXEC, "-n", "8", *TRAIN, *BIG, "--zero", "0"]
    print("+ " + " ".join(command))
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, stdin=subprocess.DEVNULL)
    print(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "(no message)")
    check("--zero 0 is refused up front (exit 2, naming --zero)",
          done.returncode == 2 and "argument --zero" in done.stderr, failures)
    with tempfile.TemporaryDirectory() as tmp:
        report = train(8, [*BIG, "--zero", "3"], Path(tmp) / "big.json", args.timeout)
    if report is None:
        failures.append("--zero 3 trains the big model")
        return
    m = report["memory"]
    print(f"--zero 3: {report['parameters']:,} parameters, {report['steps']} steps, model state "
          f"{m['model_state_bytes'] / 1e9:.3f} GB per rank (estimate {m['model_state_estimate'] / 1e9:.3f} GB), "
          f"peak RSS {m['peak_rss_bytes'] / 1e9:.3f} GB, step {report['straggler']['step_ms_p50'] / 1e3:.1f} s")
    check("--zero 3 trains the big model for its steps", report["steps"] == 3, failures)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("memory", "speed", "big"),
                   help="memory: model state, peak RSS and bytes sent per stage; speed: step time per stage; "
                        "big: the 250M-parameter model at 8 ranks")
    p.add_argument("--ranks", type=lambda s: [int(x) for x in s.split(",")], default=list(RANKS),
                   help="comma-separated rank counts (memory, speed)")
    p.add_argument("--runs", type=int, default=3, help="speed: runs per stage and rank count")
    p.add_argument("--steps", type=int, default=30, help="speed: steps per run")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    args = p.parse_args()
    failures: List[str] = []
    {"memory": memory, "speed": speed, "big": big}[args.what](args, failures)
    if failures:
        print(f"{len(failures)} target(s) failed: " + "; ".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
