"""``hierarchical_neighbor_allreduce``: average inside each machine, neighbour
allreduce between machines (by local rank 0 of each, over the machine
topology, with machine ranks), broadcast inside the machine.

Needs a machine topology (``set_machine_topology``) and machines of equal
size (LOCAL_WORLD_SIZE or BLUEFOG_NODES_PER_MACHINE consecutive ranks).
"""

from typing import Dict, List, Optional, Union

import torch

from bagua.bluefog import _ops, _state
from bagua.bluefog._state import state
from bagua.torch_api import communication as comm_api

_OP = "hierarchical_neighbor_allreduce"


def _machine_graph() -> "_ops._Graph":
    st = state()
    if st.machine_topology is None:
        raise RuntimeError(f"{_OP}: no machine topology; call bf.set_machine_topology first")
    if not st.homogeneous:
        raise ValueError(f"{_OP}: the world of {_state.size()} ranks does not split into machines "
                         f"of {st.local_size}; only equal machines are supported")
    return _ops._Graph(_OP, _state.machine_rank(), st.machine_topology, st.machine_is_weighted,
                       what="machine")


def _check_dynamic_keys(graph, src, dst) -> None:
    """BlueFog's rule for the dynamic form: sources among the in-neighbour
    machines, destinations among the out-neighbour machines."""
    bad_src = sorted(set(int(k) for k in src) - set(graph.ins))
    bad_dst = sorted(set(int(k) for k in dst) - set(graph.outs))
    if bad_src or bad_dst:
        raise ValueError(f"{_OP}: machine {graph.me}: src_machine_weights {bad_src} are not "
                         f"in-neighbour machines ({graph.ins}) or dst_machine_weights {bad_dst} "
                         f"are not out-neighbour machines ({graph.outs})")


def hierarchical_neighbor_allreduce_nonblocking(
        tensor: torch.Tensor, self_weight: Optional[float] = None,
        src_machine_weights: Optional[Dict[int, float]] = None,
        dst_machine_weights: Union[None, List[int], Dict[int, float]] = None,
        enable_topo_check: bool = False, name: Optional[str] = None) -> int:
    graph = _machine_graph()
    if dst_machine_weights is not None and src_machine_weights is not None:
        _check_dynamic_keys(graph, src_machine_weights, dst_machine_weights)
    options = _ops._neighbor_options(graph, self_weight, src_machine_weights, dst_machine_weights,
                                     enable_topo_check, name, "src_machine_weights",
                                     "dst_machine_weights")
    if not tensor.is_floating_point():
        raise ValueError(f"{_OP}: needs a floating point tensor, got {tensor.dtype}")
    x = _ops._host(tensor)

    def run():
        st = state()
        average = torch.empty_like(x)
        comm_api.allreduce(x, average, comm_api.ReduceOp.AVG, comm=st.local_comm)
        out = torch.empty_like(x)
        if st.leader_comm is not None:
            st.leader_neighbor_allreduce.run(_ops._view(average), _ops._view(out), options)
        comm_api.broadcast(out, 0, comm=st.local_comm)
        return out.to(tensor.device).view(tensor.shape)
    return _ops._submit(run, "HIERARCHICAL_NEIGHBOR_ALLREDUCE", name)


def hierarchical_neighbor_allreduce(tensor: torch.Tensor, self_weight: Optional[float] = None,
                                    src_machine_weights: Optional[Dict[int, float]] = None,
                                    dst_machine_weights=None, enable_topo_check: bool = False,
                                    name: Optional[str] = None) -> torch.Tensor:
    """out on every rank of machine m = self_weight * avg_m + sum over source
    machines k of w_k * d_k * avg_k (the uniform average over in-neighbour
    machines by default, or the machine topology's weights when weighted)."""
    return _ops.synchronize(hierarchical_neighbor_allreduce_nonblocking(
        tensor, self_weight, src_machine_weights, dst_machine_weights, enable_topo_check, name))
