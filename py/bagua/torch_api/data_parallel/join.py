"""Uneven inputs: ``with model.join():`` (PyTorch DDP's ``Join``).

A rank that runs out of batches leaves the ``with`` block while the others
still train. Without help its peers would wait in their next collective
until the timeout. Inside ``join()`` every training step starts with one
small exchange (an allgather of one number per rank: 1 for a rank about to
take a synchronizing step, 2 for a ``no_sync()`` step, 0 for a rank that
has joined). A joined rank answers each exchange and *shadows* the step:
it runs the same communication with zero gradients (the buffers'
broadcast, the bucket rebuilds, the buckets' ops, the algorithm's hooks),
without an optimizer step. When an exchange shows every rank joined, all
leave together; for the algorithms whose ranks share weights, every rank
then takes the parameters and buffers of the last rank to have joined
(the highest of them), as DDP does.

Averaging, as DDP's ``divide_by_initial_world_size``: True (the default)
divides the sum by the world size, the joined ranks contributing zeros;
False divides it by the number of ranks still training (the communicated
averages are rescaled after each step's communication).

Inside ``join()``, a step's forward broadcasts the buffers once, from the
highest rank still training (as DDP under ``Join``: rank 0 may be the one
that ran out), and a forward that does not train broadcasts nothing. Decentralized and
low-precision decentralized: the joined rank keeps mixing its frozen
weights with its neighbours'. Asynchronous model average and the P-Reduce:
the joined rank keeps serving its peers' rounds and groups until all have
joined.
"""

import contextlib
import threading
from typing import List, Optional, Sequence

import torch

from bagua.torch_api._core import InvalidArgumentError, log
from bagua.torch_api.communication import allgather
from bagua.torch_api.data_parallel.state import broadcast_coalesced

__all__ = ["join", "JoinState", "JOINED", "SYNCHRONIZING", "LOCAL"]

JOINED, SYNCHRONIZING, LOCAL = 0, 1, 2  # what a rank says at a step's exchange


class EarlyTerminationError(RuntimeError):
    """``throw_on_early_termination=True`` and a rank ran out of inputs."""


class JoinState:
    """One engine's side of the join protocol (``engine.join_state`` while
    the context is open)."""

    def __init__(self, engine, divide_by_initial_world_size: bool, throw_on_early_termination: bool):
        self.engine = engine
        self.divide_by_initial_world_size = divide_by_initial_world_size
        self.throw_on_early_termination = throw_on_early_termination
        self.world_size = engine.engine_group.get_size()
        self.last_active: List[int] = list(range(self.world_size))
        self.training_ranks = self.world_size  # ranks synchronizing in the current step

    def exchange(self, status: int) -> List[int]:
        """Every rank's status for this step (collective)."""
        group = self.engine.engine_group
        if self.world_size == 1:
            statuses = [status]
        else:
            mine = torch.tensor([status], dtype=torch.int64)
            gathered = torch.zeros(self.world_size, dtype=torch.int64)
            allgather(mine, gathered, comm=group)
            statuses = gathered.tolist()
        active = [r for r, s in enumerate(statuses) if s != JOINED]
        if active:
            self.last_active = active
            self.training_ranks = sum(1 for s in statuses if s == SYNCHRONIZING)
            self.engine.buffer_sync.root = active[-1]  # DDP's: the highest rank still training
        if self.throw_on_early_termination and len(active) < self.world_size:
            ran_out = [r for r, s in enumerate(statuses) if s == JOINED]
            raise EarlyTerminationError(
                f"rank {group.get_rank()} ({self.engine.bagua_module_name}): rank(s) {ran_out} ran out of "
                "inputs (join(throw_on_early_termination=True)): every rank stops")
        return statuses

    def step_starts(self, synchronizing: bool) -> None:
        """An active rank's training forward that opens a step."""
        self.exchange(SYNCHRONIZING if synchronizing else LOCAL)

    def rescale(self) -> None:
        """After a step's communication: averages over the ranks that
        trained, where asked (divide_by_initial_world_size=False)."""
        impl = self.engine.bagua_algorithm_impl
        if self.divide_by_initial_world_size or not impl.ranks_share_weights():
            return
        if 0 < self.training_ranks < self.world_size:
            factor = self.world_size / self.training_ranks
            with torch.no_grad():
                for tensor in self.engine.bagua_tensors:
                    tensor._bagua_current().mul_(factor)
            if self.engine.sparse_gradients is not None:
                self.engine.sparse_gradients.scale(factor)

    # -- the joined rank ----------------------------------------------------------
    def serve_until_all_joined(self) -> None:
        """Shadows the other ranks' steps until every rank has joined."""
        shadowed = 0
        while True:
            statuses = self.exchange(JOINED)
            if all(s == JOINED for s in statuses):
                break
            self._shadow(statuses)
            shadowed += 1
        if shadowed:
            log("info", f"rank {self.engine.engine_group.get_rank()} {self.engine.bagua_module_name}: "
                        f"shadowed {shadowed} steps of the ranks still training")

    def _shadow(self, statuses: Sequence[int]) -> None:
        engine, hooks = self.engine, self.engine._hooks
        engine.buffer_sync.before_forward(True, engine.bagua_algorithm_impl)
        if SYNCHRONIZING not in statuses:
            return  # a no_sync() step: nothing else is communicated
        engine._prepare_step()
        hooks.forward_pre_hook(())
        params = engine.bagua_build_params()
        with torch.no_grad():
            for _, param in params:
                if param.grad is not None:
                    param.grad.zero_()
        for name, param in params:
            hooks.backward_hook(name, param)
        hooks.post_backward_hook()
        if engine.sparse_gradients is not None:
            engine.sparse_gradients.drop_local()
            engine.reduce_sparse_gradients()
        engine._backward_finished()
        for optimizer in engine.optimizers:
            hooks.post_step_hook(optimizer)

    def finish(self) -> None:
        """All joined: the last rank's model everywhere, where ranks share weights."""
        engine = self.engine
        engine.buffer_sync.root = 0
        if not engine.bagua_algorithm_impl.ranks_share_weights():
            return
        authority = max(self.last_active)
        tensors = [p.data for p in engine.module.parameters()] + [b for b in engine.module.buffers()]
        broadcast_coalesced(tensors, engine.engine_group, src=authority)


# The join() contexts open on each thread. A second one inside the first
# would hang once inputs are uneven: a rank that runs out serves only the
# inner context's models, while the others still step the outer one's.
_open_here = threading.local()


def _engine_of(model):
    engine = getattr(model, "bagua_ddp", None) or getattr(model, "inner", None)
    if engine is None or not hasattr(engine, "engine_group"):
        raise InvalidArgumentError(f"join: {type(model).__name__} is not wrapped by bagua (with_bagua or "
                                   "bagua's DistributedDataParallel)")
    return engine


@contextlib.contextmanager
def join(models, divide_by_initial_world_size: bool = True, enable: bool = True,
         throw_on_early_termination: bool = False):
    """Trains ``models`` (one wrapped module or a list) on inputs of
    different lengths across ranks; see the module docstring. Several
    models share one context (a GAN's G and D): a joined rank shadows each
    model's steps on a thread of its own, since the ranks still training
    interleave them."""
    models = list(models) if isinstance(models, (list, tuple)) else [models]
    for name, value in (("divide_by_initial_world_size", divide_by_initial_world_size), ("enable", enable),
                        ("throw_on_early_termination", throw_on_early_termination)):
        if not isinstance(value, bool):
            raise InvalidArgumentError(f"join: {name} must be a bool, got {value!r}")
    engines = [_engine_of(m) for m in models]
    if not enable or any(e._bagua_backend is None for e in engines):
        yield
        return
    if any(e.join_state is not None for e in engines):
        raise InvalidArgumentError("join: a model is already inside a join() context")
    outer = getattr(_open_here, "engines", None)
    if outer is not None:
        raise InvalidArgumentError(
            f"join: this thread is already inside the join() of {len(outer)} other model(s); nested joins "
            "hang once inputs are uneven (a rank that runs out serves only the inner context's models). "
            "Join the models together: bagua.torch_api.join([model_a, model_b])")
    states = [JoinState(e, divide_by_initial_world_size, throw_on_early_termination) for e in engines]
    for engine, state in zip(engines, states):
        engine.join_state = state
    _open_here.engines = engines
    try:
        yield
        _serve(states)
        for state in states:
            state.finish()
    finally:
        _open_here.engines = None
        for engine in engines:
            engine.join_state = None


def _serve(states: Sequence[JoinState]) -> None:
    if len(states) == 1:
        states[0].serve_until_all_joined()
        return

    errors: List[Optional[BaseException]] = [None] * len(states)

    def serve(i):
        try:
            states[i].serve_until_all_joined()
        except BaseException as error:  # noqa: BLE001 - raised by the caller below
            errors[i] = error

    threads = [threading.Thread(target=serve, args=(i,), name=f"bagua-join-{i}") for i in range(len(states))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for error in errors:
        if error is not None:
            raise error
