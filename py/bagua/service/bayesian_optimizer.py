"""A Bayesian optimizer with Bagua's ask/tell interface, on optuna's TPE
sampler (Debian's python3-optuna; Bagua used scikit-optimize)."""

import collections
import logging
from typing import Optional, Tuple

__all__ = ["IntParam", "FloatParam", "BoolParam", "BayesianOptimizer"]


class _Param:
    """A declared parameter: its starting value and its range."""

    def __init__(self, val, space_dimension: Tuple):
        self.val = val
        self.space_dimension = tuple(space_dimension)

    def __str__(self):
        return str(self.__dict__)


class IntParam(_Param):
    """An integer in [low, high]."""


class FloatParam(_Param):
    """A float in [low, high]."""


class BoolParam(_Param):
    def __init__(self, val: bool):
        super().__init__(val, (0, 1))


class BayesianOptimizer:
    """Maximizes a score over the declared parameters: ``ask()`` proposes a
    dict of values, ``tell(values, score)`` reports how they did (values
    never asked for are welcome too, e.g. the defaults). The first
    ``n_initial_points`` proposals explore at random; ``random_state`` seeds
    them. ``initial_point_generator`` is accepted for Bagua's signature
    (optuna's TPE has its own start)."""

    def __init__(self, param_declaration: dict, n_initial_points: int = 20, initial_point_generator: str = "halton",
                 random_state: Optional[int] = 0):
        import optuna
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.param_declaration = collections.OrderedDict(param_declaration)
        self._distributions = {name: self._distribution(d) for name, d in self.param_declaration.items()}
        self._study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(
            n_startup_trials=n_initial_points, seed=random_state))
        self._asked = {}  # the values of trials asked and not told yet -> the trial

    @staticmethod
    def _distribution(declaration):
        import optuna.distributions as d
        if isinstance(declaration, BoolParam):
            return d.CategoricalDistribution([False, True])
        if isinstance(declaration, IntParam):
            return d.IntDistribution(*(int(v) for v in declaration.space_dimension))
        if isinstance(declaration, FloatParam):
            return d.FloatDistribution(*(float(v) for v in declaration.space_dimension))
        raise TypeError(f"BayesianOptimizer: declare parameters as IntParam, FloatParam or BoolParam, "
                        f"got {type(declaration).__name__}")

    def _key(self, values: dict) -> tuple:
        return tuple(values[name] for name in self.param_declaration)

    def ask(self) -> dict:
        trial = self._study.ask(self._distributions)
        values = {name: trial.params[name] for name in self.param_declaration}
        self._asked[self._key(values)] = trial
        return values

    def tell(self, param_dict: dict, score: float) -> None:
        import optuna
        missing = [name for name in self.param_declaration if name not in param_dict]
        if missing:
            raise KeyError(f"BayesianOptimizer.tell: no value for {missing}")
        values = {name: self._cast(name, param_dict[name]) for name in self.param_declaration}
        trial = self._asked.pop(self._key(values), None)
        if trial is not None:
            self._study.tell(trial, float(score))
            return
        try:
            self._study.add_trial(optuna.trial.create_trial(params=values, distributions=self._distributions,
                                                            value=float(score)))
        except ValueError as err:  # a value outside the declared space
            logging.getLogger(__name__).warning("BayesianOptimizer.tell: skipped %s (%s)", values, err)

    def _cast(self, name: str, value):
        declaration = self.param_declaration[name]
        if isinstance(declaration, BoolParam):
            return bool(value)
        if isinstance(declaration, IntParam):
            return int(value)
        return float(value)

    def best(self) -> Tuple[dict, float]:
        """The best values told so far and their score."""
        trial = self._study.best_trial
        return dict(trial.params), trial.value
