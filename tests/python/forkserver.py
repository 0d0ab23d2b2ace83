"""Starts the test suite's worker processes from pre-imported interpreters.

Every rank of every multi-process test is a fresh Python process, and most of
its start is `import torch` (about 0.9 s of CPU each with Debian's torch 1.13,
several hundred times per suite on two cores). A fork server imports torch
once and forks each worker from there; the worker then sets its environment,
working directory, argv and output, and runs its script as `__main__`, as
`python script ...` would.

What a fork cannot give a worker, a fresh process still gets:
- One server per rank index, each its own interpreter: the ranks of one test
  keep different hash seeds (set iteration orders), as under torchrun.
- A request whose environment differs from the server's in a variable read
  when Python or torch start (PYTHON*, LD_*, OMP/MKL/KMP/GOMP settings,
  TORCH_*, CUDA_*) is started as a plain subprocess (`spawn_worker` returns
  None).
- BAGUA_TEST_FORKSERVER=0 turns the servers off.

Protocol, one Unix-socket connection per worker: the client sends one JSON
line {argv, env, cwd, log}; the server forks and answers "pid N", then
"exit S" once the worker ended (S as subprocess gives it: negative for a
signal). The server is single-threaded (forking a threaded process is
unsafe): one select loop, children reaped on SIGCHLD through a wakeup pipe.
It exits when its parent's pipe closes.
"""

import atexit
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

# Variables read when the interpreter or torch start: a worker that changes
# one of them must start from scratch.
_STARTUP_PREFIXES = ("PYTHON", "LD_", "OMP_", "MKL_", "KMP_", "GOMP_", "TORCH_", "CUDA_")
_PER_WORKER = {"PYTHONFAULTHANDLER"}  # applied by the worker itself


def _startup_environment(env) -> dict:
    return {k: v for k, v in env.items() if k.startswith(_STARTUP_PREFIXES) and k not in _PER_WORKER}


# ---- the server -------------------------------------------------------------

def _serve(path: str):
    """Runs in the server; returns only in a forked worker, with its request."""
    import numpy  # noqa: F401 - imported once here, like torch
    import torch  # noqa: F401

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wake_r, selectors.EVENT_READ, "child")
    selector.register(sys.stdin, selectors.EVENT_READ, "parent")
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    workers = {}  # pid -> connection
    while True:
        for key, _ in selector.select():
            if key.data == "parent":
                if not os.read(sys.stdin.fileno(), 4096):
                    return None  # the test session ended
            elif key.data == "child":
                os.read(wake_r, 4096)
                _reap(workers)
            else:
                connection, _ = listener.accept()
                request = _read_request(connection)
                if request is None:
                    connection.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    for fd in (listener, connection):
                        fd.close()
                    for other in workers.values():
                        other.close()
                    selector.close()
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    os.close(wake_r)
                    os.close(wake_w)
                    return request
                connection.sendall(f"pid {pid}\n".encode())
                workers[pid] = connection
                _reap(workers)


def _read_request(connection):
    data = b""
    while not data.endswith(b"\n"):
        chunk = connection.recv(65536)
        if not chunk:
            return None
        data += chunk
    return json.loads(data)


def _reap(workers) -> None:
    while workers:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        connection = workers.pop(pid, None)
        if connection is not None:
            try:
                connection.sendall(f"exit {code}\n".encode())
            except OSError:
                pass
            connection.close()


def _become_worker(request) -> None:
    """In the forked child: the process `python argv...` would have been."""
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    if os.environ.get("PYTHONFAULTHANDLER"):
        import faulthandler
        faulthandler.enable()
    import numpy
    numpy.random.seed()  # a fresh process draws its own seed (random reseeds itself at fork)
    script = request["argv"][0]
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    import runpy
    runpy.run_path(script, run_name="__main__")


# ---- the client (the test session) -------------------------------------------

class ForkedWorker:
    """The subprocess.Popen calls the launcher makes, for a forked worker."""

    def __init__(self, connection: socket.socket):
        self._connection = connection
        self._buffer = b""
        self.returncode = None
        self.pid = int(self._line(timeout=60).split()[1])

    def _line(self, timeout):
        self._connection.settimeout(timeout)
        while b"\n" not in self._buffer:
            chunk = self._connection.recv(4096)
            if not chunk:
                raise ConnectionError("the fork server closed the connection")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def wait(self, timeout=None):
        if self.returncode is None:
            try:
                self.returncode = int(self._line(timeout).split()[1])
            except socket.timeout:
                raise subprocess.TimeoutExpired("forked worker", timeout) from None
            self._connection.close()
        return self.returncode

    def poll(self):
        try:
            return self.wait(timeout=0.001)
        except subprocess.TimeoutExpired:
            return None

    def send_signal(self, sig) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Server:
    def __init__(self, env):
        self.directory = tempfile.mkdtemp(prefix="bagua-forkserver-")
        self.path = os.path.join(self.directory, "socket")
        self.startup = _startup_environment(env)
        self.process = subprocess.Popen([sys.executable, os.path.abspath(__file__), self.path],
                                        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        if self.process.stdout.readline().strip() != b"ready":
            raise RuntimeError("the fork server did not start")

    def close(self) -> None:
        """Ends the server (it leaves when its stdin closes) and removes its
        socket's directory, which would otherwise stay in /tmp."""
        try:
            self.process.stdin.close()
            self.process.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            self.process.kill()
        shutil.rmtree(self.directory, ignore_errors=True)

    def spawn(self, argv, env, cwd, log):
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.connect(self.path)
        request = {"argv": [str(a) for a in argv], "env": env, "cwd": cwd, "log": str(log)}
        connection.sendall(json.dumps(request).encode() + b"\n")
        return ForkedWorker(connection)


_servers = {}


@atexit.register
def _close_servers() -> None:
    for server in _servers.values():
        server.close()


def spawn_worker(index: int, argv, env: dict, log):
    """Forks `python argv...` (argv[0] the script) with `env`, output appended
    to `log`, from server `index` (one per rank). None where a fresh process
    is needed instead: servers off, or a startup variable that differs."""
    if os.environ.get("BAGUA_TEST_FORKSERVER", "1") == "0":
        return None
    server = _servers.get(index)
    if server is None:
        server_env = dict(env)
        server_env.pop("PYTHONFAULTHANDLER", None)
        server = _servers[index] = _Server(server_env)
    if _startup_environment(env) != server.startup:
        return None
    return server.spawn(argv, env, os.getcwd(), log)


if __name__ == "__main__":
    worker_request = _serve(sys.argv[1])
    if worker_request is None:
        sys.exit(0)
    del _serve
    _become_worker(worker_request)
