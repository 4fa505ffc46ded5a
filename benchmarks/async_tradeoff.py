"""The trade-off between synchronous allreduce and the asynchronous parameter server.

    python benchmarks/async_tradeoff.py [--ranks 4] [--delay-ms 50] [--repeat 2] [--epochs 2]

Runs ``python -m allreduce_kit.train`` (digits, hidden 32) in four configurations, ``--mode
sync`` and ``--mode async-ps``, each without and with ``--straggler 2:DELAY``, in turn,
``--repeat`` times, and keeps each configuration's fastest run (one burst of load from
elsewhere can halve a short run's throughput). Targets:

- a straggler costs sync far more throughput than async: the share of its throughput async
  keeps is more than twice sync's, and more than 0.4;
- under async the slow worker pushes fewer than half the updates of the slowest other worker;
- without a straggler, at the same samples, sync is at least as accurate as async (stale
  momentum SGD is not), and async's gradients are stale (mean staleness above 0.5) while
  sync's never are.

Prints the figures and whether each target holds; exit status 1 if one does not. Runs use the
``mpiexec`` and Python of the current environment.
"""
import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from training_runs import check, train  # noqa: E402

TRAIN_ARGS = ["--hidden", "32"]
MODES = ("sync", "async-ps")


def run(ranks: int, epochs: int, extra, workdir: str) -> dict:
    """One training run's ``--json`` report."""
    report = train(ranks, [*TRAIN_ARGS, "--epochs", epochs, *extra], Path(workdir) / "run.json", 900, cwd=workdir)
    if report is None:
        sys.exit(1)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 2)[2])
    parser.add_argument("--ranks", type=int, default=4, help="ranks per run (default 4: async has 3 workers)")
    parser.add_argument("--delay-ms", type=float, default=50.0, help="rank 2's delay per step (default 50)")
    parser.add_argument("--repeat", type=int, default=2, help="runs per configuration (default 2)")
    parser.add_argument("--epochs", type=int, default=2, help="epochs per run (default 2)")
    args = parser.parse_args()
    if args.ranks < 4 or args.repeat < 1 or args.delay_ms <= 0:
        parser.error("need --ranks >= 4 (rank 2 a worker beside others), --repeat >= 1 and --delay-ms > 0")

    runs = {(mode, slow): [] for mode in MODES for slow in (False, True)}
    with tempfile.TemporaryDirectory() as workdir:
        for i in range(args.repeat):
            for mode, slow in runs:
                extra = ["--mode", mode] + (["--straggler", f"2:{args.delay_ms:g}"] if slow else [])
                runs[mode, slow].append(run(args.ranks, args.epochs, extra, workdir))
                summary = runs[mode, slow][-1]["summary"]
                print(f"[{i + 1}/{args.repeat}] {mode}{' straggler' if slow else ''}: "
                      f"{summary['samples_per_second']:,.0f} samples/s", flush=True)
    best = {key: max(reports, key=lambda r: r["summary"]["samples_per_second"]) for key, reports in runs.items()}
    summary = {key: report["summary"] for key, report in best.items()}

    print(f"\n{args.ranks} ranks, {args.epochs} epochs; fastest of {args.repeat} runs each")
    print(f"{'run':<20} {'samples/s':>10} {'samples':>8} {'test acc':>9} {'staleness':>10}")
    for (mode, slow), s in summary.items():
        print(f"{mode + (' straggler' if slow else ''):<20} {s['samples_per_second']:>10,.0f} {s['samples']:>8} "
              f"{s['test_accuracy']:>9.2%} {s['staleness_mean']:>10.2f}")
    kept = {mode: summary[mode, True]["samples_per_second"] / summary[mode, False]["samples_per_second"]
            for mode in MODES}
    workers = {w["rank"]: w["pushed"] for w in best["async-ps", True]["staleness"]["workers"]}
    others = [pushed for rank, pushed in workers.items() if rank != 2]
    print(f"throughput kept under the straggler: sync {kept['sync']:.2f}, async {kept['async-ps']:.2f}")
    print(f"updates pushed per async worker: {dict(sorted(workers.items()))}")

    sync, ps = summary["sync", False], summary["async-ps", False]
    failures: list = []
    print("targets:")
    check("async keeps more than twice sync's share of its throughput", kept["async-ps"] > 2 * kept["sync"], failures)
    check("async keeps more than 0.4 of its throughput", kept["async-ps"] > 0.4, failures)
    check("the slow worker pushes fewer than half the updates of any other", workers[2] < 0.5 * min(others), failures)
    check("without a straggler both modes see the same samples (within 8)", abs(sync["samples"] - ps["samples"]) < 8,
          failures)
    check("without a straggler sync is at least as accurate as async", sync["test_accuracy"] >= ps["test_accuracy"],
          failures)
    check("async's gradients are stale (mean above 0.5), sync's never",
          ps["staleness_mean"] > 0.5 and sync["staleness_max"] == 0, failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
