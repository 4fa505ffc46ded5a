"""``python -m allreduce_kit.pipeline show --stages S --micro-batches M --schedule gpipe|1f1b|interleaved``:
a schedule's timeline, its bubble and its peak live micro-batches per stage. No MPI: the simulator
(``schedules.simulate``) runs the ranks' lists against each other with a cost per action.
"""
import argparse
import json
import sys
from typing import List, Optional

from ..cli import RankZeroParser
from . import schedules


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return value


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def build_parser() -> RankZeroParser:
    p = RankZeroParser(prog="python -m allreduce_kit.pipeline",
                       description="Pipeline schedules (docs/pipeline.md), simulated without MPI.")
    sub = p.add_subparsers(dest="command", required=True)
    show = sub.add_parser("show", help="print a schedule's timeline, bubble and peak live micro-batches")
    show.add_argument("--stages", type=_at_least_one, required=True, metavar="S", help="pipeline ranks")
    show.add_argument("--micro-batches", type=_at_least_one, required=True, metavar="M", help="micro-batches per step")
    show.add_argument("--schedule", choices=schedules.SCHEDULES, default="1f1b", help="the schedule")
    show.add_argument("--virtual-stages", type=_at_least_one, default=1, metavar="V",
                      help="with --schedule interleaved: stages per rank")
    show.add_argument("--backward-cost", type=_positive, default=2.0, metavar="X",
                      help="a backward's cost in forwards (a forward of a whole stage costs 1; of one of V "
                           "virtual stages, 1/V)")
    show.add_argument("--json", action="store_true", help="print the figures as JSON instead of the timeline")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    S, M, V = args.stages, args.micro_batches, args.virtual_stages
    try:
        lists = schedules.build(S, M, args.schedule, V)
    except ValueError as error:
        flag = "--virtual-stages" if "virtual_stages" in str(error) else "--micro-batches"
        parser.error(f"argument {flag}: {error}")
    t = schedules.simulate(lists, 1.0 / V, args.backward_cost / V)
    if args.json:
        print(json.dumps({"stages": S, "micro_batches": M, "schedule": args.schedule, "virtual_stages": V,
                          "makespan": t.makespan, "bubble": t.bubble, "idle_share": t.idle_share,
                          "peak_live": t.peak_live, "actions": [[str(a) for a in row] for row in lists]}, indent=2))
        return 0
    tick = 1.0 / V
    whole = all(abs(s / tick - round(s / tick)) < 1e-9 for row in t.spans for s, e, _ in row)
    print(f"{args.schedule}: {S} stages, {M} micro-batches" + (f", {V} virtual stages per rank" if V > 1 else "")
          + f"; a forward costs {tick:g}, a backward {args.backward_cost / V:g} (one column: {tick:g})")
    if whole:
        print(schedules.format_timeline(t, tick))
    else:
        print("(backward cost not a whole number of columns: timeline not drawn)")
    print(f"bubble (idle share of the step): {100 * t.bubble:.1f}%"
          + (f"; (S-1)/(M+S-1) = {100 * schedules.gpipe_idle_share(S, M):.1f}%" if V == 1 else ""))
    print("rank  idle share  peak live")
    for r in range(S):
        print(f"{r:>4}  {100 * t.idle_share[r]:9.1f}%  {t.peak_live[r]:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
