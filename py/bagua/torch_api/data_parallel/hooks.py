"""The hooks that drive a training step, and the algorithm's hooks they call.

- forward pre-hook: the engine prepares the step (re-bucketing, autotuning),
  then the algorithm's forward pre-hook runs. A forward that does not train
  (``torch.no_grad()``, ``module.eval()``) or runs in ``module.no_sync()``
  communicates nothing: the algorithm's inference hooks run before and
  after it instead (``init_inference_forward_hooks``, e.g. to lock weights
  a background thread writes);
- one hook per parameter, after autograd accumulated its gradient: the
  algorithm's backward hook (with ``overlap=False`` replayed, in ready order,
  once backward has finished); nothing for a backward whose forward ran in
  ``no_sync()`` (the gradients accumulate locally, as with DDP);
- a callback queued on autograd's engine at the first gradient, run at the
  end of backward: the algorithm's post-backward hook, then the engine's
  end-of-backward work (adopting the profiled order);
- ``optimizer.step`` is wrapped (a bound method, so LR schedulers and
  torch.optim's hooks keep working): the algorithm's post-step hook runs
  after it; when the algorithm says this step's gradients stayed local
  (``skips_optimizer_step``: auto's measuring steps), the step itself does
  not run and the post-step hook takes the gradients.

What torch holds (module hooks, gradient hooks, the wrapped ``step``) refers
to the hooks only weakly, so a dropped engine is not kept alive by them.
With BAGUA_TIMELINE set, forward, backward and optimizer step are also
recorded as spans on the timeline.
"""

import functools
import types
import weakref

import torch

from bagua.torch_api.data_parallel.compiled import GraphSplitHint, eager


class _Phases:
    """Spans of the training phases on the timeline; nothing without one."""

    def __init__(self, timeline):
        self.timeline = timeline
        self._start = {}

    def begin(self, phase: str) -> None:
        if self.timeline is not None:
            self._start[phase] = self.timeline.now_us()

    def end(self, phase: str) -> None:
        if self.timeline is not None and phase in self._start:
            self.timeline.span(phase, "phase", self._start.pop(phase), self.timeline.now_us())


def _weak_call(ref, method: str, *bound):
    """A hook for torch: calls ``ref().method(*bound, *args)`` while the
    referent lives, and nothing after."""

    def call(*args):
        hooks = ref()
        if hooks is not None:
            getattr(hooks, method)(*bound, *args)

    return call


class StepHooks:
    """The hooks of one wrapped module (``ddp``: its engine)."""

    def __init__(self, ddp, timeline=None):
        self.ddp = ddp
        self.phases = _Phases(timeline)
        self._handles = []
        self._wrapped_steps = []
        self._grad_accumulators = []  # PyTorch < 2.1: keeps the hooked nodes alive
        self._deferred_grads = []
        self._callback_queued = False
        self._sync_backward = True  # whether the last training forward ran outside no_sync()
        self._step_open = False  # a training forward ran, its backward has not ended yet
        # Under torch.compile: the forward cut into graphs of about a bucket each.
        self.graph_split = GraphSplitHint(ddp.bucket_bytes)
        self.bind_algorithm()
        self._install()

    def bind_algorithm(self) -> None:
        """(Re)reads the algorithm's hooks: at wrap time and after the
        algorithm asked for a reset."""
        impl, ddp = self.ddp.bagua_algorithm_impl, self.ddp
        self.backward_hook = impl.init_backward_hook(ddp)
        self.forward_pre_hook = impl.init_forward_pre_hook(ddp)
        self.post_backward_hook = impl.init_post_backward_hook(ddp)
        self.post_step_hook = impl.init_post_optimizer_step_hook(ddp)
        self.inference_pre_hook, self.inference_post_hook = impl.init_inference_forward_hooks(ddp)

    def _install(self) -> None:
        ref = weakref.ref(self)
        module = self.ddp.module
        # The forward hooks run eagerly under torch.compile (see .compiled).
        self._handles.append(module.register_forward_pre_hook(eager(_weak_call(ref, "on_forward"))))
        self._handles.append(module.register_forward_hook(eager(_weak_call(ref, "on_forward_end"))))
        for name, param in self.ddp.bagua_build_params() + self.ddp.sparse_parameters:
            hook = _weak_call(ref, "on_grad_ready", name, param)
            if hasattr(param, "register_post_accumulate_grad_hook"):  # PyTorch >= 2.1
                self._handles.append(param.register_post_accumulate_grad_hook(hook))
            else:
                accumulator = param.expand_as(param).grad_fn.next_functions[0][0]
                self._handles.append(accumulator.register_hook(hook))
                self._grad_accumulators.append(accumulator)
        for optimizer in self.ddp.optimizers:
            self._wrap_step(optimizer, ref)

    def _wrap_step(self, optimizer, ref) -> None:
        """Wraps ``optimizer.step`` as a bound method of the optimizer, as
        torch.optim's own is: LR schedulers re-wrap it through ``__func__``
        and count calls on it (``_with_counter``, ``_opt_called``); a
        scheduler's wrapper already there is called, with its markers kept."""
        previous = optimizer.__dict__.get("step")  # an instance attribute, e.g. a scheduler's wrapper
        original = optimizer.step
        active = [True]

        def step(opt, *args, **kwargs):
            hooks = ref() if active[0] else None
            if hooks is not None:
                hooks.phases.begin("optimizer_step")
            closure = kwargs.get("closure", args[0] if args else None)
            impl = hooks.ddp.bagua_algorithm_impl if hooks is not None else None
            if impl is not None and callable(closure) and impl.skips_optimizer_step(before_backward=True):
                with torch.enable_grad():  # Lightning's closure: this step's forward and backward
                    result = closure()
            elif impl is not None and not callable(closure) and impl.skips_optimizer_step():
                result = None  # the gradients stayed local (auto measuring): the algorithm keeps them
            else:
                result = original(*args, **kwargs)
            if hooks is not None:
                hooks._step_open = False  # a forward whose backward never ran ends with the step
                hooks.post_step_hook(opt)
                hooks.phases.end("optimizer_step")
            return result

        functools.update_wrapper(step, getattr(original, "__func__", original))
        optimizer.step = types.MethodType(step, optimizer)
        self._wrapped_steps.append((optimizer, step, active, previous))

    # -- what the hooks do ----------------------------------------------------
    def _communicates(self, module) -> bool:
        """Whether this forward is a training step that communicates."""
        return torch.is_grad_enabled() and module.training and self.ddp.require_backward_grad_sync

    def on_forward(self, module, inputs) -> None:
        with self.ddp.uneven_inputs_hint():
            self._on_forward(module, inputs)

    def _on_forward(self, module, inputs) -> None:
        training = torch.is_grad_enabled() and module.training
        if training:  # its backward follows (DDP reads no_sync here too)
            self._sync_backward = self.ddp.require_backward_grad_sync
        join = self.ddp.join_state
        if join is None:
            self.ddp.buffer_sync.before_forward(training, self.ddp.bagua_algorithm_impl)
        elif training and (not self._step_open or not self.ddp.require_backward_grad_sync):
            # Inside join(): a step opens with the exchange the joined ranks
            # answer, then the one broadcast of buffers they shadow.
            join.step_starts(self.ddp.require_backward_grad_sync)
            self.ddp.buffer_sync.before_forward(True, self.ddp.bagua_algorithm_impl)
        if not self._communicates(module):
            self.inference_pre_hook(inputs)
            return
        if not self._step_open:  # the first training forward of this step
            self._step_open = True
            self.ddp._prepare_step()
            self.phases.begin("forward")
            self.forward_pre_hook(inputs)
        # else: another forward before this step's backward (a siamese
        # loss): the step was prepared once, as DDP counts one iteration.
        if self.ddp.overlap:
            self.graph_split.bucket_bytes = self.ddp.bucket_bytes
            self.graph_split.enter()

    def on_forward_end(self, module, inputs, output) -> None:
        self.graph_split.leave()
        if not self._communicates(module):
            self.inference_post_hook(output)
            return
        self.phases.end("forward")

    def on_grad_ready(self, name: str, param, *_) -> None:
        if not self._sync_backward:
            return
        if not self._callback_queued:
            self.phases.begin("backward")
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.on_backward_end)
        if self.ddp.overlap:
            self.backward_hook(name, param)
        else:  # communicate after backward: replay the hooks in ready order then
            self._deferred_grads.append((name, param))

    def on_backward_end(self) -> None:
        with self.ddp.uneven_inputs_hint():
            self._on_backward_end()

    def _on_backward_end(self) -> None:
        self.graph_split.leave()  # in case the forward raised before its end hook
        self._step_open = False
        self._callback_queued = False
        deferred, self._deferred_grads = self._deferred_grads, []
        for name, param in deferred:
            self.backward_hook(name, param)
        self.post_backward_hook()
        self.ddp.reduce_sparse_gradients()
        if self.ddp.join_state is not None:
            self.ddp.join_state.rescale()
        self.phases.end("backward")
        self.ddp._backward_finished()

    def remove(self) -> None:
        """Removes every hook and restores the optimizers' own ``step``."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.graph_split.leave()
        for optimizer, step, active, previous in self._wrapped_steps:
            active[0] = False  # a wrapper put over ours (a scheduler's) now calls straight through
            if getattr(optimizer.__dict__.get("step"), "__func__", None) is step:
                if previous is None:
                    del optimizer.step
                else:
                    optimizer.step = previous
        self._wrapped_steps.clear()
