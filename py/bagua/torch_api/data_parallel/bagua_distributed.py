"""BaguaDistributedDataParallel: the engine behind a wrapped module
(``model.bagua_ddp``), Bagua's name for it.

It owns the C++ backend (the ordered buckets and the communication thread),
the algorithm's implementation, the buckets and the hooks; what each step
does is told in :mod:`.hooks`, how buckets are planned in :mod:`.planning`,
the initial broadcast in :mod:`.state`.
"""

import contextlib
import itertools
import json
from typing import Dict, List, Optional

import torch

from bagua.torch_api import _exit
from bagua.torch_api import autotune as autotune_module
from bagua.torch_api import timeline
from bagua.torch_api._core import InvalidArgumentError, core, log
from bagua.torch_api.data_parallel import planning, replicas, sparse
from bagua.torch_api.data_parallel.buffers import BufferSync
from bagua.torch_api.data_parallel.hooks import StepHooks
from bagua.torch_api.data_parallel.state import broadcast_states, check_same_model, check_trainable
from bagua.torch_api.process_group import BaguaProcessGroup, _get_default_group, building_ops_for
from bagua.torch_api.tensor import BaguaTensor

__all__ = ["BaguaDistributedDataParallel"]

_module_ids = itertools.count()


def _checked_optimizers(algorithm, optimizers, do_flatten, overlap, autotune, broadcast_buffers=True) -> list:
    """with_bagua's arguments checked before anything communicates; returns
    the optimizers as a list."""
    from bagua.torch_api.algorithms.base import Algorithm  # the algorithm interface (a lower layer)

    if not isinstance(algorithm, Algorithm):
        raise InvalidArgumentError(
            f"with_bagua: algorithm must be a bagua Algorithm, got {type(algorithm).__name__}")
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = [optimizers]
    if not isinstance(optimizers, (list, tuple)) or not all(
            isinstance(o, torch.optim.Optimizer) for o in optimizers):
        raise InvalidArgumentError("with_bagua: optimizers must be a list of torch.optim.Optimizer")
    for name, value in (("do_flatten", do_flatten), ("overlap", overlap), ("broadcast_buffers", broadcast_buffers)):
        if not isinstance(value, bool):
            raise InvalidArgumentError(f"with_bagua: {name} must be a bool, got {value!r}")
    if autotune is not None and not isinstance(autotune, bool):
        raise InvalidArgumentError(f"with_bagua: autotune must be a bool or None, got {autotune!r}")
    return list(optimizers)


def _uncompiled_name(name: str) -> str:
    """A parameter's name without torch.compile's ``_orig_mod.`` prefixes, so
    a compiled module's tensors are named (in buckets, checkpoints, seeds)
    as the module's own."""
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


_UNEVEN_INPUTS_HINT = (
    "A peer may have run out of data: with inputs of different lengths per rank, train inside "
    "`with model.join():` (bagua.torch_api.join([model_a, model_b]) for several models), as with DDP")


def _peer_may_have_run_out(error: Exception) -> bool:
    """A timeout, or a peer that exited: what a rank with fewer batches causes."""
    return isinstance(error, core.CommTimeoutError) or "exited" in str(error)


class BaguaDistributedDataParallel:
    """The engine behind a wrapped module (``model.bagua_ddp``)."""

    #: False inside ``module.no_sync()``: training forwards then communicate
    #: nothing and their backward leaves the gradients local (Bagua's name).
    require_backward_grad_sync = True
    #: the open ``join()`` context's protocol state (data_parallel.join), else None
    join_state = None

    def __init__(self, module: torch.nn.Module, optimizers, algorithm, process_group, do_flatten: bool,
                 overlap: bool = True, autotune: Optional[bool] = None, broadcast_buffers: bool = True,
                 check_replicas_every: Optional[int] = None):
        self.optimizers = _checked_optimizers(algorithm, optimizers, do_flatten, overlap, autotune,
                                              broadcast_buffers)
        replica_check_every = replicas.resolve_every(check_replicas_every)
        self.overlap = overlap
        self.module = module
        # Embeddings with sparse gradients stay out of the buckets (.sparse).
        self.sparse_parameters = sparse.sparse_gradient_parameters(module)
        self._sparse_ids = {id(p) for _, p in self.sparse_parameters}
        self.bagua_algorithm = algorithm
        self.process_group: BaguaProcessGroup = process_group or _get_default_group()
        self.do_flatten = do_flatten
        self.bagua_module_name = f"{type(module).__name__}_{next(_module_ids)}"
        self.bucket_bytes = core.env().default_bucket_size
        if not self.process_group.is_member():
            self.engine_group = self.process_group
            self.buffer_sync = BufferSync(module, self.process_group, broadcast_buffers)
            self._init_outside_the_group()
            return
        # What this engine communicates goes over connections of its own
        # (see EngineGroup): other wrapped modules' never interleave with it.
        self.engine_group: BaguaProcessGroup = self.process_group.engine_group()
        self.buffer_sync = BufferSync(module, self.engine_group, broadcast_buffers)
        check_same_model(self.module, self.engine_group)
        check_trainable(self.module)
        broadcast_states(self.module, self.optimizers, self.engine_group)
        self.bagua_algorithm_impl = algorithm.reify(self.engine_group)
        self.sparse_gradients = self._sparse_gradients()
        self.replica_check = replicas.ReplicaCheck(self, replica_check_every)
        self._timeline = timeline.get(self.process_group.get_rank())
        # BAGUA_COMM_TIMEOUT_S is applied by the runtime.
        self._bagua_backend = core.Backend(self.process_group.get_rank(), timeline=self._timeline)
        self.bagua_buckets = []
        self.bagua_tensors: List[BaguaTensor] = []
        self._tensors_by_name: Dict[str, BaguaTensor] = {}
        self._profiled = False
        self._pending_order: Optional[List[str]] = None
        self._pending_residuals: dict = {}  # from a checkpoint, for the next rebuild
        self.step_counter = 0
        self.autotuner = None
        self._reset_algorithm_buckets(self._initial_order(autotune))
        self._hooks = StepHooks(self, self._timeline)
        _exit.track_engine(self)

    def _sparse_gradients(self) -> Optional[sparse.SparseGradients]:
        """What reduces the sparse embeddings' gradients, where there are any."""
        if not self.sparse_parameters:
            return None
        impl = self.bagua_algorithm_impl
        if not impl.reduces_sparse_gradients():
            name = self.sparse_parameters[0][0]
            raise InvalidArgumentError(
                f"with_bagua: parameter '{name}' gets sparse gradients (an Embedding or EmbeddingBag with "
                f"sparse=True), which {type(impl).__name__} cannot communicate; use GradientAllReduce, "
                "which reduces them as DDP does (indices and values), or sparse=False")
        return sparse.SparseGradients(self.sparse_parameters, self.engine_group,
                                      average=getattr(impl, "average", True))

    def reduce_sparse_gradients(self) -> None:
        """After the buckets' ops of a step (collective)."""
        if self.sparse_gradients is not None:
            self.sparse_gradients.reduce()

    def _init_outside_the_group(self) -> None:
        """This rank is not in the process group: as in Bagua, the module
        trains here without communicating (the group's collectives do
        nothing on a rank outside it). No buckets, no hooks; the algorithm's
        ``abort``/``resume`` find nothing to stop or start."""
        self.bagua_algorithm_impl = self.bagua_algorithm.reify(self.process_group)
        self.sparse_gradients = None
        self._bagua_backend = None
        self.bagua_buckets, self.bagua_tensors, self._tensors_by_name = [], [], {}
        self._profiled, self._pending_order, self._pending_residuals = False, None, {}
        self.step_counter, self.autotuner, self._hooks = 0, None, None

    def _initial_order(self, autotune: Optional[bool]) -> Optional[List[str]]:
        """A saved plan (BAGUA_AUTOTUNE_PLAN) gives the bucket size and order;
        otherwise the autotuner starts, if enabled, and the order is the
        algorithm's until the first iteration has been profiled."""
        plan_path = core.env().autotune_plan
        if plan_path:
            plan = autotune_module.load_plan(plan_path)
            self.bucket_bytes = plan["bucket_bytes"]
            self._profiled = True  # the saved plan carries the order
            return plan.get("order")
        if autotune_module.enabled(autotune):
            self.autotuner = autotune_module.Autotuner(self, self.bucket_bytes)
        return None

    # -- parameters and tensors ---------------------------------------------
    def bagua_build_params(self):
        """(name, parameter) pairs to train, in module order, shared ones once.
        Parameters marked ``allreduce = False`` (the experts of a mixture of
        experts, bagua.torch_api.moe) belong to their rank and are left out,
        and so are those with sparse gradients (``sparse_parameters``)."""
        seen = set()
        params = []
        for name, param in self.module.named_parameters():
            if param.requires_grad and id(param) not in seen and getattr(param, "allreduce", True) is not False \
                    and id(param) not in self._sparse_ids:
                seen.add(id(param))
                params.append((_uncompiled_name(name), param))
        return params

    def bagua_tensor_by_name(self, name: str) -> Optional[BaguaTensor]:
        """The communicated tensor called ``name`` (for a gradient: the
        parameter's name), or None when the algorithm does not communicate it."""
        return self._tensors_by_name.get(name)

    # -- buckets --------------------------------------------------------------
    def _reset_algorithm_buckets(self, order: Optional[List[str]] = None) -> None:
        """Asks the algorithm for its tensors, plans them into buckets (in
        ``order`` when given), lets the algorithm add its ops, and registers
        the buckets with the backend, after checking all ranks agree."""
        impl = self.bagua_algorithm_impl
        self.bagua_tensors = impl.init_tensors(self)
        self._tensors_by_name = planning.index_by_name(self.bagua_tensors, type(impl).__name__)
        ordered = planning.in_order(self.bagua_tensors, order)
        with building_ops_for(self.engine_group):
            self.bagua_buckets = planning.plan_buckets(impl, ordered, self.bucket_bytes, self.do_flatten)
            for bucket in self.bagua_buckets:
                impl.init_operations(self, bucket)
        self._restore_residuals()
        for tensor in self.bagua_tensors:
            tensor._bagua_attach_backend(self._bagua_backend)
        planning.verify_same_buckets(self.bagua_buckets, self.engine_group)
        self._bagua_backend.register_ordered_buckets([b.backend_bucket for b in self.bagua_buckets])
        if self.process_group.get_rank() == 0:
            log("info", f"{self.bagua_module_name}: {len(self.bagua_buckets)} buckets "
                        f"({', '.join(str(len(b.tensors)) for b in self.bagua_buckets)} tensors), "
                        f"target {self.bucket_bytes} bytes, flatten={self.do_flatten}")

    # -- called by the hooks ---------------------------------------------------
    def _prepare_step(self) -> None:
        """Before a training forward: rebuild what the algorithm (need_reset)
        or the profile asks for, apply the autotuner's plan, count the step."""
        # A phase change of the algorithm (need_reset), a profiled plan or a
        # loaded checkpoint: rebuild in the pending order, else the current one.
        if self.bagua_algorithm_impl.need_reset() or self._pending_order is not None:
            order, self._pending_order = self._pending_order, None
            self._reset_algorithm_buckets(order or planning.bucket_order(self.bagua_buckets))
            self._hooks.bind_algorithm()
        if self.autotuner is not None:
            proposal = self.autotuner.step_begin(self.step_counter + 1)
            if proposal is not None:
                if proposal != self.bucket_bytes:
                    self.bucket_bytes = proposal
                    self._reset_algorithm_buckets(planning.bucket_order(self.bagua_buckets))
                self.autotuner.window_starts(self.step_counter + 1)
        self.replica_check.after_step(self.step_counter)
        self.step_counter += 1

    def _backward_finished(self) -> None:
        """After the first backward: plan buckets by rank 0's ready order
        (applied before the next forward)."""
        if not self._profiled:
            self._profiled = True
            self._pending_order = planning.profiled_order(
                self._bagua_backend.last_ready_order(), self.bagua_tensors, self.bagua_buckets,
                self.engine_group)

    # -- for algorithms ----------------------------------------------------------
    def mark_unready_tensors(self) -> None:
        """Marks, in bucket order, every tensor not marked this iteration (e.g.
        parameters that took no part in the loss), so every rank runs every
        bucket. A missing gradient is communicated as zeros."""
        for name in self._bagua_backend.unready_tensor_names():
            self._tensors_by_name[name].bagua_mark_communication_ready()

    def wait_pending_comm_ops(self) -> None:
        self._bagua_backend.wait_pending_comm_ops()

    @contextlib.contextmanager
    def uneven_inputs_hint(self):
        """Around a step's communication (the hooks): a timeout, or a peer
        gone, outside ``join()`` says that a rank may have run out of data."""
        try:
            yield
        except (core.CommTimeoutError, core.BackendError) as error:
            if self.join_state is not None or not _peer_may_have_run_out(error) or \
                    _UNEVEN_INPUTS_HINT in str(error):
                raise
            raise type(error)(f"{error}. {_UNEVEN_INPUTS_HINT}") from None

    def communication_stats(self) -> dict:
        """Per bucket: tensors, bytes, and per op its executions, bytes sent
        and seconds spent on the communication thread since the buckets were
        last built; under ``algorithm_ops`` the same figures for what the
        algorithm communicates outside the buckets (e.g. P-Reduce)."""
        stats = json.loads(self._bagua_backend.stats_json())
        stats["algorithm_ops"] = self.bagua_algorithm_impl.communication_stats()
        return stats

    # -- checkpoints --------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's engine state for a checkpoint: the step count, the
        bucket plan (size and tensor order, once profiled) and the
        algorithm's own state (``AlgorithmImpl.state_dict``). Call it between
        steps, when no communication is pending."""
        order = self._pending_order
        if order is None and self._profiled:
            order = planning.bucket_order(self.bagua_buckets)
        impl = self.bagua_algorithm_impl
        residuals = {b.name: {"layout": planning.bucket_layout(b),
                              "residuals": [op.residuals() for op in b.error_feedback_ops]}
                     for b in self.bagua_buckets if b.error_feedback_ops}
        return {"algorithm": type(impl).__name__, "step_counter": self.step_counter,
                "bucket_bytes": self.bucket_bytes, "order": order,
                "algorithm_state": impl.state_dict(self), "error_feedback": residuals}

    def load_state_dict(self, state: dict) -> None:
        """Restores ``state_dict()``'s result, after the module's and the
        optimizers' states were loaded. The buckets are rebuilt before the
        next forward (in the saved plan), so the algorithm re-reads tensors
        the optimizers' loading replaced."""
        self.step_counter = int(state["step_counter"])
        self.bucket_bytes = int(state["bucket_bytes"])
        if state["order"] is not None:
            self._profiled = True  # the plan is the one the saved run profiled
            self._pending_order = state["order"]
        self.request_rebuild()
        impl = self.bagua_algorithm_impl
        if state["algorithm"] == type(impl).__name__:
            impl.load_state_dict(self, state["algorithm_state"])
            self._pending_residuals = state.get("error_feedback", {})
        else:
            log("warn", f"{self.bagua_module_name}: the checkpoint was saved with {state['algorithm']}, "
                        f"this module runs {type(impl).__name__}: the algorithm's own state starts afresh")

    def _restore_residuals(self) -> None:
        """Error feedback's residuals from a loaded checkpoint, into the ops
        of the buckets just built, where the bucket is the saved one."""
        pending, self._pending_residuals = self._pending_residuals, {}
        for bucket in self.bagua_buckets:
            saved = pending.pop(bucket.name, None)
            if saved is None:
                continue
            if saved["layout"] != planning.bucket_layout(bucket) or \
                    len(saved["residuals"]) != len(bucket.error_feedback_ops):
                log("warn", f"{self.bagua_module_name}: bucket {bucket.name} differs from the "
                            "checkpoint's: its error-feedback residuals restart at zero")
                continue
            for op, residuals in zip(bucket.error_feedback_ops, saved["residuals"]):
                op.load_residuals(residuals)
        if pending:
            log("warn", f"{self.bagua_module_name}: error-feedback residuals of buckets "
                        f"{sorted(pending)} have no bucket to go to: they restart at zero")

    def request_rebuild(self) -> None:
        """Rebuilds the buckets before the next forward: the tensors the
        algorithm communicates may have been replaced (an optimizer's state
        loaded from a checkpoint holds new momentum tensors)."""
        if self._pending_order is None:
            self._pending_order = planning.bucket_order(self.bagua_buckets)

    # -- teardown ---------------------------------------------------------------
    def remove(self) -> None:
        """Undoes the wrapping (``without_bagua``, switching algorithm, exit):
        removes the hooks and restores the optimizers' ``step``, stops the
        algorithm's background work (``AlgorithmImpl.shutdown``), detaches the
        tensors from the backend, and drops the backend (its communication
        thread is joined with the last reference). Idempotent."""
        if self._bagua_backend is None:
            return
        self._hooks.remove()
        try:
            self.bagua_algorithm_impl.shutdown(self)
        finally:
            for tensor in self.bagua_tensors:
                tensor._bagua_attach_backend(None)
            self._bagua_backend = None  # its communication thread is joined here
            if self.engine_group is not self.process_group:
                self.process_group.release_engine_group(self.engine_group)
