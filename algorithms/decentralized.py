"""Decentralized algorithms: ranks average their weights with peers instead of
all-reducing gradients.

``DecentralizedAlgorithm``: in full precision, with all ranks, one partner
(shift_one) or both ring neighbours (D_FP_S), or over any BlueFog topology,
static graph or dynamic schedule (bagua.bluefog's neighbour allreduce as a
bucket op); the exchange starts when forward starts and overlaps with
forward and backward; the averaged weights are adopted after backward,
before the optimizer step.

``LowPrecisionDecentralizedAlgorithm``: after each optimizer step every rank
exchanges the 8-bit compressed change of its weights with its two ring
neighbours (D_LP_S) and moves to the average of the three; or, with a
``topology`` (a static BlueFog graph), with its in- and out-neighbours in
the graph, mixing with the graph's weights (low-precision neighbour
allreduce).
"""

from typing import Dict, List, Tuple

import torch

from bagua.torch_api._core import InvalidArgumentError
from bagua.torch_api.algorithms.base import (
    Algorithm,
    AlgorithmImpl,
    ArgumentChecks,
    do_nothing,
    is_communication_step,
    weight_tensors,
)

__all__ = ["DecentralizedAlgorithm", "DecentralizedAlgorithmImpl", "LowPrecisionDecentralizedAlgorithm",
           "LowPrecisionDecentralizedAlgorithmImpl"]

PEER_SELECTION_MODES = ("all", "shift_one", "ring")


def _flat_weights(bucket) -> torch.Tensor:
    """A flat copy of the bucket's weights, the starting value of an op's copies."""
    return torch.cat([t.bagua_registered_tensor().detach().reshape(-1) for t in bucket.tensors])


class LowPrecisionDecentralizedAlgorithmImpl(AlgorithmImpl):
    def __init__(self, process_group, hierarchical: bool = True, communication_interval: int = 1,
                 topology=None):
        super().__init__(process_group)
        self.hierarchical = hierarchical
        self.communication_interval = communication_interval
        # With a topology: (self weight, {in-neighbour: weight}, out-neighbours)
        # of this rank, and the in-neighbours in the order of the copies.
        self.pattern = None
        self.sources: List[int] = []
        if topology is not None:
            self_weight, src_weights, dst_weights = _TopologyPatterns(
                topology, process_group.get_rank(), process_group.get_size(),
                name="LowPrecisionDecentralizedAlgorithm").next()
            if self_weight is None:  # unweighted graph: the uniform average
                self_weight = 1.0 / (len(src_weights) + 1)
                src_weights = {r: self_weight for r in src_weights}
            self.pattern = (self_weight, src_weights, sorted(dst_weights))
            self.sources = sorted(src_weights)
        # bucket name -> (weight, left peer weight, right peer weight); with a
        # topology (weight, copy of each in-neighbour's weight in the order of
        # self.sources): see copies()
        self.peer_weights: Dict[str, Tuple[torch.Tensor, ...]] = {}
        # tensor name -> its slices of the copies, kept across re-bucketing
        self._saved_copies: Dict[str, Tuple[torch.Tensor, ...]] = {}
        # the same, from a checkpoint, adopted at the next re-bucketing
        self._loaded_copies: Dict[str, Tuple[torch.Tensor, ...]] = {}

    def _copy_count(self) -> int:
        return 3 if self.pattern is None else 1 + len(self.sources)

    def copies(self, bucket_name: str) -> Tuple[torch.Tensor, Dict[int, torch.Tensor]]:
        """This rank's copy of its own weights (W) and of each neighbour's,
        by rank (ring: the left and right neighbours; with a topology: the
        in-neighbours), for the bucket ``bucket_name``."""
        weight, *peers = self.peer_weights[bucket_name]
        if self.pattern is None:
            n, rank = self.process_group.get_size(), self.process_group.get_rank()
            return weight, {(rank - 1) % n: peers[0], (rank + 1) % n: peers[1]}
        return weight, dict(zip(self.sources, peers))

    def _copies_by_tensor(self, bagua_ddp) -> Dict[str, Tuple[torch.Tensor, ...]]:
        """Each bucketed tensor's slices of the copies (weight, then the
        neighbours': left and right, or the in-neighbours' in order), cloned."""
        copies_by_tensor = {}
        for bucket in bagua_ddp.bagua_buckets:
            copies = self.peer_weights.get(bucket.name)
            if copies is None:
                continue
            offset = 0
            for tensor in bucket.tensors:
                n = tensor.bagua_registered_tensor().numel()
                copies_by_tensor[tensor.bagua_tensor_name] = tuple(c[offset:offset + n].clone() for c in copies)
                offset += n
        return copies_by_tensor

    def init_tensors(self, bagua_ddp) -> List:
        # Re-bucketing (autotune, profiling, a loaded checkpoint): keep each
        # tensor's copies of its own and its neighbours' weights, they are
        # state of the algorithm.
        self._saved_copies = self._copies_by_tensor(bagua_ddp)
        self._saved_copies.update(self._loaded_copies)
        self._loaded_copies = {}
        self.peer_weights = {}
        return weight_tensors(bagua_ddp)

    def state_dict(self, bagua_ddp) -> dict:
        state = {"peer_weights": self._copies_by_tensor(bagua_ddp)}
        if self.pattern is not None:
            state["sources"] = list(self.sources)
        return state

    def load_state_dict(self, bagua_ddp, state: dict) -> None:
        sources = state.get("sources")
        if (sources is None) != (self.pattern is None) or (sources is not None and sources != self.sources):
            raise InvalidArgumentError(
                "LowPrecisionDecentralizedAlgorithm: the checkpoint's copies are of the neighbours "
                f"{'of the ring' if sources is None else sources}, this algorithm's "
                f"{'of the ring' if self.pattern is None else self.sources} (topology differs)")
        self._loaded_copies = dict(state["peer_weights"])

    def ranks_share_weights(self) -> bool:
        return False

    def init_operations(self, bagua_ddp, bucket):
        bucket.clear_ops()
        saved = self._saved_copies
        count = self._copy_count()
        if all(t.bagua_tensor_name in saved for t in bucket.tensors):
            copies = tuple(torch.cat([saved[t.bagua_tensor_name][i] for t in bucket.tensors])
                           .to(bucket.device) for i in range(count))
        else:
            flat = _flat_weights(bucket)
            copies = tuple(flat.clone() for _ in range(count))
        self.peer_weights[bucket.name] = copies
        if self.pattern is None:
            bucket.append_low_precision_decentralized_synchronous_op(
                *copies, hierarchical=self.hierarchical, compression="MinMaxUInt8",
                group=self.process_group)
            return
        self_weight, src_weights, dst_ranks = self.pattern
        bucket.append_low_precision_neighbor_allreduce_op(
            copies[0], dict(zip(self.sources, copies[1:])), self_weight, src_weights, dst_ranks,
            compression="MinMaxUInt8", group=self.process_group)

    def init_backward_hook(self, bagua_ddp):
        return do_nothing  # weights, not gradients, are communicated

    def init_post_backward_hook(self, bagua_ddp):
        return do_nothing

    def init_post_optimizer_step_hook(self, bagua_ddp):
        def hook(optimizer):
            if is_communication_step(bagua_ddp, self.communication_interval):
                bagua_ddp.mark_unready_tensors()
                bagua_ddp.wait_pending_comm_ops()

        return hook


class LowPrecisionDecentralizedAlgorithm(Algorithm):
    impl_class = LowPrecisionDecentralizedAlgorithmImpl

    def __init__(self, hierarchical: bool = True, communication_interval: int = 1, topology=None):
        """
        Args:
            hierarchical: average inside each node in full precision first; the
                ring runs among node leaders. Must be False with a ``topology``.
            communication_interval: communicate every this many steps (on steps
                1, 1 + k, 1 + 2k, ...).
            topology: None for the ring (D_LP_S); or a static
                networkx.DiGraph over the group's ranks (e.g.
                ``bagua.bluefog.topology_util.ExponentialGraph(n)``): each rank
                mixes with its in-neighbours using the graph's weights into it
                (``GetRecvWeights``; the uniform average with its in-neighbours
                when the edges have no weights) and sends its compressed change
                to its out-neighbours. Dynamic schedules are not supported.
        """
        name = type(self).__name__
        check = ArgumentChecks(name)
        check.flags(hierarchical=hierarchical)
        check.integer("communication_interval", communication_interval, 1)
        if topology is not None:
            if not hasattr(topology, "predecessors"):
                raise InvalidArgumentError(
                    f"{name}: topology must be a static networkx.DiGraph over the ranks (dynamic schedules "
                    f"are not supported), got {type(topology).__name__}")
            if hierarchical:
                raise InvalidArgumentError(f"{name}: a topology sets the peers of every rank; pass "
                                           "hierarchical=False with it")
        self.keep_settings(hierarchical=hierarchical, communication_interval=communication_interval,
                           topology=topology)


class _TopologyPatterns:
    """The neighbour pattern of each communication step for a topology: a
    networkx DiGraph over the group's ranks (the same pattern every step:
    the graph's weights into this rank when every edge has a "weight",
    else the uniform average of this rank and its in-neighbours, BlueFog's
    unweighted default), or an iterator of (send ranks, receive ranks) per
    step, BlueFog's dynamic schedules (uniform weights 1 / (receives + 1))."""

    def __init__(self, topology, rank: int, size: int, name: str = "DecentralizedAlgorithm"):
        self.rank, self.size, self.name = rank, size, name
        self.static = None
        if hasattr(topology, "predecessors"):  # a networkx graph
            self.static = self._static_pattern(topology)
        elif hasattr(topology, "__next__"):
            self.schedule = topology
        else:
            raise InvalidArgumentError(
                f"{name}: topology must be a networkx.DiGraph over the ranks or an iterator "
                f"of (send ranks, receive ranks) per step, got {type(topology).__name__}")

    def _static_pattern(self, graph):
        from bagua.bluefog import topology_util

        if sorted(graph.nodes()) != list(range(self.size)):
            raise InvalidArgumentError(f"{self.name}: the topology must have the {self.size} nodes "
                                       f"0..{self.size - 1} (one per rank), got {graph.number_of_nodes()} nodes")
        _, sends = topology_util.GetSendWeights(graph, self.rank)
        destinations = {r: 1.0 for r in sends}
        if not all("weight" in data for _, _, data in graph.edges(data=True)):
            sources = {r: 1.0 for r in graph.predecessors(self.rank) if r != self.rank}
            return None, sources, destinations
        self_weight, sources = topology_util.GetRecvWeights(graph, self.rank)
        total = self_weight + sum(sources.values())
        if abs(total - 1.0) > 1e-6:
            raise InvalidArgumentError(
                f"{self.name}: the topology's weights into rank {self.rank} (itself included) sum "
                f"to {total:g}; averaging needs 1 (or leave the edges without weights for uniform averaging)")
        return self_weight, sources, destinations

    def next(self):
        """(self weight or None for uniform, {source: weight}, {destination: weight})."""
        if self.static is not None:
            return self.static
        try:
            sends, receives = next(self.schedule)
        except StopIteration:
            raise InvalidArgumentError("DecentralizedAlgorithm: the topology's schedule ran out of steps") from None
        weight = 1.0 / (len(receives) + 1)
        return weight, {int(r): weight for r in receives}, {int(r): 1.0 for r in sends}


class DecentralizedAlgorithmImpl(AlgorithmImpl):
    def __init__(self, process_group, hierarchical: bool = True, peer_selection_mode: str = "all",
                 communication_interval: int = 1, topology=None):
        super().__init__(process_group)
        self.hierarchical = hierarchical
        self.peer_selection_mode = peer_selection_mode
        self.communication_interval = communication_interval
        self.ops = {}  # bucket name -> DecentralizedSynchronousOp or NeighborAllreduceOp
        # The ops' communication step (shift_one's partners follow it), kept
        # across re-bucketing and checkpoints: new ops continue the count.
        self._communication_step = 0
        self.patterns = None
        if topology is not None:
            self.patterns = _TopologyPatterns(topology, process_group.get_rank(), process_group.get_size())

    def _current_step(self) -> int:
        if self.patterns is not None:
            return self._communication_step  # counted here: the neighbour ops keep no count
        return max((op.communication_step for op in self.ops.values()), default=self._communication_step)

    def init_tensors(self, bagua_ddp) -> List:
        self._communication_step = self._current_step()
        self.ops = {}
        return weight_tensors(bagua_ddp)

    def init_operations(self, bagua_ddp, bucket):
        bucket.clear_ops()
        if self.patterns is not None:
            self.ops[bucket.name] = bucket.append_neighbor_allreduce_op(_flat_weights(bucket),
                                                                        group=self.process_group)
            return
        op = bucket.append_decentralized_synchronous_op(
            _flat_weights(bucket), hierarchical=self.hierarchical,
            peer_selection_mode=self.peer_selection_mode, group=self.process_group)
        op.communication_step = self._communication_step
        self.ops[bucket.name] = op

    def state_dict(self, bagua_ddp) -> dict:
        return {"communication_step": self._current_step()}

    def load_state_dict(self, bagua_ddp, state: dict) -> None:
        self._communication_step = int(state["communication_step"])
        if self.patterns is None:
            for op in self.ops.values():
                op.communication_step = self._communication_step

    def ranks_share_weights(self) -> bool:
        return False

    def init_forward_pre_hook(self, bagua_ddp):
        def hook(inputs):
            # Start the exchange now: it overlaps with forward and backward,
            # which only read the weights.
            if is_communication_step(bagua_ddp, self.communication_interval):
                if self.patterns is not None:
                    pattern = self.patterns.next()  # one per step, for every bucket
                    for op in self.ops.values():
                        op.set_pattern(*pattern)
                    self._communication_step += 1
                bagua_ddp.mark_unready_tensors()

        return hook

    def init_backward_hook(self, bagua_ddp):
        return do_nothing

    def init_post_backward_hook(self, bagua_ddp):
        def hook():
            if is_communication_step(bagua_ddp, self.communication_interval):
                bagua_ddp.wait_pending_comm_ops()
                for bucket in bagua_ddp.bagua_buckets:
                    self.ops[bucket.name].copy_back_peer_weight(bucket)

        return hook


class DecentralizedAlgorithm(Algorithm):
    impl_class = DecentralizedAlgorithmImpl

    def __init__(self, hierarchical: bool = True, peer_selection_mode: str = "all",
                 communication_interval: int = 1, topology=None):
        """
        Args:
            hierarchical: average inside each node first; the exchange runs
                among node leaders. Must be False with a ``topology``.
            peer_selection_mode: "all" (global average), "shift_one" (one
                partner per step, changing every step; with an odd number of
                ranks one rank sits each step out) or "ring" (both ring
                neighbours, weights 1/3).
            communication_interval: exchange every this many steps (on steps
                1, 1 + k, 1 + 2k, ...).
            topology: instead of a peer selection mode, BlueFog's neighbour
                averaging (bagua.bluefog's neighbor_allreduce as a bucket op)
                over a networkx.DiGraph of the group's ranks (its edge weights
                when it has them, else the uniform average with the
                in-neighbours; e.g. ``topology_util.ExponentialGraph(n)``) or
                over a per-rank iterator of (send ranks, receive ranks), one
                item per communication step (e.g.
                ``topology_util.GetDynamicOnePeerSendRecvRanks(graph, rank)``).
        """
        name = type(self).__name__
        check = ArgumentChecks(name)
        check.flags(hierarchical=hierarchical)
        check.choice("peer_selection_mode", peer_selection_mode, PEER_SELECTION_MODES)
        check.integer("communication_interval", communication_interval, 1)
        if topology is not None and (hierarchical or peer_selection_mode != "all"):
            raise InvalidArgumentError(f"{name}: a topology sets the peers of every rank; pass "
                                       "hierarchical=False and no peer_selection_mode with it")
        self.keep_settings(hierarchical=hierarchical, peer_selection_mode=peer_selection_mode,
                           communication_interval=communication_interval, topology=topology)

