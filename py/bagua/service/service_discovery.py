"""Service discovery: how the ranks of a job agree on where the autotune
service listens (Bagua's ``bagua.service.service_discovery``).

Rank 0 picks a free port for the service and answers, over HTTP on
``master_addr:master_port``, every other rank that asks; each rank says
which host it is on. A rank gets its answer once every rank has asked, so
all of them return the same thing: the service's address and port, and the
host name of every rank. Only the standard library is used (no flask).
"""

import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Dict, List, Optional, Tuple

__all__ = ["pick_n_free_ports", "generate_and_broadcast_server_addr"]

log = logging.getLogger(__name__)

ROUTE = "/get_fuselib_server_addr"  # Bagua's name for the route
RETRY_INTERVAL_S = 0.1


def pick_n_free_ports(n: int) -> List[int]:
    """``n`` different TCP ports that are free on every interface of this
    host right now (they are held together while chosen, then released, so
    another program may still take one before it is used)."""
    sockets = []
    try:
        for _ in range(n):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind(("", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


class _Board:
    """Rank 0's record of who has asked (their host names) and who has been
    answered."""

    def __init__(self, world_size: int, answer: dict):
        self.world_size = world_size
        self.answer = answer
        self.hostnames: List[Optional[str]] = [None] * world_size
        self.answered = {0}  # rank 0 answers itself
        self.changed = threading.Condition()

    def register(self, rank: int, hostname: str) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size}")
        with self.changed:
            # The same rank asking again (a retried request) is welcome.
            if self.hostnames[rank] not in (None, hostname):
                raise ValueError(f"rank {rank} asked twice (from {self.hostnames[rank]} and {hostname})")
            self.hostnames[rank] = hostname
            self.changed.notify_all()

    def missing(self) -> List[int]:
        return [rank for rank, name in enumerate(self.hostnames) if name is None]

    def wait_for_everyone(self, deadline: float) -> bool:
        """True once every rank has asked; False if the deadline came first."""
        with self.changed:
            return self.changed.wait_for(lambda: not self.missing(), timeout=max(0.0, deadline - time.monotonic()))

    def mark_answered(self, rank: int) -> None:
        with self.changed:
            self.answered.add(rank)
            self.changed.notify_all()

    def wait_until_answered(self, deadline: float) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: len(self.answered) == self.world_size,
                                         timeout=max(0.0, deadline - time.monotonic()))

    def reply(self) -> dict:
        return dict(self.answer, hostnames=list(self.hostnames))


def _handler(board: _Board, deadline: float):
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            if self.path != ROUTE:
                return self._send(404, {"error": f"no route {self.path}; ask {ROUTE}"})
            try:
                request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                rank = int(request["rank"])
                board.register(rank, str(request["hostname"]))
            except (ValueError, KeyError, TypeError) as err:
                return self._send(400, {"error": f"bad request: {err}"})
            # Answer once everyone is here, so that every rank learns the same.
            if not board.wait_for_everyone(deadline):
                return self._send(504, {"error": f"rank(s) {board.missing()} never asked"})
            self._send(200, board.reply())
            board.mark_answered(rank)

        def _send(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format, *args):
            log.debug("service discovery: " + format, *args)

    return Handler


def _serve_discovery(master_addr: str, master_port: int, world_size: int,
                     timeout_s: float) -> Tuple[str, int, List[str]]:
    server_port = pick_n_free_ports(1)[0]
    board = _Board(world_size, {"server_addr": master_addr, "server_port": server_port})
    board.register(0, socket.gethostname())
    deadline = time.monotonic() + timeout_s
    try:
        httpd = ThreadingHTTPServer(("0.0.0.0", master_port), _handler(board, deadline))
    except OSError as err:
        raise RuntimeError(f"service discovery: rank 0 cannot listen on port {master_port}: {err}") from err
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.1},
                              name="bagua-service-discovery", daemon=True)
    thread.start()
    try:
        if not board.wait_for_everyone(deadline):
            raise TimeoutError(f"service discovery: rank(s) {board.missing()} of {world_size} did not ask rank 0 "
                               f"({master_addr}:{master_port}) within {timeout_s:g} s")
        if not board.wait_until_answered(deadline):
            unanswered = sorted(set(range(world_size)) - board.answered)
            raise TimeoutError(f"service discovery: the answers to ranks {unanswered} were not sent "
                               f"within {timeout_s:g} s")
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)
    return master_addr, server_port, board.reply()["hostnames"]


def _opener(proxies: Optional[Dict[str, Optional[str]]]):
    # By default no proxy, whatever http_proxy says: the master is on the
    # job's own network (Bagua passed {"http": None, "https": None}).
    return urllib.request.build_opener(urllib.request.ProxyHandler(
        {scheme: url for scheme, url in (proxies or {}).items() if url}))


def _ask_rank_0(master_addr: str, master_port: int, my_rank: int, proxies,
                timeout_s: float) -> Tuple[str, int, List[str]]:
    url = f"http://{master_addr}:{master_port}{ROUTE}"
    data = json.dumps({"rank": my_rank, "hostname": socket.gethostname()}).encode()
    opener = _opener(proxies)
    deadline = time.monotonic() + timeout_s
    while True:
        request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
        try:
            with opener.open(request, timeout=max(0.1, deadline - time.monotonic())) as response:
                answer = json.loads(response.read())
            return answer["server_addr"], int(answer["server_port"]), answer["hostnames"]
        except urllib.error.HTTPError as err:  # rank 0 answered, with an error
            raise RuntimeError(f"service discovery: rank {my_rank}: {url} answered {err.code}: "
                               f"{err.read().decode(errors='replace')}") from err
        except (urllib.error.URLError, OSError) as err:  # not listening yet
            if time.monotonic() + RETRY_INTERVAL_S > deadline:
                raise TimeoutError(f"service discovery: rank {my_rank} could not reach rank 0 at {url} "
                                   f"within {timeout_s:g} s: {err}") from err
            time.sleep(RETRY_INTERVAL_S)


def generate_and_broadcast_server_addr(master_addr: str, master_port: int, world_size: int, my_rank: int,
                                       proxies: Optional[Dict[str, Optional[str]]] = None,
                                       timeout_s: float = 60.0) -> Tuple[str, int, List[str]]:
    """Called by every rank (``my_rank`` in ``[0, world_size)``); returns the
    same ``(server_addr, server_port, hostnames)`` on each: where rank 0's
    autotune service is to listen (``master_addr`` and a port free on rank
    0's host) and each rank's host name. ``master_port`` must be free on
    rank 0's host; the exchange uses it and releases it before returning.
    Raises TimeoutError when a rank does not take part within ``timeout_s``."""
    if not 0 <= my_rank < world_size:
        raise ValueError(f"service discovery: my_rank={my_rank} is outside world_size={world_size}")
    if my_rank == 0:
        return _serve_discovery(master_addr, master_port, world_size, timeout_s)
    return _ask_rank_0(master_addr, master_port, my_rank, proxies, timeout_s)
