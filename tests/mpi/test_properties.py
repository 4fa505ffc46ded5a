"""Property tests: hypothesis picks lengths, dtypes, ops, algorithms and values (NaN, +-Inf,
signed zeros, integer extremes), and the result must match MPI's own Allreduce.

Every rank draws the same examples (``derandomize``) and fills its buffer from the example's
seed and its rank. The verdict is agreed across ranks before asserting, so when an example
fails, every rank fails and shrinks the same way instead of leaving the others waiting.

Where ours and MPI's may differ by design: NaN in max/min (ours propagates NaN from any rank,
MPICH's depends on which rank holds it) is checked against numpy's NaN-propagating reduction of
all ranks' inputs instead, and the sign of a zero max/min is not compared.
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from mpi4py import MPI

from allreduce_kit import ALGORITHMS, OPS, allreduce

FLOAT_SPECIALS = (np.nan, np.inf, -np.inf, 0.0, -0.0)
MPI_OP = {"sum": MPI.SUM, "mean": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}
NUMPY_OP = {"max": np.maximum, "min": np.minimum}


def rank_values(n: int, dtype: np.dtype, seed: int, rank: int, special_share: float) -> np.ndarray:
    rng = np.random.default_rng([seed, rank])
    if dtype.kind == "i":
        info = np.iinfo(dtype)
        x = rng.integers(-1000, 1000, n).astype(dtype)
        extreme = rng.random(n) < special_share  # values that overflow when summed or multiplied
        x[extreme] = rng.choice([info.min, info.max, info.max // 2 + 1, -1], extreme.sum())
        return x
    magnitudes = rng.uniform(0.5, 4.0, n) * rng.choice([-1.0, 1.0], n)  # no order-dependent overflow
    x = magnitudes.astype(dtype)
    special = rng.random(n) < special_share
    x[special] = rng.choice(FLOAT_SPECIALS, special.sum())
    return x


def truncated_mean(total: np.ndarray, p: int) -> np.ndarray:
    """Integer sum / p truncated toward zero, exactly (float division would lose int64 bits)."""
    return np.array([int(v) // p if v >= 0 else -((-int(v)) // p) for v in total], dtype=total.dtype)


def expected_result(comm, x: np.ndarray, op: str, nan_propagating: bool = True) -> np.ndarray:
    p = comm.Get_size()
    if op in NUMPY_OP and x.dtype.kind == "f" and nan_propagating:
        everyone = np.array(comm.allgather(x)).reshape(p, x.size)
        return NUMPY_OP[op].reduce(everyone, axis=0) if x.size else x.copy()
    expected = x.copy()
    comm.Allreduce(MPI.IN_PLACE, expected, op=MPI_OP[op])
    if op == "mean":
        expected = expected / x.dtype.type(p) if x.dtype.kind == "f" else truncated_mean(expected, p)
    return expected


def agrees(comm, x: np.ndarray, result: np.ndarray, expected: np.ndarray, op: str) -> bool:
    if x.dtype.kind == "i":
        return bool(np.array_equal(result, expected))
    same_class = np.array_equal(np.isnan(result), np.isnan(expected)) and np.array_equal(np.isinf(result), np.isinf(expected))
    finite = np.isfinite(expected)
    if not same_class or not np.array_equal(result[np.isinf(result)], expected[np.isinf(expected)]):
        return False
    if op in ("max", "min"):
        return bool(np.array_equal(result[finite], expected[finite]))
    scale = np.abs(np.where(np.isfinite(x), x, 0)).astype(np.float64)
    comm.Allreduce(MPI.IN_PLACE, scale, op=MPI.SUM)
    if op == "prod":
        scale = np.abs(expected.astype(np.float64))
    p, eps = comm.Get_size(), np.finfo(x.dtype).eps
    return bool(np.all(np.abs(result[finite].astype(np.float64) - expected[finite]) <= 2 * p * eps * scale[finite] + 1e-30))


@pytest.mark.mpi
@settings(derandomize=True, database=None, max_examples=60, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(n=st.integers(0, 200), dtype=st.sampled_from(["float32", "float64", "int32", "int64"]),
       op=st.sampled_from(OPS), comm_name=st.sampled_from(["world", "split"]), seed=st.integers(0, 2**32 - 1),
       special_share=st.sampled_from([0.0, 0.05, 0.5]))
def test_any_call_matches_mpi_with_every_algorithm(comms, n, dtype, op, comm_name, seed, special_share):
    comm = comms[comm_name]
    x = rank_values(n, np.dtype(dtype), seed, comm.Get_rank(), special_share)
    ours = expected_result(comm, x, op)
    mpis = expected_result(comm, x, op, nan_propagating=False)
    for algorithm in sorted(ALGORITHMS) + ["auto"]:
        expected = mpis if algorithm == "mpi" else ours  # MPI's own max/min may drop a NaN
        result = allreduce(x.copy(), op=op, algorithm=algorithm, comm=comm)
        mine = agrees(comm, x, result, expected, op)
        everyone = comms["world"].allreduce(mine, op=MPI.LAND)
        assert everyone, (f"{algorithm}: rank {comms['world'].Get_rank()} {'agrees' if mine else 'differs'}\n"
                          f"result   {result}\nexpected {expected}")
