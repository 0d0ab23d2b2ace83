"""Bagua's CacheLoader: values computed once by a loading function, then
read back from a key-value store (Redis) shared by the job's processes."""

import logging
import pickle
from typing import Any, Callable, Dict

from bagua.torch_api import InvalidArgumentError

__all__ = ["CacheLoader"]

_log = logging.getLogger(__name__)


class CacheLoader:
    """A mapping from keys to values: ``get(key, load_fn)`` returns the
    cached value, or ``load_fn(key)`` (then cached). Values are pickled and
    kept under ``"{key_prefix}_{key}"`` (``"{key}"`` without a prefix).

    Args:
        backend: ``"redis"``, the only store (``RedisStore``).
        key_prefix: keeps the entries of different caches apart in one store.
        writer_buffer_size: new values are written in batches of this many
            (``mset``); the rest of a batch is written after every 1000 reads.
        **kwargs: ``RedisStore``'s: ``hosts``, ``cluster_mode``,
            ``capacity_per_node``.

    The cache is an optimization: when the store fails, ``get`` loads the
    value (a warning is logged once) instead of failing training.
    """

    def __init__(self, backend: str = "redis", key_prefix: str = "", writer_buffer_size: int = 1, **kwargs):
        if backend != "redis":
            raise InvalidArgumentError(f"CacheLoader: backend must be 'redis', got {backend!r}")
        if not isinstance(writer_buffer_size, int) or writer_buffer_size < 1:
            raise InvalidArgumentError(f"CacheLoader: writer_buffer_size must be an integer >= 1, "
                                       f"got {writer_buffer_size!r}")
        from bagua.torch_api.contrib.utils.redis_store import RedisStore
        self.backend = backend
        self.key_prefix = key_prefix
        self.store = RedisStore(**kwargs)
        self.writer_buffer_size = writer_buffer_size
        self._pending: Dict[str, bytes] = {}
        self._reads = 0
        self._warned = False

    def _key(self, key) -> str:
        return f"{self.key_prefix}_{key}" if self.key_prefix else f"{key}"

    def get(self, key, load_fn: Callable[[Any], Any]):
        """The value of ``key``: from the cache, else ``load_fn(key)``."""
        cache_key = self._key(key)
        value = self._pending.get(cache_key)
        if value is None:
            value = self._read(cache_key)
        if value is not None:
            return pickle.loads(value)
        result = load_fn(key)
        self._pending[cache_key] = pickle.dumps(result)
        if len(self._pending) >= self.writer_buffer_size:
            self.flush()
        return result

    def _read(self, cache_key: str):
        self._reads += 1
        try:
            value = self.store.get(cache_key)
        except Exception as e:  # the store is a cache: load instead
            self._warn(e)
            return None
        if self._reads % 1000 == 0 and self._pending:
            self.flush()
        return value

    def flush(self) -> None:
        """Writes the values not written yet."""
        if not self._pending:
            return
        try:
            self.store.mset(self._pending)
        except Exception as e:
            self._warn(e)
            return
        self._pending.clear()

    def _warn(self, error: Exception) -> None:
        if not self._warned:
            self._warned = True
            _log.warning("CacheLoader %r: the store failed (%s); loading values instead", self.key_prefix, error)

    def num_keys(self) -> int:
        """The number of keys in the store (all caches sharing it)."""
        return self.store.num_keys()
