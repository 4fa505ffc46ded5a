"""The trainer's optimizers: ``--optimizer adam`` is PyTorch's Adam, and a step on blocks of the
buffers (as a sharded run takes it) is bitwise the step on the whole buffers."""
import numpy as np
import pytest

from allreduce_kit.train.optimizer import SGD, Adam, make_optimizer


def test_adam_is_pytorchs_adam():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    w = rng.standard_normal(1001).astype(np.float32)
    grads = [rng.standard_normal(1001).astype(np.float32) for _ in range(5)]
    ours = Adam(w.size, np.float32, weight_decay=1e-2)
    mine = w.copy()
    theirs = torch.nn.Parameter(torch.from_numpy(w.copy()))
    reference = torch.optim.Adam([theirs], lr=1e-2, weight_decay=1e-2)
    for g in grads:
        ours.step(mine, g, 1e-2)
        theirs.grad = torch.from_numpy(g.copy())
        reference.step()
    np.testing.assert_allclose(mine, theirs.detach().numpy(), rtol=1e-6, atol=1e-6)
    assert ours.steps == 5


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_a_step_on_blocks_is_bitwise_the_step_on_the_whole_buffer(name):
    rng = np.random.default_rng(1)
    w = rng.standard_normal(1199).astype(np.float32)
    whole = make_optimizer(name, w.size, np.float32, 0.9, 1e-4)
    blocks = make_optimizer(name, w.size, np.float32, 0.9, 1e-4)
    a, b = w.copy(), w.copy()
    cuts = [0, 250, 251, 700, 1199]
    for _ in range(3):
        g = rng.standard_normal(w.size).astype(np.float32)
        whole.step(a, g, 0.01)
        blocks.step_pieces([(b[lo:hi], g[lo:hi]) for lo, hi in zip(cuts, cuts[1:])], 0.01)
    assert np.array_equal(a, b)
    for key, state in whole.state().items():
        assert np.array_equal(state, blocks.state()[key])
    assert isinstance(make_optimizer("sgd", 1, np.float32, 0.9, 0.0), SGD)
    with pytest.raises(ValueError, match="optimizer must be one of sgd, adam"):
        make_optimizer("lamb", 1, np.float32, 0.9, 0.0)
