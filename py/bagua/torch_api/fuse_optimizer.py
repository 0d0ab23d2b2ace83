"""Where Bagua 0.8 kept its fused optimizer
(``from bagua.torch_api.fuse_optimizer import FusedOptimizer``); it lives in
:mod:`bagua.torch_api.contrib.fuse.optimizer` now."""

from bagua.torch_api.contrib.fuse.optimizer import FusedOptimizer, fuse_optimizer  # noqa: F401

__all__ = ["FusedOptimizer", "fuse_optimizer"]
