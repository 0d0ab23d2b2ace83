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

The math runs in PyTorch on the bucket's device, on the communication
thread, in the bucket's turn (a Python op); the factors go through the
engine's allreduce.
"""

import zlib
from typing import Dict, List

import torch

from bagua.torch_api.algorithms.base import Algorithm, AlgorithmImpl, check_flags, check_integer
from bagua.torch_api import InvalidArgumentError
from bagua.torch_api.communication import allreduce_inplace, low_precision_average_inplace

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
    def __init__(self, process_group, rank: int, start_iter: int, min_compression_rate: float,
                 error_feedback: bool, warm_start: bool, orthogonalization_epsilon: float, seed: int,
                 low_precision: bool = False, one_bucket: bool = False):
        super().__init__(process_group)
        self.low_precision = low_precision
        self.one_bucket = one_bucket
        self.rank = rank
        self.start_iter = start_iter
        self.min_compression_rate = min_compression_rate
        self.error_feedback = error_feedback
        self.warm_start = warm_start
        self.epsilon = orthogonalization_epsilon
        self.seed = seed
        self._q: Dict[str, torch.Tensor] = {}       # per tensor name, m x r
        self._error: Dict[str, torch.Tensor] = {}   # per tensor name, n x m
        self._q_draws: Dict[str, int] = {}          # without warm start: fresh Q per step
        self.bytes_sent = 0      # per rank, since wrapping: what the allreduces carried
        self.bytes_uncompressed = 0  # what plain averaging would have carried

    def tensors_to_buckets(self, tensors, do_flatten: bool):
        if self.one_bucket:  # one bucket per dtype and device, in the planner's order
            kinds: Dict[tuple, list] = {}
            for group in tensors:
                for t in group:  # a gradient has its parameter's dtype and device
                    kinds.setdefault((t.dtype, t.device), []).append(t)
            tensors = list(kinds.values())
        return super().tensors_to_buckets(tensors, do_flatten)

    def init_operations(self, bagua_ddp, bucket):
        bucket.clear_ops()
        communicator = self.process_group.get_bucket_communicator()
        bucket.append_python_op(lambda name: self._average_bucket(bagua_ddp, bucket, communicator),
                                group=self.process_group)

    # -- one bucket, one step --------------------------------------------------
    def _average_bucket(self, bagua_ddp, bucket, communicator) -> None:
        tensors = [(t.bagua_tensor_name, t.bagua_registered_tensor()) for t in bucket.tensors]
        with torch.no_grad():
            if bagua_ddp.step_counter <= self.start_iter:
                vectors, matrices = [g for _, g in tensors], []
            else:
                matrices = [(n, g) for n, g in tensors if compresses(g.shape, self.rank, self.min_compression_rate)]
                vectors = [g for n, g in tensors if not compresses(g.shape, self.rank, self.min_compression_rate)]
            self._average(vectors, matrices, communicator)

    def _allreduce(self, flat: torch.Tensor, communicator, eight_bit: bool) -> float:
        """Sums ``flat`` over ranks, or averages it with 8-bit codes on the
        wire; returns what to divide the result by to get the average."""
        if eight_bit:
            low_precision_average_inplace(flat, comm=communicator)
            # one code byte per element, and a min/max header per chunk and rank
            self.bytes_sent += flat.numel() + 8 * communicator.size
            return 1
        allreduce_inplace(flat, comm=communicator)
        self.bytes_sent += flat.numel() * flat.element_size()
        return communicator.size

    def _average(self, vectors: List[torch.Tensor], matrices, communicator) -> None:
        """Averages `vectors` uncompressed and `matrices` ((name, gradient)
        pairs) through their factors. The vectors travel in the allreduce of
        the P factors: two allreduces per bucket in all."""
        ms = [self._with_error(name, grad) for name, grad in matrices]
        qs = [self._q_for(name, m) for (name, _), m in zip(matrices, ms)]
        plain = sum(g.numel() for g in vectors)
        first = torch.cat([g.reshape(-1) for g in vectors] + [(m @ q).reshape(-1) for m, q in zip(ms, qs)])
        # 8 bits only where factors travel: the first start_iter steps, and
        # buckets of vectors only, stay exact
        eight_bit = self.low_precision and bool(matrices)
        divisor = self._allreduce(first, communicator, eight_bit)
        self.bytes_uncompressed += (plain + sum(m.numel() for m in ms)) * first.element_size()
        offset = 0
        for g in vectors:
            g.copy_(first[offset:offset + g.numel()].view_as(g) / divisor)
            offset += g.numel()
        if not matrices:
            return
        # P = M Q summed over ranks; only its column space matters.
        ps = []
        for m in ms:
            ps.append(orthogonalize(first[offset:offset + m.shape[0] * self.rank].view(m.shape[0], self.rank),
                                    self.epsilon))
            offset += m.shape[0] * self.rank
        # Q = M^T P, averaged over ranks.
        q_flat = torch.cat([(m.t() @ p).reshape(-1) for m, p in zip(ms, ps)])
        q_flat /= self._allreduce(q_flat, communicator, eight_bit)
        offset = 0
        for (name, _), m, p, q in zip(matrices, ms, ps, qs):
            q.copy_(q_flat[offset:offset + q.numel()].view_as(q))
            offset += q.numel()
            # m is the gradient's own memory: the error first, then the
            # approximation over m (no n x m temporaries)
            if self.error_feedback:
                torch.addmm(m, p, q.t(), alpha=-1, out=self._error[name])
            torch.mm(p, q.t(), out=m)

    def _with_error(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """The gradient as an n x m matrix viewing its memory (a bucket's
        tensors are contiguous), plus, in place, what compression lost last
        step when error feedback is on."""
        m = grad.view(grad.shape[0], -1)
        if not self.error_feedback:
            return m
        error = self._error.get(name)
        if error is None or error.shape != m.shape:
            error = self._error[name] = torch.zeros_like(m)
        return m.add_(error)

    def _q_for(self, name: str, m: torch.Tensor) -> torch.Tensor:
        """The Q to multiply M by: the last step's (warm start) or a fresh
        draw, the same on every rank."""
        q = self._q.get(name)
        if q is not None and q.shape == (m.shape[1], self.rank) and self.warm_start:
            return q
        draw = self._q_draws.get(name, 0)
        self._q_draws[name] = draw + 1
        q = initial_q(name if draw == 0 else f"{name}#{draw}", m.shape[1], self.rank, self.seed, m.dtype, m.device)
        self._q[name] = q
        return q

    # -- checkpoints -----------------------------------------------------------
    def state_dict(self, bagua_ddp) -> dict:
        return {"q": {k: v.cpu() for k, v in self._q.items()},
                "error": {k: v.cpu() for k, v in self._error.items()},
                "q_draws": dict(self._q_draws)}

    def load_state_dict(self, bagua_ddp, state: dict) -> None:
        device = next((p.device for p in bagua_ddp.module.parameters()), torch.device("cpu"))
        self._q = {k: v.to(device) for k, v in state.get("q", {}).items()}
        self._error = {k: v.to(device) for k, v in state.get("error", {}).items()}
        self._q_draws = dict(state.get("q_draws", {}))

    def compression_ratio(self) -> float:
        """Bytes plain averaging would have sent over bytes sent, since wrapping."""
        return self.bytes_uncompressed / self.bytes_sent if self.bytes_sent else 1.0


class PowerSGDAlgorithm(Algorithm):
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
                during it. The factors are small, so several buckets hide
                little transfer and cost two round trips each, while their
                math competes with the backward pass for the cores: on the
                2-core machine of docs/benchmarks.md one bucket was 1.07-1.10x
                faster at 100 Mbit/s.
        """
        check_integer(type(self).__name__, "rank", rank, 1)
        check_integer(type(self).__name__, "start_iter", start_iter, 0)
        check_flags(type(self).__name__, error_feedback=error_feedback, warm_start=warm_start,
                    low_precision=low_precision, one_bucket=one_bucket)
        if not isinstance(min_compression_rate, (int, float)) or min_compression_rate < 1:
            raise InvalidArgumentError(
                f"PowerSGDAlgorithm: min_compression_rate must be a number >= 1, got {min_compression_rate!r}")
        if not isinstance(orthogonalization_epsilon, (int, float)) or orthogonalization_epsilon < 0:
            raise InvalidArgumentError(
                f"PowerSGDAlgorithm: orthogonalization_epsilon must be >= 0, got {orthogonalization_epsilon!r}")
        self.rank = rank
        self.start_iter = start_iter
        self.min_compression_rate = float(min_compression_rate)
        self.error_feedback = error_feedback
        self.warm_start = warm_start
        self.orthogonalization_epsilon = float(orthogonalization_epsilon)
        self.seed = seed
        self.low_precision = low_precision
        self.one_bucket = one_bucket

    def reify(self, process_group) -> PowerSGDAlgorithmImpl:
        return PowerSGDAlgorithmImpl(process_group, self.rank, self.start_iter, self.min_compression_rate,
                                     self.error_feedback, self.warm_start, self.orthogonalization_epsilon,
                                     self.seed, self.low_precision, self.one_bucket)
