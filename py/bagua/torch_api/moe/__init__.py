"""Bagua's mixture-of-experts layer: ``from bagua.torch_api.moe import MoE``."""

from bagua.torch_api.moe.layer import MoE  # noqa: F401

__all__ = ["MoE"]
