"""HTA (Holistic Trace Analysis) reads a trainer's trace as ``trace summary`` does; the summary names the straggler.

    python benchmarks/trace_hta.py [--ranks 4] [--straggler 2:30] [--trace-steps 1:21]
    python benchmarks/trace_hta.py --trace run.json       # a trace already written

Runs ``python -m allreduce_kit.train`` (digits, hidden 32, batch 16, one epoch) with
``--straggler RANK:MS --trace run.json --trace-steps A:B``, reads the file with
``python -m allreduce_kit.trace summary``'s code, splits it with ``trace split`` and loads the
folder with HTA's ``TraceAnalysis`` (``pip install HolisticTraceAnalysis``; the last step
included, times kept to the nanosecond: ``HTA_DISABLE_NS_ROUNDING=1``), then prints per rank
both readings of its time and their relative difference:

- compute: the summary's ``compute ms``; HTA's ``compute_time``;
- communication: the summary's ``collective ms``; HTA's ``non_compute_time``;
- idle: the time from the rank's first step's start to its last step's end less those two (from
  the summary's figures); HTA's ``idle_time`` (no kernel running, from its first to its last).

Targets (exit status 1 if one fails):

- every rank's compute and communication agree within 5%, and its idle within 5% of that span;
- the summary names the straggler the slowest rank in at least 95% of the recorded steps
  (a run of this script's own; not checked with ``--trace``).

HTA's own straggler guess (``get_potential_stragglers``) is printed beside it, unchecked: it
looks only at communication kernels longer than 1% of a step, and the late rank's are the short
ones (it arrives last and waits for no one), so it cannot name that rank.
"""
import argparse
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
from training_runs import check, train  # noqa: E402

from allreduce_kit.trace.split import write_split  # noqa: E402
from allreduce_kit.trace.summary import load, summarise  # noqa: E402

TRAIN_ARGS = ["--hidden", "32", "--batch-size", "16", "--epochs", "1"]
TOLERANCE = 0.05


def rank_and_ms(text: str) -> Tuple[int, float]:
    rank, _, ms = text.partition(":")
    try:
        return int(rank), float(ms)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected RANK:MS such as 2:30, got {text!r}") from None


def spans_us(document: dict) -> Dict[int, float]:
    """Per rank: from its first recorded step's start to its last one's end (us)."""
    first: Dict[int, float] = {}
    last: Dict[int, float] = {}
    for e in document["traceEvents"]:
        if e.get("ph") == "X" and e["name"].startswith("ProfilerStep#"):
            first[e["pid"]] = min(first.get(e["pid"], e["ts"]), e["ts"])
            last[e["pid"]] = max(last.get(e["pid"], 0.0), e["ts"] + e["dur"])
    return {r: last[r] - first[r] for r in first}


def hta_breakdown(folder: str):
    """HTA's temporal breakdown and straggler guess for the per-rank files in ``folder``."""
    # HTA rounds each event inward to whole microseconds unless told not to: a late rank's calls
    # last tens of microseconds, and our times are whole nanoseconds that nest exactly
    os.environ.setdefault("HTA_DISABLE_NS_ROUNDING", "1")
    try:
        from hta.trace_analysis import TraceAnalysis
    except ImportError:
        sys.exit("needs HTA: pip install HolisticTraceAnalysis")
    logging.getLogger("hta").setLevel(logging.ERROR)
    analysis = TraceAnalysis(trace_dir=folder, include_last_profiler_step=True)
    breakdown = analysis.get_temporal_breakdown(visualize=False)
    try:
        guess = analysis.get_potential_stragglers(num_candidates=1)
    except Exception as error:  # noqa: BLE001 - only printed
        guess = f"({type(error).__name__}: {error})"
    return breakdown, guess


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-9)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 2)[2])
    parser.add_argument("--ranks", type=int, default=4, help="ranks of the training run (default 4)")
    parser.add_argument("--straggler", type=rank_and_ms, default=(2, 30.0), metavar="RANK:MS",
                        help="the rank made late and by how much per step (default 2:30)")
    parser.add_argument("--trace-steps", default="1:21", metavar="A:B",
                        help="the steps recorded (default 1:21: neither the first step nor any call after the last "
                             "recorded step, which HTA would leave out or count differently)")
    parser.add_argument("--trace", default=None, metavar="PATH.json",
                        help="read this trace instead of running the trainer (no straggler target)")
    parser.add_argument("--keep", default=None, metavar="DIR", help="write the trace and the per-rank files here")
    args = parser.parse_args()
    if args.trace is None and not 0 <= args.straggler[0] < args.ranks:
        parser.error(f"argument --straggler: rank {args.straggler[0]} is not among the {args.ranks} ranks")

    failures: List[str] = []
    with tempfile.TemporaryDirectory() as scratch:
        workdir = args.keep or scratch
        os.makedirs(workdir, exist_ok=True)
        path = args.trace
        if path is None:
            path = os.path.join(workdir, "run.json")
            rank, ms = args.straggler
            report = train(args.ranks, [*TRAIN_ARGS, "--straggler", f"{rank}:{ms:g}", "--trace", path,
                                        "--trace-steps", args.trace_steps], Path(workdir) / "report.json", 900,
                           cwd=workdir)
            if report is None:
                return 1
        document = load(path)
        summary = summarise(document)
        folder = os.path.join(workdir, "ranks")
        write_split(document, folder)
        breakdown, guess = hta_breakdown(folder)
    spans = spans_us(document)
    hta = {int(row["rank"]): row for _, row in breakdown.iterrows()}

    print(f"{path}: {len(summary['steps'])} steps on every rank; ms from trace summary | HTA | relative difference")
    print(f"{'rank':>4} {'compute':>24} {'communication':>30} {'idle':>24}")
    for row in summary["ranks"]:
        r = row["rank"]
        ours = (row["compute_ms"] * 1e3, row["collective_ms"] * 1e3,
                spans.get(r, 0.0) - (row["compute_ms"] + row["collective_ms"]) * 1e3)
        theirs = (hta[r]["compute_time(us)"], hta[r]["non_compute_time(us)"], hta[r]["idle_time(us)"])
        cells = []
        for label, a, b in zip(("compute", "communication", "idle"), ours, theirs):
            diff = relative(a, b) if label != "idle" else abs(a - b) / max(spans.get(r, 0.0), 1e-9)
            cells.append(f"{a / 1e3:9.2f} {b / 1e3:9.2f} {100 * diff:4.1f}%")
            if diff > TOLERANCE:
                failures.append(f"rank {r}: {label} {a / 1e3:.2f} ms (summary) against {b / 1e3:.2f} ms (HTA)")
        print(f"{r:>4} {cells[0]:>24} {cells[1]:>30} {cells[2]:>24}")
    print("(idle: its difference relative to the rank's span of steps)")
    check(f"HTA's compute, communication and idle agree with trace summary within {TOLERANCE:.0%} on every rank",
          not failures, [])
    for failure in failures:
        print(f"    {failure}")

    steps = len(summary["steps"])
    named: Optional[int] = None
    if steps:
        named = max(summary["ranks"], key=lambda row: row["slowest_steps"])["rank"]
        share = next(row["slowest_steps"] for row in summary["ranks"] if row["rank"] == named) / steps
        print(f"trace summary: slowest rank {named} in {share:.0%} of {steps} steps; "
              f"HTA's get_potential_stragglers: {guess}")
    if args.trace is None:
        rank = args.straggler[0]
        mine = next(row["slowest_steps"] for row in summary["ranks"] if row["rank"] == rank)
        check(f"trace summary names rank {rank} (the straggler) in at least 95% of steps ({mine} of {steps})",
              steps > 0 and mine >= 0.95 * steps, failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
