"""``python -m allreduce_kit.trace summary PATH.json [--json OUT]``: what a trace says per rank;
``python -m allreduce_kit.trace split PATH.json OUTDIR``: one file per rank, for readers of
per-rank profiler traces (``split.py``)."""
import argparse
import json
import sys
from typing import List, Optional

from .split import write_split
from .summary import load, summarise, table


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m allreduce_kit.trace",
                                     description="Read a trace written by --trace or ALLREDUCE_KIT_TRACE.")
    commands = parser.add_subparsers(dest="command", required=True)
    summary = commands.add_parser("summary", help="per rank: time in compute, in collectives, waiting; "
                                                  "the waits each rank caused; the slowest rank per step")
    summary.add_argument("path", metavar="PATH.json")
    summary.add_argument("--json", metavar="OUT", default=None, help="also write the summary as JSON to OUT")
    split = commands.add_parser("split", help="write OUTDIR/rank-R.json for every rank, the per-rank form that "
                                              "Holistic Trace Analysis loads (compute and collectives as kernels)")
    split.add_argument("path", metavar="PATH.json")
    split.add_argument("outdir", metavar="OUTDIR", help="the folder to write into (made if missing)")
    args = parser.parse_args(argv)
    try:
        document = load(args.path)
    except (OSError, ValueError) as bad:
        parser.error(f"argument PATH.json: {bad}")
    if args.command == "split":
        try:
            paths = write_split(document, args.outdir)
        except OSError as bad:
            parser.error(f"argument OUTDIR: {bad}")
        print(f"wrote {len(paths)} files into {args.outdir}: {', '.join(p.rsplit('/', 1)[-1] for p in paths)}")
        return 0
    result = summarise(document)
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
