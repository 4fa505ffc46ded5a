"""Where a small allreduce's time goes when ranks share cores: wall time, CPU time, run-queue wait
and scheduler slices per call, under MPICH and Open MPI in turn.

    python benchmarks/small_messages.py --ranks 8 --bytes 4 1024 --repeats 3

For each repeat, starts ``--ranks`` ranks under the venv's MPICH (``mpiexec``, heavy yield as
the CLIs set it) and then under Open MPI (``benchmarks/openmpi_env.py``, ``--oversubscribe``).
Each rank times ``--calls`` back-to-back calls of every way (``auto``: ``allreduce()``;
``plan``: ``allreduce_kit.plan``; ``mpi``: mpi4py's ``Allreduce``) on a float32 buffer of each
size, after a barrier, and reads from Linux, for the calling thread, before and after:
``/proc/thread-self/schedstat`` (time on a CPU, time waiting on a run queue, slices run) and
``getrusage(RUSAGE_THREAD)`` (voluntary and involuntary context switches). Per call, it
prints the slowest rank's wall time and the mean over ranks of the rest, as medians over the
repeats, one table per MPI. A call that costs many slices per rank is paid in context switches,
not in the algorithm.

Whether ranks share a scheduler group matters when they share cores: Linux's autogroups give
every session a group of its own, and MPICH's launcher (hydra) starts every rank in a session of
its own, Open MPI's in the launcher's. ``--own-session`` makes each rank start a session of its
own before MPI starts, as hydra does, where it can: under ``--mpi mpich-gforker`` (MPICH under
its ``gforker`` launcher, whose ranks keep the launcher's session), not under Open MPI, whose
ranks each lead a process group and so may not. Each table says in how many scheduler groups
the ranks ran, so MPICH under its two launchers is the same MPI library with and without a
group per rank:

    python benchmarks/small_messages.py --ranks 8 --mpi mpich mpich-gforker openmpi
    python benchmarks/small_messages.py --ranks 8 --mpi mpich-gforker --own-session
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve()
WAYS = ("auto", "plan", "mpi")
FIELDS = ("wall_us", "cpu_us", "wait_us", "slices", "voluntary", "involuntary")


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     epilog="\n".join(__doc__.split("\n")[1:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=8, help="ranks to start (default 8)")
    parser.add_argument("--bytes", type=int, nargs="+", default=[4, 1024],
                        help="message sizes in bytes, multiples of 4 (default 4 1024)")
    parser.add_argument("--calls", type=int, default=2000, help="calls timed per way and size (default 2000)")
    parser.add_argument("--repeats", type=int, default=3, help="runs under each MPI, alternating (default 3)")
    parser.add_argument("--mpi", nargs="+", choices=("mpich", "openmpi", "mpich-gforker"),
                        default=["mpich", "openmpi"], help="which MPIs and launchers to run under (default "
                        "mpich openmpi; mpich-gforker: MPICH's other launcher, single node)")
    parser.add_argument("--wait", nargs="+", choices=("auto", "spin", "yield", "block"), default=["auto"],
                        help="ALLREDUCE_KIT_WAIT for the ranks, each in turn within a repeat (default auto)")
    parser.add_argument("--own-session", action="store_true",
                        help="each rank starts a session of its own before MPI starts, as MPICH's hydra does")
    parser.add_argument("--json", type=Path, help="also write every sample to this file")
    parser.add_argument("--worker", type=Path, help="run as one rank of the job, writing to this file (the "
                                                     "launcher passes it)")
    args = parser.parse_args(argv)
    for name in ("ranks", "calls", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"argument --{name}: must be at least 1")
    if any(b < 4 or b % 4 for b in args.bytes):
        parser.error("argument --bytes: each size must be a positive multiple of 4 (float32 elements)")
    return args


def thread_counters() -> list:
    """[ns on a CPU, ns waiting on a run queue, slices, voluntary switches, involuntary switches]."""
    with open("/proc/thread-self/schedstat") as handle:
        run, wait, slices = (int(v) for v in handle.read().split()[:3])
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return [run, wait, slices, usage.ru_nvcsw, usage.ru_nivcsw]


def work(args: argparse.Namespace) -> None:
    import time

    if args.own_session:
        try:
            os.setsid()
        except OSError:  # a session leader already (hydra's ranks) or a group leader (Open MPI's)
            pass

    import numpy as np
    from mpi4py import MPI

    from allreduce_kit import allreduce, library_comm, online, plan
    from allreduce_kit.algorithms import spin

    comm = MPI.COMM_WORLD.Dup()
    groups = len(set(comm.allgather(spin.scheduler_group())))
    results = {}
    for nbytes in args.bytes:
        buf = np.ones(nbytes // 4, np.float32)
        planned = plan(buf)
        while online.exploring(library_comm(MPI.COMM_WORLD), buf.nbytes):  # auto's online tuning, untimed
            allreduce(buf)
        calls = {"auto": lambda: allreduce(buf), "plan": planned,
                 "mpi": lambda: comm.Allreduce(MPI.IN_PLACE, buf, MPI.SUM)}
        for way in WAYS:
            call = calls[way]
            for _ in range(max(1, args.calls // 10)):
                call()
            comm.Barrier()
            before, start = thread_counters(), time.perf_counter()
            for _ in range(args.calls):
                call()
            wall, after = time.perf_counter() - start, thread_counters()
            delta = [(a - b) / args.calls for a, b in zip(after, before)]
            mine = [wall / args.calls * 1e6, delta[0] / 1e3, delta[1] / 1e3, *delta[2:]]
            every = comm.gather(mine, root=0)
            if comm.Get_rank() == 0:
                rows = np.array(every)
                results[f"{way} {nbytes}"] = [float(rows[:, 0].max()), *map(float, rows[:, 1:].mean(axis=0))]
    if comm.Get_rank() == 0:
        library = " ".join(MPI.Get_library_version().split("\n")[0].split(",")[0].split())
        args.worker.write_text(json.dumps({"mpi": library, "groups": groups, "results": results}))


def launch(args: argparse.Namespace, mpi: str, wait: str, out: Path) -> str:
    worker = [str(HERE), "--worker", str(out), "--calls", str(args.calls), "--bytes", *map(str, args.bytes)]
    worker += ["--own-session"] if args.own_session else []
    if mpi == "openmpi":
        sys.path.insert(0, str(HERE.parent))
        import openmpi_env

        found = openmpi_env.ensure()
        command, env = found.command(args.ranks, worker), found.environment(dict(os.environ, ALLREDUCE_KIT_WAIT=wait))
    else:
        launcher = "mpiexec.gforker" if mpi == "mpich-gforker" else "mpiexec"
        command = [str(Path(sys.executable).parent / launcher), "-n", str(args.ranks), sys.executable,
                   "-m", "allreduce_kit.run", *worker]
        env = dict(os.environ, ALLREDUCE_KIT_WAIT=wait)
    subprocess.run(command, env=env, stdin=subprocess.DEVNULL, timeout=1800, check=True)
    return f"ALLREDUCE_KIT_WAIT={wait} " + " ".join(command)


def main() -> int:
    args = parse()
    if args.worker:
        work(args)
        return 0
    runs = [f"{mpi} wait={wait}" for mpi in args.mpi for wait in args.wait]
    samples = {run: [] for run in runs}
    names = {}
    with tempfile.TemporaryDirectory() as folder:
        for repeat in range(args.repeats):
            for run in runs:
                mpi, wait = run.split(" wait=")
                out = Path(folder) / f"{mpi}-{wait}-{repeat}.json"
                print("$ " + launch(args, mpi, wait, out), flush=True)
                found = json.loads(out.read_text())
                names[run] = f"{found['mpi']} ({run}, ranks in {found['groups']} scheduler group(s))"
                samples[run].append(found["results"])
    for mpi in runs:
        print(f"\n{names[mpi]}, {args.ranks} ranks: per call, median of {args.repeats} runs; wall: slowest rank, "
              f"the rest: mean over ranks")
        print(f"  {'way':6s} {'bytes':>6s} " + " ".join(f"{f:>11s}" for f in FIELDS))
        for key in samples[mpi][0]:
            way, nbytes = key.split()
            cells = [statistics.median(run[key][i] for run in samples[mpi]) for i in range(len(FIELDS))]
            print(f"  {way:6s} {nbytes:>6s} " + " ".join(f"{c:11.2f}" for c in cells))
    if args.json:
        args.json.write_text(json.dumps({"ranks": args.ranks, "calls": args.calls, "samples": samples,
                                         "mpi": names}, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
