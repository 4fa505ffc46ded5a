"""SGD with momentum and weight decay on the flat parameter buffer, and the learning-rate schedule."""
import numpy as np


class SGD:
    """``v = momentum * v + (g + weight_decay * w);  w -= lr * v`` on whole flat buffers.

    Every rank applies it to the same averaged gradient, so the replicas stay bitwise identical.
    """

    def __init__(self, size: int, dtype, momentum: float = 0.9, weight_decay: float = 0.0):
        self.momentum = float(momentum)
        self.weight_decay = float(weight_decay)
        self.velocity = np.zeros(size, dtype=dtype)
        self._tmp = np.empty(size, dtype=dtype)

    def step(self, params: np.ndarray, grads: np.ndarray, lr: float) -> None:
        v, tmp = self.velocity, self._tmp
        if self.weight_decay:
            np.multiply(params, self.weight_decay, out=tmp)
            tmp += grads
        else:
            tmp[...] = grads
        v *= self.momentum
        v += tmp
        np.multiply(v, lr, out=tmp)
        params -= tmp


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
