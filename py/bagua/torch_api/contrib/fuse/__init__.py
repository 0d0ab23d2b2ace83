"""Fused kernels of Bagua's ``contrib.fuse``: the fused optimizer."""

from bagua.torch_api.contrib.fuse.optimizer import calculate_mutual_groups, fuse_optimizer  # noqa: F401

__all__ = ["fuse_optimizer", "calculate_mutual_groups"]
