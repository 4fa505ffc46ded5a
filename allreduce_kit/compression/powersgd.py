"""PowerSGD (Vogels et al., 2019): gradients averaged as low-rank factors, with error feedback.

``PowerSGD`` is the state of PyTorch's ``powerSGD_hook`` (``PowerSGDState``) as a numpy object, with
the same arguments, defaults and steps; ``average(grads)`` replaces a list of gradients with their
PowerSGD average across the ranks, in place, using the toolkit's ``allreduce``. One call is one
step, over all of ``grads`` as one bucket:

1. Before step ``start_powerSGD_iter`` (0-based), a plain average (one ``allreduce`` of mean).
2. Then every rank adds its error (what compression lost in its previous step; zeros at first)
   to its gradients, and splits them: a gradient of shape ``(n, ...)`` seen as an ``n x m``
   matrix M is compressed at rank ``R' = min(n, m, R)`` when ``(n + m) R' min_compression_rate <
   n m``; the rest (1-D biases among them: ``m = 1``) is averaged as it is (summed in step 4's
   ``allreduce``, after P, then divided by the rank count).
3. Q (``m x R'``) is the previous step's Q, orthogonalized (warm start), or at the first
   compressed step (and every step without ``warm_start``) standard normal values from a seed
   drawn from ``random_seed``'s generator, the same on every rank, orthogonalized.
4. P = M Q for every matrix, summed across ranks in one ``allreduce`` with the uncompressed part
   (one call fewer than PyTorch's hook, which sends that part on its own); P orthogonalized
   (Gram-Schmidt for R' <= 2, else QR); Q = M^T P, summed in one ``allreduce`` and divided by
   the rank count; M is replaced by P Q^T.
5. With ``use_error_feedback``, each rank keeps (gradients + error) - what they were replaced
   with, over the whole bucket (as PyTorch does), and adds it at its next step.

Every allreduce result is bitwise the same on every rank, and every step from there is the same
arithmetic, so the averaged gradients are bitwise the same on every rank; the errors are each
rank's own. Steps 1 and 2 differ from PyTorch only in what cannot be the same: the random values
of Q's first draw come from numpy, and a column of P or Q that is all zeros with
``orthogonalization_epsilon=0`` stays zeros instead of becoming NaN. ``start_powerSGD_iter`` may be
0 or 1 here (DDP needs 2 to build its buckets first).

Elements each rank hands to ``allreduce`` per step: the uncompressed part plus ``(n + m) R'`` per
compressed matrix (``elements_sent``), against every element of ``grads`` without compression.
"""
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

#: PyTorch's ``PowerSGDState`` defaults.
DEFAULTS = dict(matrix_approximation_rank=1, start_powerSGD_iter=1000, min_compression_rate=2,
                use_error_feedback=True, warm_start=True, orthogonalization_epsilon=0.0, random_seed=0)


def should_compress(n: int, m: int, rank: int, min_compression_rate: float) -> bool:
    """Whether an ``n x m`` matrix is compressed at ``rank`` (PyTorch's ``_should_compress``)."""
    return (n + m) * rank * min_compression_rate < n * m


def matrix_shape(shape: Sequence[int]) -> Tuple[int, int]:
    """The matrix a gradient of ``shape`` is seen as: its first dimension by the rest (``(k,)`` is ``k x 1``)."""
    if len(shape) == 0:
        return 1, 1
    n = int(shape[0])
    return n, int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1


def orthogonalize(matrix: np.ndarray, epsilon: float = 0.0,
                  qr: Optional[Callable[[np.ndarray], np.ndarray]] = None) -> None:
    """Make the columns of ``matrix`` (``n x r``, r <= n) orthonormal in place: Gram-Schmidt for
    r <= 2, else the Q of a QR factorization (PyTorch's ``_orthogonalize``), ``qr(matrix)``'s
    (default numpy's). A column that is all zeros (with ``epsilon`` 0) stays zeros."""
    r = matrix.shape[1]
    if r > 2:
        matrix[...] = qr(matrix) if qr is not None else np.linalg.qr(matrix)[0]
        return
    for i in range(r):
        col = matrix[:, i]
        norm = np.sqrt(np.dot(col, col)) + matrix.dtype.type(epsilon)
        if norm != 0:
            col /= norm
        if i + 1 < r:
            rest = matrix[:, i + 1:]
            rest -= (col @ rest)[None, :] * col[:, None]


class PowerSGD:
    """PowerSGD's state for gradients of ``shapes`` (module docstring); ``average`` is one step.

    ``reduce(buf)`` sums a 1-D buffer across the ranks in place (collective); ``ranks`` is their
    count. ``PowerSGD.over(comm, ...)`` binds both to the toolkit's ``allreduce`` on ``comm``.
    ``matmul(a, b, out)`` makes the three products of each matrix, ``out[...] = a @ b``, and
    ``qr(a)`` gives the Q factor of a QR factorization (default numpy's for both;
    ``allreduce_kit.torch`` passes torch's, which keep to torch's thread count); each must give the
    same bits on every rank for the same operands.
    Arguments are checked here, on every rank alike, before anything is sent: ``ValueError`` names
    the argument.
    """

    def __init__(self, shapes: Sequence[Sequence[int]], reduce: Callable[[np.ndarray], object], ranks: int, *,
                 matrix_approximation_rank: int = 1, start_powerSGD_iter: int = 1000, min_compression_rate: float = 2,
                 use_error_feedback: bool = True, warm_start: bool = True, orthogonalization_epsilon: float = 0.0,
                 random_seed: int = 0, dtype=np.float32, matmul: Optional[Callable[..., object]] = None,
                 qr: Optional[Callable[[np.ndarray], np.ndarray]] = None):
        shapes = [tuple(int(d) for d in s) for s in shapes]
        rank = matrix_approximation_rank
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 1:
            raise ValueError(f"PowerSGD: matrix_approximation_rank must be an integer >= 1, got {rank!r}")
        matrices = [matrix_shape(s) for s in shapes if len(s) >= 2]
        if matrices and rank > max(min(n, m) for n, m in matrices):
            raise ValueError(f"PowerSGD: matrix_approximation_rank {rank} is above the smaller side of every gradient "
                             f"matrix (at most {max(min(n, m) for n, m in matrices)} here)")
        start = start_powerSGD_iter
        if isinstance(start, bool) or not isinstance(start, (int, np.integer)) or start < 0:
            raise ValueError(f"PowerSGD: start_powerSGD_iter must be an integer >= 0, got {start!r}")
        if not min_compression_rate > 0:
            raise ValueError(f"PowerSGD: min_compression_rate must be > 0, got {min_compression_rate!r}")
        if not orthogonalization_epsilon >= 0:
            raise ValueError(f"PowerSGD: orthogonalization_epsilon must be >= 0, got {orthogonalization_epsilon!r}")
        self.shapes, self.reduce, self.ranks = shapes, reduce, int(ranks)
        self.matrix_approximation_rank, self.start_powerSGD_iter = int(rank), int(start)
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback, self.warm_start = bool(use_error_feedback), bool(warm_start)
        self.orthogonalization_epsilon = float(orthogonalization_epsilon)
        self.dtype = np.dtype(dtype)
        #: ``matmul(a, b, out)``: ``out[...] = a @ b`` for 2-D arrays (``a`` may be a transposed view)
        self.matmul = matmul if matmul is not None else _numpy_matmul
        #: ``qr(a)``: the Q factor of ``a`` (``n x r``, r > 2), or ``None`` for numpy's
        self.qr = qr
        self.rng = np.random.RandomState(random_seed)
        #: Steps taken (``average`` calls); compression starts when it reaches ``start_powerSGD_iter``.
        self.iter = 0
        #: Per gradient: ``(n, m, R')`` if compressed, else ``None``.
        self.plan: List[Optional[Tuple[int, int, int]]] = []
        for s in shapes:
            n, m = matrix_shape(s)
            r = min(n, m, self.matrix_approximation_rank)
            self.plan.append((n, m, r) if should_compress(n, m, r, min_compression_rate) else None)
        self.total = sum(int(np.prod(s, dtype=np.int64)) for s in shapes)
        self.p_size = sum(n * r for n, _, r in filter(None, self.plan))
        self.q_size = sum(m * r for _, m, r in filter(None, self.plan))
        self.uncompressed = sum(int(np.prod(s, dtype=np.int64)) for s, c in zip(shapes, self.plan) if c is None)
        self.error: Optional[np.ndarray] = None          # this rank's, over all gradients in order
        self.p_memory: Optional[np.ndarray] = None
        self.q_memory: Optional[np.ndarray] = None

    @classmethod
    def over(cls, comm, shapes: Sequence[Sequence[int]], algorithm: str = "auto", **options) -> "PowerSGD":
        """A state whose sums are ``allreduce(buf, op="sum", algorithm=algorithm, comm=comm)``."""
        from ..collective import allreduce
        from mpi4py import MPI

        comm = comm if comm is not None else MPI.COMM_WORLD
        return cls(shapes, lambda buf: allreduce(buf, op="sum", algorithm=algorithm, comm=comm), comm.Get_size(),
                   **options)

    @property
    def compressing(self) -> bool:
        """Whether the next ``average`` compresses."""
        return self.iter >= self.start_powerSGD_iter

    def elements_sent(self) -> int:
        """Elements this rank hands to ``allreduce`` in the next ``average``."""
        return self.uncompressed + self.p_size + self.q_size if self.compressing else self.total

    def average(self, grads: Sequence[np.ndarray]) -> Sequence[np.ndarray]:
        """Replace ``grads`` (arrays of the state's shapes and dtype) with their PowerSGD average
        across the ranks, in place; returns them. Collective: every rank calls it each step."""
        if len(grads) != len(self.shapes) or any(tuple(g.shape) != s for g, s in zip(grads, self.shapes)):
            raise ValueError(f"PowerSGD.average: grads must have the shapes {self.shapes}, got "
                             f"{[tuple(g.shape) for g in grads]}")
        for i, g in enumerate(grads):
            if not isinstance(g, np.ndarray) or g.dtype != self.dtype or not g.flags.c_contiguous or not g.flags.writeable:
                raise ValueError(f"PowerSGD.average: grads[{i}] must be a writable C-contiguous {self.dtype} array "
                                 f"(it is replaced in place)")
        if not self.compressing:
            self.iter += 1
            flat = np.concatenate([g.reshape(-1) for g in grads]) if grads else np.zeros(0, self.dtype)
            self.reduce(flat)
            flat /= self.dtype.type(self.ranks)
            _scatter(flat, grads)
            return grads
        self.iter += 1
        dtype, p, matmul = self.dtype, self.dtype.type(self.ranks), self.matmul
        if self.use_error_feedback:   # gradients + error, kept in the error's memory until it becomes the error
            if self.error is None:
                self.error = np.zeros(self.total, dtype)
            errors = [e.reshape(g.shape) for g, e in zip(grads, _views(self.error, [(g.size, 1) for g in grads]))]
            for g, e in zip(grads, errors):
                g += e
                e[...] = g
        matrices = [g.reshape(c[0], c[1]) for g, c in zip(grads, self.plan) if c is not None]
        ranks_of = [c[2] for c in self.plan if c is not None]
        fresh = not self.warm_start or self.p_memory is None
        if fresh:   # P, then the uncompressed part, reduced together
            self.p_memory = np.empty(self.p_size + self.uncompressed, dtype)
            self.q_memory = np.empty(self.q_size, dtype)
        ps = _views(self.p_memory, [(M.shape[0], r) for M, r in zip(matrices, ranks_of)])
        qs = _views(self.q_memory, [(M.shape[1], r) for M, r in zip(matrices, ranks_of)])
        if fresh:
            draw = np.random.default_rng(self.rng.randint(1_000_000_000))
            for q in qs:
                q[...] = draw.standard_normal(q.shape).astype(dtype)
        for q in qs:
            orthogonalize(q, self.orthogonalization_epsilon, self.qr)
        rest = [g.reshape(-1) for g, c in zip(grads, self.plan) if c is None]
        tail = self.p_memory[self.p_size:]
        if rest:
            np.concatenate(rest, out=tail)
        for M, q, pm in zip(matrices, qs, ps):
            matmul(M, q, pm)
        if self.p_memory.size:
            self.reduce(self.p_memory)
        if rest:
            tail /= p
            _scatter(tail, rest)
        for pm in ps:
            orthogonalize(pm, self.orthogonalization_epsilon, self.qr)
        for M, pm, q in zip(matrices, ps, qs):
            matmul(M.T, pm, q)
        if self.q_size:
            self.reduce(self.q_memory)
            self.q_memory /= p
        for M, pm, q in zip(matrices, ps, qs):
            matmul(pm, q.T, M)
        if self.use_error_feedback:   # (gradients + error) - what they were replaced with
            for g, e in zip(grads, errors):
                e -= g
        return grads


def _numpy_matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    np.matmul(a, b, out=out)


def _views(memory: np.ndarray, shapes: List[Tuple[int, int]]) -> List[np.ndarray]:
    out, at = [], 0
    for n, r in shapes:
        out.append(memory[at:at + n * r].reshape(n, r))
        at += n * r
    return out


def _scatter(flat: np.ndarray, into: Sequence[np.ndarray]) -> None:
    at = 0
    for a in into:
        a.reshape(-1)[...] = flat[at:at + a.size]
        at += a.size
