"""Allreduce across the emulated cluster: ``auto`` against MPI's own ``Allreduce``, per layout;
or another collective (``--collective reduce_scatter|allgather|broadcast``) against MPI's own.

    python benchmarks/multinode.py [--repeat 3] [--only 2x1,2x4,4x2] [--sizes large,small] [--json out.json]
    python benchmarks/multinode.py --collective reduce_scatter --only 2x4 --sizes large

As root. For each layout (nodes x ranks per node at a link rate) it makes the cluster
(``python -m allreduce_kit.cluster up``), measures the link (``status``), and runs the bench
``--repeat`` times with block and with round-robin placement, in turn, each run with ``mpi``,
``auto``, ``hierarchical`` and the flat ``ring`` in it: 16 MiB and 64 MiB (``large``), 8 B to
1 KiB (``small``). It prints, per layout, placement, size and algorithm, the median over the
runs of the median time per call, the time against MPI's in the same runs, and "link %"
(docs/multinode.md). With ``--collective`` each run has ``mpi`` and ``auto`` in it (``auto`` runs
the collective's ``hierarchical`` across nodes for large messages), and "link %" counts what each
node's link must carry for that collective: (N-1)/N of the whole buffer for ``reduce_scatter`` and
``allgather``, the whole buffer for ``broadcast``. The layouts are those of docs/multinode.md:

- ``2x1``: 2 nodes x 1 rank at 1 Gbit/s;
- ``2x4``: 2 nodes x 4 ranks at 250 Mbit/s;
- ``4x2``: 4 nodes x 2 ranks at 250 Mbit/s.

The cluster is removed at the end (also on an error).
"""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

LAYOUTS = {"2x1": (2, 1, "1gbit"), "2x4": (2, 4, "250mbit"), "4x2": (4, 2, "250mbit")}
SIZES = {"large": ["-b", "16M", "-e", "64M", "-f", "4", "-n", "5", "-w", "2"],
         "small": ["-b", "8", "-e", "1K", "-f", "2", "-n", "20", "-w", "5"]}
ALGORITHMS = "mpi,auto,hierarchical,ring"
#: What runs with ``--collective`` other than allreduce: MPI's own call and ``auto``.
COLLECTIVE_ALGORITHMS = "mpi,auto"
COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast")
CLUSTER = [sys.executable, "-m", "allreduce_kit.cluster"]


def cluster(*args: str, timeout: float = 600) -> str:
    done = subprocess.run([*CLUSTER, *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise SystemExit(f"cluster {' '.join(args)} failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return done.stdout


def bench(ranks: int, placement: str, sizes: str, out: Path, collective: str = "allreduce") -> dict:
    which = (["-a", ALGORITHMS] if collective == "allreduce"
             else ["--collective", collective, "-a", COLLECTIVE_ALGORITHMS])
    cluster("run", "-n", str(ranks), "--placement", placement, "--timeout", "900", "--",
            sys.executable, "-m", "allreduce_kit.bench", *SIZES[sizes], *which, "--json", str(out),
            timeout=1000)
    return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="bench runs per layout, placement and size range")
    parser.add_argument("--only", default=",".join(LAYOUTS), help="layouts to run: " + ", ".join(LAYOUTS))
    parser.add_argument("--sizes", default="large,small", help="size ranges: large (16M, 64M), small (8 B to 1 KiB)")
    parser.add_argument("--collective", default="allreduce", choices=COLLECTIVES,
                        help="the collective to measure (default allreduce)")
    parser.add_argument("--json", metavar="PATH", help="write the medians per layout, placement, size and algorithm "
                                                        "as JSON")
    args = parser.parse_args()
    layouts = [n.strip() for n in args.only.split(",") if n.strip()]
    ranges = [s.strip() for s in args.sizes.split(",") if s.strip()]
    if args.repeat < 1 or not set(layouts) <= set(LAYOUTS) or not layouts or not set(ranges) <= set(SIZES) or not ranges:
        parser.error(f"--repeat >= 1, --only from {', '.join(LAYOUTS)}, --sizes from {', '.join(SIZES)}")
    from allreduce_kit.cluster import why_not_here

    problem = why_not_here()
    if problem:
        parser.exit(2, f"{parser.prog}: error: {problem}\n")
    results = []
    try:
        for name in layouts:
            nodes, per_node, rate = LAYOUTS[name]
            cluster("down")
            cluster("up", "--nodes", str(nodes), "--link", rate, "--no-measure")
            print(cluster("status", "--seconds", "3"), end="", flush=True)
            with tempfile.TemporaryDirectory() as tmp:
                for sizes in ranges:
                    runs = {"block": [], "round-robin": []}
                    for k in range(args.repeat):
                        for placement in runs:  # in turn, so load from elsewhere hits both alike
                            runs[placement].append(bench(nodes * per_node, placement, sizes,
                                                         Path(tmp) / f"{placement}-{k}.json", args.collective))
                    for placement, payloads in runs.items():
                        results.append(summarise(name, rate, placement, payloads, args.collective))
                        print_table(results[-1])
    finally:
        cluster("down")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
        print(f"# wrote {args.json}")
    return 0


def summarise(layout: str, rate: str, placement: str, payloads: list, collective: str = "allreduce") -> dict:
    """Medians over the runs, per size and algorithm; each run's time against its own MPI row."""
    cells: dict = {}
    for payload in payloads:
        mpi = {r["size"]: r["time_us"] for r in payload["rows"] if r["algorithm"] == "mpi"}
        for row in payload["rows"]:
            cell = cells.setdefault((row["size"], row["algorithm"]), {"time": [], "vs_mpi": [], "link": [], "chosen": set()})
            cell["time"].append(row["time_us"])
            cell["vs_mpi"].append(row["time_us"] / mpi[row["size"]])
            cell["chosen"].add(row["chosen"])
            if row.get("link_pct") is not None:
                cell["link"].append(row["link_pct"])
    pre = payloads[0]["preamble"]
    return {"collective": collective, "layout": layout, "rate": rate, "placement": placement, "runs": len(payloads),
            "link_bits_per_second": pre.get("link_bits_per_second"), "ranks_per_node": pre.get("ranks_per_node"),
            "rows": [{"size": size, "algorithm": algorithm, "chosen": sorted(c["chosen"]),
                      "time_us": statistics.median(c["time"]), "vs_mpi": statistics.median(c["vs_mpi"]),
                      "vs_mpi_max": max(c["vs_mpi"]),
                      "link_pct": statistics.median(c["link"]) if c["link"] else None}
                     for (size, algorithm), c in sorted(cells.items())]}


def print_table(result: dict) -> None:
    bits = result["link_bits_per_second"]
    print(f"\n## {result.get('collective', 'allreduce')}, {result['layout']} ({result['ranks_per_node']} ranks per node) "
          f"at {result['rate']}, "
          f"{result['placement']}, link {bits / 1e6:.0f} Mbit/s measured, medians of {result['runs']} runs")
    print(f"| {'size':>10} | {'algorithm':<24} | {'time (us)':>12} | {'x MPI':>6} | {'worst':>6} | {'link %':>6} |")
    print(f"|{'-' * 12}|{'-' * 26}|{'-' * 14}|{'-' * 8}|{'-' * 8}|{'-' * 8}|")
    for row in result["rows"]:
        name = row["algorithm"] if row["algorithm"] != "auto" else f"auto({'/'.join(row['chosen'])})"
        link = f"{row['link_pct']:.0f}" if row["link_pct"] is not None else "-"
        print(f"| {row['size']:>10} | {name:<24} | {row['time_us']:>12.1f} | {row['vs_mpi']:>5.2f}x | "
              f"{row['vs_mpi_max']:>5.2f}x | {link:>6} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
