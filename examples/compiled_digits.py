"""torch.compile with bagua: a convolutional model with BatchNorm on
scikit-learn's digits, compiled after with_bagua (PyTorch 2).

    python -m bagua.distributed.launch --nproc_per_node 2 examples/compiled_digits.py
    python -m bagua.distributed.launch --nproc_per_node 2 examples/compiled_digits.py --algorithm bytegrad

The hooks bagua puts on the module run eagerly between compiled graphs, and
Dynamo cuts the forward into bucket-sized graphs (as it does for DDP), so the
gradients' communication still overlaps the backward pass. BatchNorm's
running statistics are rank 0's on every rank (broadcast_buffers, as DDP).
Rank 0 prints the test accuracy.
"""

import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

import bagua.torch_api as bagua


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 16, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(16)
        self.fc = torch.nn.Linear(16 * 8 * 8, 10)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--algorithm", default="gradient_allreduce", help="a registered algorithm name")
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args()

    bagua.init_process_group()
    rank, world = bagua.get_rank(), bagua.get_world_size()
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16
    y = torch.tensor(digits.target)
    train_x, train_y, test_x, test_y = x[:1500], y[:1500], x[1500:], y[1500:]
    mine = torch.arange(rank, 1500, world)  # this rank's shard

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model = model.with_bagua([opt], args.algorithm)  # a name from GlobalAlgorithmRegistry
    compiled = torch.compile(model)
    for _ in range(args.epochs):
        for batch in mine[torch.randperm(len(mine))].split(32):
            opt.zero_grad()
            F.cross_entropy(compiled(train_x[batch]), train_y[batch]).backward()
            opt.step()
    compiled.eval()
    with torch.no_grad():
        accuracy = (compiled(test_x).argmax(1) == test_y).float().mean().item()
    if rank == 0:
        print(f"algorithm {args.algorithm}, compiled: test accuracy {accuracy:.2%}, {world} workers")


if __name__ == "__main__":
    main()
