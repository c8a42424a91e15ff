"""The compute core: pyhf workspaces as batched, device-resident PyTorch likelihoods."""

from .compiled import KernelCache, batch_bucket
from .errors import EngineError, IncompatibleModelsError, UnsupportedModelError
from .model import HistFactoryModel

__all__ = [
    "EngineError",
    "HistFactoryModel",
    "IncompatibleModelsError",
    "KernelCache",
    "UnsupportedModelError",
    "batch_bucket",
]
