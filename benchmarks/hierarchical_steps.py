"""Where a small ``hierarchical`` call's time goes across nodes: the whole call against MPI's own
``Allreduce``, and each of its waits timed alone, in one run.

    sudo python -m allreduce_kit.cluster up --nodes 2 --link 250mbit
    sudo python -m allreduce_kit.cluster run -n 8 -- python -m allreduce_kit.run benchmarks/hierarchical_steps.py

Rows, per size: ``mpi`` (MPI's ``Allreduce``), ``hierarchical`` (as ``allreduce`` runs it: the
agreement on the buffers overlapping step 1), ``agreement first`` (the same steps with the
agreement before step 1), then the agreement and steps 1, 2 and 3 each timed alone. Milliseconds,
each rank's median over ``--calls`` calls, the slowest rank's shown. Needs a communicator that
spans nodes, with several ranks on a node (direct reads inside the node).
"""
import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

from allreduce_kit import ALGORITHMS, allreduce, library_comm
from allreduce_kit.algorithms import direct, hierarchical
from allreduce_kit.algorithms.segments import bounds_array


def steps(lib, buf: np.ndarray, times: dict) -> None:
    """``hierarchical``'s steps on a float32 sum, each timed into ``times`` (the agreement first)."""
    plan, op = lib.state[hierarchical.Plan], lib.reductions["sum"]
    node, bounds = plan.node, bounds_array(buf.size, plan.shards)
    peers = direct.peers_for(node)
    a = time.perf_counter()
    hierarchical._agree(lib, plan, buf)
    b = time.perf_counter()
    first = hierarchical._reduce_scatter(buf, bounds, peers.state, peers.piece(buf.dtype), peers.iov, op.code)
    c = time.perf_counter()
    for k in plan.mine:
        shard = buf[bounds[k]:bounds[k + 1]]
        if shard.size:
            ALGORITHMS["recursive_doubling"](plan.owners[k], shard, plan.owners[k].reductions["sum"])
    d = time.perf_counter()
    hierarchical._allgather(buf, bounds, peers.state, peers.iov, first)
    e = time.perf_counter()
    for name, span in (("agreement alone", b - a), ("step 1 alone", c - b), ("step 2 alone", d - c),
                       ("step 3 alone", e - d), ("agreement first", e - a)):
        times.setdefault(name, []).append(span)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=30, help="timed calls per row and size")
    parser.add_argument("--sizes", default="8,1024,16384", help="message sizes in bytes, comma-separated")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    lib = library_comm(comm)
    if lib.layout.single_node or max(lib.layout.ranks_per_node) < 2:
        if comm.rank == 0:
            print("hierarchical_steps: run it across nodes with several ranks on a node (cluster run -n 8)")
        raise SystemExit(2)
    if comm.rank == 0:
        print(f"# {lib.layout.nodes} nodes, ranks per node {lib.layout.ranks_per_node}; ms, slowest rank's median "
              f"of {args.calls} calls")
    for nbytes in (int(s) for s in args.sizes.split(",")):
        buf = np.ones(max(1, nbytes // 4), np.float32)
        allreduce(buf, algorithm="hierarchical", comm=comm)  # plans and peers made, code compiled
        times: dict = {}
        for _ in range(args.calls):
            for name in ("mpi", "hierarchical"):
                lib.Barrier()
                a = time.perf_counter()
                allreduce(buf, algorithm=name, comm=comm)
                times.setdefault(name, []).append(time.perf_counter() - a)
            lib.Barrier()
            steps(lib, buf, times)
        medians = comm.gather({k: statistics.median(v) * 1e3 for k, v in times.items()})
        if comm.rank == 0:
            print(f"{nbytes:>8} B  " + "  ".join(f"{k} {max(m[k] for m in medians):.2f}" for k in medians[0]),
                  flush=True)


if __name__ == "__main__":
    main()
