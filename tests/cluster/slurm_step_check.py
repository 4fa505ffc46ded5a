"""Run inside a Slurm job step on the emulated cluster (``test_slurm.py``): the ranks are on
separate hosts (``isolation_check.py``, run first), then they reduce ``MIB`` MiB once with MPI's
own ``Allreduce`` and once with the toolkit's ``auto``; rank 0 prints the hosts and
``reduced: BYTES``, the bytes of the two messages, which the test compares with what crossed the
nodes' links."""
import runpy
import socket
import sys

import numpy as np
from mpi4py import MPI

from allreduce_kit import allreduce

NODES, MIB = int(sys.argv[1]), int(sys.argv[2])
sys.argv = [sys.argv[0], str(NODES)]
runpy.run_path(str(__import__("pathlib").Path(__file__).with_name("isolation_check.py")), run_name="__main__")

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
send = np.full(MIB << 18, rank + 1.0, np.float32)
mpi_sum = np.empty_like(send)
world.Allreduce(send, mpi_sum, op=MPI.SUM)
ours = send.copy()
allreduce(ours, algorithm="auto")
expected = size * (size + 1) / 2
wrong = int(np.count_nonzero(mpi_sum != expected)) + int(np.count_nonzero(ours != expected))
wrong = world.allreduce(wrong)
hosts = world.gather(socket.gethostname())
if rank == 0:
    print(f"hosts: {' '.join(hosts)}\nwrong: {wrong}\nreduced: {2 * send.nbytes}", flush=True)
