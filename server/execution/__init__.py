"""Engine calls, wherever they run: the call types (:mod:`.calls`) and the :class:`Runner`
protocol with the in-process runner (:mod:`.runners`).

Imports :mod:`~pyhf_gpu_server.engine` and :mod:`~pyhf_gpu_server.inference` only: the
service (:mod:`pyhf_gpu_server.service`) and the cluster (:mod:`pyhf_gpu_server.cluster`)
both build on it, neither through the other.
"""

from .calls import (
    BatchContext,
    CallMemory,
    CallRow,
    ComputedRow,
    EngineCall,
    EngineOperation,
    EngineRows,
    FitPlanLike,
    ModelRecipe,
    WarmModel,
    model_id,
    use_operations,
)
from .runners import Runner, check_device, device_name, is_out_of_memory, run_rows

__all__ = [
    "BatchContext",
    "CallMemory",
    "CallRow",
    "ComputedRow",
    "EngineCall",
    "EngineOperation",
    "EngineRows",
    "FitPlanLike",
    "ModelRecipe",
    "Runner",
    "WarmModel",
    "check_device",
    "device_name",
    "is_out_of_memory",
    "model_id",
    "run_rows",
    "use_operations",
]
