"""Bagua's ``bagua.torch_api.contrib``: load-balancing samplers for data of
uneven cost, a synchronized BatchNorm, the fused optimizer, and a dataset
cache on Redis (CachedDataset, CacheLoader).

    from bagua.torch_api.contrib import LoadBalancingDistributedSampler
    from bagua.torch_api.contrib.sync_batchnorm import SyncBatchNorm
"""

from bagua.torch_api.contrib.load_balancing_data_loader import (  # noqa: F401
    LoadBalancingDistributedBatchSampler,
    LoadBalancingDistributedSampler,
)
from bagua.torch_api.contrib.sync_batchnorm import SyncBatchNorm  # noqa: F401
from bagua.torch_api.contrib.fuse.optimizer import FusedOptimizer, fuse_optimizer  # noqa: F401
from bagua.torch_api.contrib.cache_loader import CacheLoader  # noqa: F401
from bagua.torch_api.contrib.cached_dataset import CachedDataset  # noqa: F401

__all__ = ["LoadBalancingDistributedSampler", "LoadBalancingDistributedBatchSampler", "SyncBatchNorm",
           "fuse_optimizer", "FusedOptimizer", "CacheLoader", "CachedDataset"]
