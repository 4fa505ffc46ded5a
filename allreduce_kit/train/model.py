"""A multilayer perceptron with softmax cross-entropy, forward and backward written out in numpy.

All parameters live in one flat buffer and all gradients in another (``FlatParameters``); each
layer's weight ``W`` (in x out) and bias ``b`` are views into them, so the backward pass writes
the fused gradient directly and one step needs one allreduce (per bucket). The matrix products
go to BLAS. numba is not used here because it would not pay: for large models the matrix
products are over 90% of the compute, and for the default digits model the whole compute
(about 0.3 ms) is a few percent of a step dominated by the allreduce (docs/training.md).
"""
from typing import List, Sequence, Tuple

import numpy as np

from ..params import FlatParameters


class MLP:
    """ReLU layers of the given widths between ``inputs`` features and ``classes`` outputs."""

    def __init__(self, inputs: int, hidden: Sequence[int], classes: int, dtype=np.float32):
        self.widths = [int(inputs), *map(int, hidden), int(classes)]
        shapes: List[Tuple[int, ...]] = []
        for fan_in, fan_out in zip(self.widths[:-1], self.widths[1:]):
            shapes += [(fan_in, fan_out), (fan_out,)]
        self.flat = FlatParameters(shapes, dtype=dtype)
        self.params, self.grads = self.flat.params, self.flat.grads
        self._p = self.flat.views(self.params)
        self._g = self.flat.views(self.grads)
        self.dtype = self.flat.dtype

    @property
    def size(self) -> int:
        return self.flat.size

    def describe(self) -> str:
        return "-".join(map(str, self.widths))

    def init(self, rng: np.random.Generator) -> None:
        """He-normal weights, zero biases (writes the flat parameter buffer)."""
        for layer in range(len(self.widths) - 1):
            W, b = self._p[2 * layer], self._p[2 * layer + 1]
            W[...] = rng.standard_normal(W.shape) * np.sqrt(2.0 / W.shape[0])
            b[...] = 0

    def _forward(self, X: np.ndarray) -> List[np.ndarray]:
        acts = [X]
        last = len(self.widths) - 2
        for layer in range(last + 1):
            W, b = self._p[2 * layer], self._p[2 * layer + 1]
            z = acts[-1] @ W
            z += b
            if layer < last:
                np.maximum(z, 0, out=z)
            acts.append(z)
        return acts

    def predict(self, X: np.ndarray) -> np.ndarray:
        return np.argmax(self._forward(X.astype(self.dtype, copy=False))[-1], axis=1)

    def forward_backward(self, X: np.ndarray, y: np.ndarray) -> Tuple[float, int]:
        """Write this batch's mean-loss gradient into ``self.grads``; return (loss sum, correct)."""
        acts = self._forward(X)
        logits = acts[-1]
        n = X.shape[0]
        logits -= logits.max(axis=1, keepdims=True)
        np.exp(logits, out=logits)
        logits /= logits.sum(axis=1, keepdims=True)          # now the softmax probabilities
        rows = np.arange(n)
        picked = logits[rows, y]
        loss_sum = float(-np.log(np.maximum(picked, np.finfo(self.dtype).tiny)).sum())
        correct = int((logits.argmax(axis=1) == y).sum())
        delta = logits
        delta[rows, y] -= 1
        delta /= n                                           # d(mean loss)/d(logits)
        for layer in range(len(self.widths) - 2, -1, -1):
            W = self._p[2 * layer]
            gW, gb = self._g[2 * layer], self._g[2 * layer + 1]
            a = acts[layer]
            np.matmul(a.T, delta, out=gW)
            np.sum(delta, axis=0, out=gb)
            if layer:
                delta = delta @ W.T
                delta *= a > 0                               # ReLU'
        return loss_sum, correct

    def evaluate(self, X: np.ndarray, y: np.ndarray, chunk: int = 4096) -> int:
        """Number of samples of (X, y) classified correctly."""
        return int(sum((self.predict(X[i:i + chunk]) == y[i:i + chunk]).sum() for i in range(0, len(y), chunk)))
