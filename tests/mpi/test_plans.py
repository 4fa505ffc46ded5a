"""Persistent plans: a plan's calls give what MPI's ``Allreduce`` gives, for every algorithm, op,
dtype and awkward length, call after call on the same buffer; misuse raises ``ValueError``
before anything is sent; ``average_buffer`` keeps its plans.
"""
import gc
import itertools

import numpy as np
import pytest
from mpi4py import MPI

import allreduce_kit
from allreduce_kit import ALGORITHMS, OPS, Plan, average_buffer, library_comm, plan
from conftest import assert_quiet, assert_same_everywhere, cases
from test_allreduce import DTYPES, float_tolerance, local_values, oracle


def plan_lengths(p: int):
    """Awkward lengths, and one past ``shared_memory``'s scatter threshold (16 KiB) in every dtype."""
    return sorted({0, 1, max(p - 1, 0), p, p + 1, 1000, 5003})


def assert_matches(comm, x: np.ndarray, expected: np.ndarray, tolerance, case: str) -> None:
    if tolerance is None:
        assert np.array_equal(x, expected), f"{case}: integers must match MPI exactly"
    else:
        error = np.abs(x.astype(np.float64) - expected)
        assert np.all(error <= tolerance), f"{case}: max error {error.max()} beyond tolerance"


@pytest.mark.mpi
def test_plan_is_exported_as_a_function():
    """``allreduce_kit.plan`` is the function even though a module defines it (``plans``)."""
    from allreduce_kit import plans

    assert allreduce_kit.plan is plans.plan and allreduce_kit.Plan is plans.Plan


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS) + ["auto"])
def test_plan_matches_mpi_allreduce(comm, algorithm):
    """Each plan is called three times on its buffer, refilled in between (the first call binds,
    the later ones take the bound path), the third time as ``start(); wait()``."""
    rank = comm.Get_rank()
    for (dtype, op), n in cases(comm, list(itertools.product(DTYPES, OPS)), plan_lengths(comm.Get_size())):
        x = np.empty(n, dtype)
        planned = plan(x, op=op, algorithm=algorithm, comm=comm)
        assert planned.algorithm in ALGORITHMS or (planned.algorithm == "auto" and (n == 0 or comm.Get_size() == 1))
        for call in range(3):
            fresh = local_values(n, dtype, rank + 7 * call)
            x[:] = fresh
            expected = oracle(comm, fresh, op)
            tolerance = float_tolerance(comm, fresh, op) if x.dtype.kind == "f" else None
            if call < 2:
                assert planned() is x, "a plan reduces its buffer in place and returns it"
            else:
                planned.start()
                assert planned.wait() is x
            case = f"{planned!r} call {call}: {dtype} {op} n={n}"
            assert_matches(comm, x, expected, tolerance, case)
            assert_same_everywhere(comm, x)
        if planned.algorithm == "mpi" and n and comm.Get_size() > 1:  # bound to MPI's own call, but for a mean
            assert (planned._native is None) == (op == "mean"), case
        assert_quiet(comm)


@pytest.mark.mpi
def test_a_plan_reduces_what_allreduce_gives_bit_for_bit(comm):
    """A plan's bound path and ``allreduce`` take the same steps: the same bits."""
    for algorithm in sorted(ALGORITHMS):
        for dtype in ("float32", "float64"):
            x = local_values(4099, dtype, comm.Get_rank())
            y = x.copy()
            allreduce_kit.allreduce(x, op="mean", algorithm=algorithm, comm=comm)
            planned = plan(y, op="mean", algorithm=algorithm, comm=comm)
            planned()
            assert np.array_equal(x, y), f"{algorithm} {dtype}"


@pytest.mark.mpi
def test_a_span_plan_reduces_only_its_span_of_any_layout(comm):
    """``Plan(buf, span=...)`` reduces elements ``[start, stop)`` of ``buf``'s flat view; a 2-D or
    Fortran-ordered ``buf`` is reduced in place and keeps its shape."""
    p, rank = comm.Get_size(), comm.Get_rank()
    for layout in ("C", "F"):
        grid = np.full((6, 7), rank + 1.0, order=layout)
        flat_before = grid.reshape(-1, order=layout).copy()
        Plan(grid, op="sum", span=(5, 30), comm=comm)()
        flat = grid.reshape(-1, order=layout)
        assert np.all(flat[5:30] == p * (p + 1) / 2) and np.array_equal(flat[:5], flat_before[:5])
        assert np.array_equal(flat[30:], flat_before[30:]) and grid.shape == (6, 7)
        plan(grid, op="max", comm=comm)()  # the whole buffer: the span's sums, elsewhere the largest rank + 1
        flat = grid.reshape(-1, order=layout)
        assert np.all(flat[5:30] == p * (p + 1) / 2) and np.all(flat[:5] == p) and np.all(flat[30:] == p)
    with pytest.raises(ValueError, match=r"plan: span \(3, 99\) is not within buf's 42 elements"):
        Plan(np.ones((6, 7)), span=(3, 99), comm=comm)


@pytest.mark.mpi
def test_misuse_raises_on_the_rank_before_anything_is_sent(comm):
    x = np.ones(10)
    planned = plan(x, comm=comm)
    with pytest.raises(ValueError, match="plan: called with another buffer than the one it was made for"):
        planned(np.ones(10))
    with pytest.raises(ValueError, match="plan: called on another communicator than the one it was made on"):
        planned(comm=MPI.COMM_SELF)
    assert planned(x, comm=comm) is x  # its own buffer and communicator are fine
    x.dtype = np.int64  # same bytes, another dtype
    with pytest.raises(ValueError, match=r"plan: buf's shape or dtype changed since the plan was made \(it was "
                                         r"\(10,\) float64, it is \(10,\) int64\)"):
        planned()
    x.dtype = np.float64
    x.shape = (2, 5)
    with pytest.raises(ValueError, match="plan: buf's shape or dtype changed"):
        planned()
    with pytest.raises(ValueError, match="plan.wait: the plan was not started"):
        planned.wait()
    x.shape = (10,)
    x.flags.writeable = False
    with pytest.raises(ValueError, match="plan: buf is read-only now"):
        planned()
    x.flags.writeable = True
    planned.start()
    with pytest.raises(ValueError, match="plan.start: the plan is already started"):
        planned.start()
    planned.wait()
    planned.free()
    with pytest.raises(ValueError, match="plan: this plan was freed"):
        planned()
    y = np.ones(10)
    orphan = plan(y, comm=comm)
    del y
    gc.collect()
    with pytest.raises(ValueError, match="plan: the buffer this plan was made for no longer exists"):
        orphan()
    with pytest.raises(ValueError, match="cannot resize"):  # numpy refuses: the plan holds a weak reference
        z = np.ones(10)
        kept = plan(z, comm=comm)  # noqa: F841  (alive while z is resized)
        z.resize(20, refcheck=False)
    assert_quiet(comm)


@pytest.mark.mpi
def test_a_plan_on_a_freed_communicator_says_so():
    mine = MPI.COMM_WORLD.Dup()
    x = np.ones(5)
    planned = plan(x, comm=mine)
    planned()
    mine.Free()
    with pytest.raises(ValueError, match="plan: the communicator this plan was made on has been freed"):
        planned()


@pytest.mark.mpi
@pytest.mark.parametrize("bad,error,words", [
    (dict(buf=[1.0, 2.0]), TypeError, "plan: buf must be a numpy.ndarray, got list"),
    (dict(op="median"), ValueError, "plan: unknown op 'median'"),
    (dict(algorithm="butterfly"), ValueError, "plan: unknown algorithm 'butterfly'"),
    (dict(buf=np.ones(3, np.int16)), TypeError, "plan: buf has unsupported dtype"),
    (dict(stall_timeout=-1), ValueError, "plan: stall_timeout: .*>= 0"),
])
def test_bad_arguments_are_named(comm, bad, error, words):
    args = dict(buf=np.ones(3), op="sum", algorithm="auto", comm=comm)
    args.update(bad)
    with pytest.raises(error, match=words):
        plan(args.pop("buf"), **args)
    assert_quiet(comm)


@pytest.mark.mpi
@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() == 1, reason="a mismatch needs two ranks")
def test_a_checked_plan_refuses_lengths_that_differ_on_every_rank(comm):
    x = np.ones(10 + (comm.Get_rank() == 1))
    with pytest.raises(ValueError, match=r"plan\(check=True\): buf length differs between ranks"):
        plan(x, check=True, comm=comm)
    assert_quiet(comm)


@pytest.mark.mpi
@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() == 1, reason="a mismatch needs two ranks")
@pytest.mark.parametrize("algorithm", ["shared_memory", "recursive_doubling", "ring"])
def test_an_unchecked_plan_whose_lengths_differ_raises_on_every_rank(comm, algorithm):
    """Without ``check``, the call's signature (``algorithms/signature.py``) still catches it, on
    the bound path too (the second call)."""
    same = np.ones(4)
    planned = plan(same, algorithm=algorithm, comm=comm)
    planned()
    x = np.ones(6 + (comm.Get_rank() == 1))
    odd = plan(x, algorithm=algorithm, comm=comm)
    with pytest.raises(ValueError, match="buf length differs between ranks"):
        odd()
    planned()  # the communicator is still usable
    assert_quiet(comm)


@pytest.mark.mpi
@pytest.mark.parametrize("bucket_mb", [0, 4e-3])
def test_average_buffer_reuses_its_plans(comm, bucket_mb):
    from allreduce_kit.plans import _BufferPlans

    rank = comm.Get_rank()
    grads = np.empty(2500, np.float32)
    for step in range(3):
        grads[:] = local_values(grads.size, "float32", rank + step)
        expected = oracle(comm, grads, "mean")
        tolerance = float_tolerance(comm, grads, "mean")
        assert average_buffer(grads, bucket_mb=bucket_mb, comm=comm) is grads
        assert_matches(comm, grads, expected, tolerance, f"step {step}")
        assert_same_everywhere(comm, grads)
    entries = library_comm(comm).state[_BufferPlans].entries
    assert len(entries) == 1, "one buffer, one set of plans, made once"
    (held, plans), = entries.values()
    assert held() is grads and len(plans) == (1 if bucket_mb == 0 else 3)  # 4 kB buckets of 10 kB
    assert_quiet(comm)
