"""The timed loop, kept free of the bench's own work.

Each sample of each algorithm: restore the input (untimed), a barrier, then ``batch``
back-to-back calls timed with ``perf_counter`` on every rank; the sample's time per call is
the slowest rank's. The algorithms of one message size take turns sample by sample, so a burst
of load from elsewhere on the machine hits them all alike and their ratios stay fair. Buffers
exist and kernels are compiled before the first timed call (warm-up calls run first).
"""
from time import perf_counter
from typing import Callable, Dict

import numpy as np
from mpi4py import MPI

#: Messages below this many bytes are timed in batches, so a sample is not just timer noise.
BATCH_BYTES = 256 << 10
MAX_BATCH = 64


def calls_per_sample(nbytes: int, batch: int = 0) -> int:
    """``batch`` if given, else enough calls that a sample moves about ``BATCH_BYTES`` (1..64)."""
    if batch > 0:
        return batch
    return max(1, min(MAX_BATCH, BATCH_BYTES // max(nbytes, 1)))


def time_calls(calls: Dict[str, Callable[[], object]], restore: Callable[[], object], comm: MPI.Intracomm,
               samples: int, warmup: int, batch: int) -> Dict[str, np.ndarray]:
    """Seconds per call for each sample of each call, the slowest rank's (the same on every rank)."""
    for call in calls.values():
        for _ in range(warmup):
            call()
    times = np.empty((len(calls), samples))
    loop = range(batch)
    for i in range(samples):
        for j, call in enumerate(calls.values()):
            restore()
            comm.Barrier()
            start = perf_counter()
            for _ in loop:
                call()
            times[j, i] = (perf_counter() - start) / batch
    comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
    return dict(zip(calls, times))
