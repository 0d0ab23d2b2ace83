"""Hugging Face's Trainer at several CPU ranks (run by test_trainer.py,
PyTorch 2 lane): a tiny GPT-2 trained by plain Trainer (its own DDP) and by
BaguaHookTrainer with bagua's ByteGrad hook on that DDP; and Accelerate's
prepare() followed by ddp_hooks.register.

Usage: trainer_workers.py SCENARIO OUT_DIR [ARGS...]; each rank saves its
results to OUT_DIR/rank{RANK}.pt.
"""

import os
import sys

import torch


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def dataset():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (32, 12), generator=g)
    return [{"input_ids": t, "labels": t} for t in tokens]


def training_arguments(out_dir, name, **extra):
    from transformers import TrainingArguments
    return TrainingArguments(output_dir=os.path.join(out_dir, name), per_device_train_batch_size=4, max_steps=4,
                             learning_rate=1e-3, report_to=[], save_strategy="no", logging_strategy="no",
                             use_cpu=True, dataloader_num_workers=0, seed=0, disable_tqdm=True, **extra)


def train(trainer_class, out_dir, name, **extra):
    model = gpt2()
    trainer = trainer_class(model=model, args=training_arguments(out_dir, name), train_dataset=dataset(), **extra)
    trainer.train()
    wrapped = type(trainer.model_wrapped).__name__
    return trainer, [p.detach().clone() for p in model.parameters()], wrapped


def recording_trainer():
    """BaguaHookTrainer that keeps what each step's loss was computed from:
    the batch Trainer handed this rank, its num_items_in_batch, the loss."""
    from bagua.torch_api.contrib.huggingface import BaguaHookTrainer

    class RecordingTrainer(BaguaHookTrainer):
        steps = []

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            self.steps.append(({k: v.detach().clone() for k, v in inputs.items()}, num_items_in_batch,
                               loss.detach().clone()))
            return loss

    return RecordingTrainer


def scenario_trainer_by_hand(out_dir):
    """Trainer with SGD at a constant rate and no clipping, against the loop
    a user writes: DDP, the same hook by ddp_hooks.register, the same
    batches (Trainer's, as it handed them out), the loss as Trainer scales
    it (summed over tokens / the tokens of every rank, times the world size)."""
    from bagua.torch_api import ddp_hooks
    from transformers import Trainer
    simple = dict(optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0)
    cls = recording_trainer()
    model = gpt2()
    trainer = cls(model=model, args=training_arguments(out_dir, "trainer", **simple), train_dataset=dataset(),
                  bagua_hook="bytegrad")
    trainer.train()
    by_trainer = [p.detach().clone() for p in model.parameters()]
    assert isinstance(trainer, Trainer) and len(cls.steps) == 4

    model = gpt2()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp_hooks.register(ddp, "bytegrad")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    world = torch.distributed.get_world_size()
    losses_equal = []
    for inputs, num_items, recorded in cls.steps:
        opt.zero_grad()
        extra = {} if num_items is None else {"num_items_in_batch": num_items}
        loss = ddp(**inputs, **extra)["loss"]
        if num_items is not None:
            loss = loss * world
        losses_equal.append(torch.equal(loss.detach(), recorded))
        loss.backward()
        opt.step()
    by_hand = [p.detach().clone() for p in model.parameters()]
    torch.save({"trainer": by_trainer, "by_hand": by_hand, "losses_equal": losses_equal,
                "num_items": [None if n is None else int(n) for _, n, _ in cls.steps]},
               os.path.join(out_dir, f"rank{torch.distributed.get_rank()}.pt"))


def scenario_trainer(out_dir):
    from transformers import Trainer
    from bagua.torch_api.contrib.huggingface import BaguaHookTrainer
    _, plain, plain_wrapped = train(Trainer, out_dir, "plain")
    trainer, hooked, hooked_wrapped = train(BaguaHookTrainer, out_dir, "bagua", bagua_hook="bytegrad")
    state = trainer.bagua_hook_state
    rank = torch.distributed.get_rank()
    torch.save({"plain": plain, "bagua": hooked, "wrapped": (plain_wrapped, hooked_wrapped),
                "buckets_run": len(state._buckets) if state is not None else 0},
               os.path.join(out_dir, f"rank{rank}.pt"))


def scenario_accelerate(out_dir):
    import torch.nn.functional as F
    from accelerate import Accelerator
    import bagua.torch_api as bagua
    from bagua.torch_api import ddp_hooks
    accelerator = Accelerator(cpu=True)
    bagua.init_process_group()
    results = {}
    for name in ("plain", "bytegrad"):
        model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
        torch.manual_seed(0)
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = accelerator.prepare(model, opt)
        if name == "bytegrad":
            ddp_hooks.register(model, "bytegrad")
        g = torch.Generator().manual_seed(accelerator.process_index)
        for _ in range(4):
            x, y = torch.randn(8, 10, generator=g), torch.randint(0, 3, (8,), generator=g)
            opt.zero_grad()
            accelerator.backward(F.cross_entropy(model(x), y))
            opt.step()
        results[name] = [p.detach().clone() for p in model.parameters()]
        results[f"{name}/wrapped"] = type(model).__name__
    torch.save(results, os.path.join(out_dir, f"rank{accelerator.process_index}.pt"))


if __name__ == "__main__":
    scenario, out_dir = sys.argv[1], sys.argv[2]
    globals()[f"scenario_{scenario}"](out_dir, *sys.argv[3:])
