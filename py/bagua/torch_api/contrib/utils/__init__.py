"""Key-value stores behind Bagua's dataset cache: ``Store``, the
client-side sharded ``ClusterStore`` and the Redis-backed ``RedisStore``."""

from bagua.torch_api.contrib.utils.store import ClusterStore, Store  # noqa: F401

__all__ = ["Store", "ClusterStore"]
