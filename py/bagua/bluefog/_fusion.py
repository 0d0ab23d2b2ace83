"""BlueFog's worker thread, and the fusion of pending neighbour allreduces.

Every BlueFog call runs on one worker thread in issue order (so the
communicators see one thread and every rank the same sequence of ops).
Pending ``neighbor_allreduce`` calls of one pattern (same self, source and
destination weights, same dtype, host memory) are fused: concatenated into
one flat buffer of at most ``BLUEFOG_FUSION_THRESHOLD`` bytes, run as ONE
C++ neighbour op and split back into the per-call results. The op computes
element by element, so each result is bit for bit the unfused one.

**Every rank must fuse the same calls.** What is queued at a given instant
differs between ranks, so the worker does not decide alone. Before moving
data, each rank proposes how many of its next pending calls it could fuse
(the longest run of one pattern that fits the threshold) together with a
digest (name, size, dtype) of each, sent to every rank in one alltoall on
the same communicator. Each rank fuses the smallest count,
cut at the first call whose digest differs between ranks, so a call that
ranks disagree on (different sizes, say) runs alone and fails on its own
handle, as it would unfused. A deterministic rule would have to know when the
program stops issuing calls, which no rank knows; the agreement costs one
small alltoall per neighbour op of nonblocking calls (none with fusion off,
none on one rank). On one host it goes through shared memory and fusion
pays even with two calls per step; across hosts, measure (docs/bluefog.md
has the figures).

Blocking calls follow a deterministic rule instead: the caller waits for
the result before issuing anything else, so there is nothing to fuse them
with; they run alone without an agreement (an alltoall costs more latency
than a neighbour exchange). So with fusion on, a call must have the same form
(blocking or nonblocking) on every rank, as it must be the same op.

``BLUEFOG_CYCLE_TIME`` (ms) bounds how long the worker waits for more calls
before proposing what it has; it stops waiting as soon as the run is closed
(a call of another pattern or kind is queued, or the threshold is reached)
or a caller waits for a result (``waiting``).

**A failed communicator stays failed.** Gloo closes a context's connections
when one of its waits times out, and a peer's closed connection ends the
other ranks' next calls. So after a call fails with a communication error
(``CommTimeoutError``, ``BackendError``) every later call on this worker
fails at once with a ``BackendError`` that names the first failure and the
way out: ``bf.shutdown()`` then ``bf.init()`` on every rank, which builds new
communicators.
"""

import atexit
import collections
import concurrent.futures
import contextlib
import hashlib
import threading
import time
from typing import Callable, List, Optional

import torch

from bagua.bluefog import _timeline
from bagua.torch_api._core import BackendError, CommTimeoutError, core, tensor_view

# At most this many calls in one fused op: the agreement's vector holds a
# digest of each, so its length is fixed on every rank.
MAX_CALLS = 128
_ABSENT = 2 ** 62  # digest slot of a call a rank does not propose
_STOP = object()


class NeighborCall:
    """One pending ``neighbor_allreduce``: its host input ``x``, the keyword
    arguments of its C++ options (``pattern``, without the name), and
    ``finish``, which turns the host output into the handle's result.
    ``alone``: a blocking call, run alone without an agreement."""

    def __init__(self, x: torch.Tensor, pattern: dict, name: Optional[str],
                 finish: Callable[[torch.Tensor], torch.Tensor], alone: bool = False):
        self.x, self.pattern, self.name, self.finish = x, pattern, name or "", finish
        self.alone = alone  # a blocking call: never fused, no agreement
        self.nbytes = x.numel() * x.element_size()
        self.future = concurrent.futures.Future()
        # Calls fuse only with calls of the same key; None: never fused
        # (device memory: the fused buffer is built on the host).
        fusable = x.device.type == "cpu" and x.is_floating_point() and not alone
        self.key = (x.dtype, _frozen(pattern)) if fusable else None
        text = f"{self.name}|{x.numel()}|{x.dtype}|{pattern['check_pattern']}"
        self.digest = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")

    def options(self, name: Optional[str] = None):
        return core.NeighborAllreduceOptions(name=self.name if name is None else name,
                                             **self.pattern)


def _frozen(pattern: dict):
    return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in sorted(pattern.items()))


class _Job:
    """A call that always runs alone (collectives, allgathers, windows...)."""

    def __init__(self, fn):
        self.fn = fn
        self.future = concurrent.futures.Future()


class Worker:
    """The worker thread: ``submit`` (any call) and ``submit_neighbor`` (a
    fusable neighbour allreduce) return futures, completed in issue order.
    ``threshold``: bytes per fused op (0: no fusion); ``cycle_s``: the longest
    wait for more calls. Both must be the same on every rank (``_state``
    agrees on the threshold at ``bf.init``)."""

    def __init__(self, comm, op, threshold: int, cycle_s: float):
        self.comm, self.op, self.threshold, self.cycle_s = comm, op, threshold, cycle_s
        self._queue = collections.deque()
        self._cond = threading.Condition()
        self._waiting = 0  # callers blocked in synchronize: no point waiting for more calls
        self._stats = dict(calls=0, ops=0, fused_ops=0, fused_calls=0, largest_fused_bytes=0,
                           agreements=0)
        self.failure: Optional[str] = None  # the first communication error, once one happened
        self._thread = threading.Thread(target=self._loop, name="bagua-bluefog", daemon=True)
        self._thread.start()
        # Like a ThreadPoolExecutor's: what is queued at exit still runs.
        atexit.register(self.shutdown)

    # -- the callers' side ------------------------------------------------------------
    def submit(self, fn, *args) -> concurrent.futures.Future:
        return self._put(_Job(lambda: fn(*args)))

    def submit_neighbor(self, call: NeighborCall) -> concurrent.futures.Future:
        return self._put(call)

    def _put(self, item):
        with self._cond:
            self._queue.append(item)
            self._cond.notify()
        return item.future

    def set_threshold(self, threshold: int) -> concurrent.futures.Future:
        """Changes the threshold once the calls queued before have run (for
        benchmarks and tests). Every rank must make the same change at the
        same point of its sequence of calls, as with any collective."""
        def change():
            self.threshold = int(threshold)
        return self.submit(change)

    @contextlib.contextmanager
    def waiting(self):
        """Held while a caller waits for a result: meanwhile the worker runs
        what is pending without waiting for more calls (the caller will
        issue none)."""
        with self._cond:
            self._waiting += 1
            self._cond.notify()
        try:
            yield
        finally:
            with self._cond:
                self._waiting -= 1

    def shutdown(self, wait: bool = True) -> None:
        """Runs what is queued, then stops the thread."""
        with self._cond:
            self._queue.append(_STOP)
            self._cond.notify()
        if wait:
            self._thread.join()

    def stats(self) -> dict:
        """Counters: neighbour calls run, C++ neighbour ops run (fused or
        not), fused ops and the calls in them, the largest fused buffer in
        bytes, agreements made."""
        with self._cond:
            return dict(self._stats)

    # -- the worker thread ------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                head = self._queue[0]
            if head is _STOP:
                return
            if self.failure is not None:
                self._pop(1)[0].future.set_exception(self._failed())
            elif isinstance(head, NeighborCall):
                self._run_neighbor_calls()
            else:
                self._pop(1)
                self._settle([head], lambda: [head.fn()])

    def _failed(self) -> BackendError:
        return BackendError(
            f"bluefog: rank {self.comm.rank}: an earlier call failed with a communication "
            f"error ({self.failure}); after one, BlueFog's communicator cannot be used again "
            "(Gloo closes its connections on a timeout, and the ranks' sequences of messages "
            "are out of step). Call bf.shutdown() then bf.init() on every rank to build new "
            "communicators.")

    def _settle(self, items: list, compute: Callable[[], list]) -> None:
        """_settle, remembering a communication error: the communicator is
        unusable after one (see the module's docstring)."""
        error = _settle(items, compute)
        if isinstance(error, (CommTimeoutError, BackendError)) and self.failure is None:
            self.failure = f"{type(error).__name__}: {error}"

    def _pop(self, count: int) -> list:
        with self._cond:
            return [self._queue.popleft() for _ in range(count)]

    def _run_neighbor_calls(self) -> None:
        """Runs the neighbour call at the head of the queue, fused with the
        following ones that every rank agrees to fuse."""
        if self.threshold <= 0 or self._queue[0].alone:
            calls = self._pop(1)
        else:
            try:
                count = self._agree(self._collect())
            except Exception as error:  # noqa: BLE001 - the agreement failed: the head call fails
                self._settle(self._pop(1), lambda failure=error: _raise(failure))
                return
            calls = self._pop(count)
        self._count(calls)
        if len(calls) == 1:
            self._settle(calls, lambda: [self._run_alone(calls[0])])
        else:
            self._settle(calls, lambda: self._run_fused(calls))

    def _collect(self) -> List[NeighborCall]:
        """The pending calls this rank could fuse with the head, once the run
        is closed, a caller waits for a result, or the cycle time has passed."""
        deadline = time.monotonic() + self.cycle_s
        with self._cond:
            while True:
                run, closed = self._local_run()
                left = deadline - time.monotonic()
                if closed or self._waiting or left <= 0:
                    return run
                self._cond.wait(left)

    def _local_run(self):
        """(calls, closed): the longest run of fusable calls from the head
        (one key, at most the threshold, at most MAX_CALLS), and whether
        something already queued ends it. Called under the lock."""
        head = self._queue[0]
        run, total = [head], head.nbytes
        if head.key is None or head.nbytes > self.threshold:
            return run, True
        for item in list(self._queue)[1:]:
            fits = (isinstance(item, NeighborCall) and item.key == head.key
                    and total + item.nbytes <= self.threshold and len(run) < MAX_CALLS)
            if not fits:
                return run, True
            run.append(item)
            total += item.nbytes
        return run, len(run) == MAX_CALLS

    def _agree(self, run: List[NeighborCall]) -> int:
        """How many calls of ``run`` to fuse, the same on every rank: the
        minimum of the ranks' proposals, cut before the first call whose
        digest differs between ranks (at least 1: the head runs alone)."""
        if self.comm.size == 1:
            return len(run)
        # [count, digests]: every rank sends its proposal to every rank in
        # one alltoall (one round of messages; an allreduce's ring takes
        # 2(n - 1) rounds, which is what a few calls per step pay for).
        proposal = torch.full((1 + MAX_CALLS,), _ABSENT, dtype=torch.int64)
        proposal[0] = len(run)
        proposal[1:1 + len(run)] = torch.tensor([call.digest for call in run], dtype=torch.int64)
        sent = proposal.repeat(self.comm.size)
        received = torch.empty_like(sent)
        self.comm.alltoall(tensor_view(sent), tensor_view(received))
        with self._cond:
            self._stats["agreements"] += 1
        proposals = received.view(self.comm.size, 1 + MAX_CALLS)
        count = int(proposals[:, 0].min())
        digests = proposals[:, 1:1 + count]
        same = (digests == digests[0]).all(dim=0).tolist()
        return max(1, same.index(False) if False in same else count)

    def _count(self, calls: List[NeighborCall]) -> None:
        with self._cond:
            s = self._stats
            s["calls"] += len(calls)
            s["ops"] += 1
            if len(calls) > 1:
                s["fused_ops"] += 1
                s["fused_calls"] += len(calls)
                s["largest_fused_bytes"] = max(s["largest_fused_bytes"],
                                               sum(c.nbytes for c in calls))

    def _run_alone(self, call: NeighborCall):
        out = torch.empty_like(call.x)
        run = lambda: self.op.run(tensor_view(call.x, allow_cuda=True),  # noqa: E731
                                  tensor_view(out, allow_cuda=True), call.options())
        _timeline.spans(["NEIGHBOR_ALLREDUCE " + call.name], run)
        return call.finish(out)

    def _run_fused(self, calls: List[NeighborCall]) -> list:
        """One op over the calls' inputs end to end; each result is a copy of
        its slice (the input tensors are only read)."""
        flat = torch.cat([c.x.reshape(-1) for c in calls])
        out = torch.empty_like(flat)
        name = f"fused {len(calls)} calls {calls[0].name!r}..{calls[-1].name!r}"
        labels = [f"NEIGHBOR_ALLREDUCE {c.name}" for c in calls]
        labels.append(f"FUSED_NEIGHBOR_ALLREDUCE {len(calls)} calls {flat.numel() * flat.element_size()} bytes")
        _timeline.spans(labels, lambda: self.op.run(tensor_view(flat), tensor_view(out),
                                                    calls[0].options(name)))
        pieces = torch.split(out, [c.x.numel() for c in calls])
        return [c.finish(p.view(c.x.shape).clone()) for c, p in zip(calls, pieces)]


def _raise(error: BaseException):
    raise error


def _settle(items: list, compute: Callable[[], list]) -> Optional[BaseException]:
    """Completes the items' futures with ``compute()``'s results, or all with
    its error (a fused op fails as a whole: every call in it would have),
    which it returns."""
    for item in items:
        item.future.set_running_or_notify_cancel()
    try:
        results = compute()
    except BaseException as error:  # noqa: BLE001 - raised at each handle's synchronize
        for item in items:
            item.future.set_exception(error)
        return error
    for item, result in zip(items, results):
        item.future.set_result(result)
    return None
