"""Calls on one communicator from several threads at once are not supported; a second thread
that makes the first call while another thread is setting the library up for that communicator
gets a clear error at once, and the communicator stays usable for the calls that follow.
"""

FIRST_CALL_FROM_TWO_THREADS = """
import sys
import threading
import time
import numpy as np
from mpi4py import MPI
from allreduce_kit import allreduce
from allreduce_kit.stall import INSPECTOR
rank = MPI.COMM_WORLD.Get_rank()
outcomes = []


def first_call():
    try:
        outcomes.append(float(allreduce(np.ones(10))[0]))
    except Exception as error:
        outcomes.append(f"{type(error).__name__}: {error}")


if rank == 0:          # thread a is setting up (waiting there for rank 1) when thread b calls
    a = threading.Thread(target=first_call)
    a.start()
    while INSPECTOR.current is None:
        time.sleep(0.001)
    b = threading.Thread(target=first_call)
    b.start()
    b.join()
    MPI.COMM_WORLD.send("b has returned", dest=1)
    a.join()
else:
    MPI.COMM_WORLD.recv(source=0)          # only then does rank 1 come to the set-up
    first_call()
# one write per line: the ranks' lines reach the launcher's output whole, never interleaved
sys.stdout.write(f"rank {rank} outcomes {sorted(outcomes, key=str)}\\n")
sys.stdout.flush()
sys.stdout.write(f"later {rank} {allreduce(np.ones(10))[0]} {allreduce(np.ones(10), algorithm='ring')[0]}\\n")
sys.stdout.flush()
"""


def test_a_second_thread_in_the_first_call_gets_a_clear_error_and_the_communicator_stays_usable(mpirun, tmp_path):
    script = tmp_path / "two_threads.py"
    script.write_text(FIRST_CALL_FROM_TWO_THREADS)
    result = mpirun(2, [script], timeout=120, via_mpi4py=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "MPI_COMM_NULL" not in result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert "rank 1 outcomes [2.0]" in lines
    [rank_0] = [line for line in lines if line.startswith("rank 0 outcomes")]
    assert rank_0.startswith("rank 0 outcomes [2.0, 'ConcurrentCallError: allreduce_kit: another thread of this "
                             "process is making the first collective call on this communicator"), rank_0
    assert "several threads at once are not supported" in rank_0
    assert "later 0 2.0 2.0" in lines and "later 1 2.0 2.0" in lines
