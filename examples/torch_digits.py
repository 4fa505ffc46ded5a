"""A small CNN on scikit-learn's handwritten digits, data-parallel with allreduce_kit.torch.

Horovod's API on CPU tensors: gradients are averaged in buckets while backward runs, and the
run ends with the straggler report and the share of the averaging hidden behind backward.

Run: mpirun -n 8 python -m allreduce_kit.run examples/torch_digits.py
"""
import argparse
import hashlib
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import allreduce_kit.torch as hvd

parser = argparse.ArgumentParser(description="a CNN on the digits with allreduce_kit.torch")
parser.add_argument("--epochs", type=int, default=15)
parser.add_argument("--batch-size", type=int, default=16, help="samples per rank per step")
parser.add_argument("--lr", type=float, default=0.02, help="learning rate per rank (scaled by the rank count)")
parser.add_argument("--json", metavar="PATH", help="write the straggler report here")
args = parser.parse_args()

hvd.init()
rank, size = hvd.rank(), hvd.size()
torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))   # this rank's share of the cores
torch.manual_seed(rank)   # different initial values on purpose: the broadcast makes rank 0's everyone's

X, y = load_digits(return_X_y=True)
X_train, X_test, y_train, y_test = train_test_split(X, y, test_size=0.2, random_state=0, stratify=y)
as_images = lambda a: torch.tensor(a, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
X_train, X_test, y_train, y_test = as_images(X_train), as_images(X_test), torch.tensor(y_train), torch.tensor(y_test)

model = nn.Sequential(
    nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),      # 16 x 4 x 4
    nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),     # 32 x 2 x 2
    nn.Flatten(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10),
)
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * size, momentum=0.9)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

for epoch in range(1, args.epochs + 1):
    model.train()
    # The same permutation on every rank; rank r takes every size-th sample, and the remainder
    # is dropped so that every rank runs the same number of steps.
    order = torch.randperm(len(y_train), generator=torch.Generator().manual_seed(epoch))
    mine = order[:len(order) - len(order) % size][rank::size]
    for start in range(0, len(mine) - args.batch_size + 1, args.batch_size):
        batch = mine[start:start + args.batch_size]
        optimizer.zero_grad()
        F.cross_entropy(model(X_train[batch]), y_train[batch]).backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():   # each rank scores its share of the test set; a sum gives the whole count
        part = slice(rank, None, size)
        correct = (model(X_test[part]).argmax(1) == y_test[part]).sum()
        counts = hvd.allreduce(torch.stack([correct, torch.tensor(len(y_test[part]))]), op=hvd.Sum, name="accuracy")
    if rank == 0:
        print(f"epoch {epoch:2d}/{args.epochs}  test accuracy {100 * counts[0].item() / counts[1].item():.2f}%", flush=True)

report = optimizer.report(json_path=args.json)
weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
digests = hvd.allgather_object(hashlib.blake2b(weights.numpy().tobytes(), digest_size=16).hexdigest())
if rank == 0:
    print(f"test accuracy {100 * counts[0].item() / counts[1].item():.2f}% on {size} ranks; "
          f"replicas bitwise identical: {'yes' if len(set(digests)) == 1 else 'NO'}")
