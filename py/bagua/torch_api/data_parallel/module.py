"""``with_bagua``: what a user calls, and what it returns.

``model.with_bagua([optimizer], algorithm)`` returns the same module object,
its class swapped for a subclass that also derives from :class:`BaguaModule`
(so ``isinstance(model, type_before)`` still holds and nothing is copied);
``model.bagua_ddp`` is the engine. Importing this module adds ``with_bagua``
to every ``torch.nn.Module``, as Bagua does.
"""

import contextlib
import sys
from typing import Optional

import torch

from bagua.torch_api._core import InvalidArgumentError
from bagua.torch_api.data_parallel.bagua_distributed import BaguaDistributedDataParallel, _checked_optimizers
from bagua.torch_api.process_group import is_initialized

__all__ = ["BaguaModule"]


class BaguaModule:
    """What ``with_bagua`` returns: the same module, now also a BaguaModule.

    ``module.bagua_ddp`` is the engine; ``module.without_bagua()`` undoes the
    wrapping (hooks removed, background threads stopped, the original class
    restored). ``with_bagua`` again switches algorithm.
    """

    def with_bagua(self, optimizers, algorithm, process_group=None, do_flatten: bool = True, *,
                   overlap: bool = True, autotune: Optional[bool] = None, broadcast_buffers: bool = True,
                   check_replicas_every: Optional[int] = None):
        """Wraps this module for distributed training with ``algorithm``.

        ``do_flatten``: buckets in one contiguous buffer each (fusion).
        ``overlap``: communicate while backward runs (True) or after it.
        ``autotune``: tune the bucket size during training (default:
        BAGUA_AUTOTUNE). See docs/execution_optimizer.md.
        ``broadcast_buffers``: as DDP's, rank 0's buffers (BatchNorm's
        running statistics) broadcast before each training forward, for
        the algorithms whose ranks share their weights (see
        :mod:`.buffers`); False keeps each rank's own.
        ``check_replicas_every``: every this many steps, compare the
        weights across ranks and raise ``ReplicasDivergedError`` naming the
        first parameter that differs (algorithms whose ranks share weights;
        default: BAGUA_CHECK_REPLICAS, off when unset; see :mod:`.replicas`).

        ``algorithm`` may be a registered name (``GlobalAlgorithmRegistry``),
        built with its defaults: e.g. ``"bytegrad"``, or ``"auto"``
        (``AutoAlgorithm()``, which measures the network and the step and
        runs the algorithm predicted fastest, docs/auto.md).

        Called on a module already wrapped, it switches to ``algorithm``: the
        previous algorithm is stopped (its background threads too) and
        released, and the module is wrapped anew (states broadcast from rank
        0 again), as in Bagua.
        """
        if not is_initialized():
            raise RuntimeError(
                "with_bagua needs bagua's process group: call bagua.torch_api.init_process_group() first")
        if isinstance(algorithm, str):
            from bagua.torch_api.algorithms.base import Algorithm  # the algorithm interface (a lower layer)
            algorithm = Algorithm.init(algorithm)
        previous = getattr(self, "bagua_ddp", None)
        if previous is not None:
            # Switching algorithm (Bagua's test_model_switch): bad arguments
            # leave the current wrapping alone; otherwise the old engine goes
            # first (its hooks, its background threads, its backend).
            _checked_optimizers(algorithm, optimizers, do_flatten, overlap, autotune, broadcast_buffers)
            previous.remove()
            self.__dict__["bagua_ddp"] = None
        try:
            ddp = BaguaDistributedDataParallel(self, optimizers, algorithm, process_group, do_flatten,
                                               overlap=overlap, autotune=autotune,
                                               broadcast_buffers=broadcast_buffers,
                                               check_replicas_every=check_replicas_every)
        except BaseException:
            if previous is not None:  # unwrapped now, not half-wrapped
                self._bagua_restore_class()
            raise
        # Into this object's own __dict__: a compiled module (torch.compile's
        # OptimizedModule) forwards attribute writes to the module it compiled.
        self.__dict__["bagua_ddp"] = ddp
        if "_bagua_original_class" not in self.__dict__:
            self.__dict__["_bagua_original_class"] = type(self)
            self.__class__ = _bagua_class(type(self))
        return self

    def _bagua_restore_class(self) -> None:
        self.__class__ = self.__dict__.pop("_bagua_original_class")

    def without_bagua(self):
        ddp = getattr(self, "bagua_ddp", None)
        if ddp is None:
            return self
        ddp.remove()
        self.__dict__["bagua_ddp"] = None
        self._bagua_restore_class()
        return self

    @contextlib.contextmanager
    def no_sync(self):
        """As DDP's ``no_sync``: forwards and backwards in this context
        communicate nothing, gradients accumulate locally; the first backward
        after it communicates the accumulated gradients::

            with model.no_sync():
                for x, y in micro_batches[:-1]:
                    loss_fn(model(x), y).backward()
            loss_fn(model(micro_batches[-1][0]), micro_batches[-1][1]).backward()
            optimizer.step()
        """
        ddp = self.bagua_ddp
        previous = ddp.require_backward_grad_sync
        ddp.require_backward_grad_sync = False
        try:
            yield
        finally:
            ddp.require_backward_grad_sync = previous

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False):
        """As DDP's ``join()``: ranks whose inputs run out first keep
        answering the others' steps until every rank is done, so inputs may
        differ in length across ranks::

            with model.join():
                for x, y in my_shard:      # any number of batches per rank
                    ...

        For several wrapped models trained together (a GAN), use
        ``bagua.torch_api.join([G, D])``. See ``data_parallel.join``."""
        from bagua.torch_api.data_parallel.join import join

        return join(self, divide_by_initial_world_size, enable, throw_on_early_termination)

    # PyTorch's DistributedDataParallel reads this attribute when it wraps a
    # module: a module bagua already trains is refused there, since both
    # would communicate every gradient (Hugging Face's Trainer and
    # Accelerate wrap the model they are given in DDP themselves).
    @property
    def _ddp_params_and_buffers_to_ignore(self):
        if self.__dict__.get("bagua_ddp") is not None and _called_by_torch_ddp():
            raise InvalidArgumentError(
                f"this {type(self).__name__} is already wrapped by bagua (with_bagua, "
                f"{type(self.bagua_ddp.bagua_algorithm).__name__}): wrapping it in torch's "
                "DistributedDataParallel as well would communicate every gradient twice, bagua's exchange "
                "and then DDP's full-precision allreduce. Train the bagua-wrapped module itself, or call "
                "model.without_bagua() before handing it to a stack that wraps DDP itself (Hugging Face "
                "Trainer, Accelerate)")
        if "_bagua_ddp_ignored" not in self.__dict__:
            raise AttributeError("_ddp_params_and_buffers_to_ignore")
        return self.__dict__["_bagua_ddp_ignored"]

    @_ddp_params_and_buffers_to_ignore.setter
    def _ddp_params_and_buffers_to_ignore(self, value):
        self.__dict__["_bagua_ddp_ignored"] = value

    @property
    def bagua_algorithm(self):
        return self.bagua_ddp.bagua_algorithm if getattr(self, "bagua_ddp", None) else None

    @property
    def bagua_buckets(self):
        return self.bagua_ddp.bagua_buckets


_bagua_classes = {}


def _called_by_torch_ddp() -> bool:
    """Whether torch.nn.parallel.DistributedDataParallel is constructing
    (a few frames up)."""
    frame = sys._getframe(1)
    for _ in range(4):
        frame = frame.f_back
        if frame is None:
            return False
        if frame.f_globals.get("__name__") == "torch.nn.parallel.distributed":
            return True
    return False


def _bagua_class(cls):
    """``cls`` mixed with BaguaModule, one class per ``cls`` (cached, so
    wrapping many modules of one class makes one new class)."""
    if issubclass(cls, BaguaModule):
        return cls
    if cls not in _bagua_classes:
        _bagua_classes[cls] = type(cls.__name__, (cls, BaguaModule), {"__module__": cls.__module__})
    return _bagua_classes[cls]


torch.nn.Module.with_bagua = BaguaModule.with_bagua
