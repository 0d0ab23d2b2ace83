"""Module buffers (BatchNorm's running statistics, counters...) during
training, as PyTorch DDP keeps them with ``broadcast_buffers=True``.

Each rank updates its buffers from its own batch, so without care the ranks'
running statistics drift apart, and so do their evaluation outputs. DDP
broadcasts rank 0's buffers before every forward. Here, for an algorithm
whose ranks share their weights (gradient averaging: GradientAllReduce,
ByteGrad, QAdam, PowerSGD, ...), rank 0's buffers are broadcast

- before every training forward (``no_sync()`` ones too, as DDP), and
- before the first forward that does not train (evaluation, ``no_grad``)
  after a training one, so every rank evaluates rank 0's statistics.

Further evaluation forwards broadcast nothing: buffers do not change in
evaluation, and a rank may then evaluate alone. (DDP broadcasts before
those too, so with DDP every rank must run every evaluation forward.)

Where ranks' weights differ by design (decentralized, low-precision
decentralized, asynchronous model average, P-Reduce) each rank keeps its
own buffers: its statistics describe its own weights, not rank 0's.
``broadcast_buffers=False`` opts out everywhere.
"""

from typing import List

import torch

from bagua.torch_api.data_parallel.state import broadcast_coalesced


class BufferSync:
    """Broadcasts a module's buffers from rank 0 when DDP would."""

    def __init__(self, module: torch.nn.Module, group, enabled: bool):
        self.module = module
        self.group = group
        self.enabled = enabled
        self._trained_since_broadcast = False
        self.root = 0  # whose buffers are broadcast (inside join(): the highest rank still training)

    def buffers(self) -> List[torch.Tensor]:
        return [b for b in self.module.buffers() if b is not None]

    def before_forward(self, training: bool, algorithm_impl) -> None:
        """Called before each forward of the wrapped module, on every rank."""
        if not self.enabled or not algorithm_impl.ranks_share_weights():
            return
        if not training and not self._trained_since_broadcast:
            return
        self._trained_since_broadcast = training
        buffers = self.buffers()
        if buffers:
            broadcast_coalesced(buffers, self.group, src=self.root)
