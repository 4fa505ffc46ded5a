"""``python -m allreduce_kit.bench``: allreduce algorithms side by side with MPI's own Allreduce.

Prints, on rank 0, a preamble and an nccl-tests-style table: one row per message size and
algorithm with the slowest rank's time per call (median, min and max over samples), algorithm
and bus bandwidth, and ``#wrong``, the elements that differ from MPI's result. Then the ratios
of median times to MPI's, per size.

  mpiexec -n 4 python -m allreduce_kit.bench -b 8 -e 64M -f 2
  mpiexec -n 4 python -m allreduce_kit.bench --collective reduce_scatter   # or allgather, broadcast
  mpiexec -n 4 python -m allreduce_kit.bench --compression fp16   # 16-bit messages beside MPI's float32 call
  mpiexec -n 4 python -m allreduce_kit.bench --tune          # crossover points for auto
  python -m allreduce_kit.bench --fit p2.json p4.json p8.json  # fit alpha, beta, gamma
  mpiexec -n 2 python -m allreduce_kit.bench --overlap        # iallreduce of 16 MiB behind 20 ms of numpy
"""
if __name__ == "__main__":  # abort-on-error and heavy yield, asked for before MPI starts
    from ..run import prepare

    prepare()

import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
from typing import List, Optional  # noqa: E402

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from .. import compression as wire_formats, config, kernels, online, selection, stall  # noqa: E402
from ..cli import settings_problem  # noqa: E402
from ..algorithms import direct
from ..cli import RankZeroParser, output_problem, outputs_problem, plural, say, write_json
from ..comm import library_comm
from ..launch import check_launch
from ..reduction import OPS, use_kernels
from ..threads import limit_threads
from ..trace import session as trace_session
from . import collectives
from . import fit as cost
from . import network, output
from . import overlap as overlapping
from ..plots import NO_MATPLOTLIB, mpi_name
from .plot import have_matplotlib, plot
from .sweep import available, ratios, sweep
from .timing import MAX_BATCH, SAMPLE_SECONDS
from .tune import crossovers

PROG = "python -m allreduce_kit.bench"
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_bytes(text: str) -> int:
    """``4``, ``64K``, ``16M``, ``1G`` (powers of 1024; a trailing ``B`` or ``iB`` is allowed)."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not match or int(match.group(1)) <= 0:
        raise ValueError(f"{text!r} is not a positive size such as 4, 64K, 16M or 1G")
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def human(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def message_sizes(low: int, high: int, factor: int, itemsize: int) -> List[int]:
    """low, low*f, ... up to high, each rounded down to whole elements (at least one)."""
    sizes, size = [], low
    while size <= high:
        sizes.append(max(itemsize, size // itemsize * itemsize))
        size *= factor
    return sorted(set(sizes))


def build_parser() -> RankZeroParser:
    names = available()
    parser = RankZeroParser(prog=PROG, description="Allreduce algorithms side by side with MPI's own Allreduce, in "
                            "nccl-tests' table layout; time is the slowest rank's per call (median over samples).",
                            epilog="Algorithms: " + ", ".join(names) + ". Run under mpiexec; output on rank 0.")
    parser.add_argument("--collective", default="allreduce", choices=("allreduce",) + collectives.COLLECTIVES,
                        help="which collective to measure; sizes and busbw as nccl-tests define them for it "
                             "(reduce_scatter, allgather: size is the whole buffer, busbw = algbw (p-1)/p; "
                             "broadcast: busbw = algbw)")
    parser.add_argument("--compression", default="none", choices=wire_formats.COMPRESSIONS,
                        help="send 16-bit values (float32, ops sum, mean, max, min): every algorithm that can, "
                             "and auto; mpi stays MPI's own float32 Allreduce")
    parser.add_argument("--root", type=int, default=0, help="--collective broadcast: the rank it broadcasts from")
    parser.add_argument("-b", "--minbytes", default="4", help="smallest message, bytes per rank (K, M, G suffixes)")
    parser.add_argument("-e", "--maxbytes", default="64M", help="largest message, bytes per rank")
    parser.add_argument("-f", "--stepfactor", type=int, default=2, help="multiply the size by this between rows")
    parser.add_argument("-n", "--iters", type=int, default=20,
                        help="timed samples per row (the median is reported)")
    parser.add_argument("-w", "--warmup_iters", type=int, default=5, help="untimed calls before the timed ones")
    parser.add_argument("-d", "--datatype", default="float32", choices=[d.name for d in kernels.DTYPES],
                        help="element type")
    parser.add_argument("-o", "--op", default="sum", choices=OPS, help="reduction operation")
    parser.add_argument("-a", "--algorithms", default="all",
                        help="comma-separated names, or 'all' (every registered algorithm, auto and mpi)")
    parser.add_argument("--batch", type=int, default=0,
                        help=f"calls per timed sample; 0: as many as the warm-up says fit in {SAMPLE_SECONDS * 1e3:g} ms "
                             f"(1 to {MAX_BATCH})")
    parser.add_argument("--kernel", default="numba", choices=("numba", "numpy"),
                        help="do the reduction step with the numba kernels or plain numpy")
    parser.add_argument("--json", metavar="PATH", help="write the preamble, every row and the ratios as JSON "
                                                        "(every output path is checked before measuring)")
    parser.add_argument("--csv", metavar="PATH", help="write every row as CSV")
    parser.add_argument("--trace", metavar="PATH.json", help="write one Chrome trace of every rank's calls on rank 0's "
                                                           "clock (docs/trace.md); the file grows with every call")
    parser.add_argument("--plot", metavar="PATH.png", help="plot busbw and time against size as a PNG, written to "
                                                          "exactly PATH.png (a path not ending in .png is refused; "
                                                          "needs matplotlib)")
    parser.add_argument("--tune", metavar="PATH", nargs="?", const=str(selection.default_path()),
                        help=f"write auto's crossover points for this rank count to PATH (default: "
                             f"{selection.default_path()}; auto reads $ALLREDUCE_KIT_TUNING if set)")
    parser.add_argument("--fit", metavar="JSON", nargs="*",
                        help="fit the alpha-beta-gamma model by least squares: to this run's rows, or, given "
                             "files written by --json, to theirs (no measuring then)")
    parser.add_argument("--link-gbps", type=float, default=None, metavar="GBIT/S",
                        help="a node link's bandwidth, for the 'link %%' column of a run across nodes (default: what "
                             "the emulated cluster measured, python -m allreduce_kit.cluster status)")
    parser.add_argument("--stall-timeout", type=float, default=None, metavar="SECONDS",
                        help="a call still waiting after this long names the ranks that have not arrived and "
                             "aborts the job (0: off; docs/reliability.md) (default: $ALLREDUCE_KIT_STALL_TIMEOUT, "
                             "else 60)")
    parser.add_argument("--overlap", metavar="SIZE", nargs="?", const="16M", default=None,
                        help="instead of the table: time a nonblocking allreduce of SIZE bytes per rank (default "
                             "16M) started before --compute-ms of numpy work, against each alone; -a names the "
                             "algorithms for iallreduce ('mpi': MPI's Iallreduce, polled; default auto,mpi)")
    parser.add_argument("--compute-ms", type=float, default=20.0, metavar="MS",
                        help="--overlap: milliseconds of numpy work per rank")
    return parser


def check_args(parser: RankZeroParser, args) -> None:
    """Every rank reaches the same verdict; ``parser.error`` exits 2 with one message."""
    try:
        args.low, args.high = parse_bytes(args.minbytes), parse_bytes(args.maxbytes)
    except ValueError as error:
        parser.error(f"-b/-e: {error}")
    if args.low > args.high:
        parser.error(f"-b/--minbytes ({args.minbytes}) is larger than -e/--maxbytes ({args.maxbytes})")
    if args.stepfactor < 2:
        parser.error(f"-f/--stepfactor must be at least 2, got {args.stepfactor}")
    if args.iters < 1:
        parser.error(f"-n/--iters must be at least 1, got {args.iters}")
    if args.warmup_iters < 0:
        parser.error(f"-w/--warmup_iters must be at least 0, got {args.warmup_iters}")
    if args.warmup_iters < 1 and not args.batch:
        parser.error("-w/--warmup_iters 0 needs a fixed --batch (the warm-up sets the batch otherwise)")
    if args.batch < 0:
        parser.error(f"--batch must be 0 (automatic) or positive, got {args.batch}")
    if args.stall_timeout is not None and not 0 <= args.stall_timeout < float("inf"):
        parser.error(f"--stall-timeout must be >= 0 seconds (0: off), got {args.stall_timeout}")
    names = available() if args.collective == "allreduce" else collectives.available(args.collective)
    if args.collective != "allreduce":
        for flag, given in (("--tune", args.tune), ("--fit", args.fit is not None), ("--plot", args.plot)):
            if given:
                parser.error(f"{flag} is for --collective allreduce only")
        if args.collective != "reduce_scatter" and args.op != "sum":
            parser.error(f"-o/--op: --collective {args.collective} reduces nothing")
    if args.compression != "none":
        for flag, value, wrong in (("--collective", args.collective, args.collective not in ("allreduce",
                                                                                               "reduce_scatter")),
                                   ("-d/--datatype", args.datatype, args.datatype != "float32"),
                                   ("-o/--op", args.op, args.op not in wire_formats.OPS),
                                   ("--tune", "", args.tune), ("--overlap", "", args.overlap is not None),
                                   ("--kernel", args.kernel, args.kernel != "numba")):
            if wrong:
                parser.error(f"--compression {args.compression} cannot go with {flag} {value}".rstrip()
                             + f": it compresses allreduce and reduce_scatter of float32 with op "
                               f"{', '.join(wire_formats.OPS)}")
        compressed = wire_formats.COMPRESSED if args.collective == "allreduce" else wire_formats.REDUCE_SCATTER
        names = [n for n in names if n in compressed or n in ("auto", "mpi")]
    if args.root != 0 and args.collective != "broadcast":
        parser.error("--root is for --collective broadcast only")
    if not 0 <= args.root < MPI.COMM_WORLD.Get_size():
        parser.error(f"--root must be a rank in 0..{MPI.COMM_WORLD.Get_size() - 1}, got {args.root}")
    if args.algorithms == "all":
        args.names = [n for n in names if not (args.tune and n == "auto")]
    else:
        args.names = [n.strip() for n in args.algorithms.split(",") if n.strip()]
        unknown = [n for n in args.names if n not in names]
        if unknown or not args.names:
            parser.error(f"-a/--algorithms: unknown {', '.join(map(repr, unknown)) or 'empty list'}; "
                         f"choose from {', '.join(names)} or 'all'")
        args.names = list(dict.fromkeys(args.names))
    if args.tune and not [n for n in args.names if n != "auto"]:
        parser.error("--tune: -a must name at least one algorithm other than auto (auto is what it tunes)")
    if args.link_gbps is not None and not 0 < args.link_gbps < float("inf"):
        parser.error(f"--link-gbps must be a positive number of Gbit/s, got {args.link_gbps}")
    if args.plot and not have_matplotlib():
        parser.error(f"--plot: {NO_MATPLOTLIB}")
    if args.overlap is not None:
        try:
            args.overlap_bytes = parse_bytes(args.overlap)
        except ValueError as error:
            parser.error(f"--overlap: {error}")
        if not 0 < args.compute_ms < float("inf"):
            parser.error(f"--compute-ms must be a positive number of milliseconds, got {args.compute_ms}")
        if args.tune or args.fit is not None or args.plot or args.csv:
            parser.error("--overlap prints its own rows: it cannot be combined with --tune, --fit, --plot or --csv")
        if args.algorithms == "all":
            args.names = ["auto", "mpi"]


def tune_file_problem(path: str) -> Optional[str]:
    """Why ``--tune PATH`` could not be written after measuring, or None: the file (whose folders
    are created) must be writable, and one already there must be a tuning file (its other rank
    counts' rules are kept)."""
    problem = output_problem("--tune", path, make_parents=True)
    if problem or not os.path.exists(path):
        return problem
    try:
        with open(path, encoding="utf-8") as handle:
            selection.parse(json.load(handle), f"tuning file {path}")
    except (OSError, ValueError) as error:
        return f"argument --tune: {path} is there and is not a tuning file to add to ({error}); move it away"
    return None


def avg_busbw(rows) -> dict:
    """nccl-tests' closing figure per algorithm: the mean bus bandwidth over the sizes (GB/s)."""
    by_name: dict = {}
    for row in rows:
        by_name.setdefault(row.algorithm, []).append(row.busbw)
    return {name: float(np.mean(values)) for name, values in by_name.items()}


def agree(comm: MPI.Intracomm, problem: Optional[str]) -> None:
    """Rank 0's verdict on something only it checked; every rank exits 2 if it found a problem."""
    problem = comm.bcast(problem, root=0)
    if problem:
        say(f"{PROG}: error: {problem}", file=sys.stderr)
        raise SystemExit(2)


def fit_files(comm: MPI.Intracomm, args) -> int:
    """``--fit a.json b.json``: fit the model to rows measured earlier."""
    rows, problem = [], None
    if comm.Get_rank() == 0:
        for path in args.fit:
            try:
                with open(path, encoding="utf-8") as handle:
                    rows.extend(json.load(handle)["rows"])
            except (OSError, ValueError, KeyError, TypeError) as error:
                problem = f"--fit: cannot read rows from {path}: {error}"
                break
    agree(comm, problem)
    if comm.Get_rank() == 0:
        report_fit(rows, args)
    return 0


def report_fit(rows: List[dict], args) -> dict:
    """Fit, print the parameters and predicted beside measured; add both to the --json file."""
    try:
        params = cost.fit(cost.points_from(rows))
    except ValueError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        raise SystemExit(2)
    print("#\n# alpha-beta-gamma fit (least squares on relative error, all rank counts together):")
    print("# " + cost.describe(params))
    per_p = {}
    for p in sorted({r["ranks"] for r in rows}):
        try:
            per_p[p] = cost.fit(cost.points_from([r for r in rows if r["ranks"] == p]))
            print(f"#   p = {p} alone: " + cost.describe(per_p[p]))
        except ValueError:
            pass
    print("#\n# predicted beside measured, median time per call (each rank count's own fit; "
          "--json also has the joint fit's):")
    for p in sorted(per_p):
        for line in cost.comparison(per_p[p], [r for r in rows if r["ranks"] == p])[(0 if p == min(per_p) else 1):]:
            print(line)
    result = {"fit": params, "fit_per_ranks": {str(p): v for p, v in per_p.items()},
              "predicted": [dict(ranks=r["ranks"], size=r["size"], algorithm=r["algorithm"], measured_us=r["time_us"],
                                 predicted_us=cost.predict(per_p.get(r["ranks"], params), r["algorithm"], r["ranks"],
                                                           r["size"]) * 1e6,
                                 predicted_joint_us=cost.predict(params, r["algorithm"], r["ranks"], r["size"]) * 1e6)
                            for r in rows if r["algorithm"] in cost.MODELLED]}
    if args.json and args.fit:
        write_json(args.json, result)
    return result


def direct_transfers(comm: MPI.Intracomm, kernel: str) -> bool:
    """Whether ``ring``, ``rabenseifner`` and ``two_shot`` will read and write peers' buffers (``direct.py``) in this
    run: only on one node, where the check passes, and with the numba kernels (the direct loops
    fold in compiled code, so ``--kernel numpy`` sends messages). Collective."""
    return direct.peers_for(library_comm(comm)) is not None and kernel == "numba"


def preamble(comm: MPI.Intracomm, args, threads: int, auto_source: str, tuning: str = "off") -> dict:
    hosts = sorted(set(comm.allgather(MPI.Get_processor_name() or socket.gethostname())))
    p = comm.Get_size()
    info = {
        "mpi_library": MPI.Get_library_version().strip().splitlines()[0],
        "mpi_name": mpi_name(MPI.Get_library_version()),
        "mpi4py": __import__("mpi4py").__version__,
        "ranks": p, "hosts": hosts, "numba_threads_per_rank": threads, "kernel": args.kernel,
        "dtype": args.datatype, "op": args.op, "min_bytes": args.low, "max_bytes": args.high,
        "step_factor": args.stepfactor, "warmup": args.warmup_iters, "samples": args.iters,
        "batch": args.batch or f"auto: calls fitting in {SAMPLE_SECONDS * 1e3:g} ms at the fastest warm-up pace of the size, 1..{MAX_BATCH}", "algorithms": args.names,
        "auto_table": auto_source,
        "online_tuning": tuning, "compression": args.compression,
        "timing": "per sample: restore input (untimed), barrier, then batch back-to-back calls, barrier (untimed); time per call = "
                  "slowest rank's; median, min and max over samples",
    }
    say(f"# {PROG}: allreduce, {plural(p, 'rank')} on {plural(len(hosts), 'host')} ({', '.join(hosts)})")
    say(f"# MPI: {info['mpi_name']} (mpi4py {info['mpi4py']})")
    say(f"# dtype {args.datatype}, op {args.op}, {human(args.low)} to {human(args.high)} x{args.stepfactor}; "
        f"reduction kernels: {args.kernel}, {plural(threads, 'thread')} per rank")
    say(f"# {args.warmup_iters} warm-up calls, then {args.iters} timed samples per row; a sample is a barrier and "
        f"then {'%d calls' % args.batch if args.batch else f'as many calls as fit in {SAMPLE_SECONDS * 1e3:g} ms at the fastest warm-up pace of the size, the same for every algorithm (1..{MAX_BATCH}; --json has each)'}"
        f" back to back, then a barrier again (untimed)")
    say("# time = the slowest rank's time per call: median, min and max over samples. algbw = size / time, "
        "busbw = algbw * 2(p-1)/p")
    if args.compression != "none":
        say(f"# compression {args.compression}: every row but mpi sends 16-bit values (size counts the float32 "
            f"buffer), #wrong against MPI's result rounded to {args.compression}; mpi = MPI's float32 Allreduce")
    mpi_row = ("allreduce(algorithm='mpi'), as auto would call it (--tune)" if args.tune
               else "mpi4py's Allreduce called directly")
    info["mpi_row"] = mpi_row
    info["direct_transfers"] = direct_transfers(comm, args.kernel)
    how = "direct reads and writes between the ranks of the node" if info["direct_transfers"] else "messages"
    say(f"# ring, rabenseifner and two_shot move data by {how} ({direct.ENV}={os.environ.get(direct.ENV, 'unset')}, "
        f"kernels {args.kernel})")
    say(f"# #wrong = elements differing from MPI's Allreduce (summed over ranks); mpi = {mpi_row}; the others go "
        f"through allreduce(); auto's table: {auto_source}")
    if "auto" in args.names:
        say(f"# auto tunes online: {tuning} ({config.ONLINE_TUNING.name}); " + (
            "at each size auto's exploring calls (every one checked) run before its warm-up, in runs as long as "
            "a sample's, each on a restored input, so its row times the choice it settled on" if tuning != "off"
            else "its row times the table's choice"))
    layout = library_comm(comm).layout
    link = network.link_bandwidth(layout, args.link_gbps)
    info.update(nodes=layout.nodes, node_hosts=list(layout.hosts), ranks_per_node=list(layout.ranks_per_node),
                link_bits_per_second=link[0] if link else None, link_source=link[1] if link else None)
    for text in network.describe(layout, link):
        say(f"# {text}")
    say("#")
    return info


def overlap_main(comm: MPI.Intracomm, args) -> int:
    """``--overlap``: the nonblocking allreduce behind numpy work, against each alone (``overlap.py``)."""
    dtype = np.dtype(args.datatype)
    threads = limit_threads(comm)
    kernels.warm_up([dtype], [args.op])
    hosts = sorted(set(comm.allgather(MPI.Get_processor_name() or socket.gethostname())))
    p = comm.Get_size()
    info = {"mpi_library": MPI.Get_library_version().strip().splitlines()[0],
            "mpi_name": mpi_name(MPI.Get_library_version()), "ranks": p, "hosts": hosts,
            "numba_threads_per_rank": threads, "cores": library_comm(comm).layout.cores_per_node[0],
            "oversubscribed": library_comm(comm).oversubscribed, "dtype": args.datatype, "op": args.op,
            "size": args.overlap_bytes, "compute_ms": args.compute_ms, "warmup": args.warmup_iters,
            "samples": args.iters, "methods": args.names,
            "timing": "each of compute alone, collective alone (started then waited for) and both (started, compute, "
                      "wait): barrier, run, slowest rank's time; median over samples; methods and timings take turns; "
                      "ratio = both / the longer alone"}
    say(f"# {PROG} --overlap: nonblocking allreduce of {human(args.overlap_bytes)} ({args.datatype} {args.op}) started "
        f"before {args.compute_ms:g} ms of numpy work, {plural(p, 'rank')} on {plural(len(hosts), 'host')} "
        f"({', '.join(hosts)})")
    say(f"# MPI: {info['mpi_name']}; {info['cores']} cores per node"
        + ("; more ranks than cores: a rank's progress thread competes with ranks for a core" if info["oversubscribed"]
           else ""))
    say(f"# {args.warmup_iters} warm-up and {args.iters} timed samples of each timing (median); time = the slowest "
        f"rank's; ratio = both / the longer alone (1.00: fully hidden; serial: the ratio with no overlap)")
    say("#\n" + overlapping.HEADER)
    rows = overlapping.measure(comm, args.overlap_bytes, dtype, args.op, args.names, args.compute_ms, args.iters,
                               args.warmup_iters)
    for row in rows:
        say(overlapping.line(row))
    if comm.Get_rank() == 0 and args.json:
        write_json(args.json, {"preamble": info, "overlap": rows})
        print(f"# wrote {args.json}", flush=True)
    comm.Barrier()
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    """The bench; with --trace, rank 0 then writes the trace of every rank's calls (collective)."""
    status = _measure(argv)
    if trace_session.tracing():
        path = trace_session.current_path()
        size = trace_session.finish()
        if size is not None:
            print(f"# wrote {path} ({size / 1e6:.2f} MB; python -m allreduce_kit.trace summary {path})", flush=True)
    return status


def _measure(argv: Optional[List[str]] = None) -> int:
    check_launch(prog="python -m allreduce_kit.bench")  # N unconnected copies (srun --mpi=none) stop here
    comm = MPI.COMM_WORLD
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.fit and args.collective != "allreduce":
        parser.error("--fit is for --collective allreduce only")
    if args.fit:
        args.names, args.low, args.high = [], 0, 0
        if args.tune:
            parser.error("--fit with files only reads them; --tune measures: use one at a time")
        agree(comm, output_problem("--json", args.json) if comm.Get_rank() == 0 else None)
        return fit_files(comm, args)
    check_args(parser, args)
    problem = settings_problem()
    if comm.Get_rank() == 0:
        # Every output checked now, not after an hour of measuring.
        problem = problem or outputs_problem((("--json", args.json), ("--csv", args.csv),
                                              ("--plot", args.plot, ".png"), ("--trace", args.trace)))
        if not problem and args.tune:
            problem = tune_file_problem(args.tune)
        try:  # a bad tuning file named by the environment is an input error, not a crash
            selection.load()
            if config.read(config.ONLINE_TUNING) == "save":
                online.save_path()
        except ValueError as error:
            problem = problem or f"auto: {error}"
    agree(comm, problem)
    if args.stall_timeout is not None:
        stall.set_stall_timeout(args.stall_timeout)
    if args.trace:                                     # --trace: from here; main writes it at the end
        trace_session.start(args.trace, comm=comm)
    if args.overlap is not None:
        return overlap_main(comm, args)

    dtype = np.dtype(args.datatype)
    sizes = message_sizes(args.low, args.high, args.stepfactor, dtype.itemsize)
    threads = limit_threads(comm)
    if args.kernel == "numpy":
        from . import numpy_kernels
        use_kernels(numpy_kernels)
    kernels.warm_up([dtype], [args.op])
    if args.collective != "allreduce":
        return run_collective(comm, parser, args, dtype, sizes, threads)
    lib = library_comm(comm)
    tuner = online.tuner_for(lib) if lib.Get_size() > 1 else None
    info = preamble(comm, args, threads, selection.source_for(lib), tuner.mode if tuner else "off")
    # Every option as typed or defaulted, under its name (the preamble's fields say what they meant).
    info["options"] = {a.dest: getattr(args, a.dest) for a in parser._actions if a.dest not in ("help", "version")}
    info["options"]["stall_timeout"] = stall.default_timeout_now()
    nodes, link_bits = info["nodes"], info["link_bits_per_second"]

    def link_pct(row) -> Optional[float]:
        return network.link_percent(row.size, row.time_us, nodes, link_bits) if link_bits else None

    say(output.header(link=link_bits is not None))
    rows = sweep(comm, sizes, dtype, args.op, args.names, args.iters, args.warmup_iters, args.batch,
                 on_row=lambda row: say(output.line(row, link_pct(row))), mpi_direct=not args.tune,
                 compression=args.compression)
    table = ratios(rows)
    say(output.summary(table))
    wrong = sum(row.wrong for row in rows)
    average = avg_busbw(rows)
    say(output.closing(wrong, average))

    payload = {"preamble": info, "rows": [dict(r.as_dict(), **({"link_pct": link_pct(r)} if link_bits else {}))
                                          for r in rows],
               "ratios": {str(s): v for s, v in table.items()},
               "wrong_total": wrong, "avg_busbw": average}
    if args.tune:
        rules = crossovers(rows)
        if comm.Get_rank() == 0:
            note = {"mpi_library": info["mpi_library"], "hosts": info["hosts"], "dtype": args.datatype,
                    "op": args.op, "sizes": [sizes[0], sizes[-1]], "samples": args.iters}
            selection.write(args.tune, comm.Get_size(), rules, note)
        say(f"#\n# auto's crossover points for {plural(comm.Get_size(), 'rank')}, measured from {human(sizes[0])} to "
            f"{human(sizes[-1])}, written to {args.tune}; auto uses them at {plural(comm.Get_size(), 'rank')} and those "
            f"sizes only (the built-in table elsewhere):")
        for start, name in rules:
            say(f"#   from {human(start):>8}: {name}")
        payload["tune"] = {"path": args.tune, "ranks": comm.Get_size(), "rules": rules}
    if comm.Get_rank() == 0:
        if args.fit is not None:
            payload.update(report_fit(payload["rows"], args))
        if args.json:
            write_json(args.json, payload)
            print(f"# wrote {args.json}", flush=True)
        if args.csv:
            output.write_csv(args.csv, rows)
            print(f"# wrote {args.csv}", flush=True)
        if args.plot:
            plot(args.plot, rows, f"allreduce, {comm.Get_size()} rank{'' if comm.Get_size() == 1 else 's'}, "
                                  f"{args.datatype} {args.op} ({info['mpi_name']})")
            print(f"# wrote {args.plot}", flush=True)
    comm.Barrier()
    return 0


def run_collective(comm: MPI.Intracomm, parser: RankZeroParser, args, dtype: np.dtype, sizes: List[int],
                   threads: int) -> int:
    """``--collective reduce_scatter|allgather|broadcast``: the table, its ratios and ``--json``."""
    p = comm.Get_size()
    what = args.collective
    hosts = sorted(set(comm.allgather(MPI.Get_processor_name() or socket.gethostname())))
    info = {
        "collective": what, "mpi_library": MPI.Get_library_version().strip().splitlines()[0],
        "mpi_name": mpi_name(MPI.Get_library_version()), "mpi4py": __import__("mpi4py").__version__,
        "ranks": p, "hosts": hosts, "numba_threads_per_rank": threads, "kernel": args.kernel,
        "dtype": args.datatype, "op": args.op if what == "reduce_scatter" else None,
        "root": args.root if what == "broadcast" else None, "min_bytes": args.low, "max_bytes": args.high,
        "step_factor": args.stepfactor, "warmup": args.warmup_iters, "samples": args.iters, "batch": args.batch or "auto",
        "algorithms": args.names, "size": "the whole buffer" + (" (each rank holds size/p of it on one side)"
                                                                if what != "broadcast" else ""),
        "busbw": "algbw" if what == "broadcast" else "algbw * (p-1)/p",
        "mpi_row": "mpi4py's own call made directly", "compression": args.compression,
        "timing": "per sample: restore input (untimed), barrier, then batch back-to-back calls, barrier (untimed); "
                  "time per call = slowest rank's; median, min and max over samples",
    }
    info["options"] = {a.dest: getattr(args, a.dest) for a in parser._actions if a.dest not in ("help", "version")}
    say(f"# {PROG}: {what}, {plural(p, 'rank')} on {plural(len(hosts), 'host')} ({', '.join(hosts)})")
    say(f"# MPI: {info['mpi_name']} (mpi4py {info['mpi4py']})")
    say(f"# dtype {args.datatype}" + (f", op {args.op}" if what == "reduce_scatter" else "")
        + (f", root {args.root}" if what == "broadcast" else "")
        + f", {human(args.low)} to {human(args.high)} x{args.stepfactor}; {args.warmup_iters} warm-up calls, "
          f"then {args.iters} timed samples per row")
    say(f"# size = the whole buffer; time = the slowest rank's time per call (median, min, max over samples); "
        f"algbw = size / time, busbw = {info['busbw']}")
    say(f"# #wrong = elements differing from MPI's result (summed over ranks); mpi = {info['mpi_row']}")
    if args.compression != "none":
        say(f"# compression {args.compression}: every row but mpi sends 16-bit values (size counts the float32 "
            f"buffer), #wrong against MPI's result rounded to {args.compression}; mpi = MPI's float32 call")
    lib = library_comm(comm)
    layout = lib.layout
    link = network.link_bandwidth(layout, args.link_gbps)
    link_bits = link[0] if link else None
    info.update(nodes=layout.nodes, node_hosts=list(layout.hosts), ranks_per_node=list(layout.ranks_per_node),
                link_bits_per_second=link_bits, link_source=link[1] if link else None)
    for text in network.describe(layout, link, what):
        say(f"# {text}")
    say("#")

    def link_pct(row) -> Optional[float]:
        return network.link_percent(row.size, row.time_us, layout.nodes, link_bits, what) if link_bits else None

    say(output.header(link=link_bits is not None))
    rows = collectives.sweep(what, comm, sizes, dtype, args.op, args.root, args.names, args.iters, args.warmup_iters,
                             args.batch, on_row=lambda row: say(output.line(row, link_pct(row))),
                             compression=args.compression)
    table = ratios(rows)
    say(output.summary(table, what))
    wrong = sum(row.wrong for row in rows)
    average = avg_busbw(rows)
    say(output.closing(wrong, average))
    if comm.Get_rank() == 0:
        if args.json:
            write_json(args.json, {"preamble": info,
                                   "rows": [dict(r.as_dict(), **({"link_pct": link_pct(r)} if link_bits else {}))
                                            for r in rows],
                                   "ratios": {str(s): v for s, v in table.items()}, "wrong_total": wrong,
                                   "avg_busbw": average})
            print(f"# wrote {args.json}", flush=True)
        if args.csv:
            output.write_csv(args.csv, rows)
            print(f"# wrote {args.csv}", flush=True)
    comm.Barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
