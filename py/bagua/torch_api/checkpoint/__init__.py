"""Checkpoints in Bagua's layout: ``save_checkpoint`` / ``load_checkpoint``."""

from bagua.torch_api.checkpoint.checkpointing import load_checkpoint, save_checkpoint

__all__ = ["save_checkpoint", "load_checkpoint"]
