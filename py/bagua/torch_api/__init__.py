"""bagua's PyTorch API (Bagua's names and signatures).

    import bagua.torch_api as bagua
    bagua.init_process_group()
    model = model.with_bagua([optimizer], GradientAllReduceAlgorithm())
"""

from bagua.torch_api._core import (  # noqa: F401
    BackendError,
    BaguaError,
    CommTimeoutError,
    InvalidArgumentError,
    StoreError,
)
from bagua.torch_api.process_group import (  # noqa: F401
    BaguaProcessGroup,
    get_local_rank,
    get_local_size,
    get_rank,
    get_world_size,
    init_process_group,
    is_initialized,
    new_group,
)
from bagua.torch_api.communication import (  # noqa: F401
    ReduceOp,
    allgather,
    allgather_inplace,
    allreduce,
    allreduce_inplace,
    alltoall,
    alltoall_inplace,
    barrier,
    low_precision_average_inplace,
    broadcast,
    gather,
    partial_allreduce,
    partial_allreduce_inplace,
    recv,
    reduce,
    reduce_inplace,
    reduce_scatter,
    reduce_scatter_inplace,
    scatter,
    send,
)
from bagua.torch_api.data_parallel import BaguaModule  # noqa: F401
from bagua.torch_api.data_parallel.join import join  # noqa: F401  (uneven inputs, several models)
from bagua.torch_api.data_parallel.replicas import ReplicasDivergedError  # noqa: F401
from bagua.torch_api.bucket import BaguaBucket  # noqa: F401
from bagua.torch_api.tensor import BaguaTensor  # noqa: F401
from bagua.torch_api import algorithms  # noqa: F401
# The rest of Bagua's top-level names, and its submodules.
from bagua.torch_api.communication import (  # noqa: F401,E402
    alltoall_v,
    alltoall_v_inplace,
    gather_inplace,
    get_backend,
    scatter_inplace,
)
from bagua.torch_api import checkpoint, communication, contrib, data_parallel, moe, utils  # noqa: F401,E402
