"""Every wait mode of the shared-flag algorithms gives every rank the exact answer, and the ranks
of a node agree on the mode."""
import os

import numpy as np
import pytest
from mpi4py import MPI

from allreduce_kit import allreduce, library_comm
from allreduce_kit.algorithms import spin
from allreduce_kit.algorithms.direct import Peers
from allreduce_kit.algorithms.shared_memory import Window

from conftest import release

LENGTHS = (1, 5, 1000, 20_000, 300_003)


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["auto", "yield", "block"])
def test_every_wait_mode_gives_the_exact_sum(mode):
    if mode == "block" and not MPI.COMM_WORLD.allreduce(spin.can_block(), MPI.LAND):
        pytest.skip("no futex wait on this machine")
    before = os.environ.get("ALLREDUCE_KIT_WAIT")
    os.environ["ALLREDUCE_KIT_WAIT"] = mode
    comm = MPI.COMM_WORLD.Dup()
    try:
        p, rank = comm.Get_size(), comm.Get_rank()
        for algorithm in ("shared_memory", "two_shot", "ring"):
            for n in LENGTHS:
                buf = np.full(n, rank + 1, np.float32)
                allreduce(buf, algorithm=algorithm, comm=comm)
                assert (buf == p * (p + 1) // 2).all(), (algorithm, n)
        lib = library_comm(comm)
        windows = [w for w in (lib.state.get(Window), lib.state.get(Peers)) if w]
        if p > 1 and lib.layout.single_node:
            assert windows, "no shared window was made on one node"
        for window in windows:
            assert len(set(comm.allgather(window.mode))) == 1
            blocking = comm.allreduce(spin.can_block(), MPI.LAND)
            if mode != "auto":
                assert window.mode == (mode if blocking or mode != "block" else "yield")
                assert window.record[7] == 0
            elif not lib.oversubscribed:
                assert window.mode == "spin"
            else:   # yielding first, then sleeping, where the node can sleep
                assert window.mode == ("block" if blocking else "yield")
                assert window.record[7] == (spin.NAP_AFTER_NS if blocking else 0)
    finally:
        release(comm)
        if before is None:
            os.environ.pop("ALLREDUCE_KIT_WAIT", None)
        else:
            os.environ["ALLREDUCE_KIT_WAIT"] = before


@pytest.mark.mpi
def test_a_bad_wait_mode_on_rank_0_raises_on_every_rank():
    before = os.environ.get("ALLREDUCE_KIT_WAIT")
    comm = MPI.COMM_WORLD.Dup()
    if comm.Get_rank() == 0:
        os.environ["ALLREDUCE_KIT_WAIT"] = "nap"
    try:
        lib = library_comm(comm)
        if comm.Get_size() > 1 and lib.layout.single_node:
            with pytest.raises(ValueError, match="ALLREDUCE_KIT_WAIT"):
                allreduce(np.ones(4, np.float32), algorithm="shared_memory", comm=comm)
        comm.Barrier()
    finally:
        if before is None:
            os.environ.pop("ALLREDUCE_KIT_WAIT", None)
        else:
            os.environ["ALLREDUCE_KIT_WAIT"] = before
        release(comm)
