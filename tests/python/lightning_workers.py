"""Worker scenarios of test_lightning.py: Lightning's Trainer with
bagua.lightning.BaguaStrategy on CPU ranks, training scikit-learn's digits.

    lightning_workers.py SCENARIO OUT_DIR DATA [ARGS...]

DATA is an .npz of the digits split (the test writes it once, so no worker
imports scikit-learn). Each rank saves its results to OUT_DIR/rank{RANK}.pt.
Ranks come from launcher.run_workers (RANK, LOCAL_RANK, ... set: Lightning
starts no process), except in ``by_name``, where Lightning's own launcher
starts rank 1 by running this script again.
"""

import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

import lightning as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

# name -> (algorithm, its keyword arguments, optimizer); every built-in
# algorithm. hierarchical=False: on one node the hierarchical variants
# average in full precision among the node's ranks, compressing nothing.
SPECS = {
    "gradient_allreduce": ("gradient_allreduce", {}, "sgd"),
    "bytegrad": ("bytegrad", {"hierarchical": False}, "sgd"),
    "floatgrad": ("floatgrad", {"hierarchical": False}, "sgd"),
    "decentralized": ("decentralized", {"hierarchical": False}, "sgd"),
    "low_precision_decentralized": ("low_precision_decentralized", {"hierarchical": False}, "sgd"),
    "qadam": ("qadam", {"hierarchical": False}, "qadam"),
    "async": ("async", {"sync_interval_ms": 20}, "sgd"),
    "powersgd": ("powersgd", {"rank": 2, "start_iter": 10}, "sgd"),
    "partial_allreduce": ("partial_allreduce", {"group_size": 2}, "sgd"),
    # PowerSGD at rank 2, as above: at auto's default rank 1 this 4-epoch run
    # ends at 0.90-0.94 depending on the path the timings pick (a PowerSGD
    # restarted fresh after a re-measure), which noise on a busy machine decides.
    "auto": ("auto", {"powersgd_rank": 2}, "sgd"),
}


def load(data):
    with np.load(data) as d:
        return (torch.from_numpy(d["x_train"]), torch.from_numpy(d["y_train"]).long(),
                torch.from_numpy(d["x_test"]), torch.from_numpy(d["y_test"]).long())


class Digits(L.LightningModule):
    """An MLP on digits; ``optimizer``: "sgd", "qadam" or "qadam+sgd" (two
    optimizers, refused by QAdam); ``manual``: manual optimization."""

    def __init__(self, data, optimizer="sgd", manual=False, batch_size=32):
        super().__init__()
        self.x_train, self.y_train, self.x_test, self.y_test = load(data)
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
        self.optimizer_kind = optimizer
        self.automatic_optimization = not manual
        self.batch_size = batch_size

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)  # not self(x): the strategy must not rely on it
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        sgd = lambda: torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)  # noqa: E731
        from bagua.torch_api.algorithms.q_adam import QAdamOptimizer

        qadam = lambda: QAdamOptimizer(self.parameters(), lr=0.01, warmup_steps=20)  # noqa: E731
        return {"sgd": sgd, "qadam": qadam, "qadam+sgd": lambda: [qadam(), sgd()]}[self.optimizer_kind]()

    def train_dataloader(self):
        # Lightning adds the DistributedSampler: each rank trains on its half
        dataset = torch.utils.data.TensorDataset(self.x_train, self.y_train)
        return torch.utils.data.DataLoader(dataset, batch_size=self.batch_size, shuffle=True)

    def accuracy(self):
        with torch.no_grad():
            return (self.net(self.x_test).argmax(1) == self.y_test).float().mean().item()


def trainer(strategy, epochs, **kwargs):
    options = dict(accelerator="cpu", devices=2, max_epochs=epochs, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, enable_checkpointing=False)
    options.update(kwargs)
    return L.Trainer(strategy=strategy, **options)


def flat(module):
    return torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])


def save(out_dir, rank, result):
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


class _CommunicationStats(Callback):
    """The engine's communication statistics at the end of training."""

    def on_train_end(self, trainer, pl_module):
        self.stats = trainer.strategy.model.bagua_ddp.communication_stats()
        # auto's path (choices and why), for a failure's message
        self.decisions = [(d["step"], d["choice"], d["reason"]) for d in
                          getattr(trainer.strategy.model.bagua_ddp.bagua_algorithm_impl, "decisions", [])]


def scenario_algorithms(out_dir, data, names, epochs="4"):
    """Each named spec trained in turn ("manual": gradient_allreduce with
    manual optimization; "accumulate": with gradients accumulated over 2
    batches): test accuracy and weights of every rank."""
    from bagua.lightning import BaguaStrategy

    results = {}
    for name in names.split(","):
        algorithm, kwargs, optimizer = SPECS.get(name, SPECS["gradient_allreduce"])
        L.seed_everything(0)
        model = Digits(data, optimizer, manual=name == "manual")
        stats = _CommunicationStats()
        t = trainer(BaguaStrategy(algorithm, **kwargs), int(epochs), callbacks=[stats],
                    accumulate_grad_batches=2 if name == "accumulate" else 1)
        start = time.perf_counter()
        t.fit(model)
        results[name] = {"accuracy": model.accuracy(), "weights": flat(model), "stats": stats.stats,
                         "seconds": time.perf_counter() - start, "steps": t.global_step,
                         "decisions": stats.decisions}
        print(f"{name}: accuracy {results[name]['accuracy']:.4f} in {results[name]['seconds']:.1f} s", flush=True)
    save(out_dir, int(os.environ["RANK"]), results)


class Collectives(Digits):
    """Digits with a validation set (each rank half of the test digits)
    that logs values known per rank, and uses the strategy's collectives."""

    def __init__(self, data):
        super().__init__(data)
        self.local = {}  # per validation epoch: this rank's correct and seen

    def val_dataloader(self):
        dataset = torch.utils.data.TensorDataset(self.x_test, self.y_test)
        return torch.utils.data.DataLoader(dataset, batch_size=50)

    test_dataloader = val_dataloader

    def on_validation_epoch_start(self):
        self.local["val_acc"] = (0.0, 0)  # the sanity check's batches and earlier epochs do not count

    def on_test_epoch_start(self):
        self.local["test_acc"] = (0.0, 0)

    def _accuracy_step(self, batch, key):
        x, y = batch
        correct = (self.net(x).argmax(1) == y).float()
        self.local[key] = (self.local[key][0] + correct.sum().item(), self.local[key][1] + len(y))
        self.log(key, correct.mean(), sync_dist=True, batch_size=len(y))

    def validation_step(self, batch, batch_idx):
        self._accuracy_step(batch, "val_acc")

    def test_step(self, batch, batch_idx):
        self._accuracy_step(batch, "test_acc")

    def training_step(self, batch, batch_idx):
        self.log("train_rank", float(self.global_rank), sync_dist=True, on_step=False, on_epoch=True)
        return super().training_step(batch, batch_idx)

    def on_validation_epoch_end(self):
        rank = float(self.global_rank)
        self.log("rank_mean", rank, sync_dist=True)
        self.log("rank_max", rank, sync_dist=True, reduce_fx="max")
        self.log("rank_min", rank, sync_dist=True, reduce_fx="min")


def _collective_calls(strategy, rank):
    """The strategy's collectives called directly, on values known per rank."""
    x = torch.full((3,), float(rank + 1), requires_grad=True)
    gathered = strategy.all_gather(x, sync_grads=True)  # (2, 3)
    (gathered * float(rank + 1)).sum().backward()  # d/dx_r = sum over ranks of (rank + 1) = 3
    try:
        strategy.reduce(torch.ones(1), reduce_op="bxor")
        bad_op = None
    except ValueError as error:
        bad_op = str(error)
    strategy.barrier("test")
    return {
        "gathered": strategy.all_gather(torch.tensor([rank, 10 * rank])), "gathered_grad": x.grad,
        "scalar_gathered": strategy.all_gather(torch.tensor(float(rank))),
        "broadcast": strategy.broadcast({"from": rank}), "broadcast_1": strategy.broadcast([rank], src=1),
        "sum": strategy.reduce(torch.tensor(rank + 1.0), reduce_op="sum"),
        "torch_sum": strategy.reduce(torch.tensor([rank + 1.0]), reduce_op=torch.distributed.ReduceOp.SUM),
        "max": strategy.reduce(torch.tensor(rank + 1.0), reduce_op="max"),
        "int_mean": strategy.reduce(torch.tensor(rank + 2, dtype=torch.int32)),  # (2 + 3) / 2, truncated
        "bool_min": strategy.reduce(torch.tensor(rank == 0), reduce_op="min"),
        "all_true": strategy.reduce_boolean_decision(rank == 0, all=True),
        "any_true": strategy.reduce_boolean_decision(rank == 0, all=False),
        "bad_op": bad_op,
    }


def scenario_collectives(out_dir, data):
    """sync_dist logging, the collectives, evaluation after a perturbed
    rank, and QAdam refusing two optimizers."""
    from bagua.lightning import BaguaStrategy
    from bagua.torch_api import InvalidArgumentError

    L.seed_everything(0)
    rank = int(os.environ["RANK"])
    model = Collectives(data)
    t = trainer(BaguaStrategy("gradient_allreduce"), 2)
    t.fit(model)
    result = {"metrics": {k: v.item() for k, v in t.callback_metrics.items()}, "local": dict(model.local),
              "num_training_batches": t.num_training_batches, "calls": _collective_calls(t.strategy, rank)}
    with torch.no_grad():  # rank 1 drifts: test must evaluate rank 0's model on every rank, as DDP
        for p in model.parameters():
            p.add_(float(rank))
    result["test"] = t.test(model, verbose=False)[0]
    result["test_local"], result["test_weights"] = model.local["test_acc"], flat(model)
    try:
        trainer(BaguaStrategy("qadam"), 1).fit(Digits(data, "qadam+sgd", manual=True))
        result["qadam_error"] = None
    except InvalidArgumentError as error:
        result["qadam_error"] = str(error)
    save(out_dir, rank, result)


class _Snapshot(Callback):
    """This rank's weights and engine step count at the end of epoch 0 and
    when training starts (after a checkpoint was restored)."""

    def __init__(self):
        self.seen = {}

    def _engine(self, trainer):
        return trainer.strategy.model.bagua_ddp

    def on_train_start(self, trainer, pl_module):
        self.seen["start"] = (flat(pl_module), self._engine(trainer).step_counter)

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == 0:
            self.seen["epoch0"] = (flat(pl_module), self._engine(trainer).step_counter)


def _fit_snapshot(data, algorithm, ckpt_dir=None, ckpt_path=None):
    from bagua.lightning import BaguaStrategy

    L.seed_everything(0)
    model = Digits(data)
    if ckpt_path is not None:
        with torch.no_grad():  # whatever the model was, the checkpoint decides
            for p in model.parameters():
                p.add_(1.0)
    snapshot = _Snapshot()
    callbacks = [snapshot]
    if ckpt_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, filename="{epoch}", save_top_k=-1))
    name, kwargs, _ = SPECS[algorithm]
    t = trainer(BaguaStrategy(name, **kwargs), 2,
                callbacks=callbacks, enable_checkpointing=ckpt_dir is not None)
    t.fit(model, ckpt_path=ckpt_path)
    return {**snapshot.seen, "final": flat(model)}


def scenario_checkpoint(out_dir, data, algorithm):
    """``algorithm`` (one whose ranks keep their own weights), 2 epochs with
    a checkpoint after the first; then resumed from it, and from a copy
    without bagua's state."""
    rank = int(os.environ["RANK"])
    ckpt_dir = os.path.join(out_dir, "checkpoints")
    result = {"straight": _fit_snapshot(data, algorithm, ckpt_dir=ckpt_dir)}
    saved = os.path.join(ckpt_dir, "epoch=0.ckpt")
    stripped = os.path.join(out_dir, "stripped.ckpt")
    if rank == 0:
        checkpoint = torch.load(saved, weights_only=False)
        result["saved_keys"] = sorted(checkpoint)
        result["saved_ranks"] = [sorted(entry) for entry in checkpoint["bagua"]["ranks"]]
        own = [checkpoint["state_dict"], checkpoint["bagua"]["ranks"][1]["state_dict"]]
        result["saved_weights"] = [torch.cat([t.reshape(-1) for t in state.values()]) for state in own]
        del checkpoint["bagua"]
        torch.save(checkpoint, stripped)
    import bagua.torch_api as bagua

    bagua.barrier()
    result["resumed"] = _fit_snapshot(data, algorithm, ckpt_path=saved)
    result["stripped"] = _fit_snapshot(data, algorithm, ckpt_path=stripped)
    save(out_dir, rank, result)


def scenario_by_name(out_dir, data):
    """strategy="bagua", started as `python lightning_workers.py ...`:
    Lightning's own launcher runs this script again for rank 1."""
    import bagua.lightning  # noqa: F401 - registers "bagua"

    L.seed_everything(0)
    model = Digits(data)
    t = trainer("bagua", 3)
    t.fit(model)
    save(out_dir, t.global_rank, {"strategy": type(t.strategy).__module__ + "." + type(t.strategy).__name__,
                                  "world_size": t.world_size, "accuracy": model.accuracy(),
                                  "weights": flat(model), "environment": type(t.strategy.cluster_environment).__name__})
    t.strategy.barrier()  # rank 0 (the parent) ends after rank 1 has saved


def scenario_lightning_bagua(out_dir, data, names):
    """lightning_bagua 0.1.0's own BaguaStrategy (Lightning 2.0), unchanged,
    over this package; its torch.cuda.set_device call, the one line that
    needs a GPU, made a no-op here."""
    torch.cuda.set_device = lambda device: None
    from lightning_bagua import BaguaStrategy

    rank = int(os.environ["RANK"])
    results = {}
    for name in names.split(","):
        algorithm, kwargs, optimizer = SPECS[name]
        L.seed_everything(0)
        model = Digits(data, optimizer)
        t = trainer(BaguaStrategy(algorithm=algorithm, **kwargs), 4)
        t.fit(model)
        results[name] = {"accuracy": model.accuracy(), "weights": flat(model)}
        print(f"lightning_bagua {name}: accuracy {results[name]['accuracy']:.4f}", flush=True)
    save(out_dir, rank, results)


if __name__ == "__main__":
    scenario, out, *rest = sys.argv[1:]
    globals()[f"scenario_{scenario}"](out, *rest)
