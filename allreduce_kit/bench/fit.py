"""The alpha-beta-gamma cost model of each algorithm, and its least-squares fit.

A call on p ranks with n bytes per rank costs ``A alpha + B beta + C gamma``: alpha per
message (latency, including our per-step Python cost), beta per byte sent, gamma per byte
reduced (Thakur, Rabenseifner & Gropp 2005). ``lg`` is ceil(log2 p); ``k = log2 pof2`` with
pof2 the largest power of two <= p; rank counts that are not a power of two pay the fold
(one message and one reduction of n before, one message after) in ``recursive_doubling`` and
``rabenseifner``.

=====================  ================  ====================  ==================
algorithm              A (messages)      B (bytes sent)        C (bytes reduced)
=====================  ================  ====================  ==================
naive                  2 (p-1)           2 (p-1) n             (p-1) n
tree                   2 lg              2 lg n                lg n
ring                   2 (p-1)           2 (p-1)/p n           (p-1)/p n
recursive_doubling     k (+2 fold)       k n (+2n)             k n (+n)
rabenseifner           2 k (+2 fold)     2 (pof2-1)/pof2 n     (pof2-1)/pof2 n
                                         (+2n)                 (+n)
=====================  ================  ====================  ==================

The fit minimises the squared *relative* error over every (algorithm, p, size) measured, so
4-byte and 64-MiB times weigh alike, with alpha, beta, gamma >= 0 (non-negative least squares).
"""
import math
from typing import Dict, Iterable, List, Sequence, Tuple

import numpy as np

MODELLED = ("naive", "tree", "ring", "recursive_doubling", "rabenseifner")


def coefficients(algorithm: str, p: int, n: float) -> Tuple[float, float, float]:
    """``(A, B, C)``: the call costs ``A alpha + B beta + C gamma`` (n in bytes)."""
    lg = math.ceil(math.log2(p))
    pof2 = 1 << (p.bit_length() - 1)
    k = pof2.bit_length() - 1
    fold = (2, 2 * n, n) if pof2 != p else (0, 0, 0)
    if algorithm == "naive":
        return 2 * (p - 1), 2 * (p - 1) * n, (p - 1) * n
    if algorithm == "tree":
        return 2 * lg, 2 * lg * n, lg * n
    if algorithm == "ring":
        return 2 * (p - 1), 2 * (p - 1) / p * n, (p - 1) / p * n
    if algorithm == "recursive_doubling":
        return k + fold[0], k * n + fold[1], k * n + fold[2]
    if algorithm == "rabenseifner":
        share = (pof2 - 1) / pof2 * n
        return 2 * k + fold[0], 2 * share + fold[1], share + fold[2]
    raise KeyError(f"no cost model for {algorithm!r}")


def fit(points: Iterable[Tuple[str, int, int, float]]) -> Dict[str, float]:
    """alpha (s), beta (s/byte), gamma (s/byte) from ``(algorithm, p, bytes, seconds)`` points."""
    rows, times = [], []
    for algorithm, p, n, t in points:
        if algorithm in MODELLED and t > 0:
            rows.append(coefficients(algorithm, p, n))
            times.append(t)
    if len(rows) < 3:
        raise ValueError("--fit needs at least 3 measurements of modelled algorithms "
                         f"({', '.join(MODELLED)})")
    a, t = np.asarray(rows, float), np.asarray(times, float)
    a, b = a / t[:, None], np.ones_like(t)  # relative error: divide each equation by its time
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    try:
        from scipy.optimize import nnls
        x, _ = nnls(a / scale, b)
    except ImportError:  # scipy comes with scikit-learn; this is only a fallback
        x = np.clip(np.linalg.lstsq(a / scale, b, rcond=None)[0], 0, None)
    alpha, beta, gamma = (x / scale).tolist()
    predicted = (np.asarray(rows) @ np.array([alpha, beta, gamma]))
    rel = predicted / np.asarray(times) - 1
    return {"alpha": alpha, "beta": beta, "gamma": gamma, "points": len(rows),
            "median_abs_rel_error": float(np.median(np.abs(rel))), "max_abs_rel_error": float(np.max(np.abs(rel)))}


def predict(params: Dict[str, float], algorithm: str, p: int, n: float) -> float:
    """Predicted seconds per call."""
    a, b, c = coefficients(algorithm, p, n)
    return a * params["alpha"] + b * params["beta"] + c * params["gamma"]


def describe(params: Dict[str, float]) -> str:
    """alpha in microseconds, beta and gamma as GB/s (their reciprocals)."""
    def rate(x: float) -> str:
        return f"{1 / x / 1e9:.2f} GB/s" if x > 0 else "inf"
    return (f"alpha = {params['alpha'] * 1e6:.2f} us, beta = {params['beta'] * 1e9:.4f} ns/B ({rate(params['beta'])}), "
            f"gamma = {params['gamma'] * 1e9:.4f} ns/B ({rate(params['gamma'])}); {params['points']} points, "
            f"median |relative error| {params['median_abs_rel_error']:.0%}")


def comparison(params: Dict[str, float], rows: Sequence[dict], sizes: Sequence[int] = ()) -> List[str]:
    """Lines of ``p size algorithm measured predicted ratio`` for the modelled rows."""
    lines = [f"#{'p':>3} {'size(B)':>10} {'algorithm':>20} {'measured(us)':>13} {'predicted(us)':>14} {'pred/meas':>9}"]
    for row in sorted(rows, key=lambda r: (r["ranks"], r["size"], r["algorithm"])):
        if row["algorithm"] not in MODELLED or (sizes and row["size"] not in sizes):
            continue
        pred = predict(params, row["algorithm"], row["ranks"], row["size"]) * 1e6
        lines.append(f" {row['ranks']:>3} {row['size']:>10} {row['algorithm']:>20} {row['time_us']:>13.2f} "
                     f"{pred:>14.2f} {pred / row['time_us']:>8.2f}x")
    return lines


def points_from(rows: Sequence[dict]) -> List[Tuple[str, int, int, float]]:
    return [(r["algorithm"], r["ranks"], r["size"], r["time_us"] * 1e-6) for r in rows]
