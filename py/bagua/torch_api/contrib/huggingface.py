"""Hugging Face's ``Trainer`` with one of bagua's DDP hooks.

``Trainer`` wraps the model in ``DistributedDataParallel`` itself (through
Accelerate) when it runs on several processes. ``BaguaHookTrainer`` is a
``Trainer`` that registers bagua's hook on that DDP before its first
training step, so the gradients cross compressed, once::

    from bagua.torch_api.contrib.huggingface import BaguaHookTrainer

    trainer = BaguaHookTrainer(model=model, args=args, train_dataset=data,
                               bagua_hook="bytegrad")      # or "powersgd", bagua_hook_options={...}
    trainer.train()

Launch it as any Trainer script (``torchrun --nproc_per_node N``); call
``bagua.torch_api.init_process_group()`` first or let the trainer do it.
Importing this module imports transformers; nothing else in bagua does.
"""

import torch
from transformers import Trainer

import bagua.torch_api as bagua
from bagua.torch_api import ddp_hooks

__all__ = ["BaguaHookTrainer"]


class BaguaHookTrainer(Trainer):
    """``Trainer`` plus ``bagua_hook`` ("bytegrad" or "powersgd") and
    ``bagua_hook_options`` (PowerSGDState's keywords). ``bagua_hook_state``
    is the hook's state once training started (None on one process)."""

    def __init__(self, *args, bagua_hook: str = "bytegrad", bagua_hook_options=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.bagua_hook = bagua_hook
        self.bagua_hook_options = dict(bagua_hook_options or {})
        self.bagua_hook_state = None

    def training_step(self, model, inputs, *args, **kwargs):
        if self.bagua_hook_state is None and isinstance(model, torch.nn.parallel.DistributedDataParallel):
            if not bagua.is_initialized():
                bagua.init_process_group()  # joins the torch.distributed group Accelerate set up
            self.bagua_hook_state = ddp_hooks.register(model, self.bagua_hook, **self.bagua_hook_options)
        return super().training_step(model, inputs, *args, **kwargs)
