"""``hierarchical="auto"``: time both forms of the gradient allreduce on the
first steps and keep the faster one.

Across nodes of several ranks the hierarchical form (the node sums through
shared memory, each rank reduces its share across nodes, the node gathers
the shares) sends a node's bytes over the network once instead of once per
rank, at the price of two more memory passes and of stages that wait for
the node's slowest rank. Which one wins depends on the link between nodes
and on how busy the cores are, not on anything known at wrap time: on 2
emulated hosts x 2 ranks (docs/benchmarks.md, "Across hosts") hierarchical
took 0.85x flat's step at 1 Gbit/s and 1.11x at 10 Gbit/s. So ``"auto"``
measures:

- steps 1 to ``STEPS_PER_FORM`` run the hierarchical form, the next
  ``STEPS_PER_FORM`` the flat one. The first step of each block is not
  timed (the first step profiles the bucket plan; the first after a switch
  touches new buffers);
- a step's time is from the forward's start to the end of the post-backward
  wait for the buckets: the part of a step the form changes;
- the samples are maxed over ranks (a step lasts as long as its slowest
  rank), the least per form is kept, and every rank then holds the same
  numbers and makes the same choice. A tie keeps flat (fewer passes).

Over one node, or with one rank per node, the two forms are the same sum
(the op runs the flat allreduce either way): nothing is measured there, and
the numbers are flat's, bit for bit. The two forms add the same gradients
in different orders, so across nodes the steps before and after the choice
round differently; every rank switches at the same step, so the replicas
stay equal.
"""

import json
import time
from typing import Dict, List, Optional, Union

import torch

import bagua.torch_api as bagua
from bagua.torch_api._core import log
from bagua.torch_api.communication import calls_known_to_match

__all__ = ["HierarchyChoice", "STEPS_PER_FORM"]

STEPS_PER_FORM = 4  # steps per form while measuring; the first of each is not timed
FORMS = ("hierarchical", "flat")  # the order they run in while measuring


class HierarchyChoice:
    """Which form the buckets' allreduce takes: fixed (``True``/``False``),
    or ``"auto"``, measured on the first steps. ``hierarchical`` is the form
    of the steps to come; ``decision`` says what was chosen and why."""

    def __init__(self, setting: Union[bool, str], process_group, steps_per_form: int = STEPS_PER_FORM):
        self.process_group = process_group
        self.steps_per_form = steps_per_form
        self.decision: Optional[Dict] = None
        self._samples: Dict[str, List[float]] = {form: [] for form in FORMS}
        self._step = 0                # steps seen while measuring
        self._forward_start = 0.0
        self._switch = False          # the form changes before the next forward
        if setting != "auto":
            self.hierarchical = bool(setting)
            self.decision = {"hierarchical": self.hierarchical, "reason": "set by the algorithm's argument"}
        elif not process_group.spans_nodes_of_several_ranks():
            self.hierarchical = False
            self.decision = {"hierarchical": False,
                             "reason": "one node, or one rank per node: both forms are the flat allreduce"}
        else:
            self.hierarchical = True  # the first block of the measurement

    @property
    def measuring(self) -> bool:
        return self.decision is None

    def take_switch(self) -> bool:
        """Before a forward: whether the buckets must be rebuilt for a new form."""
        switch, self._switch = self._switch, False
        return switch

    def step_started(self) -> None:
        if self.measuring:
            self._forward_start = time.perf_counter()

    def step_communicated(self) -> None:
        """After the post-backward wait: keeps this step's time, switches to
        the next block, and at the end of the last one decides (collective:
        every rank calls it at the same step)."""
        if not self.measuring:
            return
        elapsed = time.perf_counter() - self._forward_start
        block, position = divmod(self._step, self.steps_per_form)
        self._step += 1
        if position > 0:
            self._samples[FORMS[block]].append(elapsed)
        if position < self.steps_per_form - 1:
            return
        if block + 1 < len(FORMS):
            self._run(FORMS[block + 1] == "hierarchical")
        else:
            self._decide()

    def _run(self, hierarchical: bool) -> None:
        self._switch = hierarchical != self.hierarchical
        self.hierarchical = hierarchical

    def _decide(self) -> None:
        agreed = torch.tensor([self._samples[form] for form in FORMS], dtype=torch.float64)
        with calls_known_to_match():
            bagua.allreduce_inplace(agreed, op=bagua.ReduceOp.MAX, comm=self.process_group)
        best = dict(zip(FORMS, agreed.min(dim=1).values.tolist()))
        hierarchical = best["hierarchical"] < best["flat"]
        self.decision = {"hierarchical": hierarchical, "reason": "least measured step time",
                         "measured_step_s": best, "samples_s": dict(zip(FORMS, agreed.tolist()))}
        self._run(hierarchical)
        if self.process_group.get_rank() == 0:
            log("info", f"GradientAllReduce hierarchical='auto': {json.dumps(self.decision)}")

    # -- checkpoints: a resumed run keeps the form; one saved while measuring measures again
    def state_dict(self) -> dict:
        return {"decision": self.decision} if self.decision is not None else {}

    def load_state_dict(self, state: dict) -> None:
        decision = state.get("decision")
        if decision is None or not self.measuring:
            return
        self.decision = decision
        self._run(bool(decision["hierarchical"]))
