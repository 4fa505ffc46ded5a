"""Plain sync, backup workers, local SGD and the parameter server, with and without a straggler.

    python benchmarks/stragglers.py [--ranks 8] [--straggler 2:30] [--jitter-ms 5] [--repeat 3] [--out DIR]

For each rank count, every configuration below runs ``--repeat`` times, in turn with the others
(a burst of load from elsewhere hits all of them alike), on the default model and data (digits,
MLP 64-128-64-10, batch 32 per rank, 40 epochs):

    sync                      sync --straggler R:MS          sync --jitter-ms J
    backup-workers 1          backup-workers 1 + straggler   backup-workers 1 + jitter
    local-sgd 4               local-sgd 4 + straggler
    async-ps                  async-ps + straggler

plus one run of ``--backup-workers 0 --local-sgd 1``, which must end with plain sync's parameter
digest. It prints a markdown table of medians [min - max] per rank count, the side-by-side
``python -m allreduce_kit.compare`` of the four modes with the straggler (first repeat), and
whether each target holds, on the medians over the repeats (S0: median step of plain sync, S1:
with the straggler):

1. backup workers with the straggler: median step <= S0 + 0.2 (S1 - S0); rank R dropped in at
   least 90 % of steps; test accuracy within 1 point of plain sync without a straggler;
2. with jitter: backup workers' median step below plain sync's (and by how much);
3. local SGD 4: allreduce calls per sample at most 1/4 of plain sync's (counted), test accuracy
   at least 95 % at 8 ranks;
4. ``--backup-workers 0 --local-sgd 1`` is bitwise plain sync.

The median step is the straggler report's ``step_ms_p50`` (with backup workers: of the ranks
whose gradient is in). Exit status 1 if a target does not hold. Runs use the ``mpiexec`` and
Python of the current environment. A loaded machine moves the figures: measure on a quiet one.
"""
import argparse
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from training_runs import check, train  # noqa: E402



def configs(straggler: str, jitter: float) -> List[tuple]:
    """(name, extra options) of every configuration at one rank count."""
    modes = [("sync", []), ("backup-workers 1", ["--backup-workers", "1"]), ("local-sgd 4", ["--local-sgd", "4"]),
             ("async-ps", ["--mode", "async-ps"])]
    out = []
    for name, extra in modes:
        out.append((name, extra))
        out.append((f"{name} straggler {straggler}", extra + ["--straggler", straggler]))
    for name, extra in modes[:2]:
        out.append((f"{name} jitter {jitter:g}", extra + ["--jitter-ms", f"{jitter:g}"]))
    return out


def slug(text: str) -> str:
    return text.replace(" ", "_").replace(":", "-")


def spread(values: List[float], digits: int = 2) -> str:
    if not values:
        return "-"
    f = lambda v: f"{v:,.{digits}f}"
    return f"{f(statistics.median(values))} [{f(min(values))} - {f(max(values))}]"


def train_run(ranks: int, epochs: int, extra: List[str], path: Path) -> Optional[dict]:
    return train(ranks, ["--epochs", epochs, *extra], path, 1800)


def step_ms(run: dict) -> Optional[float]:
    return (run.get("straggler") or {}).get("step_ms_p50")


def dropped(run: dict, rank: int) -> Optional[float]:
    b = (run.get("straggler") or {}).get("backup_workers")
    return b["ranks"][rank]["dropped_share"] if b else None


def calls(run: dict) -> Optional[float]:
    return (run.get("communication") or {}).get("calls_per_sample")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 2)[2])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8], help="rank counts (default 8; e.g. 4 8)")
    parser.add_argument("--straggler", default="2:30", metavar="R:MS", help="the injected straggler (default 2:30)")
    parser.add_argument("--jitter-ms", type=float, default=5.0, help="the jitter runs' --jitter-ms (default 5)")
    parser.add_argument("--epochs", type=int, default=40, help="--epochs of every run (default 40, the trainer's)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each configuration, interleaved (default 3)")
    parser.add_argument("--out", default="stragglers-runs", metavar="DIR", help="folder for every run's --json")
    args = parser.parse_args()
    rank_text, _, delay_text = args.straggler.partition(":")
    try:
        slow, delay = int(rank_text), float(delay_text)
    except ValueError:
        parser.error(f"argument --straggler: expected R:MS such as 2:30, got {args.straggler!r}")
    if args.repeat < 1 or args.epochs < 1 or args.jitter_ms <= 0 or delay <= 0:
        parser.error("need --repeat >= 1, --epochs >= 1, --jitter-ms > 0 and a straggler delay > 0")
    if any(p < 3 or not 1 <= slow < p for p in args.ranks):
        parser.error(f"argument --ranks: every rank count must be >= 3 and hold straggler rank {slow} as a "
                     f"worker (1..P-1, rank 0 is the parameter server of async-ps)")
    out = Path(args.out)
    out.mkdir(exist_ok=True)
    table = configs(args.straggler, args.jitter_ms)
    runs: Dict[tuple, List[dict]] = {(p, name): [] for p in args.ranks for name, _ in table}
    digests = {}
    for p in args.ranks:
        same = train_run(p, args.epochs, ["--backup-workers", "0", "--local-sgd", "1"], out / f"p{p}-equivalence.json")
        digests[p] = same["params_digest"] if same else None
    for r in range(args.repeat):
        for p in args.ranks:
            for name, extra in table:
                run = train_run(p, args.epochs, extra, out / f"p{p}-{slug(name)}-{r}.json")
                if run is not None:
                    runs[(p, name)].append(run)
                    print(f"# p={p} {name} [{r + 1}/{args.repeat}]: step {step_ms(run) or 0:.2f} ms, "
                          f"{100 * run['test_accuracy']:.1f}%", file=sys.stderr, flush=True)

    failures: list = []
    straggled = f"straggler {args.straggler}"
    for p in args.ranks:
        print(f"\n## {p} ranks, {args.epochs} epochs, medians [min - max] of {args.repeat} runs\n")
        print("| run | step ms | samples/s | test accuracy % | s to 95% | allreduce calls / sample | "
              f"rank {slow} dropped |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for name, _ in table:
            got = runs[(p, name)]
            pick = lambda f: [v for v in map(f, got) if v is not None]
            from allreduce_kit.compare import time_to_accuracy
            print(f"| {name} | {spread(pick(step_ms))} | {spread([g['summary']['samples_per_second'] for g in got], 0)} | "
                  f"{spread([100 * g['test_accuracy'] for g in got], 1)} | "
                  f"{spread(pick(lambda g: time_to_accuracy(g, 0.95)))} | {spread(pick(calls), 5)} | "
                  f"{spread([100 * v for v in pick(lambda g: dropped(g, slow))], 0)} |")
        med = lambda name, f: (statistics.median(v) if (v := [x for x in map(f, runs[(p, name)]) if x is not None])
                               else float("nan"))
        s0, s1 = med("sync", step_ms), med(f"sync {straggled}", step_ms)
        backup = med(f"backup-workers 1 {straggled}", step_ms)
        print(f"\nS0 {s0:.2f} ms, S1 {s1:.2f} ms, backup workers with the straggler {backup:.2f} ms: "
              f"{100 * (s1 - backup) / (s1 - s0) if s1 > s0 else float('nan'):.0f}% of the straggler's delay won back")
        jitter_plain = med(f"sync jitter {args.jitter_ms:g}", step_ms)
        jitter_backup = med(f"backup-workers 1 jitter {args.jitter_ms:g}", step_ms)
        acc = lambda name: med(name, lambda g: g["test_accuracy"])
        print(f"jitter {args.jitter_ms:g} ms: plain sync {jitter_plain:.2f} ms, backup workers {jitter_backup:.2f} ms "
              f"({jitter_plain - jitter_backup:+.2f} ms per step saved, {100 * jitter_backup / jitter_plain:.0f}% "
              f"of plain sync's step)")
        compared = [str(out / f"p{p}-{slug(name)}-0.json") for name in
                    ("sync", f"sync {straggled}", f"backup-workers 1 {straggled}", f"local-sgd 4 {straggled}",
                     f"async-ps {straggled}")]
        print(f"\n$ python -m allreduce_kit.compare {' '.join(compared)}")
        sys.stdout.flush()
        subprocess.run([sys.executable, "-m", "allreduce_kit.compare", *compared], check=False)
        print(f"\ntargets at {p} ranks:")
        check(f"backup workers with the straggler: median step {backup:.2f} <= S0 + 0.2 (S1 - S0) = "
              f"{s0 + 0.2 * (s1 - s0):.2f} ms", backup <= s0 + 0.2 * (s1 - s0), failures)
        share = med(f"backup-workers 1 {straggled}", lambda g: dropped(g, slow))
        check(f"rank {slow} dropped in {100 * share:.0f}% of steps (>= 90%)", share >= 0.9, failures)
        a0, a1 = acc("sync"), acc(f"backup-workers 1 {straggled}")
        check(f"backup workers' test accuracy {100 * a1:.2f}% within 1 point of plain sync's {100 * a0:.2f}%",
              a1 >= a0 - 0.01, failures)
        check(f"with jitter, backup workers' median step {jitter_backup:.2f} < plain sync's {jitter_plain:.2f} ms",
              jitter_backup < jitter_plain, failures)
        c0, c4 = med("sync", calls), med("local-sgd 4", calls)
        check(f"local SGD 4: {c4:.5f} allreduce calls per sample, {c0 / c4:.2f}x fewer than plain sync (>= 4x)",
              c0 / c4 >= 4 - 1e-9, failures)
        if p == 8:
            check(f"local SGD 4 test accuracy {100 * acc('local-sgd 4'):.2f}% >= 95% at 8 ranks",
                  acc("local-sgd 4") >= 0.95, failures)
        plain = [g["params_digest"] for g in runs[(p, "sync")]]
        check("--backup-workers 0 --local-sgd 1 ends with plain sync's parameters, bitwise",
              digests[p] is not None and all(d == digests[p] for d in plain), failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
