"""QAdam: Adam whose momentum is communicated with 8-bit compression.

For the first ``warmup_steps`` steps QAdam is Adam on gradients averaged in
full precision (GradientAllReduce). Then the second moment is frozen, each
rank updates its momentum locally from its own gradient as soon as autograd
has it, and the momentum is averaged with C_LP_S (MinMaxUInt8, scatter-gather)
instead of the gradient.
"""

import math
from typing import List, Tuple

import torch

from bagua.torch_api import InvalidArgumentError
from bagua.torch_api.algorithms.base import Algorithm, AlgorithmImpl, check_flags, check_integer

__all__ = ["QAdamOptimizer", "QAdamAlgorithm", "QAdamAlgorithmImpl"]


class QAdamOptimizer(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, warmup_steps: int = 100,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0):
        check_integer("QAdamOptimizer", "warmup_steps", warmup_steps, 1,
                      " (the second moment needs full-precision steps before it is frozen)")
        if not lr > 0.0:
            raise InvalidArgumentError(f"QAdamOptimizer: lr must be positive, got {lr!r}")
        if not (len(betas) == 2 and 0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise InvalidArgumentError(f"QAdamOptimizer: betas must be in [0, 1), got {betas!r}")
        if not eps >= 0.0:
            raise InvalidArgumentError(f"QAdamOptimizer: eps must be >= 0, got {eps!r}")
        if not weight_decay >= 0.0:
            raise InvalidArgumentError(f"QAdamOptimizer: weight_decay must be >= 0, got {weight_decay!r}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.warmup_steps = warmup_steps
        self.step_id = 0
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def in_warmup(self) -> bool:
        """True while the next step is a full-precision Adam step."""
        return self.step_id < self.warmup_steps

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        warmup = self.in_warmup()
        self.step_id += 1
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                if warmup:
                    # The same operations as torch.optim.Adam (single tensor).
                    grad = p.grad
                    if group["weight_decay"] != 0:
                        grad = grad.add(p, alpha=group["weight_decay"])
                    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                    exp_avg_sq.mul_(beta2).addcmul_(grad, grad.conj(), value=1 - beta2)
                # After warmup the momentum was updated and averaged by the
                # algorithm; the second moment stays frozen.
                bias_correction1 = 1 - beta1 ** self.step_id
                bias_correction2 = 1 - beta2 ** min(self.step_id, self.warmup_steps)
                step_size = group["lr"] / bias_correction1
                denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(group["eps"])
                p.addcdiv_(exp_avg, denom, value=-step_size)
        return loss


class QAdamAlgorithmImpl(AlgorithmImpl):
    def __init__(self, process_group, q_adam_optimizer: QAdamOptimizer, hierarchical: bool = True):
        super().__init__(process_group)
        self.optimizer = q_adam_optimizer
        self.hierarchical = hierarchical
        self._compressed_phase = False

    def need_reset(self) -> bool:
        if not self._compressed_phase and not self.optimizer.in_warmup():
            self._compressed_phase = True
            return True
        return False

    def init_tensors(self, bagua_ddp) -> List:
        if not self._compressed_phase:
            return super().init_tensors(bagua_ddp)
        tensors = []
        for name, param in reversed(bagua_ddp.bagua_build_params()):
            state = self.optimizer.state[param]
            tensors.append(state["exp_avg"].ensure_bagua_tensor(
                name, bagua_ddp.bagua_module_name,
                getter_closure=lambda momentum, state=state: state["exp_avg"],
                setter_closure=lambda momentum, t, state=state: state.__setitem__("exp_avg", t)))
        return tensors

    def init_operations(self, bagua_ddp, bucket):
        bucket.clear_ops()
        if self._compressed_phase:
            bucket.append_centralized_synchronous_op(
                hierarchical=self.hierarchical, average=True, scattergather=True,
                compression="MinMaxUInt8", group=self.process_group)
        else:
            bucket.append_centralized_synchronous_op(
                hierarchical=self.hierarchical, average=True, group=self.process_group)

    def init_backward_hook(self, bagua_ddp):
        if not self._compressed_phase:
            return super().init_backward_hook(bagua_ddp)
        param_groups = {id(p): group for group in self.optimizer.param_groups for p in group["params"]}

        def hook(parameter_name, parameter):
            tensor = bagua_ddp.bagua_tensor_by_name(parameter_name)
            if tensor is None:
                return
            group = param_groups[id(parameter)]
            beta1 = group["betas"][0]
            with torch.no_grad():
                grad = parameter.grad
                if group["weight_decay"] != 0:
                    grad = grad.add(parameter, alpha=group["weight_decay"])
                self.optimizer.state[parameter]["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
            tensor.bagua_mark_communication_ready()

        return hook


class QAdamAlgorithm(Algorithm):
    def __init__(self, q_adam_optimizer: QAdamOptimizer, hierarchical: bool = True):
        """
        Args:
            q_adam_optimizer: the QAdamOptimizer that trains the module.
            hierarchical: average inside each node first, compress between nodes.
        """
        if not isinstance(q_adam_optimizer, QAdamOptimizer):
            raise InvalidArgumentError(
                f"QAdamAlgorithm needs a QAdamOptimizer, got {type(q_adam_optimizer).__name__}")
        check_flags(type(self).__name__, hierarchical=hierarchical)
        self.optimizer = q_adam_optimizer
        self.hierarchical = hierarchical

    def reify(self, process_group) -> QAdamAlgorithmImpl:
        return QAdamAlgorithmImpl(process_group, self.optimizer, self.hierarchical)
