"""Bagua's store interface: a mapping from string keys to byte values, and a
cluster of stores sharded on the client side."""

from typing import Callable, Dict, List, Optional, Sequence

__all__ = ["Store", "ClusterStore"]


class Store:
    """Base class of the stores: ``set``/``mset`` add key-value pairs,
    ``get``/``mget`` read them (None for a missing key)."""

    def set(self, key: str, value: bytes) -> None:
        raise NotImplementedError

    def get(self, key: str) -> Optional[bytes]:
        raise NotImplementedError

    def num_keys(self) -> int:
        raise NotImplementedError

    def clear(self) -> None:
        raise NotImplementedError

    def mset(self, mapping: Dict[str, bytes]) -> None:
        raise NotImplementedError

    def mget(self, keys: Sequence[str]) -> List[Optional[bytes]]:
        raise NotImplementedError

    def status(self) -> bool:
        raise NotImplementedError

    def shutdown(self) -> None:
        pass


class ClusterStore(Store):
    """Several stores as one: each key lives in store ``hash_fn(key) % n``
    (CRC-16 by default, ``hash_func.crc16``)."""

    def __init__(self, stores: Sequence[Store], hash_fn: Optional[Callable[[str], int]] = None):
        if not stores:
            from bagua.torch_api import InvalidArgumentError
            raise InvalidArgumentError("ClusterStore needs at least one store")
        self.stores = list(stores)
        self.num_stores = len(self.stores)
        if hash_fn is None:
            from bagua.torch_api.contrib.utils.hash_func import crc16
            hash_fn = crc16
        self.hash_fn = hash_fn

    def route(self, key: str) -> Store:
        return self.stores[self.hash_fn(key) % self.num_stores]

    def _by_store(self, keys) -> Dict[int, List[str]]:
        shards: Dict[int, List[str]] = {}
        for key in keys:
            shards.setdefault(self.hash_fn(key) % self.num_stores, []).append(key)
        return shards

    def set(self, key: str, value: bytes) -> None:
        self.route(key).set(key, value)

    def get(self, key: str) -> Optional[bytes]:
        return self.route(key).get(key)

    def num_keys(self) -> int:
        return sum(store.num_keys() for store in self.stores)

    def clear(self) -> None:
        for store in self.stores:
            store.clear()

    def mset(self, mapping: Dict[str, bytes]) -> None:
        for shard, keys in self._by_store(mapping).items():
            self.stores[shard].mset({k: mapping[k] for k in keys})

    def mget(self, keys: Sequence[str]) -> List[Optional[bytes]]:
        found: Dict[str, Optional[bytes]] = {}
        for shard, shard_keys in self._by_store(keys).items():
            found.update(zip(shard_keys, self.stores[shard].mget(shard_keys)))
        return [found.get(k) for k in keys]

    def status(self) -> bool:
        return all(store.status() for store in self.stores)

    def shutdown(self) -> None:
        for store in self.stores:
            store.shutdown()
