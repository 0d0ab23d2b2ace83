"""bagua: a data-parallel training runtime for PyTorch with relaxed communication.

Import the PyTorch API as ``import bagua.torch_api as bagua``.
"""

from bagua.version import __version__

__all__ = ["__version__"]
