"""Background ``torch.compile`` of warm models: the first requests run eagerly meanwhile.

The engine's :class:`~pyhf_gpu_server.engine.KernelCache` compiles, per structure, the two
kernels a fit calls: the expected main data (the objective's values) and the expected main
data with its Jacobian (the minimiser's derivatives, once per iteration).
:meth:`BackgroundCompiler.submit` warms both on a separate thread and then switches the model
over on the device thread, between batches; a kernel that fails to compile leaves the model
eager. Whether the service compiles at all is ``Settings.compile_enabled``: by default on CUDA
only (on the CPU a compiled fit gains little for its seconds of compiling per structure:
BENCHMARKS.md, "Engine").
"""

from __future__ import annotations

import logging
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any

import torch

log = logging.getLogger("pyhf_gpu_server.service.compile")


class BackgroundCompiler:
    """Compiles models' kernels off the request path."""

    def __init__(self, kernels: Any, device_executor: Executor) -> None:
        """``kernels``: a KernelCache; the switch-over runs on ``device_executor``."""
        self.kernels = kernels
        self._device_executor = device_executor
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pyhf-gpu-compile")

    def submit(self, model: Any) -> Future[None]:
        """Compile ``model``'s kernels in the background, then let the model use them."""
        return self._pool.submit(self._compile, model)

    def _compile(self, model: Any) -> None:
        """Warm the kernels (slow), then switch the model on the device thread."""
        try:
            with torch.inference_mode():  # the mode engine calls run in (a guard of the trace)
                self.kernels.warm(model)
            self._device_executor.submit(model.enable_compile, self.kernels).result()
        except Exception:
            log.warning("compiling failed; the model stays eager", exc_info=True)
            return
        log.info("model compiled", extra={"model": repr(model)})

    def shutdown(self) -> None:
        """Stop compiling (a compilation in progress finishes in its thread)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
