"""Worker scenarios of test_checkpoint.py, run on several processes by
launcher.run_workers(script=...).

Usage: checkpoint_workers.py SCENARIO OUT_DIR [ARGS...]; each rank saves its
results to OUT_DIR/rank{RANK}.pt.
"""

import os
import signal
import sys

import torch
import torch.nn.functional as F

import bagua.torch_api as bagua
from bagua.bluefog import topology_util
from bagua.torch_api.algorithms.bytegrad import ByteGradAlgorithm
from bagua.torch_api.algorithms.decentralized import DecentralizedAlgorithm, LowPrecisionDecentralizedAlgorithm
from bagua.torch_api.algorithms.base import Algorithm
from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm, GradientAllReduceAlgorithmImpl
from bagua.torch_api.algorithms.q_adam import QAdamAlgorithm, QAdamOptimizer
from bagua.torch_api.checkpoint import checkpointing, load_checkpoint, save_checkpoint
from workers import Net

STEPS, SAVE_AT, LOST_STEPS = 10, 5, 2


def batch(rank, step):
    """The same data for a (rank, step) in every run: the data order is
    deterministic, as a resumable run needs."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, 20, generator=g), torch.randint(0, 5, (16,), generator=g)


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def qadam(model):
    return QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=3)


class ErrorFeedbackByteGradImpl(GradientAllReduceAlgorithmImpl):
    def init_operations(self, bagua_ddp, bucket):
        bucket.clear_ops()
        bucket.append_centralized_synchronous_op(average=True, scattergather=True, compression="MinMaxUInt8",
                                                 group=self.process_group, error_feedback=True)


class ErrorFeedbackByteGrad(Algorithm):
    """ByteGrad with error feedback (no built-in algorithm enables it): its
    residuals are state a checkpoint must keep."""

    def reify(self, process_group):
        return ErrorFeedbackByteGradImpl(process_group)


# name -> (optimizer factory, algorithm factory taking the optimizer). Not
# hierarchical: the ranks run on one node, where hierarchical averages all in
# full precision and the compression and peer selection would never run.
# shift_one every 2nd step: its partners follow the op's step, the interval
# the engine's step count.
ALGORITHMS = {
    "gradient_allreduce": (sgd, lambda opt: GradientAllReduceAlgorithm()),
    "bytegrad": (sgd, lambda opt: ByteGradAlgorithm(hierarchical=False)),
    "bytegrad_error_feedback": (sgd, lambda opt: ErrorFeedbackByteGrad()),
    "qadam": (qadam, lambda opt: QAdamAlgorithm(opt, hierarchical=False)),
    "decentralized_shift_one": (sgd, lambda opt: DecentralizedAlgorithm(
        hierarchical=False, peer_selection_mode="shift_one", communication_interval=2)),
    "low_precision_decentralized": (sgd, lambda opt: LowPrecisionDecentralizedAlgorithm(hierarchical=False)),
    # W and one replica per in-neighbour are state
    "low_precision_neighbor": (sgd, lambda opt: LowPrecisionDecentralizedAlgorithm(
        hierarchical=False, topology=topology_util.ExponentialGraph(bagua.get_world_size()))),
}


def wrapped(name, seed=7, algorithms=None):
    torch.manual_seed(seed)
    model = Net()
    make_optimizer, make_algorithm = (algorithms or ALGORITHMS)[name]
    opt = make_optimizer(model)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    model = model.with_bagua([opt], make_algorithm(opt))
    return model, opt, scheduler


def train(model, opt, scheduler, first, last):
    """Steps first..last (counted from 1)."""
    for step in range(first, last + 1):
        x, y = batch(bagua.get_rank(), step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        scheduler.step()


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


def scenario_resume(out_dir, phase, checkpoints):
    """phase full: STEPS steps. first: SAVE_AT steps, a checkpoint, then
    LOST_STEPS more (the work a crash loses). resume: a fresh model (another
    seed), the checkpoint loaded, the steps after it."""
    bagua.init_process_group()
    results = {}
    for name in ALGORITHMS:
        path = os.path.join(checkpoints, name)
        model, opt, scheduler = wrapped(name, seed=7 if phase != "resume" else 99)
        if phase == "full":
            train(model, opt, scheduler, 1, STEPS)
        elif phase == "first":
            train(model, opt, scheduler, 1, SAVE_AT)
            save_checkpoint(SAVE_AT, path, model, opt, scheduler)
            train(model, opt, scheduler, SAVE_AT + 1, SAVE_AT + LOST_STEPS)
        else:
            iteration = load_checkpoint(path, model, opt, scheduler)
            results[name + "/iteration"] = iteration
            train(model, opt, scheduler, iteration + 1, STEPS)
        results[name] = weights(model)
        model.without_bagua()
    torch.save(results, os.path.join(out_dir, f"rank{bagua.get_rank()}.pt"))


def scenario_interrupted_save(out_dir, checkpoints, crash_at):
    """A checkpoint at SAVE_AT, then a save at STEPS killed (SIGKILL) just
    before its crash_at-th rename (1: the first file; 'tracker': the tracker
    file, after every data file was renamed into place)."""
    bagua.init_process_group()
    model, opt, scheduler = wrapped("gradient_allreduce")
    train(model, opt, scheduler, 1, SAVE_AT)
    save_checkpoint(SAVE_AT, checkpoints, model, opt, scheduler)
    torch.save(weights(model), os.path.join(out_dir, "saved_weights.pt"))
    train(model, opt, scheduler, SAVE_AT + 1, STEPS)
    renames = []

    def crash(tmp, final):
        renames.append(final)
        is_tracker = final.endswith(checkpointing.TRACKER)
        if (crash_at == "tracker" and is_tracker) or (crash_at != "tracker" and len(renames) == int(crash_at)):
            os.kill(os.getpid(), signal.SIGKILL)

    checkpointing._before_rename = crash
    save_checkpoint(STEPS, checkpoints, model, opt, scheduler)


def scenario_hold_weights(out_dir):
    """Asynchronous model average, training idle: do the weights change over
    0.3 s, with and without the algorithm's hold_weights (checkpoints read
    and write the weights inside it)?"""
    import time

    from bagua.torch_api.algorithms.async_model_average import AsyncModelAverageAlgorithm

    bagua.init_process_group()
    algorithms = {"async": (sgd, lambda opt: AsyncModelAverageAlgorithm(sync_interval_ms=5))}
    model, opt, scheduler = wrapped("async", algorithms=algorithms)
    engine = model.bagua_ddp

    def changes_over(seconds):
        before = weights(model)
        time.sleep(seconds)
        return any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))

    train(model, opt, scheduler, 1, 5)  # ranks' weights now differ: rounds move them
    results = {"free": changes_over(0.3)}
    train(model, opt, scheduler, 6, 10)
    with engine.bagua_algorithm_impl.hold_weights(engine):
        results["held"] = changes_over(0.3)
    results["after"] = changes_over(0.3)  # the rounds go on after the hold
    model.without_bagua()
    torch.save(results, os.path.join(out_dir, f"rank{bagua.get_rank()}.pt"))


def scenario_rebuild_keeps_step(out_dir):
    """Decentralized shift_one: the ops' communication step after 3 steps, a
    rebuild of the buckets (as a checkpoint load or the autotuner does) and
    2 more steps."""
    bagua.init_process_group()
    model, opt, scheduler = wrapped("decentralized_shift_one")  # communicates every 2nd step
    engine = model.bagua_ddp
    train(model, opt, scheduler, 1, 3)
    before = [op.communication_step for op in engine.bagua_algorithm_impl.ops.values()]
    engine.request_rebuild()
    train(model, opt, scheduler, 4, 5)
    after = [op.communication_step for op in engine.bagua_algorithm_impl.ops.values()]
    model.without_bagua()
    torch.save({"before": before, "after": after}, os.path.join(out_dir, f"rank{bagua.get_rank()}.pt"))


if __name__ == "__main__":
    scenario, out_dir = sys.argv[1], sys.argv[2]
    globals()[f"scenario_{scenario}"](out_dir, *sys.argv[3:])
