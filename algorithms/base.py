"""The algorithm interface: how an algorithm tells the runtime what to
communicate, how, and when.

An :class:`Algorithm` holds the user's arguments (validated when constructed);
``reify(process_group)`` makes the :class:`AlgorithmImpl` that the runtime
calls. Each hook has a default that suits gradient-based algorithms, so an
algorithm overrides only what differs. See docs/writing_an_algorithm.md.

The helpers below are what several built-in algorithms share: argument
checks with one wording, the communication interval, the tensors of a
weight-based algorithm, and a hook that does nothing. They use only bagua's
public API, as every algorithm here does.
"""

import contextlib
from typing import Callable, ContextManager, List, Sequence, Tuple

import torch

from bagua.torch_api._core import InvalidArgumentError
from bagua.torch_api.algorithms.registry import GlobalAlgorithmRegistry
from bagua.torch_api.bucket import BaguaBucket
from bagua.torch_api.tensor import BaguaTensor

__all__ = ["Algorithm", "AlgorithmImpl", "GlobalAlgorithmRegistry"]


# -- argument checks (in Algorithm constructors, before training starts) ---
class ArgumentChecks:
    """The argument checks of one algorithm, with one wording: each raises
    InvalidArgumentError with a message that begins with ``owner`` (the
    algorithm's class name, or e.g. ``"PartialAllReduceAlgorithm.abort"``)."""

    def __init__(self, owner: str):
        self.owner = owner

    def flags(self, **flags) -> None:
        """Every flag is True or False."""
        for name, value in flags.items():
            if not isinstance(value, bool):
                raise InvalidArgumentError(f"{self.owner}: {name} must be True or False, got {value!r}")

    def integer(self, name: str, value, minimum: int, why: str = "") -> None:
        """``value`` is an int >= ``minimum`` (bools are not integers here);
        ``why`` is appended to the message."""
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise InvalidArgumentError(
                f"{self.owner}: {name} must be an integer >= {minimum}, got {value!r}{why}")

    def choice(self, name: str, value, choices: Sequence[str]) -> None:
        """``value`` is one of ``choices``."""
        if value not in choices:
            raise InvalidArgumentError(
                f"{self.owner}: {name} must be one of {', '.join(repr(c) for c in choices)}, got {value!r}")


# -- shared pieces of the implementations -----------------------------------
def is_communication_step(bagua_ddp, communication_interval: int) -> bool:
    """Whether this step communicates, with ``communication_interval`` k:
    steps 1, 1 + k, 1 + 2k, ... (steps counted from 1 by the runtime)."""
    return (bagua_ddp.step_counter - 1) % communication_interval == 0


def parameter_tensors(bagua_ddp, getter_closure: Callable, setter_closure: Callable) -> List[BaguaTensor]:
    """A BaguaTensor per trainable parameter, in reverse parameter order (the
    order gradients usually become ready), reaching what the closures say."""
    return [param.ensure_bagua_tensor(name, bagua_ddp.bagua_module_name, getter_closure=getter_closure,
                                      setter_closure=setter_closure)
            for name, param in reversed(bagua_ddp.bagua_build_params())]


def weight_tensors(bagua_ddp) -> List[BaguaTensor]:
    """Each trainable parameter's weights (``param.data``) as a BaguaTensor."""
    return parameter_tensors(bagua_ddp, lambda p: p.data, lambda p, t: setattr(p, "data", t))


def do_nothing(*args) -> None:
    """A hook for the runtime that does nothing (e.g. the backward hook of an
    algorithm that communicates weights, not gradients)."""


# -- the interface ------------------------------------------------------------
class Algorithm:
    """User-facing algorithm: arguments only. Subclasses implement ``reify``,
    or name their ``impl_class`` and keep their checked arguments with
    :meth:`keep_settings`, which the default ``reify`` passes on."""

    #: The AlgorithmImpl the default ``reify`` builds.
    impl_class = None

    def keep_settings(self, **settings) -> None:
        """Keeps the constructor's checked ``settings`` as attributes (users
        read them, e.g. ``algorithm.hierarchical``); ``reify`` passes them by
        keyword, as they are then, to ``impl_class(process_group, ...)``."""
        self._setting_names = tuple(settings)
        for name, value in settings.items():
            setattr(self, name, value)

    def reify(self, process_group) -> "AlgorithmImpl":
        if type(self).impl_class is None or not hasattr(self, "_setting_names"):
            raise NotImplementedError(
                f"{type(self).__name__} must implement reify(process_group), or set impl_class and "
                "call keep_settings")
        return type(self).impl_class(process_group,
                                     **{name: getattr(self, name) for name in self._setting_names})

    @classmethod
    def init(cls, *args, **kwargs) -> "Algorithm":
        """Builds an algorithm, as Bagua's ``Algorithm.init``:

        - ``Algorithm.init("bytegrad", hierarchical=False)``: the algorithm
          registered under that name (``GlobalAlgorithmRegistry``), built
          with the keyword arguments; an unknown name raises KeyError listing
          the registered ones;
        - ``ByteGradAlgorithm.init(hierarchical=False)``: the class's own
          constructor (the older spelling, kept for old scripts).
        """
        if args and isinstance(args[0], str):
            name, rest = args[0], args[1:]
            if rest:
                raise TypeError(f"Algorithm.init({name!r}, ...): pass the algorithm's arguments by keyword, "
                                f"got {len(rest)} positional")
            return GlobalAlgorithmRegistry.get(name)(**kwargs)
        if cls is Algorithm:
            raise TypeError("Algorithm.init(name, **kwargs) needs the name of a registered algorithm; "
                            f"{GlobalAlgorithmRegistry}")
        return cls(*args, **kwargs)


class AlgorithmImpl:
    """The runtime-facing side of an algorithm, bound to a process group."""

    def __init__(self, process_group):
        self.process_group = process_group

    def need_reset(self) -> bool:
        """Checked before each forward: True rebuilds tensors, buckets and ops
        (for algorithms that change phase, e.g. after warmup)."""
        return False

    def init_tensors(self, bagua_ddp) -> List[BaguaTensor]:
        """The tensors to communicate, in the order gradients usually become
        ready (reverse parameter order). Default: every parameter's gradient."""
        for _, param in bagua_ddp.bagua_build_params():
            param.bagua_ensure_grad()
        return parameter_tensors(bagua_ddp, lambda p: p.grad, lambda p, t: setattr(p, "grad", t))

    def tensors_to_buckets(self, tensors: List[List[BaguaTensor]], do_flatten: bool) -> List[BaguaBucket]:
        """Turns the planner's grouping into buckets."""
        return [BaguaBucket(group, flatten=do_flatten, name=f"bucket{index}")
                for index, group in enumerate(tensors)]

    def init_operations(self, bagua_ddp, bucket: BaguaBucket) -> None:
        """Appends this algorithm's ops to ``bucket``."""
        bucket.clear_ops()

    def init_forward_pre_hook(self, bagua_ddp) -> Callable:
        """Called before each training forward with the forward's inputs."""
        return do_nothing

    def init_backward_hook(self, bagua_ddp) -> Callable:
        """Called as each parameter's gradient is accumulated. Default: mark the
        gradient ready, which lets its bucket communicate during backward."""

        def hook(parameter_name: str, parameter: torch.nn.Parameter):
            tensor = bagua_ddp.bagua_tensor_by_name(parameter_name)
            if tensor is not None:
                tensor.bagua_mark_communication_ready()

        return hook

    def init_post_backward_hook(self, bagua_ddp) -> Callable:
        """Called once backward has finished. Default: communicate what was not
        marked (unused parameters) and wait for all buckets."""

        def hook():
            bagua_ddp.mark_unready_tensors()
            bagua_ddp.wait_pending_comm_ops()

        return hook

    def init_post_optimizer_step_hook(self, bagua_ddp) -> Callable:
        """Called after each ``optimizer.step()`` with the optimizer."""
        return do_nothing

    def skips_optimizer_step(self, before_backward: bool = False) -> bool:
        """Whether the next ``optimizer.step()`` must not run, because this
        step's gradients were not averaged (they stayed on this rank; the
        post-step hook still runs and keeps them); ``before_backward``: asked
        before a closure passed to the step ran this step's backward, whether
        that backward will stay local. Default: never."""
        return False

    def init_inference_forward_hooks(self, bagua_ddp) -> Tuple[Callable, Callable]:
        """(before, after): called around a forward that communicates nothing
        (under ``torch.no_grad()``, in eval mode, or in ``no_sync()``), with
        the forward's inputs and its output. Default: nothing."""
        return do_nothing, do_nothing

    def communication_stats(self) -> List[dict]:
        """Communication this algorithm runs outside the buckets' ops (on its
        own communicators), in the form of a bucket op's entry of
        ``communication_stats()``: name, executions, bytes_sent and
        total_seconds. Default: none."""
        return []

    def state_dict(self, bagua_ddp) -> dict:
        """This rank's state of the algorithm that a checkpoint must keep
        beyond the module, the optimizers and the engine's step count and
        bucket plan (copies of peers' weights, a communication step...), as
        objects ``torch.save`` takes. Called between steps. Default: none."""
        return {}

    def load_state_dict(self, bagua_ddp, state: dict) -> None:
        """Restores what ``state_dict`` returned, after the module's and the
        optimizers' states were loaded. The engine rebuilds its buckets
        (``init_tensors``, ``init_operations``) before the next forward, so
        state may be kept until then. Default: nothing to restore."""

    def hold_weights(self, bagua_ddp) -> ContextManager:
        """A context in which no background work of the algorithm reads or
        writes the weights: a checkpoint saves and loads them there, between
        steps. Default: the algorithm has no background work."""
        return contextlib.nullcontext()

    def reduces_sparse_gradients(self) -> bool:
        """Whether sparse embedding gradients may be averaged exactly beside
        this algorithm's buckets (data_parallel.sparse); otherwise a model
        with them is refused at wrap time."""
        return False

    def ranks_share_weights(self) -> bool:
        """Whether every rank holds the same weights and optimizer state after
        each step (gradient averaging): a checkpoint then keeps rank 0's only,
        as Bagua's. False where ranks' weights differ (decentralized,
        asynchronous): each rank saves and loads its own."""
        return True

    def shutdown(self, bagua_ddp) -> None:
        """Called once when the module stops using this algorithm
        (``without_bagua``, ``with_bagua`` with another algorithm, exit):
        stop background work and release what it holds. Default: nothing."""
