"""PowerSGD (``allreduce_kit.compression.powersgd``) across the job's ranks against a numpy
reference of the algorithm that simulates every rank in one process: equal to 1e-6, and the
averaged gradients bitwise the same on every rank."""
import numpy as np
import pytest
from mpi4py import MPI

from allreduce_kit.compression.powersgd import PowerSGD
from conftest import assert_quiet, assert_same_everywhere

#: Gradients of a small model: two matrices that compress at rank 1 and 2, biases, and a matrix
#: too small to gain ((n + m) R >= n m / 2), which goes uncompressed.
SHAPES = [(20, 12), (12,), (12, 7), (7,), (3, 2)]
STEPS = 4


def gradients(step: int, rank: int):
    rng = np.random.default_rng([step, rank, 7])
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


def orthonormal(a: np.ndarray) -> np.ndarray:
    """The columns of ``a`` made orthonormal: Gram-Schmidt for at most 2 columns, else QR."""
    a = a.copy()
    if a.shape[1] > 2:
        return np.linalg.qr(a)[0]
    for i in range(a.shape[1]):
        a[:, i] /= np.linalg.norm(a[:, i])
        for j in range(i + 1, a.shape[1]):
            a[:, j] -= np.dot(a[:, i], a[:, j]) * a[:, i]
    return a


def reference(p: int, rank_r: int, start: int, seed: int = 0):
    """What PowerSGD gives after each of ``STEPS`` steps, every one of ``p`` ranks simulated here."""
    rng = np.random.RandomState(seed)
    errors = [[np.zeros(s, np.float32) for s in SHAPES] for _ in range(p)]
    qs = None
    out = []
    for step in range(STEPS):
        grads = [gradients(step, r) for r in range(p)]
        if step < start:
            out.append([sum(g[i] for g in grads) / np.float32(p) for i in range(len(SHAPES))])
            continue
        grads = [[g + e for g, e in zip(gs, es)] for gs, es in zip(grads, errors)]
        compress = [len(s) == 2 and (s[0] + s[1]) * min(rank_r, *s) * 2 < s[0] * s[1] for s in SHAPES]
        if qs is None:
            draw = np.random.default_rng(rng.randint(1_000_000_000))
            qs = {i: draw.standard_normal((SHAPES[i][1], min(rank_r, *SHAPES[i]))).astype(np.float32)
                  for i in range(len(SHAPES)) if compress[i]}
        averaged = []
        for i in range(len(SHAPES)):
            if not compress[i]:
                averaged.append(sum(g[i] for g in grads) / np.float32(p))
                continue
            q = orthonormal(qs[i])
            pm = orthonormal(sum(g[i] @ q for g in grads))
            qs[i] = sum(g[i].T @ pm for g in grads) / np.float32(p)
            averaged.append(pm @ qs[i].T)
        errors = [[g - a for g, a in zip(gs, averaged)] for gs in grads]
        out.append(averaged)
    return out


@pytest.mark.mpi
@pytest.mark.parametrize("rank_r", [1, pytest.param(3, marks=pytest.mark.skipif(
    MPI.COMM_WORLD.Get_size() > 4, reason="QR's path: 1-4 ranks show it (the suite is near its limit)"))])
def test_matches_the_numpy_reference_and_replicas_agree(comm, rank_r):
    p, me = comm.Get_size(), comm.Get_rank()
    # a named algorithm: auto would time candidates at each new size (online tuning), which is not under test
    state = PowerSGD.over(comm, SHAPES, algorithm="recursive_doubling", matrix_approximation_rank=rank_r,
                          start_powerSGD_iter=1)
    expected = reference(p, rank_r, start=1)
    for step in range(STEPS):
        grads = gradients(step, me)
        state.average(grads)
        for got, want in zip(grads, expected[step]):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        assert_same_everywhere(comm, np.concatenate([g.reshape(-1) for g in grads]))
    assert state.elements_sent() == 12 + 7 + 6 + (20 + 12) * rank_r + ((12 + 7) * rank_r if rank_r == 1 else 84)
    assert_quiet(comm)
