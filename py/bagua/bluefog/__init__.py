"""BlueFog's API on bagua's engine: ``import bagua.bluefog as bf`` in place of
``import bluefog.torch as bf`` (and ``from bagua.bluefog import topology_util``
in place of ``from bluefog.common import topology_util``).

No MPI: processes come from ``python -m bagua.distributed.launch`` or
``torchrun``; tensors move over bagua's communicators (Gloo on the CPU).
What exists and what does not yet: ``docs/bluefog.md``.
"""

from bagua.bluefog import topology_util
from bagua.bluefog._collectives import (
    allgather,
    allgather_nonblocking,
    allreduce,
    allreduce_,
    allreduce_nonblocking,
    allreduce_nonblocking_,
    allreduce_parameters,
    barrier,
    broadcast,
    broadcast_,
    broadcast_nonblocking,
    broadcast_nonblocking_,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from bagua.bluefog._hierarchical import (
    hierarchical_neighbor_allreduce,
    hierarchical_neighbor_allreduce_nonblocking,
)
from bagua.bluefog._ops import (
    neighbor_allgather,
    neighbor_allgather_nonblocking,
    neighbor_allreduce,
    neighbor_allreduce_nonblocking,
    pair_gossip,
    pair_gossip_nonblocking,
    poll,
    synchronize,
    wait,
)
from bagua.bluefog._state import (
    get_skip_negotiate_stage,
    in_neighbor_machine_ranks,
    in_neighbor_ranks,
    init,
    is_homogeneous,
    is_initialized,
    is_machine_topo_weighted,
    is_topo_weighted,
    load_machine_topology,
    load_topology,
    local_rank,
    local_size,
    machine_rank,
    machine_size,
    mpi_threads_supported,
    nccl_built,
    out_neighbor_machine_ranks,
    out_neighbor_ranks,
    rank,
    resume,
    set_machine_topology,
    set_skip_negotiate_stage,
    set_topology,
    shutdown,
    size,
    suspend,
    unified_mpi_window_model_supported,
)
from bagua.bluefog._timeline import (
    timeline_context,
    timeline_end_activity,
    timeline_start_activity,
)
from bagua.bluefog._windows import (
    get_current_created_window_names,
    get_win_version,
    neighbor_win_put,
    neighbor_win_put_nonblocking,
    turn_off_win_ops_with_associated_p,
    turn_on_win_ops_with_associated_p,
    win_accumulate,
    win_accumulate_nonblocking,
    win_associated_p,
    win_create,
    win_free,
    win_get,
    win_get_nonblocking,
    win_mutex,
    win_poll,
    win_put,
    win_put_nonblocking,
    win_update,
    win_update_then_collect,
    win_wait,
)
from bagua.bluefog.optimizers import (
    CommunicationType,
    DistributedAdaptThenCombineOptimizer,
    DistributedAdaptWithCombineOptimizer,
    DistributedAllreduceOptimizer,
    DistributedGradientAllreduceOptimizer,
    DistributedHierarchicalNeighborAllreduceOptimizer,
    DistributedNeighborAllreduceOptimizer,
    DistributedPullGetOptimizer,
    DistributedPushSumOptimizer,
    DistributedWinPutOptimizer,
)
from bagua.bluefog.topology_util import (
    ExponentialGraph,
    ExponentialTwoGraph,
    FullyConnectedGraph,
    GetRecvWeights,
    GetSendWeights,
    IsRegularGraph,
    IsTopologyEquivalent,
    MeshGrid2DGraph,
    RingGraph,
    StarGraph,
    SymmetricExponentialGraph,
)
