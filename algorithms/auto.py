"""``algorithm="auto"``: measure, predict each algorithm's step time, run
the fastest, check the prediction once it runs.

The first ``decide_after`` steps communicate nothing: each rank's gradients
stay local and its optimizer step does not run (the weights stay where
they are), and the gradients are kept (:class:`_HeldGradients`). The first
step of the choice averages their mean with its own gradient: those steps
act as one step of a batch ``decide_after + 1`` times as large, and no
full precision step is paid on a slow link just to measure. At the end of
the last of them every rank measures, with the same calls on every rank:

- the compute time of a step (forward start to backward end), with nothing
  communicating beside it;
- the network: the buckets' full precision allreduce and ByteGrad's own
  8-bit op at a small and a large size, each fitted to
  ``latency + bytes * seconds_per_byte``; the large size grows from 64 KiB
  until a call takes 25 ms (or reaches the gradient's size, at most 4 MiB),
  so a slow link is probed with few bytes;
- PowerSGD's op itself (its factor passes and its two exchanges, 8-bit or
  not) on a bucket of the model's gradient shapes, on this process group.

The measurements are maxed over ranks, so every rank predicts the same times
and picks the same algorithm; the cost model (:func:`predict`, written out
in docs/auto.md) turns them into a step time per candidate.

The first steps are not the steady state (the allocator and the caches warm
up, the bucket plan is profiled), and a probe can miss what a whole step
does, so the choice is checked: after ``verify_steps`` steps of it (for
PowerSGD, compressed ones), its measured step time is compared with its
prediction. Off by more than ``REMEASURE_TOLERANCE`` (30 %), every rank
measures again (compute from the chosen algorithm's steps, the probes anew)
and chooses again, with the step times measured so far taking the place of
their predictions (:class:`Chooser`). Every decision, with the predicted and
measured step times, is logged (info level) and kept in
``AutoAlgorithm.decisions(model)``. ``BAGUA_ALGORITHM`` names the algorithm
to run instead, without measuring.

Only algorithms that average gradients are candidates: they train the same
model as DDP (up to their compression error), so picking the fastest one
changes the time, not the optimization. The decentralized and asynchronous
algorithms change what is averaged and when: choose those yourself.
"""

import dataclasses
import json
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

import bagua.torch_api as bagua
from bagua.torch_api._core import core, log, tensor_view
from bagua.torch_api.algorithms.base import Algorithm, AlgorithmImpl, ArgumentChecks
from bagua.torch_api.algorithms.bytegrad import ByteGradAlgorithm
from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm
from bagua.torch_api.algorithms.powersgd import PowerSGDAlgorithm, PowerSGDAlgorithmImpl, compresses
from bagua.torch_api.communication import calls_known_to_match
from bagua.torch_api import InvalidArgumentError

__all__ = ["AutoAlgorithm", "AutoAlgorithmImpl", "CANDIDATES", "Chooser", "LinkModel", "Measurements", "predict",
           "choose", "measured_overlap", "off_prediction"]

CANDIDATES = ("gradient_allreduce", "bytegrad", "powersgd", "powersgd_8bit")
SMALL_PROBE_BYTES = 4096
LARGE_PROBE_BYTES = (256 << 10, 4 << 20)  # the large probe at most: the gradient's size, within these bounds
GROWTH_START_BYTES = 64 << 10  # the large probe starts here and grows 4x a call ...
GROW_UNTIL_S = 0.025  # ... until a call takes this long: the bytes then decide its time, not the latency
REPEAT_BELOW_S = 0.1  # a probe call longer than this is not repeated: on so slow a link one call is enough
REMEASURE_TOLERANCE = 0.3  # measured step off its prediction by more than this: measure again, choose again
LAYOUT_CANDIDATES = ("powersgd", "powersgd_8bit")  # run with one bucket; the runtime's buckets are tried once
LAYOUT_GAIN = 0.95  # the runtime's buckets are kept when their step is below this share of one bucket's


# -- the cost model ---------------------------------------------------------------
@dataclasses.dataclass
class LinkModel:
    """Time of one collective on ``n`` bytes: latency + n * seconds_per_byte."""

    latency_s: float
    seconds_per_byte: float

    def time(self, nbytes: float, calls: int = 1) -> float:
        return calls * self.latency_s + nbytes * self.seconds_per_byte

    @staticmethod
    def fit(small_bytes: int, small_s: float, large_bytes: int, large_s: float) -> "LinkModel":
        """The line through two measured points, neither part negative."""
        slope = max((large_s - small_s) / (large_bytes - small_bytes), 0.0)
        return LinkModel(max(small_s - small_bytes * slope, 0.0), slope)


@dataclasses.dataclass
class Measurements:
    """What decides the choice (times in seconds, sizes in bytes)."""

    world_size: int
    compute_s: float          # forward + backward of one step
    exposed_s: Optional[float]  # what a GradientAllReduce step still waited for after backward (None: not run)
    gradient_bytes: int       # all gradients, as stored
    buckets: int              # buckets of the gradient algorithms (one collective each)
    allreduce: LinkModel      # the buckets' full precision allreduce
    low_precision: LinkModel  # ByteGrad's 8-bit op; bytes counted as the float32 input's
    powersgd_s: float         # PowerSGD's op, one compressed step: factor passes and exchanges
    powersgd_8bit_s: float    # the same with 8-bit factors
    overlap: float            # share of compute_s that bucket-by-bucket communication hides


def measured_overlap(communication_s: float, exposed_s: float, compute_s: float) -> float:
    """The share of the compute time that hid communication in the measured
    GradientAllReduce steps: of ``communication_s`` (what the probe predicts
    its allreduces take), ``exposed_s`` was still left to wait for after
    backward; the rest was hidden behind ``compute_s``. In [0, 1]."""
    if compute_s <= 0:
        return 0.0
    return min(max((communication_s - exposed_s) / compute_s, 0.0), 1.0)


def predict(m: Measurements) -> Dict[str, float]:
    """Predicted step time (forward, backward and what the step then waits
    for) per candidate. See docs/auto.md.

    - GradientAllReduce, where its steps were measured: their compute plus
      what they waited for; else (``exposed_s`` None: the measuring steps
      communicated nothing) as ByteGrad, on the allreduce's line.
    - ByteGrad communicates bucket by bucket during the backward pass, as
      GradientAllReduce does: the backward pass hides as much of it
      (``m.overlap`` of the compute time), but never the last bucket, which
      starts when backward ends; what GradientAllReduce waited for beyond
      its unhidden allreduces (hand-offs, a busy machine) it waits for too.
    - PowerSGD runs with one bucket (``one_bucket=True``) after backward:
      its op, timed as it runs, adds to the step."""
    if m.world_size == 1:
        return {name: m.compute_s for name in CANDIDATES}
    hidden = m.overlap * m.compute_s
    allreduce_s = m.allreduce.time(m.gradient_bytes, m.buckets)
    bytegrad_s = m.low_precision.time(m.gradient_bytes, m.buckets)
    if m.exposed_s is None:
        other, allreduce_step_s = 0.0, m.compute_s + max(allreduce_s / m.buckets, allreduce_s - hidden)
    else:
        other = max(0.0, m.exposed_s - max(0.0, allreduce_s - hidden))
        allreduce_step_s = m.compute_s + m.exposed_s
    return {
        "gradient_allreduce": allreduce_step_s,
        "bytegrad": m.compute_s + other + max(bytegrad_s / m.buckets, bytegrad_s - hidden),
        "powersgd": m.compute_s + m.powersgd_s,
        "powersgd_8bit": m.compute_s + m.powersgd_8bit_s,
    }


def choose(predictions: Dict[str, float], candidates: Sequence[str],
           measured: Optional[Dict[str, float]] = None) -> str:
    """The candidate with the least step time, measured where it ran (after
    its switch), else predicted (the first listed on a tie)."""
    measured = measured or {}
    return min(candidates, key=lambda name: measured.get(name, predictions[name]))


def off_prediction(predicted_s: float, measured_s: float, tolerance: float = REMEASURE_TOLERANCE) -> bool:
    """Whether a measured step time is off its prediction by more than
    ``tolerance`` of the prediction."""
    return abs(measured_s - predicted_s) > tolerance * predicted_s


class Chooser:
    """Auto's decisions, apart from the runtime (so that the rule is tested
    on its own): ``decide`` picks the least step time (measured where known,
    else predicted); once the choice ran, ``check`` takes its measured step
    time. Within ``tolerance`` of the prediction, the choice stands, unless
    another algorithm measured faster earlier; off by more, the caller
    measures again and calls ``decide`` with new predictions. At most one
    decision per candidate after the first, so it cannot cycle."""

    def __init__(self, candidates: Sequence[str], tolerance: float = REMEASURE_TOLERANCE):
        self.candidates = list(candidates)
        self.tolerance = tolerance
        self.measured: Dict[str, float] = {}  # step times of the algorithms that ran, after their switch
        self.log: List[dict] = []
        self.choice: Optional[str] = None
        self.predicted_s = 0.0  # the choice's prediction
        self.settled = False
        self._decisions = 0

    def decide(self, step: int, predictions: Dict[str, float], reason: str) -> str:
        self._decisions += 1
        self.choice = choose(predictions, self.candidates, self.measured)
        self.predicted_s = predictions[self.choice]
        # a measured choice needs no check; the decision budget ends the search
        self.settled = self.choice in self.measured or self._decisions > len(self.candidates)
        self._record(step, reason, predictions)
        return self.choice

    def check(self, step: int, measured_s: float) -> bool:
        """Records the choice's measured step; True when it is off the
        prediction by more than the tolerance and a decision is left (measure
        again, then ``decide``); else the choice settles on the fastest
        measured algorithm (returned by ``self.choice``)."""
        checked = self.choice
        self.measured[checked] = measured_s
        off = off_prediction(self.predicted_s, measured_s, self.tolerance)
        if off and self._decisions <= len(self.candidates):
            self._record(step, f"measured {measured_s:.4f} s, predicted {self.predicted_s:.4f} s: "
                               f"off by more than {self.tolerance:.0%}, measuring again", {checked: self.predicted_s})
            return True
        self.settled = True
        fastest = min(self.measured, key=self.measured.get)
        reason = "measured within the tolerance of its prediction" if not off else "no decision left"
        if fastest != checked:
            reason = f"{checked} measured {measured_s:.4f} s; {fastest} measured faster"
            self.choice = fastest
        self._record(step, reason, {checked: self.predicted_s})
        return False

    def _record(self, step: int, reason: str, predictions: Dict[str, float]) -> None:
        self.log.append({"step": step, "choice": self.choice, "reason": reason,
                         "predicted_step_s": dict(predictions), "measured_step_s": dict(self.measured)})


# -- the measurements ---------------------------------------------------------------
def _timed(call: Callable[[], None], comm, repeats: int, warm_up: bool = True) -> float:
    """The least of ``repeats`` timings of a collective ``call``, after one
    untimed call (``warm_up``); the ranks meet at a barrier before each, so a
    rank's time is the collective's, not its wait for late peers."""
    if warm_up:
        call()
    best = float("inf")
    for _ in range(repeats):
        bagua.barrier(comm=comm)
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def _slowest(seconds: float, process_group) -> float:
    """The largest of every rank's ``seconds``: what a decision that changes
    the calls to come must be made on, so that every rank makes the same
    calls. Collective."""
    agreed = torch.tensor([seconds], dtype=torch.float64)
    bagua.allreduce_inplace(agreed, op=bagua.ReduceOp.MAX, comm=process_group)
    return agreed.item()


class _ProbeBucket:
    """A bucket of fresh tensors (random values) on its own backend, run as
    the runtime runs a model's: mark every tensor ready, wait. What its ops
    cost is what they cost in a step, without the model's other work."""

    def __init__(self, shapes: Sequence[torch.Size], dtype, device, name: str):
        numels = [max(1, int(torch.Size(s).numel())) for s in shapes]
        self.flat = torch.randn(sum(numels), dtype=dtype, device=device)
        self.tensors = [t.view(s) for t, s in zip(self.flat.split(numels), shapes)]
        self.names = [f"{name}.{i}" for i in range(len(shapes))]
        self.bucket = core.Bucket(name, [(n, tensor_view(t, allow_cuda=True))
                                         for n, t in zip(self.names, self.tensors)])
        self.keep: List[torch.Tensor] = []  # state the ops update in place
        self._backend = None

    def _step(self) -> None:
        for name in self.names:
            self._backend.mark_communication_ready(name)
        self._backend.wait_pending_comm_ops()

    def _ready(self, process_group) -> None:
        if self._backend is None:
            if self.flat.is_cuda:  # marked ready without a stream: the values must be there already
                torch.cuda.synchronize(self.flat.device)
            self._backend = core.Backend(process_group.get_rank())
            self._backend.register_ordered_buckets([self.bucket])

    def time(self, process_group, repeats: int) -> float:
        """The least of ``repeats`` calls, after one untimed."""
        self._ready(process_group)
        return _timed(self._step, process_group, repeats)

    def time_once(self, process_group) -> float:
        """One call, timed, the slowest rank's (so every rank may decide on
        it). Collective."""
        self._ready(process_group)
        return _slowest(_timed(self._step, process_group, 1, warm_up=False), process_group)

    def least_time(self, process_group, repeats: int, first: Optional[float] = None) -> float:
        """One call (``first``: its time, when it was made already), then
        ``repeats - 1`` more unless it was longer than ``REPEAT_BELOW_S``: the
        least. Collective."""
        if first is None:
            first = self.time_once(process_group)
        if first > REPEAT_BELOW_S or repeats <= 1:
            return first
        return min(first, _timed(self._step, process_group, repeats - 1, warm_up=False))


def _link_probe(size: int, compressed: bool, comm) -> _ProbeBucket:
    probe = _ProbeBucket([torch.Size([size // 4])], torch.float32, torch.device("cpu"), "auto_link")
    if compressed:
        probe.bucket.append_centralized_low_precision_op(
            comm, None, core.CentralizedLowPrecisionOptions(hierarchical=False, average=True))
    else:
        probe.bucket.append_centralized_synchronous_op(
            comm, None, core.CentralizedSynchronousOptions(hierarchical=False, average=True))
    return probe


def probe_links(process_group, gradient_bytes: int, repeats: int = 3) -> List[float]:
    """The buckets' allreduce and ByteGrad's op at a small and a large size:
    ``[small_bytes, large_bytes, ar_small, ar_large, lp_small, lp_large]``.
    The large size grows 4x from ``GROWTH_START_BYTES`` until an allreduce
    takes ``GROW_UNTIL_S`` or reaches the gradient's size (within
    ``LARGE_PROBE_BYTES``): on a slow link a few hundred KiB, not 4 MiB.
    Collective; the same sizes on every rank."""
    comm = process_group.get_bucket_communicator()
    cap = int(min(max(gradient_bytes, LARGE_PROBE_BYTES[0]), LARGE_PROBE_BYTES[1]))
    small = [_link_probe(SMALL_PROBE_BYTES, c, comm).time(process_group, repeats) for c in (False, True)]
    size = min(GROWTH_START_BYTES, cap)
    while True:
        allreduce = _link_probe(size, False, comm)
        first = allreduce.time_once(process_group)
        if first >= GROW_UNTIL_S or size >= cap:
            break
        size = min(size * 4, cap)
    ar_large = allreduce.least_time(process_group, repeats, first)
    lp_large = _link_probe(size, True, comm).least_time(process_group, repeats)
    return [SMALL_PROBE_BYTES, size, small[0], ar_large, small[1], lp_large]


def time_powersgd_op(params: Sequence[torch.Tensor], rank: int, low_precision: bool, process_group,
                     repeats: int = 3) -> float:
    """Seconds of one compressed step of PowerSGD's op (error feedback, the
    factor passes, Gram-Schmidt, both exchanges) on one bucket of gradients
    shaped as ``params``, with their dtype and device, over
    ``process_group``: the op auto would run, as it runs. Collective."""
    first = params[0]
    probe = _ProbeBucket([p.shape for p in params], first.dtype, first.device, "auto_powersgd")
    matrices = []
    for index, t in enumerate(probe.tensors):
        if compresses(t.shape, rank, 2.0):
            rows, cols = t.shape[0], t.numel() // t.shape[0]
            q = torch.randn(cols, rank, dtype=t.dtype, device=t.device)
            error = torch.zeros_like(t)
            probe.keep += [q, error]
            matrices.append((index, rows, cols, tensor_view(q, allow_cuda=True),
                             tensor_view(error, allow_cuda=True)))
    op = probe.bucket.append_powersgd_op(process_group.get_bucket_communicator(), matrices,
                                         core.PowerSGDOptions(rank=rank, low_precision=low_precision))
    op.compressing = True
    probe.time_once(process_group)  # the first call allocates the factors: not what a step pays
    return probe.least_time(process_group, repeats)


class _HeldGradients:
    """The gradients of auto's measuring steps, which communicate nothing,
    kept until the first step that does: there, before a parameter's
    gradient is communicated, the mean of its held gradients and its own
    takes its place, so the measuring steps and that one act as one step of
    their batches together.

    What is held is what the optimizer would have taken: the gradients as
    the last backward before the (skipped) ``optimizer.step`` left them (a
    second backward before the step adds to them, as in a GAN's
    discriminator step; one after it, whose gradients ``zero_grad`` then
    drops, is not held). The step then zeroes them, so a loop that does not
    call ``zero_grad`` does not count them twice."""

    def __init__(self, named_params):
        self.params = list(named_params)
        self.pending: Dict[str, torch.Tensor] = {}
        self.held: Dict[str, torch.Tensor] = {}
        self.steps = 0

    def backward_ended(self) -> None:
        self.pending = {name: p.grad.detach().clone() for name, p in self.params if p.grad is not None}

    def optimizer_stepped(self) -> None:
        if not self.pending:
            return  # a second optimizer of the same step
        for name, grad in self.pending.items():
            self.held[name] = grad if name not in self.held else self.held[name] + grad
        for name, p in self.params:
            if name in self.pending and p.grad is not None:
                if p.grad.is_sparse:
                    p.grad = None
                else:
                    p.grad.zero_()
        self.pending, self.steps = {}, self.steps + 1

    def fold(self, name: str, param) -> None:
        """``param``'s gradient, ready to be communicated, becomes the mean of
        its held ones and itself."""
        held = self.held.pop(name, None)
        if held is None or param.grad is None:
            return
        if param.grad.is_sparse or held.is_sparse:
            param.grad = ((param.grad + held) / (self.steps + 1)).coalesce()
        else:
            param.grad.add_(held).div_(self.steps + 1)


# -- the algorithm --------------------------------------------------------------------
class AutoAlgorithmImpl(AlgorithmImpl):
    """Runs ``current`` (the choice; while measuring, GradientAllReduce's
    buckets, with nothing communicated), forwarding the runtime's calls to
    it, and times its steps until the choice is settled."""

    def __init__(self, process_group, candidates: Sequence[str], decide_after: int, powersgd_rank: int,
                 powersgd_start_iter: int, overlap: Optional[float], verify_steps: int = 3):
        super().__init__(process_group)
        self.candidates = list(candidates)
        self.decide_after = decide_after
        self.verify_steps = verify_steps
        self.powersgd_rank = powersgd_rank
        self.powersgd_start_iter = powersgd_start_iter
        self.overlap = overlap
        self.chooser: Optional[Chooser] = None
        self.choice: Optional[str] = None
        self.decision: Optional[dict] = None
        self._samples: List[List[float]] = []  # [compute, exposed] of the current algorithm's steps
        self._skip = 0                         # steps left out after a switch (new buffers)
        self._held: Optional[_HeldGradients] = None  # the measuring steps' gradients, until averaged
        self._local_backward = False           # this step's gradients stayed local: its optimizer step waits
        self._forward_start = 0.0
        self._next: Optional[AlgorithmImpl] = None
        self._fixed_log: List[dict] = []       # without a chooser: the override, or a checkpoint's log
        self._one_bucket = True                # PowerSGD's layout (see _try_layout)
        self._runtime_buckets = 1              # the runtime's buckets of this model (GradientAllReduce's)
        self._layout_trial: Optional[float] = None  # while the runtime's buckets are tried: one bucket's step
        self._layout_done = False              # the layout was tried (or need not be)
        self._start(core.env().algorithm)

    def _start(self, override: str) -> None:
        if override:
            self._agree_on_override(override)
            self._fixed(override, "BAGUA_ALGORITHM")
            self._log(self.decision)
        elif self.process_group.get_size() == 1:
            self._fixed("gradient_allreduce", "one rank: nothing to communicate")
        else:
            self.chooser = Chooser(self.candidates)
            self.current, self._current_name = self._reify("gradient_allreduce"), "gradient_allreduce"

    def _fixed(self, name: str, reason: str) -> None:
        self.choice, self.decision = name, {"choice": name, "reason": reason}
        self.current, self._current_name = self._reify(name), name
        self._fixed_log = [self.decision]

    def _reify(self, name: str, one_bucket: bool = True) -> AlgorithmImpl:
        algorithm = {
            "gradient_allreduce": lambda: GradientAllReduceAlgorithm(hierarchical=False),
            "bytegrad": lambda: ByteGradAlgorithm(hierarchical=False),
            "powersgd": lambda: PowerSGDAlgorithm(rank=self.powersgd_rank, start_iter=self.powersgd_start_iter,
                                                  one_bucket=one_bucket),
            "powersgd_8bit": lambda: PowerSGDAlgorithm(rank=self.powersgd_rank, start_iter=self.powersgd_start_iter,
                                                       low_precision=True, one_bucket=one_bucket),
        }[name]()
        return algorithm.reify(self.process_group)

    def _agree_on_override(self, name: str) -> None:
        """Every rank must run the same algorithm: a BAGUA_ALGORITHM that
        differs between ranks is an error on all of them."""
        comm = self.process_group.get_global_communicator()
        if comm.size > 1:
            comm.verify_same_call(f"AutoAlgorithm with BAGUA_ALGORITHM={name}",
                                  core.TensorView(0, 0, "float32", "cpu"), -1)

    @property
    def measuring_locally(self) -> bool:
        """The first steps: nothing is communicated, nothing is applied."""
        return self.chooser is not None and self.chooser.choice is None

    @property
    def deciding(self) -> bool:
        """Still timing steps: measuring, checking the choice, or trying
        PowerSGD's layout."""
        return self.chooser is not None and (not self.chooser.settled or self._layout_open)

    @property
    def _layout_open(self) -> bool:
        """PowerSGD runs, with one bucket, and the runtime's buckets were
        not tried yet (see _try_layout)."""
        return not self._layout_done and self._current_name in LAYOUT_CANDIDATES and self._runtime_buckets > 1

    @property
    def decisions(self) -> List[dict]:
        return self.chooser.log if self.chooser is not None else self._fixed_log

    # -- timing the steps ---------------------------------------------------------------
    def _steady(self, bagua_ddp) -> bool:
        """Whether this step shows the current algorithm as it will run: not
        the first after a switch (new buffers, first touches), and for
        PowerSGD a compressed one."""
        if self._skip > 0:
            self._skip -= 1
            return False
        return not isinstance(self.current, PowerSGDAlgorithmImpl) or \
            bagua_ddp.step_counter > self.powersgd_start_iter

    def _sample(self, bagua_ddp, compute_s: float, exposed_s: float) -> None:
        if not self._steady(bagua_ddp):
            return
        self._samples.append([compute_s, exposed_s])
        needed = self.decide_after if self.chooser.choice is None else self.verify_steps
        if len(self._samples) >= needed:
            compute_s, step_s = self._agreed_samples()
            if self._layout_trial is not None:
                self._end_layout_trial(bagua_ddp, step_s)
            elif self.chooser.settled:  # settled on PowerSGD: these were its one-bucket steps
                self._try_layout(bagua_ddp, step_s)
            elif self.chooser.choice is None:
                self._decide(bagua_ddp, compute_s, "least predicted step time")
            elif self.chooser.check(bagua_ddp.step_counter, step_s):
                self._decide(bagua_ddp, compute_s, "least step time after measuring again")
            else:
                self._log(self.chooser.log[-1])
                stays = self.chooser.choice == self._current_name
                self._switch_to(self.chooser.choice)
                if stays and self._layout_open:  # its steps were just measured
                    self._try_layout(bagua_ddp, self.chooser.measured[self._current_name])

    def _agreed_samples(self) -> List[float]:
        """[compute, step] of the timed steps: per step the slowest rank's
        (the ranks wait for each other), the least over the steps; the same
        on every rank. Collective."""
        samples = torch.tensor(self._samples, dtype=torch.float64)
        self._samples = []
        with calls_known_to_match():
            bagua.allreduce_inplace(samples, op=bagua.ReduceOp.MAX, comm=self.process_group)
        return [samples[:, 0].min().item(), samples.sum(dim=1).min().item()]

    # -- measuring and deciding ----------------------------------------------------
    def _measure(self, bagua_ddp, compute_s: float) -> Measurements:
        """The probes (every rank makes the same calls, in the same order),
        maxed over ranks, with the compute time of the timed steps."""
        params = [p for _, p in bagua_ddp.bagua_build_params()]
        gradient_bytes = sum(p.numel() * p.element_size() for p in params)
        with calls_known_to_match():
            local = probe_links(self.process_group, gradient_bytes)
            local += [time_powersgd_op(params, self.powersgd_rank, low, self.process_group) for low in (False, True)]
            agreed = torch.tensor(local, dtype=torch.float64)
            bagua.allreduce_inplace(agreed, op=bagua.ReduceOp.MAX, comm=self.process_group)
        small, large, ar_small, ar_large, lp_small, lp_large, powersgd_s, powersgd_8bit_s = agreed.tolist()
        allreduce = LinkModel.fit(int(small), ar_small, int(large), ar_large)
        buckets = len(bagua_ddp.bagua_buckets)
        if self._current_name == "gradient_allreduce":
            self._runtime_buckets = buckets
        # No GradientAllReduce step was measured: nothing says what the backward
        # hides, so nothing is taken as hidden (the check corrects it).
        overlap = self.overlap if self.overlap is not None else 0.0
        return Measurements(
            world_size=self.process_group.get_size(), compute_s=compute_s, exposed_s=None,
            gradient_bytes=gradient_bytes, buckets=buckets, allreduce=allreduce,
            low_precision=LinkModel.fit(int(small), lp_small, int(large), lp_large),
            powersgd_s=powersgd_s, powersgd_8bit_s=powersgd_8bit_s, overlap=overlap)

    def _decide(self, bagua_ddp, compute_s: float, reason: str) -> None:
        measured = self._measure(bagua_ddp, compute_s)
        self.chooser.decide(bagua_ddp.step_counter, predict(measured), reason)
        self.chooser.log[-1]["measurements"] = dataclasses.asdict(measured)
        self._log(self.chooser.log[-1])
        self._switch_to(self.chooser.choice)

    def _switch_to(self, name: str) -> None:
        """``name`` runs from the next step's forward (the buckets are rebuilt
        for it); its first step is not timed (nor the first that
        communicates at all)."""
        first = self.choice is None
        self.choice, self.decision = name, self.chooser.log[-1]
        if name != self._current_name:
            self._next, self._current_name = self._reify(name), name
        if name != self._current_name or first:
            self._skip = 1

    # -- PowerSGD's layout ------------------------------------------------------------
    def _try_layout(self, bagua_ddp, one_bucket_s: float) -> None:
        """PowerSGD settled with one bucket, averaged after the backward
        (where the factors' round trips cost more than their bytes, as on
        the MLPs of docs/benchmarks.md). On a link slow for the factors'
        bytes, the runtime's buckets, each averaged while the backward goes
        on, hide them (a 12-layer transformer at 10 Mbit/s: 1.2x the step
        without communication against 1.8x). Which one wins is measured:
        ``verify_steps`` steps of the runtime's buckets, with PowerSGD's
        state (Q, error feedback) carried over; at two ranks the layout
        does not change the bits."""
        self._layout_trial = one_bucket_s
        self._switch_layout(bagua_ddp, one_bucket=False)
        self._record_layout(bagua_ddp.step_counter, f"trying the runtime's {self._runtime_buckets} buckets, "
                                                    f"averaged during the backward (one bucket: {one_bucket_s:.4f} s)")

    def _end_layout_trial(self, bagua_ddp, buckets_s: float) -> None:
        one_bucket_s, self._layout_trial, self._layout_done = self._layout_trial, None, True
        if buckets_s < LAYOUT_GAIN * one_bucket_s:
            reason = f"the runtime's buckets kept: {buckets_s:.4f} s a step against one bucket's {one_bucket_s:.4f} s"
        else:
            reason = f"one bucket again: {one_bucket_s:.4f} s a step against the runtime's buckets' {buckets_s:.4f} s"
            self._switch_layout(bagua_ddp, one_bucket=True)
        self.chooser.measured[self._current_name] = min(buckets_s, one_bucket_s)
        self._record_layout(bagua_ddp.step_counter, reason)

    def _switch_layout(self, bagua_ddp, one_bucket: bool) -> None:
        """The same algorithm with the other layout from the next step's
        forward, PowerSGD's state carried over (its first step not timed)."""
        impl = self._reify(self._current_name, one_bucket=one_bucket)
        impl.load_state_dict(bagua_ddp, self.current.state_dict(bagua_ddp))
        self._next, self._one_bucket, self._skip = impl, one_bucket, 1

    def _record_layout(self, step: int, reason: str) -> None:
        entry = {"step": step, "choice": self._current_name, "reason": reason,
                 "layout": "one bucket" if self._one_bucket else "the runtime's buckets",
                 "measured_step_s": dict(self.chooser.measured)}
        self.chooser.log.append(entry)
        self.decision = entry
        self._log(entry)

    def _log(self, decision: dict) -> None:
        if self.process_group.get_rank() == 0:
            log("info", f"AutoAlgorithm: {json.dumps(decision)}")

    # -- the runtime's calls, forwarded ------------------------------------------------
    def need_reset(self) -> bool:
        if self._next is not None:  # the choice takes over before this step's forward
            self.current, self._next = self._next, None
            return True
        return self.current.need_reset()

    def init_tensors(self, bagua_ddp):
        return self.current.init_tensors(bagua_ddp)

    def tensors_to_buckets(self, tensors, do_flatten: bool):
        return self.current.tensors_to_buckets(tensors, do_flatten)

    def init_operations(self, bagua_ddp, bucket) -> None:
        self.current.init_operations(bagua_ddp, bucket)

    def init_forward_pre_hook(self, bagua_ddp):
        inner = self.current.init_forward_pre_hook(bagua_ddp)

        def hook(inputs):
            self._local_backward = False  # a new step (an optimizer step skipped or not called)
            if self.deciding:
                self._forward_start = time.perf_counter()
            inner(inputs)
        return hook

    def init_backward_hook(self, bagua_ddp):
        inner = self.current.init_backward_hook(bagua_ddp)

        def hook(name, param):
            if self.measuring_locally:
                return  # nothing communicated: the gradient is held at the step
            if self._held is not None:
                self._held.fold(name, param)
            inner(name, param)
        return hook

    def init_post_backward_hook(self, bagua_ddp):
        inner = self.current.init_post_backward_hook(bagua_ddp)

        def hook():
            if self.measuring_locally:
                backward_end = time.perf_counter()
                if self._held is None:
                    self._held = _HeldGradients(bagua_ddp.bagua_build_params() + bagua_ddp.sparse_parameters)
                self._held.backward_ended()
                self._local_backward = True
                self._sample(bagua_ddp, backward_end - self._forward_start, 0.0)
                return
            self._drop_held()
            if not self.deciding:
                return inner()
            backward_end = time.perf_counter()
            inner()  # waits for the buckets still communicating
            self._sample(bagua_ddp, backward_end - self._forward_start, time.perf_counter() - backward_end)
        return hook

    def _drop_held(self) -> None:
        """After the first step that communicated: what it did not fold in
        (a parameter without a gradient in that step) is dropped."""
        if self._held is None:
            return
        if self._held.held and self.process_group.get_rank() == 0:
            log("debug", f"AutoAlgorithm: {len(self._held.held)} held gradients had no gradient to join "
                         f"in the first averaged step: dropped ({sorted(self._held.held)[:4]}...)")
        self._held = None

    def skips_optimizer_step(self, before_backward: bool = False) -> bool:
        return self.measuring_locally if before_backward else self._local_backward

    def init_post_optimizer_step_hook(self, bagua_ddp):
        inner = self.current.init_post_optimizer_step_hook(bagua_ddp)

        def hook(optimizer):
            if self._local_backward:
                self._held.optimizer_stepped()
                return
            inner(optimizer)
        return hook

    def init_inference_forward_hooks(self, bagua_ddp):
        return self.current.init_inference_forward_hooks(bagua_ddp)

    def hold_weights(self, bagua_ddp):
        return self.current.hold_weights(bagua_ddp)

    def ranks_share_weights(self) -> bool:
        return self.current.ranks_share_weights()

    def shutdown(self, bagua_ddp) -> None:
        self.current.shutdown(bagua_ddp)

    # -- checkpoints: a resumed run keeps the choice -------------------------------------
    def state_dict(self, bagua_ddp) -> dict:
        return {"choice": self.choice, "decision": self.decision, "decisions": self.decisions,
                "one_bucket": self._one_bucket, "algorithm_state": (self._next or self.current).state_dict(bagua_ddp)}

    def load_state_dict(self, bagua_ddp, state: dict) -> None:
        saved = state.get("choice")
        if saved is None:
            return  # saved while still measuring: this run measures again
        impl = self._next or self.current
        one_bucket = state.get("one_bucket", True)
        if saved != self._current_name or one_bucket != self._one_bucket:
            impl = self._reify(saved, one_bucket=one_bucket)
        impl.load_state_dict(bagua_ddp, state.get("algorithm_state", {}))
        if impl is not self.current:
            self._next = impl  # takes over at the rebuild the checkpoint's loading asks for
        self.choice, self.decision, self._current_name = saved, state.get("decision"), saved
        self._one_bucket, self._layout_trial, self._layout_done = one_bucket, None, True
        self.chooser = None  # the saved choice runs as it is, unchecked
        self._fixed_log = list(state.get("decisions", [self.decision]))


class AutoAlgorithm(Algorithm):
    def __init__(self, candidates: Sequence[str] = CANDIDATES, decide_after: int = 3, powersgd_rank: int = 1,
                 powersgd_start_iter: int = 10, overlap: Optional[float] = None, verify_steps: int = 3):
        """
        Args:
            candidates: the algorithms to choose from (names of ``CANDIDATES``).
            decide_after: steps measured before choosing (the profiling
                iteration is the first); they communicate nothing and do not
                step the optimizer: the choice's first step averages their
                gradients with its own.
            powersgd_rank, powersgd_start_iter: PowerSGD's ``rank`` and
                ``start_iter`` when it is chosen.
            overlap: the share of a step's compute time that bucket-by-bucket
                communication hides behind; None (default): 0 for the first
                prediction (the measuring steps communicate nothing), then
                the check of the measured steps (docs/auto.md).
            verify_steps: steps of the chosen algorithm timed (after its
                first, and for PowerSGD compressed ones) to check its
                prediction; off by more than 30 %, auto measures again and
                may choose again.
        """
        if not candidates or isinstance(candidates, str):
            raise InvalidArgumentError(f"AutoAlgorithm: candidates must be a list of names from {CANDIDATES}")
        check = ArgumentChecks(type(self).__name__)
        for name in candidates:
            check.choice("candidates", name, CANDIDATES)
        check.integer("decide_after", decide_after, 1)
        check.integer("verify_steps", verify_steps, 1)
        check.integer("powersgd_rank", powersgd_rank, 1)
        check.integer("powersgd_start_iter", powersgd_start_iter, 0)
        if overlap is not None and (not isinstance(overlap, (int, float)) or not 0 <= overlap <= 1):
            raise InvalidArgumentError(
                f"AutoAlgorithm: overlap must be None or a number in [0, 1], got {overlap!r}")
        self.candidates = list(candidates)
        self.decide_after = decide_after
        self.verify_steps = verify_steps
        self.powersgd_rank = powersgd_rank
        self.powersgd_start_iter = powersgd_start_iter
        self.overlap = None if overlap is None else float(overlap)

    def reify(self, process_group) -> AutoAlgorithmImpl:
        return AutoAlgorithmImpl(process_group, self.candidates, self.decide_after, self.powersgd_rank,
                                 self.powersgd_start_iter, self.overlap, self.verify_steps)

    @staticmethod
    def _impl(model) -> AutoAlgorithmImpl:
        impl = model.bagua_ddp.bagua_algorithm_impl
        if not isinstance(impl, AutoAlgorithmImpl):
            raise InvalidArgumentError("AutoAlgorithm: this module is not wrapped with AutoAlgorithm")
        return impl

    @staticmethod
    def decision(model) -> Optional[dict]:
        """The latest decision of a module wrapped with ``algorithm="auto"``:
        the algorithm that runs (``choice``), why, and for a choice made by
        measuring the predicted and measured step times and the
        measurements; None while measuring the first steps."""
        return AutoAlgorithm._impl(model).decision

    @staticmethod
    def decisions(model) -> List[dict]:
        """Every decision so far, in order: each choice with the step (the
        engine's count), the reason, the predicted step times (for a choice)
        and the step times measured by then."""
        return AutoAlgorithm._impl(model).decisions
