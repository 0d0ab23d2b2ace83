"""Train an MLP on scikit-learn's digits with Lightning's Trainer and
bagua's BaguaStrategy, on CPU processes (or GPUs with --accelerator cuda).

    python examples/lightning_digits.py --devices 2 --algorithm bytegrad --kwarg hierarchical=False
    python -m bagua.distributed.launch --nproc_per_node 2 examples/lightning_digits.py --devices 2

In the first form Lightning starts the other processes itself (it runs this
script again); in the second the launcher does. Each rank trains on its part
of the training set (Lightning's DistributedSampler); the validation
accuracy is logged with sync_dist=True (the mean over the ranks); rank 0
prints the test accuracy of every rank's model at the end. Needs Lightning
(pip install lightning) and scikit-learn.
"""

import argparse
import ast

import lightning as L
import torch
import torch.nn.functional as F

from bagua.lightning import BaguaStrategy


class DigitsMLP(L.LightningModule):
    def __init__(self, algorithm: str, lr: float = 0.1, batch_size: int = 32):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))

    def setup(self, stage):
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        digits = load_digits()
        x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
        y = torch.tensor(digits.target)
        x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
        self.train_set = torch.utils.data.TensorDataset(x_train, y_train)
        self.test_set = torch.utils.data.TensorDataset(x_test, y_test)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_acc", (self(x).argmax(1) == y).float().mean(), sync_dist=True, prog_bar=True)

    def configure_optimizers(self):
        if self.hparams.algorithm == "qadam":  # QAdam needs its own optimizer, exactly one
            from bagua.torch_api.algorithms.q_adam import QAdamOptimizer

            return QAdamOptimizer(self.parameters(), lr=0.01, warmup_steps=50)
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(self.test_set, batch_size=128)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithm", default="gradient_allreduce", help="a name of GlobalAlgorithmRegistry")
    parser.add_argument("--kwarg", action="append", default=[], metavar="NAME=VALUE",
                        help="an argument of the algorithm, e.g. hierarchical=False (repeatable)")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args()
    kwargs = {}
    for item in args.kwarg:
        name, _, value = item.partition("=")
        kwargs[name] = ast.literal_eval(value)

    L.seed_everything(0)
    model = DigitsMLP(args.algorithm)
    trainer = L.Trainer(strategy=BaguaStrategy(args.algorithm, **kwargs), accelerator=args.accelerator,
                        devices=args.devices, max_epochs=args.epochs, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model)
    # Each rank's own model on the whole test set (the decentralized and
    # asynchronous algorithms end with different models on each rank).
    x, y = model.test_set.tensors
    with torch.no_grad():
        mine = (model.cpu()(x).argmax(1) == y).float().mean().reshape(1)
    ranks = trainer.strategy.all_gather(mine).flatten().tolist()
    if trainer.is_global_zero:
        print(f"algorithm {args.algorithm}: test accuracy {100 * sum(ranks) / len(ranks):.2f}% "
              f"(ranks: {', '.join(f'{100 * a:.2f}' for a in ranks)}), {trainer.world_size} workers "
              f"({type(trainer.strategy).__name__})")


if __name__ == "__main__":
    main()
