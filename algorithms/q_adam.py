"""QAdam: Adam whose momentum is communicated with 8-bit compression.

For the first ``warmup_steps`` steps QAdam is Adam on gradients averaged in
full precision (GradientAllReduce). Then the second moment is frozen, each
rank updates its momentum locally from its own gradient as soon as autograd
has it, and the momentum is averaged with C_LP_S (MinMaxUInt8, scatter-gather)
instead of the gradient.

The frozen second moment is a floor-raised one. A coordinate that had
(almost) no gradient during the warmup -- a ReLU unit dead then, an input
pixel that was zero in every warmup batch -- freezes with v ~ 0, and once its
gradient appears the step m / (sqrt(v) + eps) is unbounded: weights jump by
orders of magnitude and training ends in NaN, with or without compression
(the 8-bit quantization error of m only adds to it). Adam itself can never be
in such a state: its raw moments always satisfy

    m_t^2 <= (1 - b1)^2 / (1 - b2) * S_t * v_t,   S_t = sum_{k<t} (b1^2 / b2)^k

(Cauchy-Schwarz on m_t = (1 - b1) sum_k b1^k g_{t-k} against
v_t = (1 - b2) sum_k b2^k g_{t-k}^2). So after the warmup each step first
raises v to the least value Adam allows for the averaged momentum,
v <- max(v, c_t m^2) with c_t = (1 - b2) / ((1 - b1)^2 S_t): the frozen
estimate is kept wherever it is consistent with the momentum, and a step can
never exceed Adam's own bound, whatever the momentum's quantization error.
The averaged momentum is the same on every rank, so v stays the same too.
A warning says when the floor had to raise many coordinates (over 1 % per
step just after the freeze): the warmup was too short for the frozen second
moment to cover them.
"""

import math
import warnings
from typing import List, Tuple

import torch

from bagua.torch_api import InvalidArgumentError
from bagua.torch_api.algorithms.base import Algorithm, AlgorithmImpl, ArgumentChecks

__all__ = ["QAdamOptimizer", "QAdamAlgorithm", "QAdamAlgorithmImpl"]

# torch.optim.Adam moves the first moment with lerp_ since PyTorch 2.0 and
# with mul_ then add_ before: the same value, different rounding. The warmup
# follows the installed version's, so it stays bit-equal to Adam.
_ADAM_LERPS = int(torch.__version__.split(".")[0]) >= 2


def _update_first_moment(exp_avg: torch.Tensor, grad: torch.Tensor, beta1: float) -> None:
    """exp_avg = beta1 * exp_avg + (1 - beta1) * grad, rounded as Adam does."""
    if _ADAM_LERPS:
        exp_avg.lerp_(grad, 1 - beta1)
    else:
        exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)


class QAdamOptimizer(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, warmup_steps: int = 100,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0):
        ArgumentChecks("QAdamOptimizer").integer("warmup_steps", warmup_steps, 1,
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
        # Coordinates the floor raised since the freeze (a tensor, so that
        # counting costs no device synchronization), and whether we warned.
        self._raised = None
        self._warned = False
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def state_dict(self) -> dict:
        """torch's optimizer state (the moments) and QAdam's step count, which
        decides the phase and the bias corrections."""
        state = super().state_dict()
        raised = None if self._raised is None else int(self._raised.item())
        state["qadam"] = {"step_id": self.step_id, "raised": raised, "warned": self._warned}
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        qadam = state_dict.pop("qadam", None)
        super().load_state_dict(state_dict)
        if qadam is not None:
            self.step_id = int(qadam["step_id"])
            self._raised = None if qadam["raised"] is None else torch.tensor(qadam["raised"])
            self._warned = bool(qadam["warned"])

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
                    _update_first_moment(exp_avg, grad, beta1)
                    exp_avg_sq.mul_(beta2).addcmul_(grad, grad.conj(), value=1 - beta2)
                else:
                    # After warmup the momentum was updated and averaged by
                    # the algorithm; the second moment stays frozen, raised
                    # where it is below Adam's bound for this momentum.
                    self._raise_to_adam_floor(exp_avg, exp_avg_sq, beta1, beta2)
                bias_correction1 = 1 - beta1 ** self.step_id
                bias_correction2 = 1 - beta2 ** min(self.step_id, self.warmup_steps)
                step_size = group["lr"] / bias_correction1
                denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(group["eps"])
                p.addcdiv_(exp_avg, denom, value=-step_size)
        if not warmup:
            self._maybe_warn_short_warmup()
        return loss

    def _raise_to_adam_floor(self, exp_avg, exp_avg_sq, beta1: float, beta2: float) -> None:
        """exp_avg_sq <- max(exp_avg_sq, c_t * exp_avg^2), counting the raised
        coordinates (see the module docstring)."""
        c = adam_second_moment_floor(beta1, beta2, self.step_id)
        if c == 0.0:
            return
        floor = exp_avg.square().mul_(c)
        raised = (floor > exp_avg_sq).sum()
        self._raised = raised if self._raised is None else self._raised.add_(raised.to(self._raised.device))
        torch.maximum(exp_avg_sq, floor, out=exp_avg_sq)

    def _maybe_warn_short_warmup(self) -> None:
        # Judged once, when the momentum has forgotten the warmup (1 / (1 - b1)
        # steps after the freeze): one host synchronization per run. A few
        # raised coordinates are normal (the quantization error, a rare
        # input); in the digits example a warmup of >= 50 steps raises < 0.3 %
        # per step, one of 2 or 20 steps 9-26 %.
        horizon = max(math.ceil(1.0 / (1.0 - group["betas"][0]) - 1e-9) for group in self.param_groups)
        since = self.step_id - self.warmup_steps
        if self._warned or self._raised is None or since != horizon:
            return
        self._warned = True
        raised = int(self._raised.item())
        total = sum(p.numel() for group in self.param_groups for p in group["params"])
        if raised <= 0.01 * total * since:
            return
        warnings.warn(
            f"QAdamOptimizer: warmup_steps={self.warmup_steps} is too short to freeze the second "
            f"moment: over the {since} steps after it, {raised / (total * since):.1%} of the "
            f"coordinates per step had a momentum too large for their frozen variance and were "
            f"raised to Adam's bound (QAdam trains, but further from Adam). Use a longer warmup.",
            RuntimeWarning, stacklevel=5)


def adam_second_moment_floor(beta1: float, beta2: float, step: int) -> float:
    """c such that m^2 <= v / c holds for the raw first and second moments of
    every Adam run after ``step`` steps (0.0 where Adam bounds nothing:
    ``beta2 == 0 < beta1``, or ``beta1**2 >= beta2`` over a long run)."""
    if beta2 == 0.0:
        return 1.0 if beta1 == 0.0 else 0.0
    ratio = beta1 * beta1 / beta2
    if ratio == 1.0:
        series = float(step)
    elif ratio > 1.0 and step * math.log(ratio) > 700.0:
        return 0.0
    else:
        series = (1.0 - ratio ** step) / (1.0 - ratio)
    return (1.0 - beta2) / ((1.0 - beta1) ** 2 * series)


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

    def load_state_dict(self, bagua_ddp, state: dict) -> None:
        # The optimizer (loaded first) holds the step count and the moments;
        # the phase follows it, and the engine's rebuild re-reads the momentum
        # tensors the optimizer's loading replaced.
        self._compressed_phase = not self.optimizer.in_warmup()

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
                _update_first_moment(self.optimizer.state[parameter]["exp_avg"], grad, beta1)
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
        ArgumentChecks(type(self).__name__).flags(hierarchical=hierarchical)
        self.optimizer = q_adam_optimizer
        self.hierarchical = hierarchical

    def reify(self, process_group) -> QAdamAlgorithmImpl:
        return QAdamAlgorithmImpl(process_group, self.optimizer, self.hierarchical)
