"""Where Bagua's examples import the DDP-compatible wrapper from
(``from bagua.torch_api.ddp_compatible import DistributedDataParallel``):
:class:`bagua.torch_api.data_parallel.DistributedDataParallel`, PyTorch
DDP's signature plus ``optimizers`` and ``algorithm``."""

from bagua.torch_api.data_parallel import DistributedDataParallel  # noqa: F401

__all__ = ["DistributedDataParallel"]
