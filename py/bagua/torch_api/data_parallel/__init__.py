"""Data parallelism: wrapping a module for distributed training.

``model.with_bagua([optimizer], algorithm)`` returns the same module object,
now also a :class:`BaguaModule`. What happens, in order:

1. Parameters, buffers and optimizer state are broadcast from rank 0
   (:mod:`.state`).
2. The algorithm is reified for the process group; its ``init_tensors`` says
   which tensors to communicate (gradients, weights...).
3. Buckets are planned (:mod:`.planning`): first in reverse parameter order
   (the usual gradient ready order); after the first iteration, in the order
   the tensors actually became ready on rank 0 (the profile), up to
   BAGUA_DEFAULT_BUCKET_SIZE bytes each. Every rank applies rank 0's plan,
   so all ranks bucket identically, which a digest checks.
4. Hooks drive a training step (:mod:`.hooks`): forward pre-hook, one hook
   per parameter after its gradient is accumulated, a callback at the end of
   backward, and one after each ``optimizer.step()``; each calls the
   algorithm's hook.

The engine doing this is :class:`BaguaDistributedDataParallel`
(:mod:`.bagua_distributed`, Bagua's name and place for it); the module
wrapper is :class:`BaguaModule` (:mod:`.module`).
"""

from bagua.torch_api.data_parallel.bagua_distributed import BaguaDistributedDataParallel
from bagua.torch_api.data_parallel.module import BaguaModule

__all__ = ["BaguaDistributedDataParallel", "BaguaModule"]
from bagua.torch_api.data_parallel.distributed import DistributedDataParallel  # noqa: E402,F401
__all__ += ["DistributedDataParallel"]
