"""The data: scikit-learn's bundled digits, or a synthetic problem of any size; and the shards.

The digits are read straight from the compressed CSV file that scikit-learn ships, without
importing scikit-learn (whose import, through scipy, costs each rank about a second of CPU);
the result is the same as ``sklearn.datasets.load_digits``.

Sharding (``epoch_batches``): every epoch all ranks draw the same permutation of the training
set from ``(seed, epoch)``, drop its last ``N mod p`` entries (fewer than p samples, a different
few each epoch, so none is left out for good), and rank r takes every p-th entry starting at r.
So the shards are disjoint, equally long (``N // p``), and every rank runs the same number of
steps: no rank ever waits at the end of an epoch for a rank with an extra batch. The last batch
of an epoch may be shorter than ``--batch-size``, equally short on every rank. Taking every p-th
entry also makes the p ranks' batches of step t together exactly the batch of step t of one
rank with batch p*b, which is what the equivalence test relies on.
"""
import gzip
import importlib.util
import os
from typing import List, NamedTuple, Optional, Tuple

import numpy as np


class Dataset(NamedTuple):
    name: str
    X_train: np.ndarray
    y_train: np.ndarray
    X_test: np.ndarray
    y_test: np.ndarray
    classes: int

    @property
    def features(self) -> int:
        return self.X_train.shape[1]


def _split(X: np.ndarray, y: np.ndarray, test_fraction: float, seed: int):
    order = np.random.default_rng([seed, 1]).permutation(len(y))
    n_test = int(round(len(y) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    return X[train], y[train], X[test], y[test]


def _bundled_digits_file() -> Optional[str]:
    """The path of scikit-learn's ``datasets/data/digits.csv.gz``, found without importing it; or None."""
    spec = importlib.util.find_spec("sklearn")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(root, "datasets", "data", "digits.csv.gz")
        if os.path.isfile(path):
            return path
    return None


def load_digits_arrays() -> Tuple[np.ndarray, np.ndarray]:
    """The 1797 digits as ``load_digits(return_X_y=True)`` gives them: pixels 0..16 (float64), labels."""
    path = _bundled_digits_file()
    if path is None:                      # a scikit-learn that keeps the file elsewhere
        from sklearn.datasets import load_digits

        return load_digits(return_X_y=True)
    with gzip.open(path, "rt", encoding="utf-8") as f:
        table = np.loadtxt(f, delimiter=",")
    return table[:, :-1], table[:, -1].astype(int)


def digits(test_fraction: float = 0.2, seed: int = 0, dtype=np.float32) -> Dataset:
    """scikit-learn's 1797 8x8 handwritten digits (bundled, no download), pixels scaled to [0, 1]."""
    X, y = load_digits_arrays()
    X = (X / 16.0).astype(dtype)
    return Dataset("digits", *_split(X, y.astype(np.int64), test_fraction, seed), classes=10)


def synthetic(samples: int, features: int, classes: int, test_fraction: float = 0.2, seed: int = 0,
              dtype=np.float32) -> Dataset:
    """A learnable problem generated from ``seed``, bitwise the same on every rank.

    Gaussian inputs; the label is the argmax of a random two-layer teacher network's output, so
    an MLP can learn it well and a linear model cannot quite.
    """
    rng = np.random.default_rng([seed, 2])
    X = rng.standard_normal((samples, features), dtype=np.float32).astype(dtype, copy=False)
    hidden = max(classes, 32)
    A = rng.standard_normal((features, hidden), dtype=np.float32) / np.sqrt(features)
    B = rng.standard_normal((hidden, classes), dtype=np.float32)
    y = np.argmax(np.tanh(X @ A) @ B, axis=1).astype(np.int64)
    return Dataset("synthetic", *_split(X, y, test_fraction, seed), classes=classes)


def shard_batch(samples: int, ranks: int, batch: int) -> int:
    """The batch a rank can take: ``batch``, or its whole shard of ``samples // ranks`` if that is smaller."""
    return max(1, min(batch, samples // ranks))


def steps_per_epoch(samples: int, ranks: int, batch: int) -> int:
    """Steps every rank takes per epoch: its shard of ``samples // ranks`` in batches of ``batch``."""
    return -(-(samples // ranks) // batch)


def epoch_batches(samples: int, ranks: int, rank: int, batch: int, seed: int, epoch: int) -> List[np.ndarray]:
    """This rank's batches (index arrays into the training set) for ``epoch``; see the module doc."""
    usable = samples - samples % ranks
    order = np.random.default_rng([seed, 3, epoch]).permutation(samples)[:usable]
    mine = order[rank::ranks]
    return [mine[i:i + batch] for i in range(0, len(mine), batch)]
