"""A multilayer perceptron with softmax cross-entropy, forward and backward written out in numpy.

All parameters live in one flat buffer and all gradients in another (``FlatParameters``); each
layer's weight ``W`` (in x out) and bias ``b`` are views into them, so the backward pass writes
the fused gradient directly and one step needs one allreduce (per bucket). The matrix products
go to BLAS. numba is not used here because it would not pay: for large models the matrix
products are over 90% of the compute, and for the default digits model the whole compute
(about 0.3 ms) is a few percent of a step dominated by the allreduce (docs/training.md).

Layer l's ``W`` and ``b`` are next to each other in the flat buffer (``layer_bounds``). A
sharded run (``sharding.py``) that holds no whole buffer makes the model without them
(``buffers=False``) and hands ``forward_backward`` and ``evaluate`` a ``layers`` object that
supplies each layer's parameters as the pass reaches it and takes each layer's gradient as the
backward pass writes it; the arithmetic is the same either way.
"""
from typing import List, Optional, Sequence, Tuple

import numpy as np

from ..params import FlatParameters


class OwnLayers:
    """What ``forward_backward`` asks of ``layers``, answered from the model's own flat buffers.

    ``weights(layer)``: ``(W, b)`` just before the pass uses them (forward 0, 1, ..., then
    backward from the last layer down to layer 1, the last layer asked for twice in a row; a view
    stays valid until the next call);
    ``gradients(layer)``: ``(gW, gb)`` to write layer's gradient into; ``gradient_done(layer)``:
    they hold it now (the backward pass goes from the last layer to layer 0)."""

    def __init__(self, model: "MLP"):
        self.model = model

    def weights(self, layer: int) -> Tuple[np.ndarray, np.ndarray]:
        return self.model._p[2 * layer], self.model._p[2 * layer + 1]

    def gradients(self, layer: int) -> Tuple[np.ndarray, np.ndarray]:
        return self.model._g[2 * layer], self.model._g[2 * layer + 1]

    def gradient_done(self, layer: int) -> None:
        """Nothing to do: the gradient is in the flat buffer."""


class MLP:
    """ReLU layers of the given widths between ``inputs`` features and ``classes`` outputs."""

    def __init__(self, inputs: int, hidden: Sequence[int], classes: int, dtype=np.float32, buffers: bool = True):
        self.widths = [int(inputs), *map(int, hidden), int(classes)]
        shapes: List[Tuple[int, ...]] = []
        for fan_in, fan_out in zip(self.widths[:-1], self.widths[1:]):
            shapes += [(fan_in, fan_out), (fan_out,)]
        self.shapes = shapes
        self.offsets = [0]
        for shape in shapes:
            self.offsets.append(self.offsets[-1] + int(np.prod(shape)))
        self.dtype = np.dtype(dtype)
        self.flat: Optional[FlatParameters] = None
        self.params: Optional[np.ndarray] = None
        self.grads: Optional[np.ndarray] = None
        if buffers:
            self.flat = FlatParameters(shapes, dtype=dtype)
            self.params, self.grads = self.flat.params, self.flat.grads
            self._p = self.flat.views(self.params)
            self._g = self.flat.views(self.grads)
        self.own = OwnLayers(self)

    @property
    def size(self) -> int:
        return self.offsets[-1]

    @property
    def layers(self) -> int:
        return len(self.widths) - 1

    def layer_bounds(self, layer: int) -> Tuple[int, int]:
        """``[start, stop)`` of layer's ``W`` and ``b`` in the flat buffer."""
        return self.offsets[2 * layer], self.offsets[2 * layer + 2]

    def layer_views(self, buf: np.ndarray, layer: int) -> Tuple[np.ndarray, np.ndarray]:
        """``(W, b)`` as views into ``buf``, a 1-D buffer of the layer's length (at least)."""
        fan_in, fan_out = self.widths[layer], self.widths[layer + 1]
        return buf[:fan_in * fan_out].reshape(fan_in, fan_out), buf[fan_in * fan_out:(fan_in + 1) * fan_out]

    def describe(self) -> str:
        return "-".join(map(str, self.widths))

    def init_layer(self, rng: np.random.Generator, layer: int, W: np.ndarray, b: np.ndarray) -> None:
        """He-normal weights, zero bias, for one layer (``init`` calls it layer by layer)."""
        W[...] = rng.standard_normal(W.shape) * np.sqrt(2.0 / W.shape[0])
        b[...] = 0

    def init(self, rng: np.random.Generator) -> None:
        """He-normal weights, zero biases (writes the flat parameter buffer)."""
        for layer in range(self.layers):
            self.init_layer(rng, layer, self._p[2 * layer], self._p[2 * layer + 1])

    def _forward(self, X: np.ndarray, layers=None) -> List[np.ndarray]:
        source = layers or self.own
        acts = [X]
        last = len(self.widths) - 2
        for layer in range(last + 1):
            W, b = source.weights(layer)
            z = acts[-1] @ W
            z += b
            if layer < last:
                np.maximum(z, 0, out=z)
            acts.append(z)
        return acts

    def predict(self, X: np.ndarray, layers=None) -> np.ndarray:
        return np.argmax(self._forward(X.astype(self.dtype, copy=False), layers)[-1], axis=1)

    def forward_backward(self, X: np.ndarray, y: np.ndarray, layers=None) -> Tuple[float, int]:
        """Write this batch's mean-loss gradient into ``self.grads`` (or hand it to ``layers``, as
        ``OwnLayers`` describes); return (loss sum, correct)."""
        source = layers or self.own
        acts = self._forward(X, source)
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
        last = len(self.widths) - 2
        for layer in range(last, -1, -1):
            gW, gb = source.gradients(layer)
            a = acts[layer]
            np.matmul(a.T, delta, out=gW)
            np.sum(delta, axis=0, out=gb)
            if layer:
                W = source.weights(layer)[0]
                delta = delta @ W.T
                delta *= a > 0                               # ReLU'
            source.gradient_done(layer)
        return loss_sum, correct

    def evaluate(self, X: np.ndarray, y: np.ndarray, chunk: int = 4096, layers=None) -> int:
        """Number of samples of (X, y) classified correctly."""
        return int(sum((self.predict(X[i:i + chunk], layers) == y[i:i + chunk]).sum() for i in range(0, len(y), chunk)))
