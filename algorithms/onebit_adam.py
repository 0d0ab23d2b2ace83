"""Bagua's first name for QAdam (``bagua.torch_api.algorithms.onebit_adam``,
used by its older examples): the same algorithm under the old signatures.

``OnebitAdamAlgorithm(optimizer, warmup_steps, hierarchical_reduce)``: in
the old code the algorithm's ``warmup_steps`` chose when compression starts
and the optimizer's when the second moment freezes; here one number does
both, so a value given to the algorithm becomes the optimizer's.
"""

from bagua.torch_api.algorithms.base import ArgumentChecks
from bagua.torch_api.algorithms.q_adam import QAdamAlgorithm, QAdamOptimizer

__all__ = ["OnebitAdamAlgorithm", "OnebitAdamOptimizer"]


class OnebitAdamOptimizer(QAdamOptimizer):
    def __init__(self, params, lr: float = 1e-3, warmup_steps: int = 100, is_bert: bool = False,
                 freeze_test_step: int = -1, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0):
        """QAdamOptimizer's arguments; ``is_bert`` and ``freeze_test_step`` were
        switches of the old code's experiments and are accepted as they are."""
        del is_bert, freeze_test_step  # accepted for the old signature
        super().__init__(params, lr=lr, warmup_steps=warmup_steps, betas=betas, eps=eps,
                         weight_decay=weight_decay)


class OnebitAdamAlgorithm(QAdamAlgorithm):
    def __init__(self, onebit_optimizer: QAdamOptimizer, warmup_steps=None, hierarchical_reduce: bool = True):
        if warmup_steps is not None:
            ArgumentChecks("OnebitAdamAlgorithm").integer("warmup_steps", warmup_steps, 1,
                          " (the second moment needs full-precision steps before it is frozen)")
            onebit_optimizer.warmup_steps = warmup_steps
        super().__init__(onebit_optimizer, hierarchical=hierarchical_reduce)
