"""The floor of examples/digits_mlp.py: each rank's shard trained alone, with
the example's model, optimizer, batch order and epochs, and no
communication at all. An algorithm that averages must beat these
accuracies (tests/python/test_example.py cites them).

    source scripts/env.sh && /usr/bin/python3 bench/digits_alone.py --world 4
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import digits_mlp  # noqa: E402  (the example's data and model)


def train_alone(rank: int, world: int, epochs: int, batch_size: int, lr: float, seed: int) -> float:
    """Test accuracy of rank ``rank``'s model after training on its shard alone."""
    x_train, y_train, x_test, y_test = digits_mlp.load_data(seed)
    torch.manual_seed(seed)  # every rank starts from the same weights, as in the example
    shard = torch.arange(rank, len(x_train), world)
    x_shard, y_shard = x_train[shard], y_train[shard]
    model = digits_mlp.MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    generator = torch.Generator().manual_seed(seed + rank)
    for _ in range(epochs):
        order = torch.randperm(len(x_shard), generator=generator)
        for step in range(len(x_shard) // batch_size):
            batch = order[step * batch_size:(step + 1) * batch_size]
            optimizer.zero_grad()
            F.cross_entropy(model(x_shard[batch]), y_shard[batch]).backward()
            optimizer.step()
    with torch.no_grad():
        return (model(x_test).argmax(dim=1) == y_test).float().mean().item()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    accuracies = [train_alone(r, args.world, args.epochs, args.batch_size, args.lr, args.seed)
                  for r in range(args.world)]
    print(f"each of {args.world} ranks alone on its shard, {args.epochs} epochs: "
          + ", ".join(f"{a * 100:.2f}" for a in accuracies) + " %")


if __name__ == "__main__":
    main()
