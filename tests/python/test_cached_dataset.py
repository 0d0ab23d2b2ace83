"""CachedDataset, CacheLoader and RedisStore against real Redis servers
(Debian's redis-server, started here): Bagua's store checks, client-side
sharding over three servers, the cache serving samples without calling the
dataset again, DataLoader workers, two processes sharing one bootstrapped
server, and the failure cases."""

import shutil
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

redis = pytest.importorskip("redis", reason="python3-redis is not installed (scripts/install_deps.sh installs it)")
if shutil.which("redis-server") is None:
    pytest.skip("redis-server is not installed (scripts/install_deps.sh installs it)", allow_module_level=True)

from bagua.torch_api import InvalidArgumentError  # noqa: E402
from bagua.torch_api.contrib import CachedDataset, CacheLoader  # noqa: E402
from bagua.torch_api.contrib.utils import redis_store  # noqa: E402
from bagua.torch_api.contrib.utils.hash_func import crc16  # noqa: E402
from bagua.torch_api.contrib.utils.redis_store import RedisStore, find_free_port, start_redis_server_cli  # noqa: E402
from launcher import run_workers  # noqa: E402


@pytest.fixture
def servers():
    """Starts Redis servers on free ports; shuts them down afterwards."""
    started = []

    def start(count):
        for _ in range(count):
            port = find_free_port()
            start_redis_server_cli(port, 10_000_000)
            redis_store._connect("127.0.0.1", port)
            started.append(port)
        return [{"host": "127.0.0.1", "port": port} for port in started[-count:]]

    yield start
    for port in started:
        redis_store._shutdown("127.0.0.1", port)


class Samples(torch.utils.data.Dataset):
    """Random samples that count how often they are read."""

    def __init__(self, size, seed):
        rng = np.random.default_rng(seed)
        self.samples = [(rng.random((5, 2)), rng.random(1)) for _ in range(size)]
        self.reads = 0

    def __getitem__(self, index):
        sample = self.samples[index]  # IndexError ends iteration, uncounted
        self.reads += 1
        return sample

    def __len__(self):
        return len(self.samples)


def test_crc16_is_redis_clusters_checksum():
    assert crc16("123456789") == 0x31C3  # the check value in the Redis Cluster specification
    assert crc16(b"") == 0


def check_store(store):
    """Bagua's store check."""
    store.clear()
    assert store.num_keys() == 0
    data = [np.random.rand(10) for _ in range(5)]
    store.set("1", pickle.dumps(data[1]))
    store.mset({"2": pickle.dumps(data[2]), "3": pickle.dumps(data[3]), "4": pickle.dumps(data[4])})
    got = store.mget(["1", "2", "5"])
    assert (pickle.loads(got[0]) == data[1]).all() and (pickle.loads(got[1]) == data[2]).all()
    assert got[2] is None
    assert (pickle.loads(store.get("4")) == data[4]).all() and store.get("6") is None
    assert store.num_keys() == 4
    assert store.status()


def test_redis_store_on_one_server(servers):
    check_store(RedisStore(hosts=servers(1)))


def test_cluster_mode_shards_keys_over_the_servers(servers):
    hosts = servers(3)
    store = RedisStore(hosts=hosts, cluster_mode=True)
    check_store(store)
    store.mset({f"k{i}": str(i).encode() for i in range(60)})
    assert store.mget([f"k{i}" for i in range(60)]) == [str(i).encode() for i in range(60)]
    sizes = [redis.Redis(port=h["port"]).dbsize() for h in hosts]
    assert sum(sizes) == store.num_keys() == 64
    assert sum(1 for s in sizes if s > 0) == 3, sizes  # every server holds some keys
    for i in range(60):  # each key lives where its CRC-16 sends it
        assert redis.Redis(port=hosts[crc16(f"k{i}") % 3]["port"]).get(f"k{i}") == str(i).encode()
    single = RedisStore(hosts=hosts, cluster_mode=False)  # the first server only
    assert single.num_keys() == sizes[0]


def test_cached_dataset_serves_samples_from_the_cache():
    """Bagua's test (bootstrapped server, two datasets sharing it), plus:
    after the first epoch the dataset is not read again."""
    dataset1, dataset2 = Samples(102, 1), Samples(102, 2)
    cached1 = CachedDataset(dataset1, backend="redis", dataset_name="d1")
    cached1.cache_loader.store.clear()  # the process's bootstrapped server may hold other tests' keys
    cached2 = CachedDataset(dataset2, backend="redis", dataset_name="d2")
    for dataset, cached, keys in ((dataset1, cached1, 102), (dataset2, cached2, 204)):
        for _ in range(10):
            for _ in cached:
                pass
        for i in range(len(dataset)):
            assert (dataset.samples[i][0] == cached[i][0]).all() and (dataset.samples[i][1] == cached[i][1]).all()
        assert dataset.reads == len(dataset)  # every sample computed once, then served by Redis
        assert cached.cache_loader.num_keys() == keys


def test_cached_dataset_in_dataloader_workers():
    dataset = Samples(40, 3)
    cached = CachedDataset(dataset, dataset_name="workers", writer_buffer_size=1)
    for i in range(len(dataset)):
        cached[i]  # cached by this process
    loader = torch.utils.data.DataLoader(cached, batch_size=8, num_workers=2)
    batches = list(loader)
    expected = torch.utils.data.default_collate([dataset.samples[i] for i in range(8)])
    assert torch.equal(batches[0][0], expected[0]) and torch.equal(batches[0][1], expected[1])
    assert sum(len(b[0]) for b in batches) == 40


def test_two_processes_share_one_bootstrapped_server(tmp_path):
    results = run_workers("cache_shared", 2, tmp_path, script=Path(__file__).with_name("cache_workers.py"))
    assert results[0]["host"] == results[1]["host"]
    assert results[1]["seen_from_rank0"] == "written by rank 0"
    assert results[0]["loads"] + results[1]["loads"] == 30  # each sample computed by one rank only


def test_bad_arguments_and_unreachable_servers_are_clear_errors(monkeypatch):
    with pytest.raises(InvalidArgumentError, match="backend must be 'redis'"):
        CacheLoader(backend="lmdb")
    with pytest.raises(InvalidArgumentError, match="hosts must be None or"):
        RedisStore(hosts=[{"port": 1}])
    monkeypatch.setattr(redis_store, "_CONNECT_TIMEOUT_S", 0.5)
    port = find_free_port()
    with pytest.raises(InvalidArgumentError, match=f"127.0.0.1:{port}"):
        RedisStore(hosts=[{"host": "127.0.0.1", "port": port}])


def test_a_failed_store_falls_back_to_loading(servers, caplog):
    hosts = servers(1)
    loader = CacheLoader(hosts=hosts, key_prefix="gone")
    assert loader.get(1, lambda k: k * 10) == 10
    assert loader.get(1, lambda k: -1) == 10  # cached
    redis_store._shutdown("127.0.0.1", hosts[0]["port"])
    assert loader.get(2, lambda k: k * 10) == 20  # loaded although the store is gone
    assert "the store failed" in caplog.text
