"""RedisStore: the store of Bagua's dataset cache on Redis servers, given or
started by the job itself.

``RedisStore(hosts=None)`` bootstraps: local rank 0 of every node starts one
``redis-server`` (Debian's ``redis-server`` package) on a free port, the
nodes learn each other's address through ``broadcast_object`` when bagua is
initialized, and every later ``RedisStore(hosts=None)`` of the process
reuses those servers. The process that started a server shuts it down at
exit. ``cluster_mode=True`` shards keys over all servers (``ClusterStore``);
otherwise each process uses its own node's server (or the first of
``hosts``).
"""

import atexit
import logging
import shutil
import socket
import subprocess
import time
from typing import Dict, List, Optional, Sequence

from bagua.torch_api import InvalidArgumentError, env
from bagua.torch_api.contrib.utils.store import ClusterStore, Store

__all__ = ["RedisStore", "start_redis_server_cli", "find_free_port", "get_host_ip"]

_log = logging.getLogger(__name__)
_bootstrapped: Optional[List[Dict]] = None   # every node's server, once started
_CONNECT_TIMEOUT_S = 30.0


def _redis():
    try:
        import redis
    except ImportError:
        raise InvalidArgumentError("RedisStore needs the redis client: apt-get install python3-redis "
                                   "(or pip install redis)") from None
    return redis


class RedisStore(ClusterStore):
    """A store on Redis servers.

    Args:
        hosts: ``[{"host": ..., "port": ...}, ...]`` of running servers, or
            None to start one per node (see the module's docstring).
        cluster_mode: shard keys over all servers; otherwise one server per
            process (its node's when bootstrapped, else the first of hosts).
        capacity_per_node: the started servers' ``maxmemory`` in bytes; they
            evict random keys beyond it (a cache may lose entries).
    """

    def __init__(self, hosts: Optional[List[Dict]] = None, cluster_mode: bool = False,
                 capacity_per_node: int = 100_000_000_000):
        if hosts is not None and (not isinstance(hosts, (list, tuple)) or not hosts or
                                  not all(isinstance(h, dict) and "host" in h and "port" in h for h in hosts)):
            raise InvalidArgumentError(f"RedisStore: hosts must be None or a non-empty list of "
                                       f"{{'host': ..., 'port': ...}}, got {hosts!r}")
        self.bootstrap = hosts is None
        self.cluster_mode = cluster_mode
        self.capacity_per_node = capacity_per_node
        if self.bootstrap:
            nodes = _bootstrap_servers(capacity_per_node)
            self.hosts = list(nodes) if cluster_mode else [nodes[_node_index()]]
        else:
            self.hosts = list(hosts) if cluster_mode else [hosts[0]]
        super().__init__([_RedisStore(h["host"], int(h["port"])) for h in self.hosts])


class _RedisStore(Store):
    """One Redis server. Picklable (DataLoader workers): the connection is
    opened again in the process that unpickles it."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self._client = None
        self.status()

    def __getstate__(self):
        return {"host": self.host, "port": self.port, "_client": None}

    @property
    def client(self):
        if self._client is None:
            self._client = _connect(self.host, self.port)
        return self._client

    def set(self, key: str, value: bytes) -> None:
        self.client.set(key, value)

    def get(self, key: str) -> Optional[bytes]:
        return self.client.get(key)

    def num_keys(self) -> int:
        return self.client.dbsize()

    def clear(self) -> None:
        self.client.flushdb()

    def mset(self, mapping: Dict[str, bytes]) -> None:
        if mapping:
            self.client.mset(mapping)

    def mget(self, keys: Sequence[str]) -> List[Optional[bytes]]:
        return self.client.mget(list(keys)) if keys else []

    def status(self) -> bool:
        return bool(self.client.ping())


def _client(host: str, port: int):
    """A Redis client that reports a lost server at once: newer redis-py
    versions retry with backoff by default (seconds per call), which turns a
    dead cache into a stalled training step."""
    redis = _redis()
    try:
        from redis.backoff import NoBackoff
        from redis.retry import Retry
        return redis.Redis(host=host, port=port, retry=Retry(NoBackoff(), 0), socket_connect_timeout=5)
    except (ImportError, TypeError):  # older clients do not retry
        return redis.Redis(host=host, port=port, socket_connect_timeout=5)


def _connect(host: str, port: int, timeout_s: Optional[float] = None):
    """A client of host:port once it answers PING (a server just started
    needs a moment); InvalidArgumentError naming the address after
    ``timeout_s`` (default 30 s)."""
    redis = _redis()
    timeout_s = _CONNECT_TIMEOUT_S if timeout_s is None else timeout_s
    client = _client(host, port)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.ping()
            return client
        except redis.exceptions.ConnectionError as e:
            if time.monotonic() > deadline:
                raise InvalidArgumentError(
                    f"RedisStore: no Redis server answers at {host}:{port} after {timeout_s:.0f} s ({e})") from None
            time.sleep(0.05)


def start_redis_server_cli(port: int, capacity: int, *args: str) -> None:
    """Starts a daemonized ``redis-server`` on ``port`` with ``maxmemory``
    ``capacity`` bytes, random eviction and no persistence; ``args`` are more
    of its options (e.g. ``"--cluster-config-file nodes.conf"``)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise InvalidArgumentError("RedisStore: redis-server is not installed (apt-get install redis-server)")
    command = [binary, "--daemonize", "yes", "--port", str(port), "--maxmemory", str(int(capacity)),
               "--maxmemory-policy", "allkeys-random", "--appendonly", "no", "--save", "",
               "--protected-mode", "no"]
    for arg in args:
        command.extend(arg.split())
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)


def find_free_port() -> int:
    """Bagua's older name of :func:`bagua.torch_api.env.find_free_network_port`."""
    return env.find_free_network_port()


def get_host_ip() -> str:
    """This host's address as the other nodes reach it (its hostname's)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _node_index() -> int:
    return env.get_rank() // max(1, env.get_local_size())


def _bootstrap_servers(capacity: int) -> List[Dict]:
    """Every node's server, started by its local rank 0 on the first call of
    the process and shared by later ones."""
    global _bootstrapped
    if _bootstrapped is not None:
        return _bootstrapped
    import bagua.torch_api as bagua
    from bagua.torch_api.communication import broadcast_object
    mine = None
    if env.get_local_rank() == 0:
        mine = {"host": get_host_ip(), "port": find_free_port()}
        start_redis_server_cli(mine["port"], capacity)
        _connect(mine["host"], mine["port"])
        atexit.register(_shutdown, mine["host"], mine["port"])
        _log.info("started redis-server at %s:%d", mine["host"], mine["port"])
    if bagua.is_initialized() and bagua.get_world_size() > 1:
        local = max(1, env.get_local_size())
        nodes = [broadcast_object(mine if bagua.get_rank() == n * local else None, src=n * local)
                 for n in range(bagua.get_world_size() // local)]
    else:
        nodes = [mine]
    if any(n is None for n in nodes):
        raise InvalidArgumentError("RedisStore(hosts=None) needs bagua.init_process_group() on several "
                                   "processes, so that every node's local rank 0 starts a server")
    _bootstrapped = nodes
    return nodes


def _shutdown(host: str, port: int) -> None:
    try:
        _client(host, port).shutdown(nosave=True)
    except Exception:  # already gone, or the client reports the closed connection
        pass
