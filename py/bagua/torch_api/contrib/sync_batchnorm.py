"""SyncBatchNorm: BatchNorm whose training statistics are those of the
global batch, all ranks' inputs together, as ``torch.nn.SyncBatchNorm``.

The statistics come from two sums over the ranks, each through
:func:`bagua.torch_api.data_parallel.functional.all_reduce` (which autograd
differentiates): the per-channel sum and element count, giving the mean,
then the per-channel sum of squared deviations from it, giving the biased
variance. The forward is then BatchNorm's formula, and backward is what
autograd derives from it, the input gradient including the other ranks'
terms. ``weight`` and ``bias`` get this rank's gradient (the data-parallel
wrapper averages them, as with torch's). Works on CPU and CUDA tensors.
"""

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(_BatchNorm):
    r"""BatchNorm over N-dimensional input (``(N, C, ...)``) with the batch
    statistics of every rank of ``process_group`` (default: all ranks).

    Arguments as ``torch.nn.BatchNorm*d``: ``num_features`` (C), ``eps``,
    ``momentum`` (None: cumulative average), ``affine``,
    ``track_running_stats``. In eval mode with running statistics nothing
    is communicated. Every rank of the group must run each forward and
    backward (batches may differ in size between ranks).
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_group = process_group

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _averaging_factor(self) -> float:
        if self.momentum is not None:
            return self.momentum
        return 1.0 / float(self.num_batches_tracked)

    def _group_size(self) -> int:
        from bagua.torch_api import get_world_size
        from bagua.torch_api.data_parallel.functional import _bagua_group

        if self.process_group is None:
            return get_world_size()
        return _bagua_group(self.process_group).get_size()

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
        if not self.training and self.track_running_stats:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0,
                                self.eps)
        factor = self._averaging_factor() if self.track_running_stats else 0.0
        if self._group_size() == 1:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias, True, factor,
                                self.eps)
        return self._synchronized(input, factor)

    def _synchronized(self, input: torch.Tensor, factor: float) -> torch.Tensor:
        from bagua.torch_api.data_parallel.functional import all_reduce

        channels = input.size(1)
        # stats in at least float32, whatever the input
        x = input.float() if input.dtype in (torch.float16, torch.bfloat16) else input
        dims = [d for d in range(x.dim()) if d != 1]
        shape = [1, channels] + [1] * (x.dim() - 2)
        count = torch.full((1,), input.numel() // channels, dtype=x.dtype, device=x.device)
        sums = all_reduce(torch.cat([x.sum(dims), count]), group=self.process_group)
        total = sums[channels:].detach()
        mean = sums[:channels] / total
        centered = x - mean.view(shape)
        var = all_reduce((centered * centered).sum(dims), group=self.process_group) / total
        out = centered * torch.rsqrt(var + self.eps).view(shape)
        if self.weight is not None:
            out = out * self.weight.view(shape).to(out.dtype) + self.bias.view(shape).to(out.dtype)
        if self.track_running_stats:
            with torch.no_grad():
                n = float(total.item())
                unbiased = var.detach() * (n / (n - 1)) if n > 1 else var.detach()
                self.running_mean.mul_(1 - factor).add_(mean.detach().to(self.running_mean.dtype), alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)
        return out.to(input.dtype)

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module, process_group=None) -> torch.nn.Module:
        """``module`` with every ``BatchNorm*d`` replaced by a SyncBatchNorm
        sharing its parameters and buffers (a BatchNorm itself is returned
        replaced). Call it before wrapping the model for data parallelism."""
        converted = module
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            converted = cls(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_group)
            if module.affine:
                with torch.no_grad():
                    converted.weight = module.weight
                    converted.bias = module.bias
            converted.running_mean = module.running_mean
            converted.running_var = module.running_var
            converted.num_batches_tracked = module.num_batches_tracked
            converted.train(module.training)
            if hasattr(module, "qconfig"):
                converted.qconfig = module.qconfig
        for name, child in module.named_children():
            converted.add_module(name, cls.convert_sync_batchnorm(child, process_group))
        return converted
