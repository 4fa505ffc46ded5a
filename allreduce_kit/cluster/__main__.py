"""``python -m allreduce_kit.cluster up|run|status|down``: the emulated cluster's command line."""
import argparse
import json
import os
import signal
import subprocess
import sys
from typing import List, Optional

from . import (BRIDGE, STATE_DIR, ClusterError, State, down, launcher_kind, link, mpiexec_command, on_node,
               require, run_environment, up, why_not_here)
from ..cli import DefaultsFormatter

PROG = "python -m allreduce_kit.cluster"
#: TCP port the bandwidth measurement listens on, inside the receiving node.
MEASURE_PORT = 5201
#: Flows of the parallel measurement.
PARALLEL_FLOWS = 4


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return int(text)


def _counts(text: str) -> List[int]:
    parts = text.split(",")
    if not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"expected counts >= 1 separated by commas (e.g. 3,5), got {text!r}")
    return [int(p) for p in parts]


def _rate(text: str) -> str:
    try:
        link.parse_rate(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog=PROG, formatter_class=DefaultsFormatter,
                                  description="An emulated cluster on this machine (root, Linux namespaces): "
                                              "isolated nodes joined through a bridge by rate-shaped links, and "
                                              "MPI jobs across them. See docs/multinode.md.")
    from .. import __version__

    top.add_argument("--version", action="version", version=f"allreduce_kit {__version__}")
    sub = top.add_subparsers(dest="command", required=True)
    p = sub.add_parser("up", formatter_class=DefaultsFormatter, help="make the cluster",
                       description="Make NODES isolated nodes (own network, host name, PIDs, IPC, /dev/shm), "
                                   "each linked to a bridge by a link shaped to RATE in both directions.")
    p.add_argument("--nodes", type=_positive, default=2, help="number of nodes")
    p.add_argument("--link", type=_rate, default="1gbit", help="each node's link rate, as tc writes it (1gbit, 250mbit)")
    p.add_argument("--no-measure", action="store_true", help="do not measure the link after making it")
    p.add_argument("--own-cores", action="store_true",
                   help="run each node on its own share of this machine's cores (default: every node on all of them)")
    p = sub.add_parser("run", formatter_class=DefaultsFormatter, help="run an MPI job across the nodes",
                       description="Run COMMAND as N MPI ranks across the cluster with MPICH's mpiexec (or "
                                   "with Open MPI's mpirun: --mpirun).")
    p.add_argument("-n", type=_positive, required=True, help="number of ranks")
    p.add_argument("--placement", choices=("block", "round-robin"), default="block",
                   help="block: each node's ranks consecutive; round-robin: rank r on node r mod nodes")
    p.add_argument("--nodes", type=_positive, default=None, help="use the first NODES nodes (default: all)")
    p.add_argument("--ranks-per-node", type=_counts, default=None,
                   help="ranks on each node in turn, e.g. 3,5 (block placement; default: as even as possible)")
    p.add_argument("--timeout", type=float, default=None, help="end the job after this many seconds")
    p.add_argument("--mpirun", default=None, metavar="PATH",
                   help="launch with this MPICH mpiexec or Open MPI mpirun (told apart by --version; default: the "
                        "mpiexec beside this Python)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    p = sub.add_parser("status", formatter_class=DefaultsFormatter, help="show nodes and links, measure the links",
                       description="Show the nodes, their links' rates and the bandwidth measured between the first "
                                   "two nodes with TCP, one flow and several in parallel.")
    p.add_argument("--seconds", type=float, default=2.0, help="seconds each measurement counts")
    p.add_argument("--no-measure", action="store_true", help="show what was measured last, measure nothing")
    p.add_argument("--json", action="store_true", help="print the state as JSON")
    sub.add_parser("down", formatter_class=DefaultsFormatter, help="remove the cluster (also what a crash left)",
                   description="Remove every node, link, namespace and the state, also what an interrupted 'up' left.")
    return top


#: The key of the measurement with every link busy at once (``measure``).
EVERY_LINK = "every link at once"


def _receiver(node, flows: int, seconds: float) -> subprocess.Popen:
    receiver = subprocess.Popen(on_node(node, [sys.executable, "-m", "allreduce_kit.cluster.measure", "receive",
                                               str(MEASURE_PORT), str(flows), str(seconds)]),
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    assert receiver.stdout is not None
    receiver.stdout.readline()  # "listening"
    return receiver


def _flows(pairs, flows: int, seconds: float) -> List[float]:
    """Bits per second over each ``(sender, receiver)`` pair of nodes, all sending at once."""
    receivers = []
    try:
        for _, to in pairs:
            receivers.append(_receiver(to, flows, seconds))
        senders = [subprocess.Popen(on_node(frm, [sys.executable, "-m", "allreduce_kit.cluster.measure", "send",
                                                  to.address, str(MEASURE_PORT), str(flows), str(seconds)]),
                                    stdin=subprocess.DEVNULL) for frm, to in pairs]
        for sender in senders:
            if sender.wait(timeout=seconds + 30) != 0:
                raise subprocess.CalledProcessError(sender.returncode, "send")
        return [json.loads(r.communicate(timeout=30)[0])["bits_per_second"] for r in receivers]
    except (subprocess.SubprocessError, OSError, ValueError) as error:
        links = ", ".join(f"{a.host} -> {b.host}" for a, b in pairs)
        raise ClusterError(f"measuring {links} failed: {error}") from None
    finally:
        for r in receivers:
            if r.poll() is None:
                r.kill()


def measure(state: State, seconds: float) -> dict:
    """Bits per second from the first node to the second: one TCP flow, and several at once; and,
    with every node sending to the next and receiving from the one before (every link busy both
    ways, as in a ring allreduce), the slowest of those links."""
    if len(state.nodes) < 2:
        return {}
    first, second = state.nodes[0], state.nodes[1]
    results = {}
    for flows in (1, PARALLEL_FLOWS):
        results[f"{flows} flow" + ("s" if flows > 1 else "")] = _flows([(first, second)], flows, seconds)[0]
    n = len(state.nodes)
    ring = [(state.nodes[k], state.nodes[(k + 1) % n]) for k in range(n)]
    results[EVERY_LINK] = min(_flows(ring, 1, seconds))
    return results


def show(state: State) -> None:
    print(f"cluster: {len(state.nodes)} node(s) on bridge {BRIDGE}, each link {link.describe(state.link_bits)} "
          f"each way (tc tbf)")
    for node in state.nodes:
        cores = ",".join(map(str, node.cores)) or "all"
        print(f"  {node.host:8s} {node.address:14s} pid {node.pid:<8d} cores {cores}")

    def rate(bits: float) -> str:
        return f"{link.describe(int(bits))} ({100 * bits / state.link_bits:.0f}%)"

    pair = {name: bits for name, bits in state.measured.items() if name != EVERY_LINK}
    if pair:
        print(f"measured {state.nodes[0].host} -> {state.nodes[1].host}: "
              + ", ".join(f"{name}: {rate(bits)}" for name, bits in pair.items()))
    if EVERY_LINK in state.measured:
        print(f"measured with every node sending to the next at once: slowest link {rate(state.measured[EVERY_LINK])}")


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "run" and args.cmd[:1] == ["--"]:
        args.cmd = args.cmd[1:]
    if args.command == "run" and not args.cmd:
        parser().error("run: give the command after --, e.g. run -n 4 -- python -m allreduce_kit.bench")
    problem = why_not_here()
    if problem:
        print(f"{PROG}: error: {problem}", file=sys.stderr)
        return 2
    try:
        if args.command == "up":
            state = up(args.nodes, args.link, args.own_cores)
            if not args.no_measure:
                state.measured = measure(state, 1.0)
                state.save()
            show(state)
        elif args.command == "down":
            removed = down()
            print("removed: " + ", ".join(removed) if removed else "nothing to remove")
        elif args.command == "status":
            state = require()
            if not args.no_measure:
                state.measured = measure(state, args.seconds)
                state.save()
            if args.json:
                from dataclasses import asdict

                print(json.dumps(asdict(state), indent=2))
            else:
                show(state)
        else:
            state = require()
            hostfile = STATE_DIR / f"ranks.{os.getpid()}"   # where Open MPI reads each rank's node
            try:
                kind = launcher_kind(args.mpirun) if args.mpirun is not None else "mpich"
                command = mpiexec_command(state, args.n, args.cmd, args.placement, args.ranks_per_node, args.nodes,
                                          args.mpirun, hostfile, kind)
            except ValueError as error:
                print(f"{PROG}: error: {error}", file=sys.stderr)
                return 2
            job = subprocess.Popen(command, env=run_environment(args.n, kind == "openmpi"), start_new_session=True)
            try:
                return job.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                print(f"{PROG}: error: the job did not finish within {args.timeout:g} s", file=sys.stderr)
                return 124
            finally:
                if job.poll() is None:  # timed out, or interrupted: end mpiexec and its proxies
                    os.killpg(job.pid, signal.SIGTERM)
                    try:
                        job.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        os.killpg(job.pid, signal.SIGKILL)
                if hostfile.exists():
                    hostfile.unlink()
    except ValueError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    except ClusterError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
