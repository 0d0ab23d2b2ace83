"""``algorithm="auto"``: measure, predict each algorithm's step time, run
the fastest.

The first ``decide_after`` steps run GradientAllReduce (the exact average,
so nothing is lost while measuring). At the end of the last of them every
rank measures, with the same calls on every rank:

- the compute time of a step: forward start to backward end, the least of
  those steps (the profiling iteration included), and how long each then
  still waited for its allreduces: how much of them the backward pass hid;
- the network: a full precision allreduce and an 8-bit average
  (``low_precision_average_inplace``, ByteGrad's scheme, compression
  included) of a small and a large buffer, each fitted to
  ``latency + bytes * seconds_per_byte``;
- PowerSGD's factor math on this device, for the model's gradient shapes.

The measurements are maxed over ranks, so every rank predicts the same times
and picks the same algorithm; the cost model (:func:`predict`, written out
in docs/auto.md) turns them into a step time per candidate. The choice, the
measurements and the predictions are logged (info level) and kept in
``AutoAlgorithm.decision(model)``. ``BAGUA_ALGORITHM`` names the algorithm
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
from bagua.torch_api.algorithms.base import Algorithm, AlgorithmImpl, check_choice, check_integer
from bagua.torch_api.algorithms.bytegrad import ByteGradAlgorithm
from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm
from bagua.torch_api.algorithms.powersgd import PowerSGDAlgorithm, compresses
from bagua.torch_api.communication import calls_known_to_match
from bagua.torch_api import InvalidArgumentError

__all__ = ["AutoAlgorithm", "AutoAlgorithmImpl", "CANDIDATES", "LinkModel", "Measurements", "predict",
           "choose", "measured_overlap"]

CANDIDATES = ("gradient_allreduce", "bytegrad", "powersgd", "powersgd_8bit")
SMALL_PROBE_BYTES = 4096
LARGE_PROBE_BYTES = (256 << 10, 4 << 20)  # the large probe: the gradient's size, within these bounds


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
    compute_s: float        # forward + backward of one step
    gradient_bytes: int     # all gradients, as stored
    buckets: int            # buckets of the gradient algorithms (one collective each)
    allreduce: LinkModel    # full precision allreduce
    low_precision: LinkModel  # 8-bit average; bytes counted as the float32 input's
    powersgd_bytes: int     # what PowerSGD's two exchanges carry per step, float32
    powersgd_math_s: float  # PowerSGD's factor math per step on this device
    overlap: float          # share of compute_s that bucket-by-bucket communication hides


def measured_overlap(communication_s: float, exposed_s: float, compute_s: float) -> float:
    """The share of the compute time that hid communication in the measured
    GradientAllReduce steps: of ``communication_s`` (what the probe predicts
    its allreduces take), ``exposed_s`` was still left to wait for after
    backward; the rest was hidden behind ``compute_s``. In [0, 1]."""
    if compute_s <= 0:
        return 0.0
    return min(max((communication_s - exposed_s) / compute_s, 0.0), 1.0)


def predict(m: Measurements) -> Dict[str, float]:
    """Predicted step time (forward, backward and the exposed communication)
    per candidate. The gradient algorithms communicate bucket by bucket
    during the backward pass, which hides ``m.overlap`` of the compute time;
    PowerSGD runs with one bucket (``one_bucket=True``) after it: its math
    and its two exchanges add to the step. See docs/auto.md."""
    if m.world_size == 1:
        return {name: m.compute_s for name in CANDIDATES}

    def overlapped(communication_s: float) -> float:
        return m.compute_s + max(0.0, communication_s - m.overlap * m.compute_s)

    def after_backward(communication_s: float) -> float:
        return m.compute_s + m.powersgd_math_s + communication_s

    k = m.buckets
    return {
        "gradient_allreduce": overlapped(m.allreduce.time(m.gradient_bytes, k)),
        "bytegrad": overlapped(m.low_precision.time(m.gradient_bytes, k)),
        "powersgd": after_backward(m.allreduce.time(m.powersgd_bytes, 2)),
        "powersgd_8bit": after_backward(m.low_precision.time(m.powersgd_bytes, 2)),
    }


def choose(predictions: Dict[str, float], candidates: Sequence[str]) -> str:
    """The candidate with the least predicted time (the first listed on a tie)."""
    return min(candidates, key=lambda name: predictions[name])


# -- the measurements ---------------------------------------------------------------
def _timed(call: Callable[[], None], comm, repeats: int) -> float:
    """The least of ``repeats`` timings of a collective ``call``, after one
    untimed call; the ranks meet at a barrier before each, so a rank's time is
    the collective's, not its wait for late peers."""
    call()
    best = float("inf")
    for _ in range(repeats):
        bagua.barrier(comm=comm)
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def probe_links(comm, gradient_bytes: int, repeats: int = 3) -> List[float]:
    """[small, large] probe sizes and the [allreduce, 8-bit average] times
    at each: ``[small_bytes, large_bytes, ar_small, ar_large, lp_small, lp_large]``."""
    large = int(min(max(gradient_bytes, LARGE_PROBE_BYTES[0]), LARGE_PROBE_BYTES[1]))
    result = [SMALL_PROBE_BYTES, large]
    for collective in (bagua.allreduce_inplace, bagua.low_precision_average_inplace):
        for size in (SMALL_PROBE_BYTES, large):
            buffer = torch.ones(size // 4, dtype=torch.float32)
            result.append(_timed(lambda: collective(buffer, comm=comm), comm, repeats))
    return result


def powersgd_plan(shapes: Sequence[torch.Size], rank: int, min_compression_rate: float = 2.0) -> int:
    """Float32 bytes PowerSGD's two exchanges carry per step for gradients
    of ``shapes``: P (n * r) and Q (m * r) per compressed matrix, the rest
    uncompressed."""
    elements = 0
    for shape in shapes:
        if compresses(shape, rank, min_compression_rate):
            n = shape[0]
            elements += (n + shape.numel() // n) * rank
        else:
            elements += shape.numel()
    return 4 * elements


def time_powersgd_math(params: Sequence[torch.Tensor], rank: int, repeats: int = 2) -> float:
    """Seconds of one step of PowerSGD's factor math (P = MQ, Gram-Schmidt,
    Q = M^T P, M' = PQ^T, the new error) for gradients shaped as ``params``,
    on their device, without communication."""
    matrices = [p for p in params if compresses(p.shape, rank, 2.0)]
    if not matrices:
        return 0.0
    work = []
    for p in matrices:
        rows, cols = p.shape[0], p.numel() // p.shape[0]
        work.append([torch.randn(rows, cols, dtype=p.dtype, device=p.device) for _ in range(2)] +
                    [torch.randn(cols, rank, dtype=p.dtype, device=p.device),
                     torch.empty(rows, rank, dtype=p.dtype, device=p.device), rows, cols])

    def once() -> None:  # the op's own steps (include/bagua/ops/low_rank_steps.h)
        for m, error, q, p, rows, cols in work:
            core.low_rank_step(*(tensor_view(t, allow_cuda=True) for t in (m, error, q, p)), rows, cols, rank)

    once()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        once()
        best = min(best, time.perf_counter() - start)
    return best


# -- the algorithm --------------------------------------------------------------------
class AutoAlgorithmImpl(AlgorithmImpl):
    """Runs ``current`` (GradientAllReduce while measuring, then the choice),
    forwarding the runtime's calls to it."""

    def __init__(self, process_group, candidates: Sequence[str], decide_after: int, powersgd_rank: int,
                 powersgd_start_iter: int, overlap: Optional[float]):
        super().__init__(process_group)
        self.candidates = list(candidates)
        self.decide_after = decide_after
        self.powersgd_rank = powersgd_rank
        self.powersgd_start_iter = powersgd_start_iter
        self.overlap = overlap
        self.choice: Optional[str] = None
        self.decision: Optional[dict] = None
        self._compute_samples: List[float] = []
        self._exposed_samples: List[float] = []  # waiting for communication after backward
        self._forward_start = 0.0
        self._next: Optional[AlgorithmImpl] = None
        override = core.env().algorithm
        if override:
            self._agree_on_override(override)
            self.choice = override
            self.decision = {"choice": override, "reason": "BAGUA_ALGORITHM"}
            self.current = self._reify(override)
            self._log()
        elif process_group.get_size() == 1:
            self.choice = "gradient_allreduce"
            self.decision = {"choice": self.choice, "reason": "one rank: nothing to communicate"}
            self.current = self._reify(self.choice)
        else:
            self.current = self._reify("gradient_allreduce")

    def _reify(self, name: str) -> AlgorithmImpl:
        algorithm = {
            "gradient_allreduce": lambda: GradientAllReduceAlgorithm(hierarchical=False),
            "bytegrad": lambda: ByteGradAlgorithm(hierarchical=False),
            "powersgd": lambda: PowerSGDAlgorithm(rank=self.powersgd_rank, start_iter=self.powersgd_start_iter,
                                                  one_bucket=True),
            "powersgd_8bit": lambda: PowerSGDAlgorithm(rank=self.powersgd_rank, start_iter=self.powersgd_start_iter,
                                                       low_precision=True, one_bucket=True),
        }[name]()
        return algorithm.reify(self.process_group)

    def _agree_on_override(self, name: str) -> None:
        """Every rank must run the same algorithm: a BAGUA_ALGORITHM that
        differs between ranks is an error on all of them."""
        comm = self.process_group.get_global_communicator()
        if comm.size > 1:
            comm.verify_same_call(f"AutoAlgorithm with BAGUA_ALGORITHM={name}",
                                  core.TensorView(0, 0, "float32", "cpu"), -1)

    # -- measuring and deciding ----------------------------------------------------
    @property
    def deciding(self) -> bool:
        return self.choice is None

    def _decide(self, bagua_ddp) -> None:
        params = [p for _, p in bagua_ddp.bagua_build_params()]
        gradient_bytes = sum(p.numel() * p.element_size() for p in params)
        with calls_known_to_match():  # every rank makes the same calls, in the same order
            local = [min(self._compute_samples), min(self._exposed_samples),
                     time_powersgd_math(params, self.powersgd_rank)]
            local += probe_links(self.process_group, gradient_bytes)
            agreed = torch.tensor(local, dtype=torch.float64)
            bagua.allreduce_inplace(agreed, op=bagua.ReduceOp.MAX, comm=self.process_group)
        compute_s, exposed_s, math_s, small, large, ar_small, ar_large, lp_small, lp_large = agreed.tolist()
        allreduce = LinkModel.fit(int(small), ar_small, int(large), ar_large)
        buckets = len(bagua_ddp.bagua_buckets)
        overlap = self.overlap if self.overlap is not None else \
            measured_overlap(allreduce.time(gradient_bytes, buckets), exposed_s, compute_s)
        measured = Measurements(
            world_size=self.process_group.get_size(), compute_s=compute_s, gradient_bytes=gradient_bytes,
            buckets=buckets, allreduce=allreduce,
            low_precision=LinkModel.fit(int(small), lp_small, int(large), lp_large),
            powersgd_bytes=powersgd_plan([p.shape for p in params], self.powersgd_rank),
            powersgd_math_s=math_s, overlap=overlap)
        predictions = predict(measured)
        self.choice = choose(predictions, self.candidates)
        self.decision = {"choice": self.choice, "reason": "least predicted step time",
                         "predicted_step_s": predictions, "measurements": dataclasses.asdict(measured)}
        self._log()
        if self.choice != "gradient_allreduce":
            self._next = self._reify(self.choice)

    def _log(self) -> None:
        if self.process_group.get_rank() == 0:
            log("info", f"AutoAlgorithm: {json.dumps(self.decision)}")

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
        if not self.deciding:
            return inner

        def hook(inputs):
            self._forward_start = time.perf_counter()
            inner(inputs)
        return hook

    def init_backward_hook(self, bagua_ddp):
        return self.current.init_backward_hook(bagua_ddp)

    def init_post_backward_hook(self, bagua_ddp):
        inner = self.current.init_post_backward_hook(bagua_ddp)
        if not self.deciding:
            return inner

        def hook():
            backward_end = time.perf_counter()
            self._compute_samples.append(backward_end - self._forward_start)
            inner()  # waits for the buckets still communicating
            self._exposed_samples.append(time.perf_counter() - backward_end)
            if self.deciding and len(self._compute_samples) >= self.decide_after:
                self._decide(bagua_ddp)
        return hook

    def init_post_optimizer_step_hook(self, bagua_ddp):
        return self.current.init_post_optimizer_step_hook(bagua_ddp)

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
        return {"choice": self.choice, "decision": self.decision,
                "algorithm_state": self.current.state_dict(bagua_ddp)}

    def load_state_dict(self, bagua_ddp, state: dict) -> None:
        saved = state.get("choice")
        if saved is None:
            return  # saved while still measuring: this run measures again
        impl = self._next or self.current
        if saved != self.choice:
            impl = self._reify(saved)
        impl.load_state_dict(bagua_ddp, state.get("algorithm_state", {}))
        if impl is not self.current:
            self._next = impl  # takes over at the rebuild the checkpoint's loading asks for
        self.choice, self.decision = saved, state.get("decision")


class AutoAlgorithm(Algorithm):
    def __init__(self, candidates: Sequence[str] = CANDIDATES, decide_after: int = 3, powersgd_rank: int = 1,
                 powersgd_start_iter: int = 10, overlap: Optional[float] = None):
        """
        Args:
            candidates: the algorithms to choose from (names of ``CANDIDATES``).
            decide_after: steps of GradientAllReduce measured before choosing
                (the profiling iteration is the first).
            powersgd_rank, powersgd_start_iter: PowerSGD's ``rank`` and
                ``start_iter`` when it is chosen.
            overlap: the share of a step's compute time that bucket-by-bucket
                communication hides behind; None (default): measured in the
                GradientAllReduce steps (docs/auto.md).
        """
        if not candidates or isinstance(candidates, str):
            raise InvalidArgumentError(f"AutoAlgorithm: candidates must be a list of names from {CANDIDATES}")
        for name in candidates:
            check_choice(type(self).__name__, "candidates", name, CANDIDATES)
        check_integer(type(self).__name__, "decide_after", decide_after, 1)
        check_integer(type(self).__name__, "powersgd_rank", powersgd_rank, 1)
        check_integer(type(self).__name__, "powersgd_start_iter", powersgd_start_iter, 0)
        if overlap is not None and (not isinstance(overlap, (int, float)) or not 0 <= overlap <= 1):
            raise InvalidArgumentError(
                f"AutoAlgorithm: overlap must be None or a number in [0, 1], got {overlap!r}")
        self.candidates = list(candidates)
        self.decide_after = decide_after
        self.powersgd_rank = powersgd_rank
        self.powersgd_start_iter = powersgd_start_iter
        self.overlap = None if overlap is None else float(overlap)

    def reify(self, process_group) -> AutoAlgorithmImpl:
        return AutoAlgorithmImpl(process_group, self.candidates, self.decide_after, self.powersgd_rank,
                                 self.powersgd_start_iter, self.overlap)

    @staticmethod
    def decision(model) -> Optional[dict]:
        """The choice of a module wrapped with ``algorithm="auto"``: its name,
        why, and (when measured) the measurements and predicted step times;
        None while still measuring."""
        impl = model.bagua_ddp.bagua_algorithm_impl
        if not isinstance(impl, AutoAlgorithmImpl):
            raise InvalidArgumentError("AutoAlgorithm.decision: this module is not wrapped with AutoAlgorithm")
        return impl.decision
