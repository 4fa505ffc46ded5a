"""The stall inspector: a collective that waits too long for a rank names that rank and ends
the job instead of hanging forever.
"""
import re
import time

import pytest

SCRIPT = """
import sys, time
import numpy as np
from mpi4py import MPI
from allreduce_kit import allreduce
late, sleep = int(sys.argv[1]), float(sys.argv[2])
allreduce(np.ones(10))                     # every rank takes part in a first call
if MPI.COMM_WORLD.Get_rank() == late:
    print("late from", time.time(), flush=True)
    time.sleep(sleep)                      # this rank is late for the second
allreduce(np.ones(10), algorithm="ring")
print("finished on rank", MPI.COMM_WORLD.Get_rank(), flush=True)
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "late_rank.py"
    path.write_text(SCRIPT)
    return path


def test_a_late_rank_is_named_and_the_job_ends_before_it_would_arrive(mpirun, script):
    """Rank 2 is 120 s late; the job must end within the 90 s ``mpirun`` allows it, so it cannot
    have waited for that rank. (How soon after the timeout it ends: benchmarks/fault_latency.py.)"""
    result = mpirun(4, [script, 2, 120], timeout=90, via_mpi4py=False, env={"ALLREDUCE_KIT_STALL_TIMEOUT": "2"})
    assert result.returncode != 0
    assert "missing ranks (have not reached this call): [2]" in result.stderr
    assert "late from" in result.stdout and "finished" not in result.stdout


REPEATED = """
import time
import numpy as np
from mpi4py import MPI
from allreduce_kit import allreduce
from allreduce_kit.collective import LAST
buf = np.ones(10)
for _ in range(5):  # the first calls compile, make the window and keep the call: slow, and said so
    allreduce(buf, algorithm="shared_memory")
start, world = time.monotonic(), MPI.COMM_WORLD
while not world.bcast(time.monotonic() - start > 2.5):  # one buffer again and again, for longer than
    for _ in range(2000):                                 # the timeout: the short path
        allreduce(buf, algorithm="shared_memory")
assert LAST[0] is not None and LAST[0].ref() is buf
if world.Get_rank() == 0:
    print("looped for", time.monotonic() - start, flush=True)
if MPI.COMM_WORLD.Get_rank() == 2:
    time.sleep(120)
allreduce(buf, algorithm="shared_memory")
print("finished", flush=True)
"""


def test_a_late_rank_is_named_in_a_loop_of_calls_that_repeat(mpirun, tmp_path):
    """A repeated call (``collective.Repeat``) tells the inspector what it runs without a tuple of
    its own per call. A loop of such calls that lasts longer than the timeout is not a stall; a
    late rank still is, named with the call's description, and it ends the job."""
    path = tmp_path / "repeated.py"
    path.write_text(REPEATED)
    result = mpirun(3, [path], timeout=90, via_mpi4py=False, env={"ALLREDUCE_KIT_STALL_TIMEOUT": "1"})
    assert result.returncode != 0
    looped = [float(line.split()[-1]) for line in result.stdout.splitlines() if line.startswith("looped for")]
    assert looped and looped[0] > 2.5, result.stdout  # the loop outlasted the timeout
    slow = [int(re.search(r"\(call #(\d+) ", line).group(1)) for line in result.stderr.splitlines()
            if "allreduce_kit: stall:" in line and "slow, not stuck" in line]
    assert all(call <= 5 for call in slow), result.stderr  # none in the loop, whose calls all move on
    assert "allreduce(algorithm='shared_memory', 10 x float64) (call #" in result.stderr
    assert "missing ranks (have not reached this call): [2]" in result.stderr
    assert "finished" not in result.stdout


def test_a_rank_late_by_less_than_the_timeout_is_only_waited_for(mpirun, script):
    result = mpirun(3, [script, 1, 1.5], timeout=90, via_mpi4py=False,
                    env={"ALLREDUCE_KIT_STALL_TIMEOUT": "30"})  # generous: a loaded machine is slow too
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("finished on rank") == 3
    assert "stall" not in result.stderr


def test_timeout_zero_turns_the_inspector_off(mpirun, script):
    result = mpirun(2, [script, 1, 3], timeout=60, via_mpi4py=False,
                    env={"ALLREDUCE_KIT_STALL_TIMEOUT": "0.0"})
    assert result.returncode == 0, result.stderr
    assert "stall" not in result.stderr


def test_a_bad_timeout_setting_is_refused_by_name(mpirun, script):
    result = mpirun(2, [script, 1, 0], timeout=60, env={"ALLREDUCE_KIT_STALL_TIMEOUT": "soon"})
    assert result.returncode != 0
    assert "ValueError: ALLREDUCE_KIT_STALL_TIMEOUT='soon': expected a number of seconds" in result.stderr


def test_a_negative_timeout_is_refused_by_name():
    from allreduce_kit import set_stall_timeout

    with pytest.raises(ValueError, match="set_stall_timeout: seconds: .* >= 0"):
        set_stall_timeout(-1)
    with pytest.raises(ValueError, match="set_stall_timeout: seconds: expected a finite number"):
        set_stall_timeout(float("nan"))
    with pytest.raises(TypeError, match="set_stall_timeout: seconds: expected a number of seconds, got str"):
        set_stall_timeout("5")


def test_a_point_to_point_wait_longer_than_the_timeout_names_the_rank_waited_on_and_what_it_does(monkeypatch):
    """``Inspector.wait`` (a pipeline's waits between stages) in one process: a receive nobody
    has sent waits past its timeout; the watchdog asks the rank waited on (here itself, waiting)
    what it does and ends the job, here an ``abort_job`` that records the message and sends the
    message waited for, so the wait returns."""
    import numpy as np
    from mpi4py import MPI

    from allreduce_kit import stall
    from allreduce_kit.comm import library_comm

    lib = library_comm(MPI.COMM_SELF)
    ended = []

    def abort_job(message=None, code=1):
        ended.append(message)
        MPI.Comm(lib).Send(np.zeros(1), 0, tag=7)

    monkeypatch.setattr(stall, "abort_job", abort_job)
    request = MPI.Comm(lib).Irecv(np.empty(1), 0, tag=7)
    what = "stage 1 (rank 0) waiting for stage 0 (rank 0) to send its activations of micro-batch 2"
    stall.INSPECTOR.wait(request, lib.watch, 0, lambda: what, timeout=0.3)
    assert len(ended) == 1, ended
    assert re.fullmatch(rf"allreduce_kit: stall: {re.escape(what)}: has waited 0\.[3-9] s on rank 0; rank 0 is "
                        rf"itself waiting: {re.escape(what)}\. Aborting the job\.", ended[0]), ended[0]
    assert stall.INSPECTOR.current is None


SKIPS = """
import sys, time
import numpy as np
from mpi4py import MPI
from allreduce_kit import allreduce, broadcast_parameters
mode, rank = sys.argv[1], MPI.COMM_WORLD.Get_rank()
if mode == "skips-first-call":
    if rank != 1:
        allreduce(np.ones(10))           # the first collective on the communicator: rank 1 never comes
elif mode == "skips-checked-call":
    allreduce(np.ones(10), check=True)
    if rank != 1:
        allreduce(np.ones(10), check=True)   # the agreement step is watched too
elif mode == "skips-plan-call":
    from allreduce_kit import plan
    x = np.ones(10)
    planned = plan(x)
    planned()
    if rank != 1:
        planned()                        # a plan's calls are watched as allreduce's are
elif mode == "root-skips-broadcast":
    allreduce(np.ones(10))
    if rank != 0:
        broadcast_parameters(np.ones(10), root=0)
print("started sleeping on rank", rank, time.time(), flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("mode,words", [
    ("skips-first-call", "has not made its first collective call"),
    ("skips-checked-call", "missing ranks (have not reached this call): [1]"),
    ("skips-plan-call", "10 x float64) (call #3 on this communicator) has waited"),  # plan(), call, call
    ("root-skips-broadcast", "broadcast_parameters(root=0, 10 x float64) (call #2 on this communicator)"),
])
def test_every_collective_the_library_makes_is_watched(mpirun, tmp_path, mode, words):
    script = tmp_path / "skips.py"
    script.write_text(SKIPS)
    started = time.time()
    result = mpirun(2, [script, mode], timeout=90, via_mpi4py=False, env={"ALLREDUCE_KIT_STALL_TIMEOUT": "3"})
    assert result.returncode != 0
    assert words in result.stderr, result.stderr[-3000:]
    if mode == "skips-plan-call":
        assert "missing ranks (have not reached this call): [1]" in result.stderr, result.stderr[-3000:]
    assert time.time() - started < 60


def test_a_watchdog_that_fails_ends_the_job_instead_of_vanishing(mpirun, tmp_path):
    script = tmp_path / "broken_watchdog.py"
    script.write_text("import time\nimport numpy as np\nfrom allreduce_kit import allreduce, stall\n"
                      "def broken(self):\n    raise RuntimeError('watchdog broken on purpose')\n"
                      "stall.Inspector._watch_loop = broken\n"
                      "allreduce(np.ones(4))\ntime.sleep(120)\n")
    result = mpirun(2, [script], timeout=90, via_mpi4py=False)
    assert result.returncode != 0
    assert "the stall inspector failed (RuntimeError: watchdog broken on purpose)" in result.stderr


DIFFERENT_CALLS = """
import sys
import numpy as np
from mpi4py import MPI
rank = MPI.COMM_WORLD.Get_rank()
mode, first, others = sys.argv[1:4]
mine = first if rank == 0 else others
if mode == "algorithms":                     # one allreduce, another algorithm on rank 0
    from allreduce_kit import allreduce
    allreduce(np.ones(int(sys.argv[4]), np.float32), algorithm=mine)
else:                                        # another collective of allreduce_kit.torch on rank 0
    import torch
    import allreduce_kit.torch as hvd
    hvd.init()
    calls = {"allgather": lambda: hvd.allgather(torch.ones(3)), "barrier": hvd.barrier,
             "allreduce": lambda: hvd.allreduce(torch.ones(3))}
    calls[mine]()
print("finished on rank", rank, flush=True)
"""


@pytest.mark.parametrize("mode, first, others, size", [
    ("algorithms", "ring", "tree", 1000),
    ("algorithms", "shared_memory", "recursive_doubling", 1000),
    ("algorithms", "auto", "mpi", 1000),
    ("algorithms", "ring", "mpi", 300000),
    ("torch", "allgather", "barrier", 0),
    ("torch", "allreduce", "barrier", 0),
])
def test_ranks_in_one_call_that_disagree_on_it_are_named_and_the_job_ends(mpirun, tmp_path, mode, first, others,
                                                                          size):
    """Every rank reached call #N, but rank 0's call is another algorithm or another collective:
    it can never complete. Within the stall timeout the inspector says which rank is in which
    call and ends the job, rather than calling it slow and waiting for ever."""
    script = tmp_path / "different_calls.py"
    script.write_text(DIFFERENT_CALLS)
    started = time.time()
    result = mpirun(3, [script, mode, first, others, size], timeout=90, via_mpi4py=False,
                    env={"ALLREDUCE_KIT_STALL_TIMEOUT": "2"})
    assert result.returncode != 0
    if mode == "algorithms":
        assert "the ranks are in different calls at this call's number" in result.stderr, result.stderr[-3000:]
        assert f"rank 0: allreduce(algorithm={first!r}, {size} x float32); rank 1: allreduce(algorithm={others!r}, " \
               f"{size} x float32)" in result.stderr, result.stderr[-3000:]
    else:
        # ``barrier`` runs on a communicator of its own (it does not wait for calls in flight, as
        # Horovod's does not): on the collectives' communicator the ranks in it never reach rank
        # 0's call, and on the barrier's rank 0 never arrives; whichever is seen first is named
        assert ("missing ranks (have not reached this call): [1, 2]" in result.stderr
                or "missing ranks (have not reached this call): [0]" in result.stderr), result.stderr[-3000:]
    assert "slow, not stuck" not in result.stderr
    assert "finished" not in result.stdout
    assert time.time() - started < 60


SLOW_BUT_ALIKE = """
import time
import numpy as np
import torch
from mpi4py import MPI
import allreduce_kit.torch as hvd
from allreduce_kit.algorithms import ALGORITHMS
from allreduce_kit.torch import mpi_ops
rank = MPI.COMM_WORLD.Get_rank()


def late(work):                              # rank 1 is inside the call, but takes 3 s over it
    def slowly(*args, **kwargs):
        if rank == 1:
            time.sleep(3)
        return work(*args, **kwargs)
    return slowly


hvd.init()
from allreduce_kit import allreduce
ALGORITHMS["ring"] = late(ALGORITHMS["ring"])
assert allreduce(np.ones(10), algorithm="ring")[0] == MPI.COMM_WORLD.Get_size()
plain_bytes, mpi_ops.as_bytes = mpi_ops.as_bytes, late(mpi_ops.as_bytes)      # in the Allgatherv
assert hvd.allgather(torch.ones(2)).shape == (2 * hvd.size(),)
mpi_ops.as_bytes, mpi_ops.agree_cheaply = plain_bytes, late(mpi_ops.agree_cheaply)  # before the root can leave
assert hvd.broadcast(torch.full((2,), float(rank)), 0).sum() == 0
print("finished on rank", rank, flush=True)
"""


def test_ranks_in_one_call_that_agree_on_it_are_only_slow_and_are_waited_for(mpirun, tmp_path):
    """The other side of the test above: every rank in the same call, described alike (an
    ``allreduce`` and ``allreduce_kit.torch``'s allgather and broadcast), but one of them takes
    three times the timeout inside it: said to be slow, waited for, and the job ends well."""
    script = tmp_path / "slow_but_alike.py"
    script.write_text(SLOW_BUT_ALIKE)
    result = mpirun(2, [script], timeout=180, via_mpi4py=False, env={"ALLREDUCE_KIT_STALL_TIMEOUT": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("finished on rank") == 2
    assert "slow, not stuck" in result.stderr
    assert "different calls" not in result.stderr and "missing ranks" not in result.stderr
