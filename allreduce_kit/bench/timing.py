"""The timed loop, kept free of the bench's own work.

Each sample of each algorithm: restore the input (untimed), a barrier, then ``batch``
back-to-back calls timed with ``perf_counter`` on every rank, then a second barrier (untimed);
the sample's time per call is the slowest rank's. The second barrier keeps the bench's own work
out of other ranks' timed calls: without it a rank that finishes early goes on to restore the
next input (a copy of the whole buffer) while the others are still timed, and where ranks
share cores that copy takes a core from them (at 8 ranks on 2 cores and 16 MiB it made MPI's
time 27% longer, the ring's 30% and two_shot's 43%: docs/performance.md).

The algorithms of one message size take turns sample by sample, so a burst of load from
elsewhere on the machine hits them all alike and their ratios stay fair; each sample takes
them in a new random order (seeded, the same on every rank), so that no algorithm always runs
right after the same other one and inherits the state it leaves behind. Buffers
exist and kernels are compiled before the first timed call (warm-up calls run first).

``batch`` comes from the warm-up: as many calls as fit in ``SAMPLE_SECONDS`` at the fastest
algorithm's warm-up pace (its quickest warm-up call, on the slowest rank), 1 to ``MAX_BATCH``,
unless ``--batch`` fixes it. Batching keeps a microsecond call from drowning in timer and
barrier noise; one call per sample suffices for long ones. Every algorithm of a size gets the
same batch: a sample's fixed cost (ranks leave the barrier at different times, by up to a time
slice when they share cores) is then spread over the same number of calls for each, instead of
favouring whichever algorithm happened to warm up fastest.
"""
from time import perf_counter
from typing import Callable, Dict, Tuple

import numpy as np
from mpi4py import MPI

SAMPLE_SECONDS = 1e-3
MAX_BATCH = 64


def batch_for(pace: float) -> int:
    """Calls per sample for calls of ``pace`` seconds: as many as fit in ``SAMPLE_SECONDS``, 1 to ``MAX_BATCH``."""
    return int(max(1, min(MAX_BATCH, SAMPLE_SECONDS / max(pace, 1e-9))))


def time_calls(calls: Dict[str, Callable[[], object]], restore: Callable[[], object], comm: MPI.Intracomm,
               samples: int, warmup: int, batch: int = 0) -> Tuple[Dict[str, np.ndarray], Dict[str, int]]:
    """Seconds per call for each sample of each call (the slowest rank's, the same on every
    rank), and the batch each was timed with."""
    paces = np.full(len(calls), np.inf)
    for j, call in enumerate(calls.values()):
        restore()
        for _ in range(warmup):  # the pace is the quickest warm-up call: a one-off cost of one call
            start = perf_counter()  # (a first use, a rank that arrives late) would shrink every batch
            call()
            paces[j] = min(paces[j], perf_counter() - start)
    comm.Allreduce(MPI.IN_PLACE, paces, op=MPI.MAX)
    common = batch if batch > 0 else batch_for(paces.min())
    batches = [common] * len(calls)
    times = np.empty((len(calls), samples))
    functions = list(calls.values())
    turns = np.random.default_rng(0)  # the same seed on every rank, so every rank calls alike
    for i in range(samples):
        for j in turns.permutation(len(functions)):
            call = functions[j]
            loop = range(batches[j])
            restore()
            comm.Barrier()
            start = perf_counter()
            for _ in loop:
                call()
            times[j, i] = (perf_counter() - start) / batches[j]
            comm.Barrier()  # nobody restores (a copy of the whole buffer) while others are still timed
    comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
    return dict(zip(calls, times)), dict(zip(calls, batches))
