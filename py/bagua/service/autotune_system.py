"""The system tuner: searches the communication environment variables of
this runtime for the fastest setting on the given hosts (Bagua's launcher
``--autotune_level 2``).

Each trial runs the benchmark :mod:`bagua.service.sysperf` on every host at
once, under ``python -m bagua.distributed.launch``, with the trial's
variables set, and scores the setting by the allreduce throughput rank 0
reports. The first trial is the default setting; a Bayesian optimizer
proposes the others.

What is tuned depends on the backend the job will use (``BAGUA_BACKEND``):

- ``gloo``: ``BAGUA_SHARED_MEMORY`` and ``BAGUA_SHARED_MEMORY_MIN_BYTES``
  (a power of two, 4 KiB to 16 MiB);
- ``nccl``: the NCCL variables Bagua tuned: ``NCCL_MIN_NCHANNELS``,
  ``NCCL_SOCKET_NTHREADS``, ``NCCL_NSOCKS_PERTHREAD`` (0: left to NCCL) and
  ``NCCL_BUFFSIZE`` (a power of two, 64 KiB to 64 MiB).

Hosts that are this machine (``localhost``, ``127.*``, ``::1``, this
hostname) run as local processes; any other host is reached with
``ssh -p SSH_PORT HOST`` (key-based login, no password prompt), and must
have the same Python and bagua at the same path. Every run is bounded by
``timeout_s`` and killed past it; a host that fails, or does not finish in
time, ends the search with a :class:`SystemTuningError` naming the host,
the command and the end of its output.
"""

import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple, Union

from bagua.service.bayesian_optimizer import BayesianOptimizer, BoolParam, IntParam
from bagua.service.service_discovery import pick_n_free_ports

__all__ = ["autotune_system_hyperparameters", "SystemTuningError", "is_local_host"]

log = logging.getLogger(__name__)

# Bagua's launcher used this port for its benchmark runs; it is the default
# when the first host is another machine (no free port can be probed there).
REMOTE_MASTER_PORT = 8124
# How long a run that is told to stop (SIGTERM, which the launcher passes to
# its workers) may take before it is killed.
STOP_GRACE_S = 10.0
OUTPUT_TAIL_CHARS = 2000


class SystemTuningError(RuntimeError):
    """A benchmark run failed or did not finish in time."""


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def is_local_host(host: str) -> bool:
    """Whether ``host`` names this machine, so that no ssh is needed."""
    return _is_loopback(host) or host in (socket.gethostname(), socket.getfqdn())


# The search space of each backend: the optimizer's parameters, the first
# trial's values (the runtime's or NCCL's defaults) and how values become
# environment variables.

def _search_space(backend: str) -> Tuple[Dict, Dict]:
    if backend == "nccl":
        space = {
            "NCCL_MIN_NCHANNELS": IntParam(0, (0, 12)),  # 0: not set
            "NCCL_SOCKET_NTHREADS": IntParam(0, (0, 8)),
            "NCCL_NSOCKS_PERTHREAD": IntParam(0, (0, 8)),
            "nccl_buffsize_2p": IntParam(22, (16, 26)),  # NCCL_BUFFSIZE = 2 ** p; NCCL's default is 4 MiB
        }
    else:
        space = {
            "shared_memory": BoolParam(True),
            "shared_memory_min_bytes_2p": IntParam(0, (0, 24)),  # the default is 1 byte (docs/environment.md)
        }
    return space, {name: declaration.val for name, declaration in space.items()}


def _environment(backend: str, params: dict) -> Dict[str, str]:
    if backend == "nccl":
        env = {name: str(value) for name, value in params.items() if name.startswith("NCCL_") and value != 0}
        env["NCCL_BUFFSIZE"] = str(2 ** params["nccl_buffsize_2p"])
        return env
    if not params["shared_memory"]:
        return {"BAGUA_SHARED_MEMORY": "0"}  # the threshold means nothing then
    return {"BAGUA_SHARED_MEMORY": "1",
            "BAGUA_SHARED_MEMORY_MIN_BYTES": str(2 ** params["shared_memory_min_bytes_2p"])}


def _hosts(host_list: Union[str, Sequence[str]]) -> List[str]:
    if isinstance(host_list, str):  # the launcher's --host_list "a,b"
        host_list = host_list.replace(",", " ").split()
    hosts = [str(host).strip() for host in host_list if str(host).strip()]
    if not hosts:
        raise ValueError(f"autotune_system_hyperparameters: no host in host_list={host_list!r}")
    return hosts


def autotune_system_hyperparameters(host_list: Union[str, Sequence[str]], nproc_per_node: int, ssh_port: int, *,
                                    max_trials: int = 8, timeout_s: float = 180.0,
                                    master_port: Optional[int] = None, backend: Optional[str] = None,
                                    python: Optional[str] = None, benchmark_args: Sequence[str] = (),
                                    random_state: Optional[int] = 0) -> Tuple[Tuple[str, str], ...]:
    """Benchmarks ``max_trials`` settings on ``host_list`` (``nproc_per_node``
    ranks on each) and returns the fastest, as Bagua did: a tuple of
    ``(variable, value)`` pairs sorted by name (``dict(result)`` gives the
    environment; ``os.environ.update(result)`` applies it).

    ``timeout_s`` bounds each run; ``master_port`` is the rendezvous port on
    the first host (default: a free one when that host is this machine, else
    8124); ``backend`` is ``"gloo"`` or ``"nccl"`` (default: this process's
    ``BAGUA_BACKEND``); ``python`` is the interpreter on every host (default:
    this one); ``benchmark_args`` go to :mod:`bagua.service.sysperf` (e.g.
    ``["--buffer_mib", "16,64"]``). Settings tried more than once are judged
    by their mean score.
    """
    hosts = _hosts(host_list)
    if any(not is_local_host(host) for host in hosts) and _is_loopback(hosts[0]):
        raise ValueError(f"autotune_system_hyperparameters: the first host, {hosts[0]!r}, is where the other hosts "
                         f"connect to; name it by an address they can reach (host_list={hosts})")
    if nproc_per_node < 1 or max_trials < 1 or timeout_s <= 0:
        raise ValueError(f"autotune_system_hyperparameters: nproc_per_node={nproc_per_node} and max_trials="
                         f"{max_trials} must be >= 1, timeout_s={timeout_s} > 0")
    if backend is None:
        import bagua_core
        backend = bagua_core.env().backend
    backend = backend.lower()
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"autotune_system_hyperparameters: backend must be 'gloo' or 'nccl', got {backend!r}")
    space, params = _search_space(backend)
    optimizer = BayesianOptimizer(space, n_initial_points=max(1, min(4, max_trials // 2)), random_state=random_state)
    runner = _TrialRunner(hosts, nproc_per_node, ssh_port, timeout_s, master_port, python or sys.executable,
                          list(benchmark_args))
    scores: Dict[Tuple[Tuple[str, str], ...], List[float]] = {}
    log.info("system tuning (%s) on %s, %d rank(s) per host, %d trial(s)", backend, hosts, nproc_per_node, max_trials)
    for trial in range(1, max_trials + 1):
        env = _environment(backend, params)
        # The runs use the backend tuned for, on every host (ssh passes no environment).
        result = runner.run(dict(env, BAGUA_BACKEND=backend), f"trial {trial}/{max_trials}")
        score = result["throughput_mb_s"]
        log.info("trial %d/%d: %s -> %.1f MB/s (step %.4f s +- %.4f)", trial, max_trials, _show(env), score,
                 result["step_s"], result["step_s_std"])
        scores.setdefault(_key(env), []).append(score)
        optimizer.tell(params, score)
        if trial < max_trials:
            params = _next_untried(optimizer, backend, scores)
    ranking = sorted(scores.items(), key=lambda item: -sum(item[1]) / len(item[1]))
    best, best_scores = ranking[0]
    log.info("system tuning: best %s at %.1f MB/s", _show(dict(best)), sum(best_scores) / len(best_scores))
    return best


def _key(env: Dict[str, str]) -> Tuple[Tuple[str, str], ...]:
    return tuple(sorted(env.items()))


def _next_untried(optimizer: BayesianOptimizer, backend: str, scores: Dict, attempts: int = 20) -> dict:
    """The optimizer's next proposal whose environment has not been measured
    yet: a run costs far more than an ask, so a proposal already measured
    is told its known mean score instead (after ``attempts`` such proposals,
    the last one is measured again)."""
    for _ in range(attempts):
        params = optimizer.ask()
        known = scores.get(_key(_environment(backend, params)))
        if known is None:
            return params
        optimizer.tell(params, sum(known) / len(known))
    return params


def _show(env: Dict[str, str]) -> str:
    return " ".join(f"{name}={value}" for name, value in sorted(env.items())) or "(defaults)"


class _TrialRunner:
    """Starts the benchmark on every host, waits for all (bounded), and
    returns rank 0's result."""

    def __init__(self, hosts: List[str], nproc_per_node: int, ssh_port: int, timeout_s: float,
                 master_port: Optional[int], python: str, benchmark_args: List[str]):
        self.hosts = hosts
        self.nproc_per_node = nproc_per_node
        self.ssh_port = ssh_port
        self.timeout_s = timeout_s
        self.master_port = master_port
        self.python = python
        self.benchmark_args = benchmark_args

    def _port(self) -> int:
        if self.master_port is not None:
            return self.master_port
        # A fresh port per trial: the previous trial's may still be in TIME_WAIT.
        return pick_n_free_ports(1)[0] if is_local_host(self.hosts[0]) else REMOTE_MASTER_PORT

    def command(self, node_rank: int, port: int) -> List[str]:
        return [self.python, "-m", "bagua.distributed.launch", "--nproc_per_node", str(self.nproc_per_node),
                "--nnodes", str(len(self.hosts)), "--node_rank", str(node_rank),
                "--master_addr", self.hosts[0], "--master_port", str(port),
                "-m", "bagua.service.sysperf", *self.benchmark_args]

    def run(self, env: Dict[str, str], name: str) -> dict:
        # Not imported with the package: the runs execute it with -m.
        from bagua.service.sysperf import parse_result

        # Workers that lose their peers give up within the run's time too.
        env = dict(env, BAGUA_COMM_TIMEOUT_S=str(max(1, int(self.timeout_s))))
        port = self._port()
        with tempfile.TemporaryDirectory(prefix="bagua_sysperf_") as directory:
            runs = []
            try:
                for node_rank, host in enumerate(self.hosts):
                    runs.append(_HostRun(host, node_rank, self.command(node_rank, port), env, self.ssh_port,
                                         directory))
                self._wait(runs, name)
            finally:
                for run in runs:
                    run.stop()
            result = parse_result(runs[0].output())
        if result is None:
            raise SystemTuningError(f"{name}: host {self.hosts[0]} printed no benchmark result; "
                                    f"command: {runs[0].shown}\n{runs[0].tail()}")
        return result

    def _wait(self, runs: List["_HostRun"], name: str) -> None:
        """Returns once every run ended well; raises at the first failure, or
        when the time is up."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            failed = [run for run in runs if run.returncode() not in (None, 0)]
            if failed:
                run = failed[0]
                raise SystemTuningError(f"{name}: the benchmark failed on host {run.host} (exit code "
                                        f"{run.returncode()}); command: {run.shown}\n{run.tail()}")
            running = [run for run in runs if run.returncode() is None]
            if not running:
                return
            if time.monotonic() > deadline:
                run = running[0]
                raise SystemTuningError(f"{name}: the benchmark on host(s) {', '.join(r.host for r in running)} did "
                                        f"not finish within timeout_s={self.timeout_s:g} s and was killed; "
                                        f"command: {run.shown}\n{run.tail()}")
            time.sleep(0.1)


class _HostRun:
    """One host's launcher: a local process, or ssh running it there. It runs
    in its own process group, so that stopping it reaches what it started."""

    def __init__(self, host: str, node_rank: int, command: List[str], env: Dict[str, str], ssh_port: int,
                 directory: str):
        self.host = host
        if is_local_host(host):
            argv, process_env = command, dict(os.environ, **env)
        else:
            # The variables travel in the remote command line; PYTHONPATH too,
            # for hosts that share this source tree.
            if "PYTHONPATH" in os.environ:
                env = dict(env, PYTHONPATH=os.environ["PYTHONPATH"])
            remote = "cd {} 2>/dev/null; exec env {} {}".format(
                shlex.quote(os.getcwd()), " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items())),
                shlex.join(command))
            # -tt: the remote side gets a terminal, so it is hung up when ssh ends.
            argv = ["ssh", "-tt", "-p", str(ssh_port), "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", host, remote]
            process_env = dict(os.environ)
        self.shown = shlex.join(argv)
        self.stdout_path = os.path.join(directory, f"node{node_rank}.out")
        self.stderr_path = os.path.join(directory, f"node{node_rank}.err")
        with open(self.stdout_path, "w") as stdout, open(self.stderr_path, "w") as stderr:
            try:
                self.process = subprocess.Popen(argv, env=process_env, stdin=subprocess.DEVNULL, stdout=stdout,
                                                stderr=stderr, start_new_session=True)
            except OSError as err:
                raise SystemTuningError(f"host {host}: could not start {self.shown}: {err}") from err

    def returncode(self) -> Optional[int]:
        return self.process.poll()

    def stop(self) -> None:
        """Asks the process group to stop, then kills it after STOP_GRACE_S."""
        if self.process.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        self._signal(signal.SIGKILL)  # anything left in the group
        try:
            self.process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            log.warning("host %s: %s did not end after SIGKILL", self.host, self.shown)

    def _signal(self, signum: int) -> None:
        try:
            os.killpg(self.process.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def output(self) -> str:
        with open(self.stdout_path, errors="replace") as stdout:
            return stdout.read()

    def tail(self) -> str:
        with open(self.stderr_path, errors="replace") as stderr:
            text = stderr.read()
        if not text.strip():
            text = self.output()
        return f"--- end of its output ---\n{text[-OUTPUT_TAIL_CHARS:]}"
