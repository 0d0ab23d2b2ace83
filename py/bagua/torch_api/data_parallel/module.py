"""``with_bagua``: what a user calls, and what it returns.

``model.with_bagua([optimizer], algorithm)`` returns the same module object,
its class swapped for a subclass that also derives from :class:`BaguaModule`
(so ``isinstance(model, type_before)`` still holds and nothing is copied);
``model.bagua_ddp`` is the engine. Importing this module adds ``with_bagua``
to every ``torch.nn.Module``, as Bagua does.
"""

from typing import Optional

import torch

from bagua.torch_api.data_parallel.bagua_distributed import BaguaDistributedDataParallel
from bagua.torch_api.process_group import is_initialized

__all__ = ["BaguaModule"]


class BaguaModule:
    """What ``with_bagua`` returns: the same module, now also a BaguaModule.

    ``module.bagua_ddp`` is the engine; ``module.without_bagua()`` undoes the
    wrapping (hooks removed, the original class restored), after which the
    module can be wrapped again.
    """

    def with_bagua(self, optimizers, algorithm, process_group=None, do_flatten: bool = True, *,
                   overlap: bool = True, autotune: Optional[bool] = None):
        """Wraps this module for distributed training with ``algorithm``.

        ``do_flatten``: buckets in one contiguous buffer each (fusion).
        ``overlap``: communicate while backward runs (True) or after it.
        ``autotune``: tune the bucket size during training (default:
        BAGUA_AUTOTUNE). See docs/execution_optimizer.md.
        """
        if not is_initialized():
            raise RuntimeError(
                "with_bagua needs bagua's process group: call bagua.torch_api.init_process_group() first")
        if getattr(self, "bagua_ddp", None) is not None:
            raise RuntimeError(
                f"this {type(self).__name__} is already wrapped with_bagua; call "
                "module.without_bagua() before wrapping it again")
        ddp = BaguaDistributedDataParallel(self, optimizers, algorithm, process_group, do_flatten,
                                           overlap=overlap, autotune=autotune)
        self.bagua_ddp = ddp
        original_class = type(self)
        self.__class__ = _bagua_class(original_class)
        self._bagua_original_class = original_class
        return self

    def without_bagua(self):
        ddp = getattr(self, "bagua_ddp", None)
        if ddp is None:
            return self
        ddp.remove()
        self.bagua_ddp = None
        self.__class__ = self._bagua_original_class
        return self

    @property
    def bagua_algorithm(self):
        return self.bagua_ddp.bagua_algorithm if getattr(self, "bagua_ddp", None) else None

    @property
    def bagua_buckets(self):
        return self.bagua_ddp.bagua_buckets


_bagua_classes = {}


def _bagua_class(cls):
    """``cls`` mixed with BaguaModule, one class per ``cls`` (cached, so
    wrapping many modules of one class makes one new class)."""
    if issubclass(cls, BaguaModule):
        return cls
    if cls not in _bagua_classes:
        _bagua_classes[cls] = type(cls.__name__, (cls, BaguaModule), {"__module__": cls.__module__})
    return _bagua_classes[cls]


torch.nn.Module.with_bagua = BaguaModule.with_bagua
