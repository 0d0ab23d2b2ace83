"""Autotuning of the bucket size, inside the job.

With ``BAGUA_AUTOTUNE=1`` (or ``with_bagua(..., autotune=True)``, or the
launcher's ``--autotune_level 1``), after ``BAGUA_AUTOTUNE_WARMUP_STEPS``
steps the runtime tries bucket-size plans and keeps the fastest:

- rank 0 proposes each plan with Optuna (TPE, log-uniform bucket size); the
  first trial is the default size, so the result is never slower than it;
- the proposal is broadcast and every rank re-buckets at the same step,
  between iterations (the planner builds the same buckets on every rank from
  rank 0's profiled order; gradients, weights and optimizer state are copied
  into the new buffers);
- a trial is scored by the training throughput over a window of
  ``BAGUA_AUTOTUNE_WINDOW_STEPS`` steps: each step's time is the slowest
  rank's, and the score is the inverse of the median step time (a median,
  so one step disturbed by something else on the machine does not decide);
- after ``BAGUA_AUTOTUNE_MAX_TRIALS`` trials or ``BAGUA_AUTOTUNE_MAX_SECONDS``
  the best plan is applied and frozen.

Every trial and the chosen plan are logged and written as JSON to
``BAGUA_AUTOTUNE_OUTPUT`` (default ``bagua_autotune.json``, rank 0). A later
run loads a saved plan with ``BAGUA_AUTOTUNE_PLAN=path`` and skips tuning.
"""

import json
import time
from pathlib import Path
from typing import List, Optional

import torch

from bagua.torch_api._core import InvalidArgumentError, core, log
from bagua.torch_api.communication import ReduceOp, allreduce_inplace, broadcast


def enabled(explicit: Optional[bool]) -> bool:
    if explicit is not None:
        return bool(explicit)
    return core.env().autotune


def load_plan(path: str) -> dict:
    """A plan written by a previous autotuned run."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise InvalidArgumentError(f"BAGUA_AUTOTUNE_PLAN={path}: cannot read a plan: {error}") from None
    best = data.get("best", data)
    if not isinstance(best.get("bucket_bytes"), int) or best["bucket_bytes"] <= 0:
        raise InvalidArgumentError(f"BAGUA_AUTOTUNE_PLAN={path}: no positive 'bucket_bytes' in the plan")
    return best


class Autotuner:
    """Drives the trials of one wrapped module. ``step_begin`` is called at the
    start of every training step on every rank; it returns a bucket size to
    apply before this step, or None."""

    SMALLEST = 16 * 1024
    LARGEST = 256 * 1024 * 1024

    def __init__(self, ddp, default_bucket_bytes: int):
        self.ddp = ddp
        self.rank = ddp.process_group.get_rank()
        self.default_bucket_bytes = default_bucket_bytes
        env = core.env()
        self.warmup_steps = env.autotune_warmup_steps
        self.window_steps = env.autotune_window_steps
        self.max_trials = env.autotune_max_trials
        self.max_seconds = env.autotune_max_seconds
        self.output = env.autotune_output
        self.trials: List[dict] = []
        self.frozen = False
        self.best: Optional[dict] = None
        self._started_at: Optional[float] = None
        self._step_starts: List[float] = []
        self._window_begin_step = 0
        self._current: Optional[dict] = None
        self._study = None
        self._optuna_trial = None

    # -- rank 0's proposals ---------------------------------------------------
    def _propose(self) -> int:
        """Rank 0: the next bucket size, or -1 to stop."""
        if len(self.trials) >= self.max_trials or time.monotonic() - self._started_at > self.max_seconds:
            return -1
        if not self.trials:
            return self.default_bucket_bytes
        if self._study is None:
            import optuna

            optuna.logging.set_verbosity(optuna.logging.WARNING)
            self._study = optuna.create_study(direction="maximize",
                                              sampler=optuna.samplers.TPESampler(seed=0))
            for trial in self.trials:  # what was measured before the study existed
                self._study.add_trial(optuna.trial.create_trial(
                    params={"bucket_bytes": trial["bucket_bytes"]},
                    distributions={"bucket_bytes": self._distribution()},
                    value=trial["steps_per_second"]))
        self._optuna_trial = self._study.ask({"bucket_bytes": self._distribution()})
        return int(self._optuna_trial.params["bucket_bytes"])

    def _distribution(self):
        import optuna

        return optuna.distributions.IntDistribution(min(self.SMALLEST, self.default_bucket_bytes),
                                                    max(self.LARGEST, self.default_bucket_bytes), log=True)

    def _tell(self, value: float) -> None:
        if self._study is not None and self._optuna_trial is not None:
            self._study.tell(self._optuna_trial, value)
            self._optuna_trial = None

    def _agree(self, value: int) -> int:
        tensor = torch.tensor([value], dtype=torch.int64)
        broadcast(tensor, 0, comm=self.ddp.engine_group)
        return int(tensor.item())

    def _median_slowest_step(self, step_times: List[float]) -> float:
        """Median over the window's steps of the slowest rank's step time."""
        tensor = torch.tensor(step_times, dtype=torch.float64)
        allreduce_inplace(tensor, op=ReduceOp.MAX, comm=self.ddp.engine_group)
        return float(tensor.median().item())

    # -- the state machine ----------------------------------------------------
    def step_begin(self, step: int) -> Optional[int]:
        if self.frozen or step <= self.warmup_steps:
            return None
        if self._started_at is None:
            self._started_at = time.monotonic()
        if self._current is not None:
            self._step_starts.append(time.perf_counter())
            if step - self._window_begin_step < self.window_steps:
                return None
            starts = self._step_starts
            median = self._median_slowest_step([b - a for a, b in zip(starts, starts[1:])])
            self._current["steps_per_second"] = 1.0 / median
            self._current["buckets"] = len(self.ddp.bagua_buckets)
            self.trials.append(self._current)
            if self.rank == 0:
                self._tell(self._current["steps_per_second"])
                log("info", f"autotune trial {len(self.trials)}: bucket size {self._current['bucket_bytes']} "
                            f"bytes, {self._current['buckets']} buckets, "
                            f"{self._current['steps_per_second']:.2f} steps/s")
            self._current = None
        proposal = self._agree(self._propose() if self.rank == 0 else 0)
        if proposal < 0:
            self.best = max(self.trials, key=lambda t: t["steps_per_second"])
            self.frozen = True
            self._write()
            return self.best["bucket_bytes"]
        self._current = {"trial": len(self.trials), "bucket_bytes": proposal, "step": step}
        return proposal

    def window_starts(self, step: int) -> None:
        """Called once the proposal of this step has been applied: the trial's
        measuring window starts now."""
        if self._current is not None and self._current["step"] == step:
            self._window_begin_step = step
            self._step_starts = [time.perf_counter()]

    def _write(self) -> None:
        order = [t.bagua_tensor_name for b in self.ddp.bagua_buckets for t in b.tensors]
        report = {"trials": self.trials, "best": {**self.best, "order": order},
                  "warmup_steps": self.warmup_steps, "window_steps": self.window_steps}
        log("info", f"autotune chose bucket size {self.best['bucket_bytes']} bytes "
                    f"({self.best['steps_per_second']:.2f} steps/s) after {len(self.trials)} trials")
        if self.rank == 0:
            Path(self.output).write_text(json.dumps(report, indent=2))
