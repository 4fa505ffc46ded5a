"""An MLP cut into stages: which layers each stage holds, and a stage's forward and backward.

A stage is a run of consecutive layers ``[first, stop)`` of ``train.model.MLP``. Its forward
keeps its input activations per micro-batch; its backward adds the micro-batch's weight
gradients into the stage's gradient buffer and returns the gradient with respect to its input
(already through the previous layer's ReLU), which is what the previous stage's last layer
needs. The arithmetic is ``MLP.forward_backward``'s, micro-batch by micro-batch: the sum over
micro-batches is the whole batch's gradient up to the order of floating-point additions.
"""
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["balanced_split", "check_split", "stage_layers", "StageLayers", "layer_costs"]


def layer_costs(widths: Sequence[int]) -> List[int]:
    """Each layer's compute in a step, as its multiply-adds per sample: fan_in x fan_out for the
    forward, as much again for the weights' gradient and for the input's, which the first layer
    does not compute (its input is the data)."""
    return [(2 if i == 0 else 3) * int(a) * int(b) for i, (a, b) in enumerate(zip(widths[:-1], widths[1:]))]


def balanced_split(costs: Sequence[float], parts: int) -> List[int]:
    """The layer indices where parts 1 .. ``parts``-1 start, splitting ``costs`` into ``parts``
    runs of consecutive layers, at least one each, with the largest run's cost the least
    possible (ties: the earliest cuts)."""
    n = len(costs)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot split {n} layers into {parts} stages of at least one layer")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the least largest cost splitting the first i layers into k parts; cut[k][i] the last cut
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    cuts, i = [], n
    for k in range(parts, 0, -1):
        i = cut[k][i]
        cuts.append(i)
    return sorted(cuts)[1:]


def check_split(split: Sequence[int], layers: int, parts: int) -> Optional[str]:
    """Why ``split`` (start layers of parts 1 ..) cannot cut ``layers`` layers into ``parts``, or None."""
    if len(split) != parts - 1:
        return f"needs {parts - 1} layer ind{'ex' if parts == 2 else 'ices'} for {parts} stages, got {len(split)}"
    bounds = [0, *split, layers]
    if any(b <= a for a, b in zip(bounds[:-1], bounds[1:])):
        return (f"stage start layers must increase strictly within 1..{layers - 1} (each stage at least one "
                f"of the model's {layers} layers), got {','.join(map(str, split))}")
    return None


def stage_layers(split: Sequence[int], layers: int) -> List[Tuple[int, int]]:
    """``[first, stop)`` of each stage's layers."""
    bounds = [0, *split, layers]
    return list(zip(bounds[:-1], bounds[1:]))


#: Bytes of the scratch a micro-batch's weight gradient is made in, a band of rows at a time,
#: before it is added to the gradient buffer.
SCRATCH_BYTES = 4 << 20


class StageLayers:
    """Layers ``[first, stop)`` of an MLP of ``widths`` whose parameters and gradients are views
    (``params[l]`` = (W, b), ``grads[l]`` likewise) the caller owns.

    ``new_step()`` starts a step: the first backward of each layer after it writes the layer's
    gradient (as ``MLP.forward_backward`` does, so at one micro-batch it is bitwise that); each later
    one adds its own, made a band of rows at a time in a small scratch buffer, so that no
    weight-sized temporary is made (a fresh one per micro-batch costs its page faults and a pass
    more than the product itself when the micro-batch is small)."""

    def __init__(self, widths: Sequence[int], first: int, stop: int,
                 params: Dict[int, Tuple[np.ndarray, np.ndarray]], grads: Dict[int, Tuple[np.ndarray, np.ndarray]]):
        self.widths = list(widths)
        self.first, self.stop = first, stop
        self.last_layer = len(self.widths) - 2
        self.params, self.grads = params, grads
        self.inputs: Dict[int, List[np.ndarray]] = {}
        self.fresh = set(range(first, stop))            # layers whose gradient this step has not written
        self._scratch: Optional[np.ndarray] = None

    def new_step(self) -> None:
        """The next backward of each layer writes its gradient rather than adding to it."""
        self.fresh = set(range(self.first, self.stop))

    @property
    def is_first(self) -> bool:
        return self.first == 0

    @property
    def is_last(self) -> bool:
        return self.stop == self.last_layer + 1

    @property
    def in_width(self) -> int:
        return self.widths[self.first]

    @property
    def out_width(self) -> int:
        return self.widths[self.stop]

    @property
    def live(self) -> int:
        """Micro-batches whose activations this stage holds (forward done, backward not)."""
        return len(self.inputs)

    def forward(self, mb: int, x: np.ndarray, keep: bool = True) -> np.ndarray:
        """The stage's output for micro-batch ``mb``'s input ``x`` (logits at the last stage)."""
        acts = [x]
        for layer in range(self.first, self.stop):
            W, b = self.params[layer]
            z = acts[-1] @ W
            z += b
            if layer < self.last_layer:
                np.maximum(z, 0, out=z)
            acts.append(z)
        if keep:
            self.inputs[mb] = acts[:-1]
        return acts[-1]

    def backward(self, mb: int, delta: np.ndarray) -> Optional[np.ndarray]:
        """Add ``mb``'s weight gradients given ``delta``, the loss gradient at this stage's output
        (before the output's ReLU, as ``MLP.forward_backward`` keeps it); return the gradient at
        the input (through its ReLU), or None at the first stage."""
        acts = self.inputs.pop(mb)
        for layer in range(self.stop - 1, self.first - 1, -1):
            gW, gb = self.grads[layer]
            a = acts[layer - self.first]
            if layer in self.fresh:
                np.matmul(a.T, delta, out=gW)
                np.sum(delta, axis=0, out=gb)
                self.fresh.discard(layer)
            else:
                self._add_product(gW, a, delta)
                gb += delta.sum(axis=0)
            if layer:
                delta = delta @ self.params[layer][0].T
                delta *= a > 0
        return None if self.is_first else delta


    def _add_product(self, gW: np.ndarray, a: np.ndarray, delta: np.ndarray) -> None:
        """``gW += a.T @ delta``, a band of ``gW``'s rows at a time through the scratch buffer."""
        band = max(1, SCRATCH_BYTES // max(1, gW.shape[1] * gW.itemsize))
        if self._scratch is None or self._scratch.dtype != gW.dtype or self._scratch.size < band * gW.shape[1]:
            self._scratch = np.empty(band * gW.shape[1], gW.dtype)
        for lo in range(0, gW.shape[0], band):
            hi = min(lo + band, gW.shape[0])
            part = self._scratch[:(hi - lo) * gW.shape[1]].reshape(hi - lo, gW.shape[1])
            np.matmul(a[:, lo:hi].T, delta, out=part)
            gW[lo:hi] += part


def softmax_loss(logits: np.ndarray, y: np.ndarray, total: int) -> Tuple[float, int, np.ndarray]:
    """(loss sum, correct, d(loss sum / ``total``)/d(logits)) of softmax cross-entropy, as
    ``MLP.forward_backward`` computes them; ``logits`` is overwritten."""
    rows = np.arange(len(y))
    logits -= logits.max(axis=1, keepdims=True) if len(y) else 0
    np.exp(logits, out=logits)
    logits /= logits.sum(axis=1, keepdims=True) if len(y) else 1
    picked = logits[rows, y]
    loss = float(-np.log(np.maximum(picked, np.finfo(logits.dtype).tiny)).sum())
    correct = int((logits.argmax(axis=1) == y).sum()) if len(y) else 0
    logits[rows, y] -= 1
    logits /= total
    return loss, correct, logits
