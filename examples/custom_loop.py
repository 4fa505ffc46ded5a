"""A data-parallel training loop of your own, on allreduce_kit's public API.

Run: mpirun -n 4 python -m allreduce_kit.run examples/custom_loop.py
"""
import numpy as np
from mpi4py import MPI
from sklearn.datasets import load_digits

from allreduce_kit import allreduce, average_arrays, broadcast_parameters

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()

X, y = load_digits(return_X_y=True)
X = (X / 16.0).astype(np.float32)
X_train, y_train, X_test, y_test = X[:1500], y[:1500], X[1500:], y[1500:]

# A softmax-regression model. Each rank draws different values on purpose:
# broadcasting rank 0's makes every replica start from the same point.
rng = np.random.default_rng(rank)
W = (0.01 * rng.standard_normal((64, 10))).astype(np.float32)
b = np.zeros(10, dtype=np.float32)
for param in (W, b):
    broadcast_parameters(param, root=0)

batch, lr = 32, 0.5
for epoch in range(10):
    # The same permutation on every rank; rank r takes every size-th sample, and the
    # remainder is dropped so that every rank runs the same number of steps.
    order = np.random.default_rng(epoch).permutation(len(y_train))
    mine = order[:len(order) - len(order) % size][rank::size]
    for start in range(0, len(mine) - batch + 1, batch):
        xb, yb = X_train[mine[start:start + batch]], y_train[mine[start:start + batch]]
        logits = xb @ W + b
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)
        probs[np.arange(len(yb)), yb] -= 1          # d(loss)/d(logits), summed over the batch
        grad_W, grad_b = xb.T @ probs / len(yb), probs.mean(axis=0)
        average_arrays([grad_W, grad_b])            # one fused allreduce(op="mean")
        W -= lr * grad_W                            # the same update on every rank
        b -= lr * grad_b

# Each rank scores its share of the test set; a sum gives the whole count.
counts = np.zeros(2)
part = slice(rank, None, size)
counts[0] = (np.argmax(X_test[part] @ W + b, axis=1) == y_test[part]).sum()
counts[1] = len(y_test[part])
allreduce(counts, op="sum")
same = comm.allgather(W.tobytes() + b.tobytes())
if rank == 0:
    print(f"test accuracy {counts[0] / counts[1]:.3f} on {size} ranks; "
          f"replicas identical: {all(s == same[0] for s in same)}")
