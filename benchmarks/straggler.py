"""How much one slow rank slows synchronous training, and whether the report blames it.

    python benchmarks/straggler.py [--ranks 3] [--delay-ms 40] [--repeat 3]

Runs ``python -m allreduce_kit.train`` (digits, hidden 32, batch 16, one epoch) without and
with ``--straggler 1:DELAY``, one after the other, ``--repeat`` times, and prints each rank's
median step time in both, the rise, and its median wait in the collective. Targets, on the
medians over the repeats:

- every rank's step time rises by more than half the delay and less than twice it (each step
  waits for the slowest rank, and only for it);
- every other rank waits more than half the delay per step, the straggler less than half;
- the report names rank 1 slowest, in at least 90 % of the steps.

Prints whether each target holds; exit status 1 if one does not. Runs use the ``mpiexec`` and
Python of the current environment. Not for a loaded machine: other work moves the figures.
"""
import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from training_runs import check, train  # noqa: E402

TRAIN_ARGS = ["--hidden", "32", "--batch-size", "16"]


def straggler_report(ranks: int, epochs: int, extra, workdir: str) -> dict:
    """One training run's straggler report (the ``straggler`` object of its ``--json``)."""
    report = train(ranks, [*TRAIN_ARGS, "--epochs", epochs, *extra], Path(workdir) / "run.json", 600, cwd=workdir)
    if report is None:
        sys.exit(1)
    return report["straggler"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 2)[2])
    parser.add_argument("--ranks", type=int, default=3, help="ranks per run (default 3)")
    parser.add_argument("--delay-ms", type=float, default=40.0, help="the straggler's delay per step (default 40)")
    parser.add_argument("--repeat", type=int, default=3, help="pairs of runs (default 3)")
    parser.add_argument("--epochs", type=int, default=1, help="epochs per run (default 1)")
    args = parser.parse_args()
    if args.ranks < 2 or args.repeat < 1 or args.delay_ms <= 0:
        parser.error("need --ranks >= 2, --repeat >= 1 and --delay-ms > 0")

    delay = args.delay_ms
    pairs = []
    with tempfile.TemporaryDirectory() as workdir:
        for i in range(args.repeat):
            base = straggler_report(args.ranks, args.epochs, [], workdir)
            slow = straggler_report(args.ranks, args.epochs, ["--straggler", f"1:{delay:g}"], workdir)
            pairs.append((base, slow))
            print(f"[{i + 1}/{args.repeat}] slowest rank {slow['slowest_rank']}, step p50 "
                  f"{base['step_ms_p50']:.1f} -> {slow['step_ms_p50']:.1f} ms", flush=True)

    def median(pick):
        return statistics.median(pick(base, slow) for base, slow in pairs)

    print(f"\n{args.ranks} ranks, rank 1 late by {delay:g} ms per step; medians over {args.repeat} pairs of runs")
    print(f"{'rank':>4} {'step ms':>9} {'with':>9} {'rise':>9} {'wait ms':>9} {'slowest':>8}")
    rises, waits = {}, {}
    for r in range(args.ranks):
        before = median(lambda b, s: b["ranks"][r]["step_p50_ms"])
        after = median(lambda b, s: s["ranks"][r]["step_p50_ms"])
        rises[r] = median(lambda b, s: s["ranks"][r]["step_p50_ms"] - b["ranks"][r]["step_p50_ms"])
        waits[r] = median(lambda b, s: s["ranks"][r]["wait_p50_ms"])
        share = median(lambda b, s: s["ranks"][r]["slowest_share"])
        print(f"{r:>4} {before:>9.1f} {after:>9.1f} {rises[r]:>9.1f} {waits[r]:>9.1f} {share:>8.0%}")

    failures: list = []
    print("targets:")
    check(f"every rank's step time rises by {0.5 * delay:g} to {2 * delay:g} ms",
          all(0.5 * delay < rise < 2 * delay for rise in rises.values()), failures)
    check(f"the other ranks wait more than {0.5 * delay:g} ms per step",
          all(wait > 0.5 * delay for r, wait in waits.items() if r != 1), failures)
    check(f"the straggler waits less than {0.5 * delay:g} ms per step", waits[1] < 0.5 * delay, failures)
    check("the report names rank 1 slowest in every run", all(s["slowest_rank"] == 1 for _, s in pairs), failures)
    check("rank 1 is slowest in at least 90 % of the steps",
          median(lambda b, s: s["ranks"][1]["slowest_share"]) >= 0.9, failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
