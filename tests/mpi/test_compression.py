"""``allreduce(..., compression="fp16" | "bf16")``: 16-bit messages, float32 folds.

The contract (docs/compression.md): the result is bitwise the same on every rank and made of
16-bit values; for sum it is within (p + 2) (u sum_i |x_i| + eta) of numpy's float32 sum of the
16-bit-rounded inputs (u the format's unit roundoff, eta half its smallest subnormal; mean: that
over p); max and min are exactly the max and min of the 16-bit-rounded inputs.
"""
import numpy as np
import pytest
from mpi4py import MPI

from allreduce_kit import allreduce, iallreduce, ireduce_scatter, library_comm, reduce_scatter
from allreduce_kit.blocks import block
from allreduce_kit.compression import COMPRESSED, REDUCE_SCATTER, WIRES
from conftest import assert_quiet, assert_same_everywhere

OPS = ("sum", "mean", "max", "min")
#: Half the smallest positive subnormal of each format: the most a rounding moves a tiny value.
ETA = {"fp16": 2.0 ** -25, "bf16": 2.0 ** -134}
NUMPY = {"sum": np.sum, "mean": np.sum, "max": np.max, "min": np.min}
#: At 5 and 8 ranks (more ranks than this machine's cores) the cases that add nothing there are
#: left out: the suite is near its time limit.
MANY = MPI.COMM_WORLD.Get_size() > 4


def lengths(p: int):
    """Empty, one, p - 1, p + 1, and a prime: every way blocks can come out uneven (at many ranks
    p - 1 and the prime only)."""
    return sorted({max(p - 1, 0), 7919} if MANY else {0, 1, max(p - 1, 0), p + 1, 7919})


def rounded(x: np.ndarray, compression: str) -> np.ndarray:
    return WIRES[compression].round(x.copy())


def check_result(comm, x: np.ndarray, got: np.ndarray, op: str, compression: str, block: slice = slice(None)) -> None:
    """``got`` against numpy's float32 reduction of every rank's 16-bit-rounded ``x`` (its
    elements ``block``: a reduce-scatter's)."""
    p = comm.Get_size()
    everyone = np.array(comm.allgather(x), dtype=np.float32).reshape(p, -1)[:, block]
    expected = NUMPY[op](np.array([rounded(row, compression) for row in everyone]), axis=0).astype(np.float32)
    assert np.array_equal(rounded(got, compression).view(np.uint32), got.view(np.uint32)), "not 16-bit values"
    if op in ("max", "min"):
        assert np.array_equal(got, expected), "max and min must be exact"
        return
    bound = (p + 2) * (WIRES[compression].unit_roundoff * np.abs(everyone.astype(np.float64)).sum(axis=0)
                       + ETA[compression])
    if op == "mean":
        expected, bound = expected / np.float32(p), bound / p
    worst = np.abs(got.astype(np.float64) - expected) - bound
    assert (worst <= 0).all(), f"beyond the bound by {worst.max()} at {np.argmax(worst)}"


@pytest.mark.mpi
@pytest.mark.parametrize("compression", sorted(WIRES))
def test_matches_the_rounded_reduction_and_is_the_same_everywhere(comm, compression):
    p, rank = comm.Get_size(), comm.Get_rank()
    algorithms = ["auto", *sorted(COMPRESSED)]  # taking turns: every one meets every op and most lengths
    for i, (op, n) in enumerate((op, n) for op in OPS for n in lengths(p)):
        x = np.random.default_rng([n, rank]).standard_normal(n).astype(np.float32)
        got = allreduce(x.copy(), op=op, algorithm=algorithms[i % len(algorithms)], comm=comm,
                        compression=compression)
        check_result(comm, x, got, op, compression)
        assert_same_everywhere(comm, got)
    assert_quiet(comm)


@pytest.mark.mpi
@pytest.mark.parametrize("compression", sorted(WIRES))
def test_reduce_scatter_leaves_block_r_of_the_compressed_allreduce(comm, compression):
    """Rank r's block meets the allreduce's bound; on one node, bitwise the compressed ring
    allreduce's block r (the same messages, stopped before the allgather); ``out`` may be ``buf``'s
    own block; the nonblocking forms give what the blocking ones give."""
    p, rank = comm.Get_size(), comm.Get_rank()
    algorithms = ["auto", *sorted(REDUCE_SCATTER)]
    for i, (op, n) in enumerate((op, n) for op in OPS for n in lengths(p)):
        x = np.random.default_rng([n, rank, 5]).standard_normal(n).astype(np.float32)
        lo, hi = block(n, p, rank)
        got = reduce_scatter(x, op=op, algorithm=algorithms[i % len(algorithms)], comm=comm, compression=compression)
        assert got.shape == (hi - lo,)
        check_result(comm, x, got, op, compression, slice(lo, hi))
        whole = allreduce(x.copy(), op=op, algorithm="ring", comm=comm, compression=compression)
        assert np.array_equal(got.view(np.uint32), whole[lo:hi].view(np.uint32))
        in_place = x.copy()
        reduce_scatter(in_place, in_place[lo:hi], op=op, comm=comm, compression=compression)
        assert np.array_equal(in_place[lo:hi].view(np.uint32), got.view(np.uint32))
        assert np.array_equal(np.delete(in_place, np.s_[lo:hi]), np.delete(x, np.s_[lo:hi]))
    x = np.random.default_rng([9, rank]).standard_normal(4099).astype(np.float32)
    lo, hi = block(x.size, p, rank)
    started = [ireduce_scatter(x, comm=comm, compression=compression),
               iallreduce(x.copy(), op="mean", comm=comm, compression=compression)]
    got, whole = (h.wait() for h in started)
    assert np.array_equal(got, reduce_scatter(x, comm=comm, compression=compression))
    assert np.array_equal(whole, allreduce(x.copy(), op="mean", comm=comm, compression=compression))
    assert_quiet(comm)


@pytest.mark.mpi
@pytest.mark.parametrize("call", [reduce_scatter, ireduce_scatter, iallreduce])
@pytest.mark.parametrize("buf, kwargs, kind, names", [
    (np.ones(4, np.int64), {}, TypeError, "compression='bf16' takes float32"),
    (np.ones(4, np.float32), {"op": "prod"}, ValueError, "op='prod'"),
    (np.ones(4, np.float32), {"algorithm": "recursive_halving"}, ValueError,
     "algorithm 'recursive_halving' does not support compression"),
    (np.ones(4, np.float32), {"compression": "half"}, ValueError, "unknown compression 'half'"),
])
def test_reduce_scatter_and_the_nonblocking_calls_refuse_what_cannot_compress_before_sending(comm, call, buf, kwargs,
                                                                                          kind, names):
    if call is iallreduce and kwargs.get("algorithm") == "recursive_halving":
        kwargs = {"algorithm": "tree"}
        names = "algorithm 'tree' does not support compression"
    kwargs = {"compression": "bf16", **kwargs}
    with pytest.raises(kind, match=f"^{call.__name__}: .*{names}"):
        call(buf, comm=comm, **kwargs)
    assert_quiet(comm)


@pytest.mark.mpi
def test_a_2d_buffer_and_large_values_reduce_as_their_flat_form(comm):
    p, rank = comm.Get_size(), comm.Get_rank()
    x = np.full((3, 5), 1000.3 * (rank + 1), np.float32)  # partial sums of up to 36000: fp16's coarse range
    got = allreduce(x.copy(), comm=comm, compression="fp16")
    assert got.shape == (3, 5)
    check_result(comm, x.reshape(-1), got.reshape(-1), "sum", "fp16")
    assert_same_everywhere(comm, got)


@pytest.mark.mpi
@pytest.mark.parametrize("buf, kwargs, kind, names", [
    (np.ones(4, np.int32), {}, TypeError, "compression='fp16' takes float32"),
    (np.ones(4, np.int64), {}, TypeError, "int64"),
    (np.ones(4, np.float64), {}, TypeError, "float64"),
    (np.ones(4, np.float32), {"op": "prod"}, ValueError, "op='prod'"),
    (np.ones(4, np.float32), {"algorithm": "tree"}, ValueError, "algorithm 'tree' does not support compression"),
    (np.ones(4, np.float32), {"compression": "fp8"}, ValueError, "unknown compression 'fp8'"),
])
def test_bad_input_raises_on_the_calling_rank_before_anything_is_sent(comm, buf, kwargs, kind, names):
    kwargs = {"compression": "fp16", **kwargs}
    before = buf.copy()
    with pytest.raises(kind, match=names.replace("(", r"\(")):
        allreduce(buf, comm=comm, **kwargs)
    assert np.array_equal(buf, before)
    assert_quiet(comm)


@pytest.mark.mpi
@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() < 2, reason="needs two ranks to differ")
def test_compression_that_differs_between_ranks_is_named_on_every_rank_with_check(comm):
    compression = "fp16" if comm.Get_rank() == 0 else "none"
    with pytest.raises(ValueError, match="compression differs between ranks"):
        allreduce(np.ones(10, np.float32), comm=comm, compression=compression, check=True)
    assert_quiet(comm)


@pytest.mark.mpi
@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() < 2, reason="needs two ranks to differ")
def test_lengths_that_differ_between_ranks_raise_on_every_rank(comm):
    n = 1000 + (comm.Get_rank() == 0)
    with pytest.raises(ValueError, match="buf length differs between ranks"):
        allreduce(np.ones(n, np.float32), comm=comm, compression="bf16")
    assert_quiet(comm)
    assert library_comm(comm) is not None


@pytest.mark.mpi
@pytest.mark.skipif(MANY, reason="the bench's wiring: 2-4 ranks show it")
def test_the_bench_sweep_checks_compressed_rows_against_mpis_result_rounded(comm):
    from allreduce_kit.bench.sweep import sweep
    rows = sweep(comm, [1028], np.dtype(np.float32), "mean", ["ring", "auto", "mpi"], 1, 1, batch=1,
                 compression="fp16")
    assert [(r.algorithm, r.chosen, r.compression, r.wrong) for r in rows] == [
        ("ring", "ring", "fp16", 0), ("auto", "ring", "fp16", 0), ("mpi", "mpi", "none", 0)]



@pytest.mark.mpi
@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() < 2, reason="two nodes need two ranks")
def test_across_two_nodes_hierarchical_compresses_between_them_and_auto_takes_it(comm):
    """The ranks told they sit on two nodes (the first half and the rest): ``hierarchical``'s plan
    splits them so, and its node steps and compressed ring between the nodes meet the contract."""
    import dataclasses
    from allreduce_kit import compression

    p, rank = comm.Get_size(), comm.Get_rank()
    lib = library_comm(comm)
    cores = lib.layout.cores_per_node[0]
    lib.layout = dataclasses.replace(lib.layout, node_of=tuple(int(r >= (p + 1) // 2) for r in range(p)),
                                     cores_per_node=(cores, cores), hosts=(), machine_of=(), cores_per_machine=(),
                                     ranks_per_machine=())
    assert compression.choose(lib, 4096) == "hierarchical"
    for i, (op, n) in enumerate((op, n) for op in OPS for n in (1, p + 1, 7919)):
        x = np.random.default_rng([n, rank, 3]).standard_normal(n).astype(np.float32)
        got = allreduce(x.copy(), op=op, algorithm=("auto", "hierarchical")[i % 2], comm=comm, compression="bf16")
        check_result(comm, x, got, op, "bf16")
        assert_same_everywhere(comm, got)
        lo, hi = block(n, p, rank)  # reduce-scatter: 16-bit partial blocks between the nodes
        got = reduce_scatter(x, op=op, algorithm=("hierarchical", "auto")[i % 2], comm=comm, compression="fp16")
        check_result(comm, x, got, op, "fp16", slice(lo, hi))
    assert_quiet(comm)
