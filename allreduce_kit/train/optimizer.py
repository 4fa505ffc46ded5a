"""The optimizers (SGD with momentum, Adam) on a flat parameter buffer, and the learning-rate schedule.

Both are elementwise: element i of the update reads element i of the parameters, the gradient and
the state only. So an optimizer made for a block of the flat buffer (``size`` the block's length)
and stepped on that block of the parameters and of the averaged gradient gives bitwise the block
of the update the whole-buffer optimizer gives: that is how the sharded trainer (``sharding.py``)
keeps only its block of the optimizer state. ``state()`` names the state arrays (the names a
checkpoint stores them under); ``scalars()`` is the rest of the state (Adam's step count).
"""
from typing import Dict, Sequence, Tuple

import numpy as np
from numba import njit

#: The ``--optimizer`` choices.
OPTIMIZERS = ("sgd", "adam")
#: Adam's (beta1, beta2) and epsilon: PyTorch's defaults.
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8


@njit(cache=True, nogil=True)
def _sgd_update(params, grads, velocity, lr, momentum, weight_decay):  # pragma: no cover (compiled)
    for i in range(params.size):
        v = momentum * velocity[i] + (grads[i] + weight_decay * params[i])
        velocity[i] = v
        params[i] -= lr * v


class SGD:
    """``v = momentum * v + (g + weight_decay * w);  w -= lr * v`` on whole flat buffers.

    One compiled pass over the buffers (numba): it reads each of parameters, gradient and
    velocity once, where numpy needs five passes and a temporary buffer; for a 5.3M-parameter
    model that is about 4x faster (docs/training.md) and leaves the caches to the collective.
    Every rank applies it to the same averaged gradient, so the replicas stay bitwise identical.
    """

    def __init__(self, size: int, dtype, momentum: float = 0.9, weight_decay: float = 0.0):
        self.dtype = np.dtype(dtype)
        self.momentum = float(momentum)
        self.weight_decay = float(weight_decay)
        self.velocity = np.zeros(size, dtype=self.dtype)

    def warm_up(self) -> None:
        """Load (or compile) the update kernel now, on a one-element buffer, not in step 1."""
        one = np.zeros(1, dtype=self.dtype)
        _sgd_update(one, one.copy(), one.copy(), self.dtype.type(0), self.dtype.type(0), self.dtype.type(0))

    def step(self, params: np.ndarray, grads: np.ndarray, lr: float) -> None:
        self.step_pieces([(params, grads)], lr)

    def step_pieces(self, pieces: Sequence[Tuple[np.ndarray, np.ndarray]], lr: float) -> None:
        """One step on (parameters, gradient) pieces that take the state's elements one after the
        other (a rank's blocks of several buckets): bitwise ``step`` on their concatenation."""
        scalar = self.dtype.type          # arithmetic in the buffers' dtype
        at = 0
        for params, grads in pieces:
            _sgd_update(params, grads, self.velocity[at:at + params.size], scalar(lr), scalar(self.momentum),
                        scalar(self.weight_decay))
            at += params.size

    def state(self) -> Dict[str, np.ndarray]:
        """The state arrays by the name a checkpoint stores them under."""
        return {"velocity": self.velocity}

    def scalars(self) -> Dict[str, int]:
        return {}

    def load_scalars(self, scalars: Dict[str, int]) -> None:
        """Nothing but arrays: SGD's state is its velocity."""


@njit(cache=True, nogil=True)
def _adam_update(params, grads, m, v, step_size, bias2_root, beta1, beta2, eps, weight_decay):  # pragma: no cover
    one = beta1 - beta1 + 1
    for i in range(params.size):
        g = grads[i] + weight_decay * params[i]
        mi = beta1 * m[i] + (one - beta1) * g
        vi = beta2 * v[i] + (one - beta2) * g * g
        m[i] = mi
        v[i] = vi
        params[i] -= step_size * mi / (np.sqrt(vi) / bias2_root + eps)


class Adam:
    """Adam (Kingma and Ba, 2015) as ``torch.optim.Adam`` computes it, weight decay added to the gradient::

        g = g + weight_decay * w;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
        w -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

    with (b1, b2) = ``ADAM_BETAS``, eps = ``ADAM_EPS`` and t the number of steps taken. Its state is
    8 bytes per float32 parameter (m and v), which is what ``--zero 1`` shards. One compiled pass.
    """

    def __init__(self, size: int, dtype, weight_decay: float = 0.0,
                 betas: Tuple[float, float] = ADAM_BETAS, eps: float = ADAM_EPS):
        self.dtype = np.dtype(dtype)
        self.weight_decay = float(weight_decay)
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = float(eps)
        self.exp_avg = np.zeros(size, dtype=self.dtype)
        self.exp_avg_sq = np.zeros(size, dtype=self.dtype)
        self.steps = 0

    def warm_up(self) -> None:
        """Load (or compile) the update kernel now, on a one-element buffer, not in step 1."""
        one = np.zeros(1, dtype=self.dtype)
        s = self.dtype.type
        _adam_update(one, one.copy(), one.copy(), one.copy(), s(0), s(1), s(0), s(0), s(1), s(0))

    def step(self, params: np.ndarray, grads: np.ndarray, lr: float) -> None:
        self.step_pieces([(params, grads)], lr)

    def step_pieces(self, pieces: Sequence[Tuple[np.ndarray, np.ndarray]], lr: float) -> None:
        """One step (t counts once) on pieces that take the state's elements one after the other."""
        self.steps += 1
        b1, b2 = self.betas
        s = self.dtype.type               # the scalars worked out in float64, the loop in the buffers' dtype
        at = 0
        for params, grads in pieces:
            stop = at + params.size
            _adam_update(params, grads, self.exp_avg[at:stop], self.exp_avg_sq[at:stop],
                         s(lr / (1 - b1 ** self.steps)), s(np.sqrt(1 - b2 ** self.steps)), s(b1), s(b2), s(self.eps),
                         s(self.weight_decay))
            at = stop

    def state(self) -> Dict[str, np.ndarray]:
        """The state arrays by the name a checkpoint stores them under."""
        return {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    def scalars(self) -> Dict[str, int]:
        return {"adam_steps": self.steps}

    def load_scalars(self, scalars: Dict[str, int]) -> None:
        self.steps = int(scalars.get("adam_steps", 0))


def make_optimizer(name: str, size: int, dtype, momentum: float, weight_decay: float):
    """The ``--optimizer`` ``name`` for a buffer (or a block) of ``size`` elements."""
    if name == "adam":
        return Adam(size, dtype, weight_decay)
    if name == "sgd":
        return SGD(size, dtype, momentum, weight_decay)
    raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {name!r}")


def state_per_parameter(name: str) -> int:
    """How many elements of optimizer state each parameter has (SGD: velocity; Adam: m and v)."""
    return 2 if name == "adam" else 1


def learning_rate(base: float, ranks: int, scaling: str, warmup_steps: int, step: int) -> float:
    """The learning rate at global ``step`` (0-based).

    ``scaling="linear"`` targets ``base * ranks`` (Goyal et al. 2017, "Accurate, Large Minibatch
    SGD"); during the first ``warmup_steps`` steps the rate rises linearly from ``base`` to the
    target, as in that paper. With ``scaling="none"`` the target is ``base`` (warm-up changes nothing).
    """
    target = base * ranks if scaling == "linear" else base
    if warmup_steps > 0 and step < warmup_steps:
        return base + (target - base) * step / warmup_steps
    return target
