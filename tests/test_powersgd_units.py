"""PowerSGD's pieces that need no MPI job: which matrices gain, orthogonalization, the argument
checks, and one rank's step (a sum over one rank is the identity) against the closed form."""
import numpy as np
import pytest

from allreduce_kit.compression.powersgd import PowerSGD, matrix_shape, orthogonalize, should_compress


def test_a_matrix_is_compressed_only_where_the_factors_are_less_than_half_of_it():
    assert should_compress(64, 128, 21, 2) and not should_compress(64, 128, 22, 2)   # 192 R x 2 < 8192
    assert not should_compress(12, 1, 1, 2), "a bias seen as k x 1 never gains"
    assert matrix_shape((5,)) == (5, 1) and matrix_shape((4, 3, 2)) == (4, 6)


@pytest.mark.parametrize("r", [1, 2, 3])
def test_orthogonalize_makes_orthonormal_columns_spanning_the_same_space(r):
    a = np.random.default_rng(r).standard_normal((9, r)).astype(np.float32)
    q = a.copy()
    orthogonalize(q)
    np.testing.assert_allclose(q.T @ q, np.eye(r), atol=1e-5)
    np.testing.assert_allclose(q @ (q.T @ a), a, atol=1e-5)


def test_a_column_of_zeros_stays_zeros_instead_of_nan():
    q = np.zeros((4, 2), np.float32)
    q[:, 1] = 1
    orthogonalize(q)
    assert np.isfinite(q).all() and not q[:, 0].any()


@pytest.mark.parametrize("kwargs, message", [
    ({"matrix_approximation_rank": 0}, "matrix_approximation_rank must be an integer >= 1, got 0"),
    ({"matrix_approximation_rank": 9}, "matrix_approximation_rank 9 is above the smaller side of every gradient "
                                       "matrix (at most 8 here)"),
    ({"start_powerSGD_iter": -1}, "start_powerSGD_iter must be an integer >= 0, got -1"),
    ({"min_compression_rate": 0}, "min_compression_rate must be > 0"),
])
def test_bad_arguments_name_themselves(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        PowerSGD([(8, 20), (20,)], lambda a: None, 1, **kwargs)


def test_one_rank_step_is_the_rank_r_projection_and_the_error_is_what_it_lost():
    """At one rank, the first compressed step replaces M by P P^T M (P spans M Q) and keeps M - that."""
    rng = np.random.default_rng(0)
    m = rng.standard_normal((30, 20)).astype(np.float32)
    bias = rng.standard_normal(20).astype(np.float32)
    state = PowerSGD([m.shape, bias.shape], lambda a: None, 1, matrix_approximation_rank=2, start_powerSGD_iter=0)
    grads = [m.copy(), bias.copy()]
    state.average(grads)
    assert np.array_equal(grads[1], bias), "the bias goes uncompressed"
    q = np.random.default_rng(np.random.RandomState(0).randint(1_000_000_000)).standard_normal((20, 2)).astype(np.float32)
    orthogonalize(q)
    p = m @ q
    orthogonalize(p)
    np.testing.assert_allclose(grads[0], p @ (m.T @ p).T, atol=1e-5)
    np.testing.assert_allclose(state.error[:m.size].reshape(m.shape), m - grads[0], atol=1e-6)
    assert state.elements_sent() == 20 + (30 + 20) * 2


def test_average_refuses_gradients_of_other_shapes_or_not_contiguous():
    state = PowerSGD([(8, 20)], lambda a: None, 1)
    with pytest.raises(ValueError, match="grads must have the shapes"):
        state.average([np.zeros((20, 8), np.float32)])
    with pytest.raises(ValueError, match=r"grads\[0\] must be a writable C-contiguous float32 array"):
        state.average([np.zeros((20, 8), np.float32).T])


def test_the_torch_layers_state_multiplies_and_factors_by_torch_to_the_numpy_states_rounding():
    """``allreduce_kit.torch`` makes the products and QR with torch (its threads fit the rank's
    share of the cores; numpy's BLAS starts a thread per core beside every rank), and gets numpy's
    results to rounding, the error feedback included, over steps with warm start."""
    torch = pytest.importorskip("torch")
    import allreduce_kit.torch as hvd

    shapes = [(30, 20), (30,), (16, 30), (16,)]
    compressor = hvd.Compression.powersgd(rank=3, start_iter=1)
    rng = np.random.default_rng(7)
    grads = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(4)]
    numpy_state = PowerSGD(shapes, lambda a: None, 1, matrix_approximation_rank=3, start_powerSGD_iter=1)
    for step in grads:
        params = [torch.empty(s) for s in shapes]
        views = [torch.from_numpy(g.copy()) for g in step]
        compressor.average(0, params, views, lambda a: None, 1)
        expected = numpy_state.average([g.copy() for g in step])
        for v, e in zip(views, expected):
            np.testing.assert_allclose(v.numpy(), e, rtol=1e-5, atol=1e-6)
    state = compressor.states[0]
    assert state.matmul is not numpy_state.matmul and state.qr is not None
    np.testing.assert_allclose(state.error, numpy_state.error, atol=1e-5)   # differences of values near 1


def test_a_compressed_step_reduces_twice_p_with_the_uncompressed_part_then_q():
    """Two collectives a step, not three: the biases travel in P's allreduce (each is a
    latency-bound call where ranks share cores); the elements sent are those ``elements_sent`` counts."""
    shapes = [(30, 20), (30,), (16, 30), (16,)]
    sizes = []
    state = PowerSGD(shapes, lambda a: sizes.append(a.size), 1, matrix_approximation_rank=2, start_powerSGD_iter=0)
    expected_sent = state.elements_sent()
    rng = np.random.default_rng(3)
    state.average([rng.standard_normal(s).astype(np.float32) for s in shapes])
    assert sizes == [(30 + 16) * 2 + 30 + 16, (20 + 30) * 2]
    assert sum(sizes) == expected_sent
