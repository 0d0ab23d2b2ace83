"""BaguaStrategy: Lightning's ``Trainer`` training with a bagua algorithm.

What the strategy does, and where Lightning calls it:

- ``setup_distributed`` (every process, after Lightning launched them):
  exports RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and
  MASTER_PORT from Lightning's cluster environment, selects this rank's
  GPU on CUDA, then ``bagua.torch_api.init_process_group()``;
- ``setup`` (when fitting): the optimizers are made, then the
  LightningModule, inside a small module that Lightning's forward
  redirection calls, is wrapped with ``with_bagua(optimizers, algorithm)``;
  the algorithm is built by name, ``Algorithm.init(name, **bagua_kwargs)``
  (QAdam gets the one QAdamOptimizer of ``configure_optimizers``);
- ``on_train_start`` / ``on_train_end``: the asynchronous algorithm's
  ``resume`` and ``abort``; the P-Reduce's ``abort`` (its ranks that finish
  first stay in the groups of the others). Lightning (2.6) begins every
  training step with a broadcast over all ranks (its SIGTERM check), so
  the ranks of these algorithms stay within a step of each other;
- ``reduce``, ``all_gather``, ``broadcast``, ``barrier`` (``self.log(...,
  sync_dist=True)``, ``self.all_gather``, callbacks): bagua's primitives;
- checkpoints: the engine's state (step count, bucket plan, the algorithm's
  own state) of every rank rides in Lightning's checkpoint under
  ``"bagua"``, with each rank's weights and optimizer states where the
  ranks' weights differ (decentralized, asynchronous); a resumed fit loads
  each rank's own.
"""

import io
import os
import warnings
from contextlib import contextmanager, nullcontext
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import torch
from torch import Tensor

try:
    from lightning.fabric.utilities.optimizer import _optimizer_to_device, _optimizers_to_device
    from lightning.fabric.utilities.seed import reset_seed
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn
except ModuleNotFoundError as error:  # pragma: no cover - only without Lightning
    if (error.name or "").split(".")[0] != "lightning":
        raise
    raise ModuleNotFoundError("bagua.lightning needs PyTorch Lightning (2.1 or later): pip install lightning",
                              name="lightning") from error
try:
    # Since Lightning 2.1 a strategy's model is called through this
    # redirection (training_step via the wrapper's forward), which the
    # strategy relies on; Lightning 2.0 called the model's training_step.
    from lightning.pytorch.strategies.strategy import _ForwardRedirection  # noqa: F401
except ImportError as error:  # pragma: no cover - only on Lightning 2.0
    import lightning

    raise ImportError(f"bagua.lightning needs Lightning 2.1 or later, found {lightning.__version__}; on Lightning "
                      "2.0, lightning-bagua 0.1.0's BaguaStrategy runs on this package") from error

import bagua.torch_api as bagua
from bagua.torch_api._core import SUPPORTED_DTYPES, InvalidArgumentError
from bagua.torch_api.algorithms import Algorithm, GlobalAlgorithmRegistry
from bagua.torch_api.algorithms.async_model_average import AsyncModelAverageAlgorithm
from bagua.torch_api.algorithms.partial_allreduce import PartialAllReduceAlgorithm
from bagua.torch_api.algorithms.q_adam import QAdamOptimizer
from bagua.torch_api.communication import broadcast_object
from bagua.torch_api.data_parallel import BaguaModule
from bagua.torch_api.data_parallel.state import broadcast_states
from bagua.torch_api.process_group import _get_default_group

__all__ = ["BaguaStrategy"]


class _TrainingStepModule(torch.nn.Module):
    """What bagua wraps: the LightningModule as its only child.

    Lightning calls ``training_step`` through the strategy's model (its
    forward redirection calls this module, whose forward calls the
    LightningModule, whose forward is patched to the step). The engine's
    forward hooks sit on this module, so they run once per step even when
    ``training_step`` never calls ``self(...)``.
    """

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    # The engine decides from ``training`` whether a forward trains and
    # communicates. Lightning switches modes on the LightningModule (and
    # sometimes on the strategy's model): the wrapper follows its child, so
    # the two can never disagree.
    @property
    def training(self) -> bool:
        module = self.__dict__.get("_modules", {}).get("module")
        return True if module is None else module.training

    @training.setter
    def training(self, mode: bool) -> None:
        pass  # train()/eval() reach the child, which holds the mode


def _reduction(reduce_op) -> Tuple["bagua.ReduceOp", bool]:
    """(bagua's op, whether the sum is then divided by the world size) for
    Lightning's ``reduce_op``: None, a string, or torch's ReduceOp."""
    if reduce_op is None:
        name = "mean"
    elif isinstance(reduce_op, str):
        name = reduce_op.lower()
    else:  # torch.distributed.ReduceOp.SUM and friends (their .name, or "RedOpType.SUM")
        name = str(getattr(reduce_op, "name", reduce_op)).rsplit(".", 1)[-1].lower()
    if name in ("mean", "avg"):
        return bagua.ReduceOp.SUM, True
    ops = {"sum": bagua.ReduceOp.SUM, "max": bagua.ReduceOp.MAX, "min": bagua.ReduceOp.MIN,
           "product": bagua.ReduceOp.PRODUCT}
    if name not in ops:
        raise ValueError(f"BaguaStrategy.reduce: reduce_op {reduce_op!r} is not supported; use 'mean', "
                         "'sum', 'max', 'min' or 'product' (or torch.distributed.ReduceOp's SUM, MAX, MIN, "
                         "PRODUCT, AVG)")
    return ops[name], False


def _communicable(tensor: Tensor) -> Tensor:
    """A contiguous copy bagua can send: bool and the narrow integer types
    travel as int64 (bagua's runtime has no bool or int8/int16 ops); other
    types go as they are (an unsupported one is bagua's clear error)."""
    work = tensor.detach()
    if work.dtype not in SUPPORTED_DTYPES and (work.dtype == torch.bool or not work.is_floating_point()):
        work = work.to(torch.int64)
    return work.clone(memory_format=torch.contiguous_format)


def _to_bytes(obj) -> Tensor:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _gather_to_rank_zero(obj, device: torch.device) -> Optional[list]:
    """Every rank's ``obj`` on rank 0, in rank order (None elsewhere); by
    send/recv, so the other ranks never receive each other's states. The
    bytes travel on ``device``, the rank's training device (NCCL reaches
    only GPU memory; Gloo reaches both)."""
    if bagua.get_rank() != 0:
        data = _to_bytes(obj).to(device)
        bagua.send(torch.tensor([data.numel()], dtype=torch.int64, device=device), 0)
        bagua.send(data, 0)
        return None
    gathered = [obj]
    for src in range(1, bagua.get_world_size()):
        length = torch.zeros(1, dtype=torch.int64, device=device)
        bagua.recv(length, src)
        data = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
        bagua.recv(data, src)
        # our own bytes, just written by a peer: not untrusted input
        buffer = io.BytesIO(data.cpu().numpy().tobytes())
        gathered.append(torch.load(buffer, map_location="cpu", weights_only=False))
    return gathered


class _AllGatherWithGrad(torch.autograd.Function):
    """all_gather whose backward sends each rank the gradient of its own
    slice summed over the ranks (torch.distributed.nn's all_gather)."""

    @staticmethod
    def forward(ctx, tensor):
        return _gathered(tensor)

    @staticmethod
    def backward(ctx, grad):
        summed = _communicable(grad)
        bagua.allreduce_inplace(summed, op=bagua.ReduceOp.SUM)
        return summed[bagua.get_rank()].to(grad.dtype)


def _gathered(tensor: Tensor) -> Tensor:
    send = _communicable(tensor)
    recv = torch.empty((bagua.get_world_size(),) + tuple(send.shape), dtype=send.dtype, device=send.device)
    bagua.allgather(send, recv)
    return recv.to(tensor.dtype)


class BaguaStrategy(DDPStrategy):
    """Trains with a bagua algorithm, chosen by name.

    Args:
        algorithm: a name registered in
            ``bagua.torch_api.algorithms.GlobalAlgorithmRegistry``:
            "gradient_allreduce", "bytegrad", "decentralized",
            "low_precision_decentralized", "qadam", "async", "powersgd",
            "partial_allreduce", "auto", or one you registered.
        flatten: bagua's ``do_flatten``: each bucket's tensors in one
            contiguous buffer.
        bagua_kwargs: the algorithm's arguments, passed to
            ``Algorithm.init(algorithm, **bagua_kwargs)`` (e.g.
            ``hierarchical=False``). For "qadam", ``configure_optimizers``
            must return exactly one optimizer, a ``QAdamOptimizer``, which
            the strategy passes as ``q_adam_optimizer``. For
            "partial_allreduce" the generator is the static schedule (the
            timing-based ones could hang under Lightning: see
            ``_static_p_reduce``).

    Processes are started as for Lightning's DDP: by Lightning itself
    (``python train.py`` with ``devices=N``), or by a launcher
    (``python -m bagua.distributed.launch``, ``torchrun``, SLURM).
    """

    strategy_name = "bagua"

    def __init__(self, algorithm: str = "gradient_allreduce", flatten: bool = True,
                 accelerator=None, parallel_devices: Optional[List[torch.device]] = None,
                 cluster_environment=None, checkpoint_io=None, precision_plugin=None,
                 **bagua_kwargs: Any):
        if not isinstance(algorithm, str):
            raise TypeError(f"BaguaStrategy: algorithm must be a registered name (a str), got "
                            f"{type(algorithm).__name__}; pass the algorithm's arguments as keywords: "
                            f"BaguaStrategy('decentralized', hierarchical=False). {GlobalAlgorithmRegistry}")
        if not isinstance(flatten, bool):
            raise TypeError(f"BaguaStrategy: flatten must be a bool, got {flatten!r}")
        if algorithm == "qadam" and "q_adam_optimizer" in bagua_kwargs:
            raise ValueError("BaguaStrategy('qadam'): do not pass q_adam_optimizer; the strategy takes the "
                             "QAdamOptimizer that configure_optimizers returns")
        if algorithm == "partial_allreduce":
            bagua_kwargs = _static_p_reduce(bagua_kwargs)
        # Bad names and arguments fail here, before any process is launched
        # (QAdam's need its optimizer: they are checked at setup).
        GlobalAlgorithmRegistry.get(algorithm)
        if algorithm != "qadam":
            Algorithm.init(algorithm, **bagua_kwargs)
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self._bagua_algorithm_name = algorithm
        self._bagua_flatten = flatten
        self._bagua_kwargs = bagua_kwargs
        self._bagua_algorithm: Optional[Algorithm] = None  # the one wrapping the model now
        # whether the last fit's algorithm kept one model for all ranks (None: no fit yet)
        self._ranks_share_weights: Optional[bool] = None

    # -- processes ----------------------------------------------------------------
    def setup_distributed(self) -> None:
        reset_seed()
        self.set_world_ranks()
        self._export_launch_environment()
        if self.root_device.type == "cuda":
            # bagua's communicator and kernels use the current device: this rank's (LOCAL_RANK's)
            torch.cuda.set_device(self.root_device)
        if not bagua.is_initialized():
            bagua.init_process_group()
        elif (bagua.get_rank(), bagua.get_world_size()) != (self.global_rank, self.world_size):
            raise RuntimeError(
                f"BaguaStrategy: bagua's process group is rank {bagua.get_rank()} of {bagua.get_world_size()}, "
                f"this Trainer wants rank {self.global_rank} of {self.world_size}; a process joins one group")

    def _export_launch_environment(self) -> None:
        """What ``bagua.torch_api.init_process_group`` reads, from Lightning's
        cluster environment (Lightning's own launcher sets only some of it)."""
        environment = self.cluster_environment
        os.environ.update({
            "MASTER_ADDR": environment.main_address, "MASTER_PORT": str(environment.main_port),
            "RANK": str(self.global_rank), "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank), "LOCAL_WORLD_SIZE": str(self.num_processes),
            "NODE_RANK": str(self.node_rank)})

    # -- the model ------------------------------------------------------------------
    def setup(self, trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
            self._wrap_model()
        elif self._ranks_share_weights is not False:
            # As DDP: evaluating, every rank holds rank 0's model; not after a
            # fit whose ranks each kept their own (decentralized, asynchronous).
            broadcast_states(self.model, [], _get_default_group())

    def _wrap_model(self) -> None:
        self._bagua_algorithm = self._build_algorithm()
        wrapper = _TrainingStepModule(self.model)
        self.model = wrapper.with_bagua(self.optimizers, self._bagua_algorithm, do_flatten=self._bagua_flatten)
        self._ranks_share_weights = self._engine().bagua_algorithm_impl.ranks_share_weights()

    def _build_algorithm(self) -> Algorithm:
        if self._bagua_algorithm_name != "qadam":
            return Algorithm.init(self._bagua_algorithm_name, **self._bagua_kwargs)
        optimizers = self.optimizers
        if len(optimizers) != 1 or not isinstance(optimizers[0], QAdamOptimizer):
            found = ", ".join(type(o).__name__ for o in optimizers) or "none"
            raise InvalidArgumentError(
                "BaguaStrategy('qadam') needs configure_optimizers to return exactly one optimizer, a "
                f"bagua.torch_api.algorithms.q_adam.QAdamOptimizer; it returned {len(optimizers)}: {found}")
        return Algorithm.init("qadam", q_adam_optimizer=optimizers[0], **self._bagua_kwargs)

    def _engine(self):
        """The engine of the wrapped model (``model.bagua_ddp``), or None
        outside a fit."""
        return getattr(self.model, "bagua_ddp", None) if isinstance(self.model, BaguaModule) else None

    def _weights_held(self):
        """No background work (asynchronous model average) writes the
        weights inside: what is saved or loaded is one step's."""
        engine = self._engine()
        return engine.bagua_algorithm_impl.hold_weights(engine) if engine is not None else nullcontext()

    @contextmanager
    def block_backward_sync(self):
        # Gradient accumulation: the micro-batches before the last one
        # communicate nothing (bagua's no_sync, as DDP's).
        if isinstance(self.model, BaguaModule):
            with self.model.no_sync():
                yield None
        else:
            yield None

    def on_train_start(self) -> None:
        super().on_train_start()
        if isinstance(self._bagua_algorithm, AsyncModelAverageAlgorithm):
            self._bagua_algorithm.resume(self.model)

    def on_train_end(self) -> None:
        # The asynchronous rounds stop; a P-Reduce rank that finished keeps
        # serving the others' groups until every rank has (docs/ripples.md).
        if isinstance(self._bagua_algorithm, (AsyncModelAverageAlgorithm, PartialAllReduceAlgorithm)):
            self._bagua_algorithm.abort(self.model)
        super().on_train_end()

    def teardown(self) -> None:
        # Unwrapped (hooks removed, background threads stopped) after every
        # fit, also one ended by an exception: a later fit wraps anew.
        if isinstance(self.model, BaguaModule):
            self.model.without_bagua()
            self.model = self.lightning_module
        self._bagua_algorithm = None
        super().teardown()

    # -- collectives (self.log(sync_dist=True), self.all_gather, callbacks) -----------------
    def barrier(self, name: Optional[str] = None) -> None:
        if bagua.is_initialized():
            bagua.barrier()

    def broadcast(self, obj, src: int = 0):
        if not bagua.is_initialized():
            return obj
        return broadcast_object(obj, src)

    def reduce(self, tensor, group: Optional[Any] = None, reduce_op: Optional[Union[str, Any]] = "mean"):
        """``tensor`` reduced over the ranks, as a new tensor of its dtype
        ("mean": the sum divided by the world size, as Lightning's DDP
        does). Anything but a tensor is returned unchanged."""
        if not isinstance(tensor, Tensor):
            return tensor
        _check_no_group(group, "reduce")
        op, divide = _reduction(reduce_op)
        if not bagua.is_initialized():
            return tensor
        work = _communicable(tensor)
        bagua.allreduce_inplace(work, op=op)
        if divide:
            world = bagua.get_world_size()
            work = work / world if work.is_floating_point() else torch.div(work, world, rounding_mode="trunc")
        return work.to(tensor.dtype)

    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        """Every rank's ``tensor``, stacked: shape (world size, *tensor.shape).
        With ``sync_grads`` the gradient flows back to each rank's input."""
        _check_no_group(group, "all_gather")
        if not bagua.is_initialized():
            return tensor
        if sync_grads:
            return _AllGatherWithGrad.apply(tensor)
        with torch.no_grad():
            return _gathered(tensor)

    # -- checkpoints ------------------------------------------------------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # Weights, optimizer states and the engine's state are loaded into the
        # wrapped model: wrapping broadcasts rank 0's states, which would
        # overwrite each rank's own (decentralized, asynchronous).
        return True

    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath, storage_options: Optional[Any] = None) -> None:
        """Collective (every rank calls it, as Lightning's ``save_checkpoint``):
        rank 0 writes Lightning's checkpoint plus, under ``"bagua"``, every
        rank's engine state and, where ranks' weights differ, their own
        weights and optimizer states."""
        with self._weights_held():  # until written, not only referenced
            engine = self._engine()
            if engine is not None:
                training = "optimizer_states" in checkpoint  # False for save_checkpoint(weights_only=True)
                ranks = _gather_to_rank_zero(self._rank_state(engine, training), self.root_device)
                if self.is_global_zero:
                    checkpoint = {**checkpoint, "bagua": {"world_size": self.world_size, "ranks": ranks}}
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def _rank_state(self, engine, training: bool) -> dict:
        state = {"engine": engine.state_dict()} if training else {}
        rank_local = any(getattr(p, "allreduce", True) is False for p in self.lightning_module.parameters())
        if self.global_rank != 0 and (rank_local or not engine.bagua_algorithm_impl.ranks_share_weights()):
            state["state_dict"] = self.lightning_module.state_dict()
            if training:
                state["optimizer_states"] = [optimizer.state_dict() for optimizer in self.optimizers]
        return state

    def _own_state(self, checkpoint: Mapping[str, Any]) -> dict:
        """This rank's entry of the checkpoint's ``"bagua"`` state ({} for a
        checkpoint without one, or of another world size: rank 0's weights,
        and the algorithm's state starts afresh)."""
        saved = checkpoint.get("bagua")
        if saved is None:
            return {}
        if saved["world_size"] != self.world_size:
            rank_zero_warn(f"BaguaStrategy: the checkpoint was saved by {saved['world_size']} ranks, this run "
                           f"has {self.world_size}: every rank loads rank 0's weights and the algorithm's "
                           "state starts afresh")
            return {}
        return saved["ranks"][self.global_rank]

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        state = self._own_state(checkpoint).get("state_dict", checkpoint["state_dict"])
        with self._weights_held():
            self.lightning_module.load_state_dict(state, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        own = self._own_state(checkpoint)
        with self._weights_held():
            for optimizer, state in zip(self.optimizers, own.get("optimizer_states",
                                                                  checkpoint["optimizer_states"])):
                optimizer.load_state_dict(state)
                _optimizer_to_device(optimizer, self.root_device)
        engine = self._engine()
        if engine is None:
            return
        if "engine" in own:  # after the optimizers: the engine rebuilds over their new tensors
            engine.load_state_dict(own["engine"])
        else:
            engine.request_rebuild()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        previous = dict.get(strategy_registry, cls.strategy_name)  # the registry's own get() builds one
        if previous is not None and previous["strategy"] is not cls:
            warnings.warn(f"Lightning's strategy '{cls.strategy_name}' was {previous['strategy'].__module__}."
                          f"{previous['strategy'].__name__} (lightning_bagua?); bagua.lightning replaces it")
        strategy_registry.register(cls.strategy_name, cls, description="bagua's algorithms (gradient_allreduce "
                                   "by default): bagua.lightning.BaguaStrategy", override=True)


def _static_p_reduce(bagua_kwargs: dict) -> dict:
    """The P-Reduce's arguments under Lightning: the static schedule.

    Lightning starts every training step with a collective over all ranks
    (its SIGTERM check, a torch.distributed broadcast, whenever
    torch.distributed is initialized, which bagua's init_process_group
    does), and ``self.log(..., sync_dist=True)`` in ``training_step`` adds
    another. The "smart" and "random" generators pair ranks by timing,
    across steps: a rank may wait for its group with a peer that waits in
    that collective for it, and both hang until BAGUA_COMM_TIMEOUT_S. The
    static schedule pairs ranks by step, so it cannot.
    """
    generator = bagua_kwargs.get("group_generator", "static")
    if generator in ("smart", "random"):
        raise ValueError(
            f"BaguaStrategy('partial_allreduce', group_generator={generator!r}): the {generator!r} generator "
            "pairs ranks by timing, across steps, and Lightning synchronizes all ranks at every training step "
            "(its SIGTERM check broadcasts; sync_dist logging too): a rank can wait for a group whose peer "
            "waits for it in that collective. Use group_generator='static' (the default here)")
    return {**bagua_kwargs, "group_generator": generator}


def _check_no_group(group, what: str) -> None:
    if group is not None:
        raise ValueError(f"BaguaStrategy.{what}: a process group other than the world is not supported "
                         f"(got {group!r}); leave group=None")


# Lightning 2.x finds third-party strategies only in its registry: importing
# bagua.lightning registers "bagua".
BaguaStrategy.register_strategies(StrategyRegistry)
