"""Algorithms by name: Bagua's ``GlobalAlgorithmRegistry``.

Bagua's clients build algorithms from a string, e.g. Lightning's Bagua
strategy calls ``Algorithm.init("bytegrad", hierarchical=False)``. The
registry maps each name to the class (or any callable) that builds the
algorithm from keyword arguments; ``bagua.torch_api.algorithms`` registers
the built-in ones when it is imported, and users register their own::

    from bagua.torch_api.algorithms import GlobalAlgorithmRegistry
    GlobalAlgorithmRegistry.register("my_algorithm", MyAlgorithm, description="...")

This module sits below every algorithm and imports nothing of bagua, so any
algorithm module can use it.
"""

from typing import Any, Callable, Dict, List, Optional

__all__ = ["GlobalAlgorithmRegistry"]


class _AlgorithmRegistry(dict):
    """name -> {"algorithm": callable, "description": str}, as Bagua's."""

    def register(self, name: str, algorithm: Callable, description: Optional[str] = None) -> None:
        """Registers ``algorithm`` (a class or a factory taking keyword
        arguments) under ``name``. A name already registered is refused
        (ValueError), so two libraries cannot silently shadow each other."""
        if not isinstance(name, str) or not name:
            raise TypeError(f"`name` must be a non-empty str, found {name!r}")
        if not callable(algorithm):
            raise TypeError(f"`algorithm` must be callable (a class or a factory), found {algorithm!r}")
        if name in self:
            raise ValueError(f"'{name}' is already present in the registry.")
        entry: Dict[str, Any] = {"algorithm": algorithm, "description": description or ""}
        self[name] = entry

    def get(self, name: str) -> Callable:  # type: ignore[override]
        """The callable registered under ``name``; KeyError listing the
        registered names when there is none."""
        if name in self:
            return self[name]["algorithm"]
        available = ", ".join(sorted(self.keys())) or "none"
        raise KeyError(f"'{name}' not found in registry. Available names: {available}")

    def available_algorithms(self) -> List[str]:
        """The registered names, in registration order."""
        return list(self.keys())

    def __str__(self) -> str:
        return "Registered Algorithms: {}".format(", ".join(self.keys()))


#: The process-wide registry (Bagua's name).
GlobalAlgorithmRegistry = _AlgorithmRegistry()
