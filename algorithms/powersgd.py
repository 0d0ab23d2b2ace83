"""PowerSGD: gradient averaging with low-rank compression (Vogels et al.,
"PowerSGD: Practical Low-Rank Gradient Compression for Distributed
Optimization", 2019), the scheme of PyTorch DDP's ``powerSGD_hook``.

Each matrix-shaped gradient M (n x m, higher dimensions folded into m) is
sent as two thin factors instead of n * m numbers:

    M += error                 (error feedback: what compression lost last step)
    P = M Q                    (n x r; Q is m x r, kept from the last step)
    P = allreduce(P)           (summed: only its column space matters)
    P = orthogonalize(P)       (Gram-Schmidt on the columns)
    Q = allreduce(M^T P) / N   (m x r, the average)
    M' = P Q^T                 (the rank-r approximation of the average)
    error = M - M'

All factors of a bucket travel in one allreduce for P and one for Q. Vectors
(biases, norms) and matrices that would not shrink by ``min_compression_rate``
are averaged uncompressed, in one allreduce per bucket. The first
``start_iter`` steps average every gradient uncompressed, as DDP's hook does,
so that training leaves its first, fast-changing phase before compression
starts. Q starts from the same random values on every rank (seeded by
``seed`` and the tensor's name) and is warm-started from the previous step
after that.

With ``low_precision=True`` the two exchanges after ``start_iter`` carry
MinMaxUInt8 codes instead of floats (the low-precision P-Reduce with every
rank a member: scatter of 8-bit chunks, owners average, gather of the 8-bit
averages): about a quarter of the bytes again. They then average P instead
of summing it, which changes nothing, since only P's column space is used;
error feedback also absorbs what the 8 bits lose on the matrices.

Each bucket's averaging is the C++ op ``PowerSGDOp``
(include/bagua/ops/powersgd.h): one pass over each gradient per matrix
step, on the bucket's device, on the communication thread in the bucket's
turn. Q and the error buffers are tensors this class owns (so checkpoints
carry them) and the op updates in place.
"""

import zlib
from typing import Dict

import torch

from bagua.torch_api.algorithms.base import Algorithm, AlgorithmImpl, ArgumentChecks
from bagua.torch_api.bucket import BaguaBucket
from bagua.torch_api import InvalidArgumentError

__all__ = ["PowerSGDAlgorithm", "PowerSGDAlgorithmImpl", "initial_q", "orthogonalize", "compresses"]


def compresses(shape: torch.Size, rank: int, min_compression_rate: float) -> bool:
    """Whether a gradient of ``shape`` is sent as rank-``rank`` factors: a
    matrix (2 or more dimensions) whose factors are smaller than it by at
    least ``min_compression_rate`` (DDP's rule)."""
    if len(shape) < 2:
        return False
    n = shape[0]
    m = 1
    for d in shape[1:]:
        m *= d
    return (n + m) * rank * min_compression_rate < n * m


def initial_q(name: str, columns: int, rank: int, seed: int, dtype, device) -> torch.Tensor:
    """The first Q of tensor ``name``: standard normal values drawn on the
    CPU from a generator seeded by ``seed`` and the name, so every rank
    starts from the same Q without communicating."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randn(columns, rank, generator=generator, dtype=torch.float32).to(dtype=dtype, device=device)


def orthogonalize(p: torch.Tensor, epsilon: float = 0.0) -> torch.Tensor:
    """Gram-Schmidt on the columns of ``p`` (n x r), in place. A column that
    is all zeros stays zero (a parameter without gradient on every rank)
    instead of turning into NaN."""
    for i in range(p.shape[1]):
        column = p[:, i:i + 1]
        norm = torch.linalg.vector_norm(column)
        if norm > 0:
            column /= norm + epsilon
        if i + 1 < p.shape[1]:
            rest = p[:, i + 1:]
            rest -= (column * rest).sum(dim=0, keepdim=True) * column
    return p


class PowerSGDAlgorithmImpl(AlgorithmImpl):
    # Host buckets take a fresh gradient (zero_grad(set_to_none=True),
    # torch 2's default) as their memory instead of copying it in. On the
    # slow-link bench's issue MLP it took 4.7-8.4 ms off the step, A/B in
    # alternate launches (docs/benchmarks.md, "PowerSGD against its floor").
    # A stall seen there (one rank's backward 40-60 ms slower) came with it
    # on and with it off alike: it was the timeline's allocations (79ed3f3).
    adopts_fresh_gradients = True

    def __init__(self, process_group, rank: int, start_iter: int, min_compression_rate: float,
                 error_feedback: bool, warm_start: bool, orthogonalization_epsilon: float, seed: int,
                 low_precision: bool = False, one_bucket: bool = False):
        super().__init__(process_group)
        # The factor passes over host gradients run on as many threads as
        # torch's own CPU ops (BAGUA_HOST_THREADS overrides): on a many-core
        # host, one thread beside multi-threaded matrix products would make
        # them most of the step. The bits do not depend on the count.
        from bagua.torch_api._core import core

        core.set_host_threads(core.env().host_threads or min(256, max(1, torch.get_num_threads())))
        self.low_precision = low_precision
        self.one_bucket = one_bucket
        self.rank = rank
        self.start_iter = start_iter
        self.min_compression_rate = min_compression_rate
        self.error_feedback = error_feedback
        self.warm_start = warm_start
        self.epsilon = orthogonalization_epsilon
        self.seed = seed
        # The state the ops update in place, per tensor name (checkpoints
        # save it): Q (m x r) and the error (n x m).
        self._q: Dict[str, torch.Tensor] = {}
        self._error: Dict[str, torch.Tensor] = {}
        # On host memory the error is deferred (include/bagua/ops/powersgd.h):
        # _error then holds M, and the error is M - p_prev q_prev^T.
        self._p_prev: Dict[str, torch.Tensor] = {}
        self._q_prev: Dict[str, torch.Tensor] = {}
        self._q_draws: Dict[str, int] = {}          # without warm start: fresh Q per step
        self._ops: Dict[str, object] = {}           # per bucket name, the latest op
        self._retired_bytes = [0, 0]                # the counts of ops replaced since
        self._q_used = False                        # a compressed step ran with the current Q
        self._rebuild = False                       # a checkpoint brought state of other shapes

    def tensors_to_buckets(self, tensors, do_flatten: bool):
        if self.one_bucket:  # one bucket per dtype and device, in the planner's order
            kinds: Dict[tuple, list] = {}
            for group in tensors:
                for t in group:  # a gradient has its parameter's dtype and device
                    kinds.setdefault((t.dtype, t.device), []).append(t)
            tensors = list(kinds.values())
        if not self.adopts_fresh_gradients:
            return super().tensors_to_buckets(tensors, do_flatten)
        # On host memory the op can read each gradient where autograd left it:
        # no flat buffer, and a fresh gradient (zero_grad(set_to_none=True))
        # adopted, not copied in (the op's first pass reads it anyway).
        return [BaguaBucket(group, flatten=do_flatten and group[0].device.type != "cpu", name=f"bucket{index}",
                            adopt_replaced=True)
                for index, group in enumerate(tensors)]

    def need_reset(self) -> bool:
        rebuild, self._rebuild = self._rebuild, False
        return rebuild

    def init_operations(self, bagua_ddp, bucket):
        bucket.clear_ops()
        matrices = []
        for index, t in enumerate(bucket.tensors):
            grad = t.bagua_registered_tensor()
            if not compresses(grad.shape, self.rank, self.min_compression_rate):
                continue
            # The gradient's memory as shape[0] rows, as the op reads it (a
            # channels_last gradient: its columns in memory order).
            m = grad.as_strided((grad.shape[0], grad.numel() // grad.shape[0]), (grad.numel() // grad.shape[0], 1))
            error = self._state(self._error, t.bagua_tensor_name, m) if self.error_feedback else None
            matrices.append((index, self._q_for(t.bagua_tensor_name, m), error)
                            + self._deferred_for(t.bagua_tensor_name, error))
        op = bucket.append_powersgd_op(matrices, rank=self.rank, low_precision=self.low_precision,
                                       orthogonalization_epsilon=self.epsilon, group=self.process_group)
        old = self._ops.get(bucket.name)
        if old is not None:
            self._retired_bytes[0] += old.exchanged_bytes
            self._retired_bytes[1] += old.uncompressed_bytes
        self._ops[bucket.name] = op
        op.compressing = bagua_ddp.step_counter > self.start_iter

    def init_forward_pre_hook(self, bagua_ddp):
        def hook(inputs):
            compressing = bagua_ddp.step_counter > self.start_iter
            if compressing and not self.warm_start:
                if self._q_used:  # a fresh Q for every step after the first
                    for name, q in self._q.items():
                        q.copy_(self._draw_q(name, q.shape[0], q.dtype, q.device))
                self._q_used = True
            for op in self._ops.values():
                op.compressing = compressing
        return hook

    def _state(self, states: Dict[str, torch.Tensor], name: str, m: torch.Tensor) -> torch.Tensor:
        """The error of tensor ``name``: kept if its shape still fits, else zeros."""
        state = states.get(name)
        if state is None or state.shape != m.shape or state.dtype != m.dtype or state.device != m.device:
            state = states[name] = torch.zeros_like(m)
            self._p_prev.pop(name, None)  # a fresh error is all in the new state
            self._q_prev.pop(name, None)
        return state

    def _deferred_for(self, name: str, error) -> tuple:
        """(p_prev, q_prev) of tensor ``name`` whose error state is ``error``
        (rows x cols): the factors its M was approximated by, zeros at first;
        () on a device or without error feedback (the error is then kept
        as it is)."""
        if error is None or error.device.type != "cpu":
            return ()
        shapes = {"p": (error.shape[0], self.rank), "q": (error.shape[1], self.rank)}
        kept = []
        for key, states in (("p", self._p_prev), ("q", self._q_prev)):
            state = states.get(name)
            if state is None or state.shape != shapes[key] or state.dtype != error.dtype:
                state = states[name] = torch.zeros(shapes[key], dtype=error.dtype)
            kept.append(state)
        return tuple(kept)

    def _materialized_error(self, name: str, state: torch.Tensor) -> torch.Tensor:
        """The error of tensor ``name`` as a new CPU tensor: its state, or
        with the error deferred, the state minus p_prev q_prev^T."""
        p_prev = self._p_prev.get(name)
        if p_prev is None:
            return state.cpu().clone()
        from bagua.torch_api._core import core, tensor_view

        error = torch.empty_like(state)
        q_prev = self._q_prev[name]
        core.low_rank_deferred_error(*(tensor_view(t) for t in (state, p_prev, q_prev, error)),
                                     state.shape[0], state.shape[1], p_prev.shape[1])
        return error

    def _q_for(self, name: str, m: torch.Tensor) -> torch.Tensor:
        """The Q of tensor ``name``: the one kept (warm start, checkpoints) if
        its shape fits, else the first draw, the same on every rank."""
        q = self._q.get(name)
        if q is None or q.shape != (m.shape[1], self.rank) or q.dtype != m.dtype or q.device != m.device:
            q = self._q[name] = self._draw_q(name, m.shape[1], m.dtype, m.device)
        return q

    def _draw_q(self, name: str, columns: int, dtype, device) -> torch.Tensor:
        draw = self._q_draws.get(name, 0)
        self._q_draws[name] = draw + 1
        return initial_q(name if draw == 0 else f"{name}#{draw}", columns, self.rank, self.seed, dtype, device)

    # -- checkpoints -----------------------------------------------------------
    def state_dict(self, bagua_ddp) -> dict:
        return {"q": {k: v.cpu().clone() for k, v in self._q.items()},
                "error": {k: self._materialized_error(k, v) for k, v in self._error.items()},
                "q_draws": dict(self._q_draws)}

    def load_state_dict(self, bagua_ddp, state: dict) -> None:
        """Copies into the tensors the ops update where shapes agree (the ops
        keep them); other shapes take effect after a rebuild of the ops."""
        device = next((p.device for p in bagua_ddp.module.parameters()), torch.device("cpu")) \
            if bagua_ddp is not None else torch.device("cpu")
        for key, states in (("q", self._q), ("error", self._error)):
            for name, value in state.get(key, {}).items():
                current = states.get(name)
                if current is not None and current.shape == value.shape:
                    current.copy_(value)
                else:
                    states[name] = value.to(device)
                    self._rebuild = True
                if key == "error" and name in self._p_prev:  # the loaded error is all in the state
                    self._p_prev[name].zero_()
        self._q_draws = dict(state.get("q_draws", {}))

    # -- figures ---------------------------------------------------------------
    @property
    def bytes_sent(self) -> int:
        """Per rank, since wrapping: what the exchanges were handed (8-bit
        codes and their headers with low_precision)."""
        return self._retired_bytes[0] + sum(op.exchanged_bytes for op in self._ops.values())

    @property
    def bytes_uncompressed(self) -> int:
        """What plain averaging would have sent over the same steps."""
        return self._retired_bytes[1] + sum(op.uncompressed_bytes for op in self._ops.values())

    def compression_ratio(self) -> float:
        """Bytes plain averaging would have sent over bytes sent, since wrapping."""
        return self.bytes_uncompressed / self.bytes_sent if self.bytes_sent else 1.0


class PowerSGDAlgorithm(Algorithm):
    impl_class = PowerSGDAlgorithmImpl

    def __init__(self, rank: int = 1, start_iter: int = 10, min_compression_rate: float = 2.0,
                 error_feedback: bool = True, warm_start: bool = True, orthogonalization_epsilon: float = 0.0,
                 seed: int = 0, low_precision: bool = False, one_bucket: bool = False):
        """
        Args:
            rank: the rank r of the approximation (PyTorch's
                ``matrix_approximation_rank``): each n x m gradient is sent as
                (n + m) * r numbers.
            start_iter: this many first steps average uncompressed
                (``start_powerSGD_iter``).
            min_compression_rate: a matrix is compressed only if its factors
                are at least this many times smaller than it.
            error_feedback: add what compression lost to the next step's
                gradient (needed to converge like plain averaging).
            warm_start: start each step's power iteration from the last Q.
            orthogonalization_epsilon: added to column norms in Gram-Schmidt.
            seed: seeds the first Q (identical on every rank).
            low_precision: send the factors (and the vectors riding with P)
                as MinMaxUInt8 codes, about 4x fewer bytes, once compression
                started.
            one_bucket: all gradients in one bucket (per dtype), averaged
                once backward has finished, instead of bucket by bucket
                during it. Where the factors are small for the link,
                several buckets hide little transfer and cost two round
                trips each, while their math competes with the backward
                pass for the cores: on the 2-core machine of
                docs/benchmarks.md one bucket was 1.07-1.10x faster on the
                MLPs at 100 Mbit/s, 1.02-1.22x at 10 Mbit/s. Where their
                bytes take long (a 12-layer transformer at rank 4 over
                10 Mbit/s), the buckets hide them behind the backward:
                1.21-1.27x the step without communication, against
                1.73-1.76x with one bucket. ``algorithm="auto"`` tries both.
        """
        check = ArgumentChecks(type(self).__name__)
        check.integer("rank", rank, 1)
        check.integer("start_iter", start_iter, 0)
        check.flags(error_feedback=error_feedback, warm_start=warm_start,
                    low_precision=low_precision, one_bucket=one_bucket)
        if not isinstance(min_compression_rate, (int, float)) or min_compression_rate < 1:
            raise InvalidArgumentError(
                f"PowerSGDAlgorithm: min_compression_rate must be a number >= 1, got {min_compression_rate!r}")
        if not isinstance(orthogonalization_epsilon, (int, float)) or orthogonalization_epsilon < 0:
            raise InvalidArgumentError(
                f"PowerSGDAlgorithm: orthogonalization_epsilon must be >= 0, got {orthogonalization_epsilon!r}")
        self.keep_settings(rank=rank, start_iter=start_iter, min_compression_rate=float(min_compression_rate),
                           error_feedback=error_feedback, warm_start=warm_start,
                           orthogonalization_epsilon=float(orthogonalization_epsilon), seed=seed,
                           low_precision=low_precision, one_bucket=one_bucket)
