"""BaguaBucket: tensors communicated together, and the ops applied to them.

The Python face of ``bagua_core.Bucket``. Flattening allocates one buffer per
bucket and makes every tensor a view into it, so each op communicates one
contiguous message; unflattened buckets are packed into a staging buffer by
the runtime instead.
"""

from typing import Callable, Dict, List, Optional

import torch

from bagua.torch_api._core import InvalidArgumentError, core, device_name, dtype_name, tensor_view
from bagua.torch_api.process_group import group_for_ops
from bagua.torch_api.communication import calls_known_to_match
from bagua.torch_api.tensor import BaguaTensor


class BaguaBucket:
    def __init__(self, tensors: List[BaguaTensor], name: str, flatten: bool = True,
                 alignment: int = 1, adopt_replaced: bool = False):
        """``adopt_replaced`` (host memory, not flattened): when the training
        loop replaces a tensor (a fresh gradient after
        ``zero_grad(set_to_none=True)``), the bucket takes the new tensor as
        its memory instead of copying it into the old one. Only for ops
        that find their tensors when they run (PowerSGD's)."""
        if not tensors:
            raise InvalidArgumentError(f"bucket '{name}' has no tensors")
        if alignment < 1:
            raise InvalidArgumentError(f"bucket '{name}': alignment must be >= 1, got {alignment}")
        self.name = name
        self.tensors = list(tensors)
        self.flatten = flatten
        self.alignment = alignment
        names, ids = set(), set()
        for t in self.tensors:
            # Flattened twice, a tensor would be bound to two places of the
            # buffer and communicated twice: refuse it.
            if t.bagua_tensor_name in names or id(t) in ids:
                raise InvalidArgumentError(f"bucket '{name}' holds tensor '{t.bagua_tensor_name}' twice")
            names.add(t.bagua_tensor_name)
            ids.add(id(t))
        currents = [t._bagua_current() for t in self.tensors]
        first = currents[0]
        for t, current in zip(self.tensors, currents):
            if current.dtype != first.dtype or current.device != first.device:
                raise InvalidArgumentError(
                    f"bucket '{name}' mixes {self.tensors[0].bagua_tensor_name} ({first.dtype}, {first.device}) "
                    f"with {t.bagua_tensor_name} ({current.dtype}, {current.device})")
        self.dtype = first.dtype
        self.device = first.device
        self.flattened: Optional[torch.Tensor] = None
        if flatten:
            total = sum(c.numel() for c in currents)
            padded = -(-total // alignment) * alignment
            self.flattened = torch.zeros(padded, dtype=self.dtype, device=self.device)
            offset = 0
            with torch.no_grad():
                for t, current in zip(self.tensors, currents):
                    # In the tensor's own memory order (channels_last stays so:
                    # autograd then accumulates its gradient in place, as DDP's
                    # gradient-layout contract has it).
                    view = self.flattened.as_strided(current.shape, current.stride(), offset)
                    view.copy_(current)
                    t.bagua_setter_closure(view)
                    t._bagua_register(view)
                    offset += current.numel()
        else:
            adopts = adopt_replaced and self.device.type == "cpu"
            for t, current in zip(self.tensors, currents):
                t._bagua_register(current, adopts)
        self._keep_alive = []  # tensors the ops hold views of
        self.error_feedback_ops: List["ErrorFeedbackOp"] = []  # their residuals go into checkpoints
        self.backend_bucket = core.Bucket(
            name, [(t.bagua_tensor_name, tensor_view(t.bagua_registered_tensor(), f"tensor '{t.bagua_tensor_name}'",
                                                  allow_cuda=True, any_dense_order=True))
                   for t in self.tensors])

    def clear_ops(self) -> "BaguaBucket":
        self.backend_bucket.clear_ops()
        self._keep_alive = []
        self.error_feedback_ops = []  # their residuals are saved in checkpoints
        return self

    def append_centralized_synchronous_op(self, hierarchical: bool = False, average: bool = True,
                                          scattergather: bool = False,
                                          compression: Optional[str] = None,
                                          group=None, error_feedback: bool = False) -> "BaguaBucket":
        """Every rank gets the sum (average=False) or average of the bucket
        over the group.

        - ``compression=None`` (C_FP_S): full precision; ``scattergather`` uses
          reduce-scatter + allgather instead of allreduce.
        - ``compression="MinMaxUInt8"`` (C_LP_S): the paper's compressed
          scatter-reduce, about a quarter of the bytes for fp32; always in
          scatter-gather form. ``error_feedback=True`` adds back what
          compression lost on the previous call (worker and server side).
        - ``compression="Float16"`` (C_HP_S): PyTorch DDP's
          ``fp16_compress_hook``: the bucket converted to float16, divided
          by the world size (``average``), allreduced (sum) in float16,
          converted back; half the bytes for fp32. float32, float64 and
          float16 buckets (bfloat16 is refused: it would save nothing and
          lose range); no ``scattergather`` or ``error_feedback``.
        - ``hierarchical``: reduce inside each node first (full precision;
          float16 with ``"Float16"``), communicate among node leaders,
          broadcast back inside the node.
        """
        for flag, value in (("hierarchical", hierarchical), ("average", average),
                            ("scattergather", scattergather), ("error_feedback", error_feedback)):
            if not isinstance(value, bool):
                raise InvalidArgumentError(f"append_centralized_synchronous_op: {flag} must be a bool, got {value!r}")
        compression = _check_compression(compression, allow_none=True, supported=("MinMaxUInt8", "Float16"))
        if error_feedback and compression != "MinMaxUInt8":
            raise InvalidArgumentError("append_centralized_synchronous_op: error_feedback needs "
                                       f"compression='MinMaxUInt8', got {compression!r}")
        group = _group_or_default(group)
        if compression != "MinMaxUInt8":
            # Full precision and float16 sum the same numbers either way: over
            # one node, or one rank per node, the flat form (the op would run
            # it too) without setting up the node groups.
            hierarchical = hierarchical and group.spans_nodes_of_several_ranks()
        hierarchy = group.get_hierarchical_communicators() if hierarchical else None
        if compression is None:
            self.backend_bucket.append_centralized_synchronous_op(
                group.get_bucket_communicator(), hierarchy, core.CentralizedSynchronousOptions(
                    hierarchical=hierarchical, average=average, scattergather=scattergather))
        elif compression == "Float16":
            if scattergather:
                raise InvalidArgumentError("append_centralized_synchronous_op: compression='Float16' "
                                           "allreduces; scattergather=True is not available with it")
            # The op checks the bucket's dtype (InvalidArgumentError naming it).
            self.backend_bucket.append_centralized_half_precision_op(
                group.get_bucket_communicator(), hierarchy, core.CentralizedHalfPrecisionOptions(
                    hierarchical=hierarchical, average=average))
        else:
            _check_floating(self.dtype, "append_centralized_synchronous_op(compression='MinMaxUInt8')")
            op = self.backend_bucket.append_centralized_low_precision_op(
                group.get_bucket_communicator(), hierarchy, core.CentralizedLowPrecisionOptions(
                    hierarchical=hierarchical, average=average, error_feedback=error_feedback))
            if error_feedback:
                self.error_feedback_ops.append(ErrorFeedbackOp(op, self.device))
        return self

    def append_low_precision_decentralized_synchronous_op(
            self, weight, left_peer_weight, right_peer_weight, hierarchical: bool = True,
            compression: str = "MinMaxUInt8", group=None) -> "BaguaBucket":
        """D_LP_S: low-precision decentralized averaging with both ring
        neighbours. ``weight``, ``left_peer_weight`` and ``right_peer_weight``
        are this rank's copies of its own and its neighbours' weights: flat
        tensors (or BaguaTensors) of the bucket's size and dtype, equal to
        the bucket's weights at the start. Run it after the optimizer step."""
        if not isinstance(hierarchical, bool):
            raise InvalidArgumentError(f"hierarchical must be a bool, got {hierarchical!r}")
        if _check_compression(compression, allow_none=False) is None:
            raise InvalidArgumentError("low precision decentralized needs compression='MinMaxUInt8'")
        _check_floating(self.dtype, "append_low_precision_decentralized_synchronous_op")
        copies = []
        for what, tensor in (("weight", weight), ("left_peer_weight", left_peer_weight),
                             ("right_peer_weight", right_peer_weight)):
            if isinstance(tensor, BaguaTensor):
                tensor = tensor.bagua_getter_closure()
            if not isinstance(tensor, torch.Tensor) or tensor.dtype != self.dtype or \
                    tensor.numel() != self.numel():
                raise InvalidArgumentError(
                    f"append_low_precision_decentralized_synchronous_op: {what} must be a tensor of "
                    f"{self.numel()} {self.dtype} elements, got "
                    f"{getattr(tensor, 'dtype', type(tensor).__name__)}{list(getattr(tensor, 'shape', []))}")
            copies.append(tensor)
        group = _group_or_default(group)
        hierarchy = group.get_hierarchical_communicators() if hierarchical else None
        for tensor, name in zip(copies, ("weight", "left", "right")):
            if tensor.device != self.device:
                raise InvalidArgumentError(
                    f"append_low_precision_decentralized_synchronous_op: {name} is on {tensor.device}, "
                    f"the bucket on {self.device}")
        views = [tensor_view(t, name, allow_cuda=True)
                 for t, name in zip(copies, ("weight", "left", "right"))]
        self.backend_bucket.append_low_precision_decentralized_op(
            group.get_bucket_communicator(), hierarchy, *views,
            core.LowPrecisionDecentralizedOptions(hierarchical=hierarchical))
        self._keep_alive.extend(copies)
        # Bagua's names for the copies, which its users read
        self._weight, self._left_peer_weight, self._right_peer_weight = copies
        return self

    def append_decentralized_synchronous_op(self, peer_weight, hierarchical: bool = True,
                                            peer_selection_mode: str = "all", group=None):
        """D_FP_S: averages this bucket (weights) with the peers of
        ``peer_selection_mode`` ("all", "shift_one", "ring") into
        ``peer_weight`` (a flat tensor of the bucket's size and dtype), leaving
        the bucket untouched; returns the op, whose
        ``copy_back_peer_weight(bucket)`` writes the average into the bucket."""
        if not isinstance(hierarchical, bool):
            raise InvalidArgumentError(f"hierarchical must be a bool, got {hierarchical!r}")
        options = core.DecentralizedSynchronousOptions(
            hierarchical=hierarchical, peer_selection=core.parse_peer_selection(peer_selection_mode))
        if isinstance(peer_weight, BaguaTensor):
            peer_weight = peer_weight.bagua_getter_closure()
        self._check_copy("peer_weight", peer_weight)
        group = _group_or_default(group)
        hierarchy = group.get_hierarchical_communicators() if hierarchical else None
        op = self.backend_bucket.append_decentralized_synchronous_op(
            group.get_bucket_communicator(), hierarchy,
            tensor_view(peer_weight, "peer_weight", allow_cuda=True), options)
        self._keep_alive.append(peer_weight)
        self._peer_weight = peer_weight  # Bagua's name: the last exchange's average
        return DecentralizedSynchronousOp(op)

    def append_neighbor_allreduce_op(self, peer_weight, group=None) -> "NeighborAllreduceOp":
        """BlueFog's neighbour allreduce of this bucket (weights) into
        ``peer_weight`` (a flat tensor of the bucket's size and dtype), leaving
        the bucket untouched, over the pattern last given to the returned
        op's ``set_pattern`` (the default: no neighbours, the weights as they
        are); ``copy_back_peer_weight(bucket)`` writes the result into the
        bucket. ``DecentralizedAlgorithm(topology=...)`` drives it."""
        if isinstance(peer_weight, BaguaTensor):
            peer_weight = peer_weight.bagua_getter_closure()
        self._check_copy("peer_weight", peer_weight)
        group = _group_or_default(group)
        op = self.backend_bucket.append_neighbor_allreduce_op(
            group.get_bucket_communicator(), tensor_view(peer_weight, "peer_weight", allow_cuda=True))
        self._keep_alive.append(peer_weight)
        self._peer_weight = peer_weight
        return NeighborAllreduceOp(op)

    def append_low_precision_neighbor_allreduce_op(
            self, weight, peer_weights: Dict[int, torch.Tensor], self_weight: float,
            src_weights: Dict[int, float], dst_ranks: List[int], compression: str = "MinMaxUInt8",
            check_pattern: bool = True, group=None) -> "BaguaBucket":
        """Low-precision neighbour averaging over a static graph (D_LP_S on
        any topology): ``weight`` is this rank's copy of its own weights as
        its out-neighbours know them, ``peer_weights`` its copy of each
        in-neighbour's (keys: the in-neighbours' ranks, those of
        ``src_weights``), all flat tensors of the bucket's size and dtype,
        equal to the weights every rank starts from. Each execution
        compresses d = self_weight * weight + sum_j src_weights[j] *
        peer_weights[j] + (bucket - weight) - weight, sends it to
        ``dst_ranks``, adds the decoded messages of the in-neighbours to
        their copies and sets bucket = weight = weight + Q^-1(Q(d)). Run it
        after the optimizer step. ``check_pattern``: the ranks agree on the
        pattern at the first execution (one small allgather)."""
        if _check_compression(compression, allow_none=False) is None:
            raise InvalidArgumentError("low precision neighbour allreduce needs compression='MinMaxUInt8'")
        _check_floating(self.dtype, "append_low_precision_neighbor_allreduce_op")
        if isinstance(weight, BaguaTensor):
            weight = weight.bagua_getter_closure()
        self._check_copy("weight", weight)
        if not isinstance(peer_weights, dict) or not isinstance(src_weights, dict) or \
                sorted(peer_weights) != sorted(src_weights):
            raise InvalidArgumentError(
                "append_low_precision_neighbor_allreduce_op: peer_weights and src_weights must be dicts with "
                f"the same ranks, got {sorted(peer_weights) if isinstance(peer_weights, dict) else peer_weights!r} "
                f"and {sorted(src_weights) if isinstance(src_weights, dict) else src_weights!r}")
        sources = sorted(src_weights)
        replicas = []
        for rank in sources:
            replica = peer_weights[rank]
            if isinstance(replica, BaguaTensor):
                replica = replica.bagua_getter_closure()
            self._check_copy(f"peer_weights[{rank}]", replica)
            replicas.append(replica)
        options = core.LowPrecisionNeighborOptions(
            self_weight=float(self_weight), sources=[(int(r), float(src_weights[r])) for r in sources],
            destinations=sorted(int(r) for r in dst_ranks), check_pattern=bool(check_pattern))
        group = _group_or_default(group)
        self.backend_bucket.append_low_precision_neighbor_allreduce_op(
            group.get_bucket_communicator(), tensor_view(weight, "weight", allow_cuda=True),
            [tensor_view(t, f"peer_weights[{r}]", allow_cuda=True) for r, t in zip(sources, replicas)],
            options)
        self._keep_alive.append(weight)
        self._keep_alive.extend(replicas)
        return self

    def append_asynchronous_model_average_op(self, peer_selection_mode: str = "all", group=None,
                                             sync_interval_ms: int = 500, max_staleness_steps=None):
        """Asynchronous model average of this bucket (weights) over the group,
        in a background thread every ``sync_interval_ms``; returns the op
        (``lock_weight``, ``unlock_weight``, ``abort``, ``resume``, ``reset``,
        ``get_status``, ``count_step``, ``wait_within_staleness``, ``stats``).
        The background rounds start when the op first runs.
        ``max_staleness_steps``: None (unbounded) or the local steps allowed
        between two completed rounds (see ``wait_within_staleness``)."""
        if not isinstance(sync_interval_ms, int) or isinstance(sync_interval_ms, bool):
            raise InvalidArgumentError(f"sync_interval_ms must be an integer, got {sync_interval_ms!r}")
        if max_staleness_steps is not None and (not isinstance(max_staleness_steps, int) or
                                                isinstance(max_staleness_steps, bool) or max_staleness_steps < 1):
            raise InvalidArgumentError(
                f"max_staleness_steps must be None or an integer >= 1, got {max_staleness_steps!r}")
        options = core.AsyncModelAverageOptions(peer_selection=core.parse_peer_selection(peer_selection_mode),
                                                sync_interval_ms=sync_interval_ms,
                                                max_staleness_steps=max_staleness_steps)
        group = _group_or_default(group)
        return self.backend_bucket.append_asynchronous_model_average_op(
            group.new_dedicated_communicator(), options)

    def append_powersgd_op(self, matrices, rank: int = 1, low_precision: bool = False,
                           orthogonalization_epsilon: float = 0.0, group=None):
        """PowerSGD's low-rank average of this bucket over the group (the C++
        op of ``include/bagua/ops/powersgd.h``). ``matrices``: one
        ``(index, q, error)`` per bucket tensor sent as factors, the tensor
        seen as ``shape[0]`` rows; ``q`` (columns x ``rank``) and ``error``
        (the tensor's size, or None without error feedback) are tensors of
        the bucket's dtype and device that the op updates in place every
        step, kept alive by the bucket. ``(index, q, error, p_prev, q_prev)``
        (host memory, every matrix or none) defers the error: ``error`` then
        holds M and the error is M - p_prev q_prev^T (``PowerSGDOp``). The other tensors are averaged
        uncompressed. Returns the op, whose ``compressing`` property (off at
        first) switches between plain and low-rank averaging."""
        group = _group_or_default(group)
        entries, deferred = [], []
        for index, q, error, *kept in matrices:
            grad = self.tensors[index].bagua_registered_tensor()
            rows = grad.shape[0] if grad.dim() > 0 else 1
            for what, state in (("q", q), ("error", error)):
                if state is not None and (state.dtype != self.dtype or state.device != self.device):
                    raise InvalidArgumentError(
                        f"append_powersgd_op: {what} of tensor {index} must be {self.dtype} on {self.device}, "
                        f"got {state.dtype} on {state.device}")
            no_error = core.TensorView(0, 0, dtype_name(self.dtype), device_name(self.device))
            entries.append((index, rows, grad.numel() // max(rows, 1), tensor_view(q, "q", allow_cuda=True),
                            no_error if error is None else tensor_view(error, "error", allow_cuda=True)))
            self._keep_alive.extend(s for s in (q, error, *kept) if s is not None)
            if kept:
                deferred.append(tuple(tensor_view(s, name) for s, name in zip(kept, ("p_prev", "q_prev"))))
        if deferred and len(deferred) != len(entries):
            raise InvalidArgumentError("append_powersgd_op: give p_prev and q_prev for every matrix or for none")
        return self.backend_bucket.append_powersgd_op(
            group.get_bucket_communicator(), entries, core.PowerSGDOptions(
                rank=rank, orthogonalization_epsilon=orthogonalization_epsilon, low_precision=low_precision),
            deferred)

    def _check_copy(self, what, tensor):
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != self.dtype or \
                tensor.numel() != self.numel() or tensor.device != self.device:
            raise InvalidArgumentError(
                f"{what} must be a tensor of {self.numel()} {self.dtype} elements on {self.device}, got "
                f"{getattr(tensor, 'dtype', type(tensor).__name__)}{list(getattr(tensor, 'shape', []))}")

    def numel(self) -> int:
        return sum(t.bagua_registered_tensor().numel() for t in self.tensors)

    def append_python_op(self, python_function: Callable[[str], None], group=None) -> "BaguaBucket":
        """Runs ``python_function(bucket_name)`` on the communication thread in
        this bucket's turn. Exceptions it raises fail the iteration. The
        collectives it issues skip the cross-rank size check
        (``communication.calls_known_to_match``): every rank runs the same ops in the
        same bucket order."""
        if not callable(python_function):
            raise InvalidArgumentError("append_python_op: python_function must be callable")

        def run(bucket_name: str) -> None:
            with calls_known_to_match():
                python_function(bucket_name)

        self.backend_bucket.append_python_op(run)
        return self

    def bytes(self) -> int:
        return sum(t.bagua_registered_tensor().numel() for t in self.tensors) * \
            torch.tensor([], dtype=self.dtype).element_size()

    def __repr__(self) -> str:
        return f"BaguaBucket({self.name}, {len(self.tensors)} tensors, {self.dtype}, flatten={self.flatten})"


class ErrorFeedbackOp:
    """A C_LP_S op with error feedback: its residuals, for checkpoints. Use
    them only between steps (no execution pending)."""

    def __init__(self, op, device):
        self._op, self._device = op, device

    def residuals(self) -> List[torch.Tensor]:
        """[worker, server] residuals (float32, empty before the first step)."""
        result = []
        for server in (False, True):
            out = torch.empty(self._op.residual_numel(server), dtype=torch.float32, device=self._device)
            self._op.copy_residual_to(server, tensor_view(out, "residual", allow_cuda=True))
            result.append(out)
        return result

    def load_residuals(self, residuals: List[torch.Tensor]) -> None:
        for server, values in zip((False, True), residuals):
            values = values.to(device=self._device, dtype=torch.float32).contiguous()
            self._op.set_residual(server, tensor_view(values, "residual", allow_cuda=True))


class DecentralizedSynchronousOp:
    """Handle of a D_FP_S op (see append_decentralized_synchronous_op)."""

    def __init__(self, op):
        self._op = op

    def copy_back_peer_weight(self, bucket: "BaguaBucket") -> None:
        """Writes the average computed by the last execution into ``bucket``.
        On a GPU the copy is enqueued on the current stream, after the
        kernels that still read the weights; nobody waits on the host."""
        if bucket.device.type == "cuda":
            stream = torch.cuda.current_stream(bucket.device).cuda_stream
            self._op.copy_back_peer_weight(bucket.backend_bucket, cuda_stream=stream)
        else:
            self._op.copy_back_peer_weight(bucket.backend_bucket)

    @property
    def communication_step(self) -> int:
        """Executions so far (shift_one's partners follow it); settable, to
        resume a count, while no execution is pending."""
        return self._op.communication_step

    @communication_step.setter
    def communication_step(self, step: int) -> None:
        self._op.communication_step = int(step)


class NeighborAllreduceOp:
    """Handle of a bucket's neighbour allreduce (see append_neighbor_allreduce_op)."""

    def __init__(self, op):
        self._op = op

    def set_pattern(self, self_weight: Optional[float], src_weights: Dict[int, float],
                    dst_weights: Dict[int, float], check_pattern: bool = False) -> None:
        """The next executions compute self_weight * x + sum over src_weights
        of w_j * d_j * x_j, where d_j is the weight rank j gives this rank in
        its dst_weights; without a self weight, the uniform average of x and
        the sources' d_j * x_j. Ranks are the group's. ``check_pattern``:
        the ranks first agree that every send has a matching receive (one
        small allgather per execution); without it a mismatch fails within
        the communication timeout."""
        self._op.set_pattern(core.NeighborAllreduceOptions(
            self_weight=None if self_weight is None else float(self_weight),
            sources=[(int(r), float(w)) for r, w in sorted(src_weights.items())],
            destinations=[(int(r), float(w)) for r, w in sorted(dst_weights.items())],
            check_pattern=check_pattern))

    def copy_back_peer_weight(self, bucket: "BaguaBucket") -> None:
        """Writes the result of the last execution into ``bucket``."""
        self._op.copy_back_peer_weight(bucket.backend_bucket)


def _check_compression(compression, allow_none: bool, supported=("MinMaxUInt8",)):
    if compression is None and allow_none:
        return None
    if compression not in supported:
        raise InvalidArgumentError(
            f"unknown compression {compression!r}; supported: " + ", ".join(repr(c) for c in supported)
            + (" or None" if allow_none else ""))
    return compression


def _check_floating(dtype, what):
    if not dtype.is_floating_point:
        raise InvalidArgumentError(f"{what}: MinMaxUInt8 compresses floating point tensors, got {dtype}")


def _group_or_default(group):
    # Inside an engine's bucket building, the engine's own connections.
    return group_for_ops(group)
