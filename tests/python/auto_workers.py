"""Worker scenarios of test_auto.py, run on several processes by
launcher.run_workers. Usage: auto_workers.py SCENARIO OUT_DIR [ARGS...];
each rank saves its results to OUT_DIR/rank{RANK}.pt."""

import os
import sys

import torch
import torch.nn.functional as F

import bagua.torch_api as bagua
from bagua.torch_api.algorithms.auto import AutoAlgorithm
from bagua.torch_api.algorithms.bytegrad import ByteGradAlgorithm
from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm
from bagua.torch_api.algorithms.powersgd import PowerSGDAlgorithm

from workers import batches, fresh_model_and_optimizer

DIRECT = {"gradient_allreduce": lambda start: GradientAllReduceAlgorithm(hierarchical=False),
          "bytegrad": lambda start: ByteGradAlgorithm(hierarchical=False),
          "powersgd": lambda start: PowerSGDAlgorithm(rank=1, start_iter=start, one_bucket=True),
          "powersgd_8bit": lambda start: PowerSGDAlgorithm(rank=1, start_iter=start, low_precision=True,
                                                           one_bucket=True)}
DECIDE_AFTER = 2


def _train(model, opt, rank, steps, record=None, data=None):
    params = []
    for step, (x, y) in enumerate(data or batches(rank, steps=steps), 1):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        params.append([p.detach().clone() for p in model.parameters()])
        if record is not None:
            record.append(AutoAlgorithm.decision(model))
    return params


def _held_gradients(data):
    """What auto holds after its measuring steps on ``data``: each step's
    gradients at the initial weights (the measuring steps leave them put),
    summed in step order as _HeldGradients sums them."""
    model, _ = fresh_model_and_optimizer("sgd")
    held = None
    for x, y in data:
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        grads = [p.grad.detach().clone() for p in model.parameters()]
        held = grads if held is None else [h + g for h, g in zip(held, grads)]
    return held


def _train_first_step_folded(model, opt, rank, data, held):
    """Trains on ``data``; on its first step each parameter's gradient
    becomes (its own + held) / (measuring steps + 1) before the wrapper
    sees it, the same sum in the same order as auto's fold, so a quantizing
    choice (ByteGrad) sees the very bits auto's first step communicates."""
    hooks = [p.register_hook(lambda g, h=h: (g + h) / (DECIDE_AFTER + 1))
             for p, h in zip(model.parameters(), held)]
    first = _train(model, opt, rank, 0, data=data[:1])
    for hook in hooks:
        hook.remove()
    return first + _train(model, opt, rank, 0, data=data[1:])


def scenario_auto(out_dir, override="", steps="6", candidates=""):
    """Trains with algorithm="auto" (BAGUA_ALGORITHM=override when given),
    then the same from the same start with the algorithm auto chose, given
    directly from its first step. A measured choice is compared with its run
    from the step after the measuring ones, whose first gradient is the
    mean of the measuring steps' gradients (at the initial weights) and its
    own, summed as auto sums them, the weights before it the initial ones.
    ``candidates``: comma-separated, auto's default ones when empty."""
    if override:
        os.environ["BAGUA_ALGORITHM"] = override
    bagua.init_process_group()
    rank = bagua.get_rank()
    model, opt = fresh_model_and_optimizer("sgd")
    # the first choice runs to the end (its check would come after step 50)
    initial = [p.detach().clone() for p in model.parameters()]
    chosen_from = dict(candidates=candidates.split(",")) if candidates else {}
    model = model.with_bagua([opt], AutoAlgorithm(decide_after=DECIDE_AFTER, powersgd_start_iter=2,
                                                  verify_steps=50, **chosen_from))
    decisions = []
    auto_params = _train(model, opt, rank, int(steps), decisions)
    impl = model.bagua_ddp.bagua_algorithm_impl
    state = model.bagua_ddp.state_dict()["algorithm_state"]
    choice = decisions[-1]["choice"]
    model.without_bagua()
    direct_model, direct_opt = fresh_model_and_optimizer("sgd")
    data = batches(rank, steps=int(steps))
    if override:
        direct_model = direct_model.with_bagua([direct_opt], DIRECT[choice](2))
        direct_params = _train(direct_model, direct_opt, rank, int(steps))
    else:  # auto's PowerSGD compressed from its first step (start_iter 2, 2 measuring steps)
        held = _held_gradients(data[:DECIDE_AFTER])
        direct_model = direct_model.with_bagua([direct_opt], DIRECT[choice](0))
        direct_params = [initial] * DECIDE_AFTER + \
            _train_first_step_folded(direct_model, direct_opt, rank, data[DECIDE_AFTER:], held)
    torch.save({"decisions": decisions, "current": type(impl.current).__name__, "state_choice": state["choice"],
                "auto": auto_params, "direct": direct_params}, os.path.join(out_dir, f"rank{rank}.pt"))


def scenario_layout(out_dir, gain, steps="14"):
    """auto with PowerSGD (8-bit) its only candidate, on a model of several
    runtime buckets: once settled it tries the runtime's buckets, keeps them
    or goes back to one bucket (``gain``: LAYOUT_GAIN, so that the test
    decides which), PowerSGD's state carried over. Then PowerSGD with one
    bucket directly, from auto's first averaged step (as scenario_auto)."""
    import bagua.torch_api.algorithms.auto as auto

    auto.LAYOUT_GAIN = float(gain)
    bagua.init_process_group()
    rank = bagua.get_rank()
    model, opt = fresh_model_and_optimizer("sgd")
    initial = [p.detach().clone() for p in model.parameters()]
    model = model.with_bagua([opt], AutoAlgorithm(candidates=["powersgd_8bit"], decide_after=DECIDE_AFTER,
                                                  powersgd_start_iter=2, verify_steps=2))
    decisions = []
    auto_params = _train(model, opt, rank, int(steps), decisions)
    impl = model.bagua_ddp.bagua_algorithm_impl
    layout = {"one_bucket": impl.current.one_bucket, "buckets": len(model.bagua_ddp.bagua_buckets),
              "state_one_bucket": model.bagua_ddp.state_dict()["algorithm_state"]["one_bucket"]}
    model.without_bagua()
    direct_model, direct_opt = fresh_model_and_optimizer("sgd")
    data = batches(rank, steps=int(steps))
    held = _held_gradients(data[:DECIDE_AFTER])
    direct_model = direct_model.with_bagua([direct_opt], DIRECT["powersgd_8bit"](0))
    direct_params = [initial] * DECIDE_AFTER + \
        _train_first_step_folded(direct_model, direct_opt, rank, data[DECIDE_AFTER:], held)
    torch.save({"decisions": impl.decisions, "layout": layout, "auto": auto_params, "direct": direct_params},
               os.path.join(out_dir, f"rank{rank}.pt"))


def scenario_remeasure(out_dir):
    """The first prediction of PowerSGD is made 1000x too small: once it ran
    (2 compressed steps), its measured step is far off, so auto measures
    again and chooses again with the measured time in place of the
    prediction. Records every rank's decision log and what runs at the end."""
    import bagua.torch_api.algorithms.auto as auto

    predict, calls = auto.predict, []

    def first_one_wrong(m):
        p = predict(m)
        calls.append(dict(p))
        if len(calls) == 1:
            p["powersgd"] = p["gradient_allreduce"] / 1000
        return p

    auto.predict = first_one_wrong
    bagua.init_process_group()
    rank = bagua.get_rank()
    model, opt = fresh_model_and_optimizer("sgd")
    model = model.with_bagua([opt], AutoAlgorithm(candidates=["gradient_allreduce", "powersgd"], decide_after=2,
                                                  powersgd_start_iter=2, verify_steps=2))
    _train(model, opt, rank, 12)
    impl = model.bagua_ddp.bagua_algorithm_impl
    torch.save({"log": AutoAlgorithm.decisions(model), "deciding": impl.deciding, "predictions": calls,
                "current": type(impl.current).__name__, "choice": impl.choice},
               os.path.join(out_dir, f"rank{rank}.pt"))


def scenario_override_mismatch(out_dir):
    """The last rank sets another BAGUA_ALGORITHM than the others."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.environ["BAGUA_ALGORITHM"] = "bytegrad" if rank == world - 1 else "powersgd"
    bagua.init_process_group()
    model, opt = fresh_model_and_optimizer("sgd")
    error = None
    try:
        model.with_bagua([opt], "auto")
    except bagua.InvalidArgumentError as e:
        error = str(e)
    torch.save({"error": error}, os.path.join(out_dir, f"rank{rank}.pt"))


def scenario_resume(out_dir):
    """A checkpoint taken after the choice (ByteGrad, the only candidate),
    loaded into a fresh auto wrapper that would measure for 50 steps and
    could only pick PowerSGD: it runs the saved choice from the next step."""
    bagua.init_process_group()
    rank = bagua.get_rank()
    model, opt = fresh_model_and_optimizer("sgd")
    model = model.with_bagua([opt], AutoAlgorithm(candidates=["bytegrad"], decide_after=2))
    _train(model, opt, rank, 3)
    saved = model.bagua_ddp.state_dict()
    model.without_bagua()
    fresh, fresh_opt = fresh_model_and_optimizer("sgd")
    fresh = fresh.with_bagua([fresh_opt], AutoAlgorithm(candidates=["powersgd"], decide_after=50))
    fresh.bagua_ddp.load_state_dict(saved)
    _train(fresh, fresh_opt, rank, 2)
    impl = fresh.bagua_ddp.bagua_algorithm_impl
    torch.save({"choice": AutoAlgorithm.decision(fresh)["choice"], "current": type(impl.current).__name__},
               os.path.join(out_dir, f"rank{rank}.pt"))


if __name__ == "__main__":
    scenario, out_dir = sys.argv[1], sys.argv[2]
    globals()[f"scenario_{scenario}"](out_dir, *sys.argv[3:])
