"""Bagua's ``bagua.torch_api.communication``, whole: the primitives on torch
tensors (:mod:`._primitives`: ``allreduce``, ``broadcast``, ..., ``ReduceOp``
and the process groups) and the rest of Bagua's module
(:mod:`._compat_communication`: ``CommMember``, ``from_torch_group``,
``alltoall_v``, ``broadcast_object``, ...).

This module only gathers the two; neither imports it, so each can be read
and changed alone. Every name of both is here, the private ones too (Bagua's
users and tests reach ``communication._rank_not_in_group`` and friends).
"""

from bagua.torch_api import _compat_communication, _primitives


def _gather(module) -> None:
    for name, value in vars(module).items():
        if not name.startswith("__") and name not in globals():
            globals()[name] = value


_gather(_primitives)
_gather(_compat_communication)
__all__ = list(_primitives.__all__) + list(_compat_communication.__all__)
