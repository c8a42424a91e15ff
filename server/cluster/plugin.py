"""A cluster worker's warm models: a Dask :class:`~distributed.WorkerPlugin` holding the same
LRU as the server's cache (:class:`~pyhf_gpu_server.service.models_cache.WarmModels`), on the
worker's one device.

Models are built from a recipe (:class:`~pyhf_gpu_server.execution.ModelRecipe`) the
first time a batch brings one, then found by key; a batch that brings only the key of a model
this worker no longer holds gets ``None`` (the API node resends the recipe).
"""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Hashable
from typing import Any

import torch
from distributed import WorkerPlugin

from pyhf_gpu_server.allocator import tune_cpu_allocator
from pyhf_gpu_server.blas import limit_blas_threads
from pyhf_gpu_server.execution import ModelRecipe, check_device, device_name
from pyhf_gpu_server.service import warmup
from pyhf_gpu_server.service.admission import FitMemory
from pyhf_gpu_server.service.models_cache import (
    CacheEntry,
    WarmModels,
    host_memory_releaser,
    memory_releaser,
    model_bytes,
)
from pyhf_gpu_server.service.settings import Settings

PLUGIN_NAME = "pyhf-gpu-models"
_INSTALL_LOCK = threading.Lock()


class WorkerModels(WorkerPlugin):
    """Warm models on one device, by key; hit and miss counts for ``/info``."""

    name = PLUGIN_NAME

    def __init__(
        self,
        device: str = "auto",
        max_items: int = 32,
        max_bytes: int = 4096 * 2**20,
        torch_threads: int = 0,
        warm_up: bool = True,
    ) -> None:
        """Settings only (the plugin may be pickled); the device is taken in :meth:`setup`."""
        self.device_spec = device
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.torch_threads = torch_threads
        self.warm_up = warm_up

    def setup(self, worker: Any) -> None:
        """Take the device (``ValueError`` when it is not there), warm torch up on it."""
        spec = Settings(device=self.device_spec)
        self.device = check_device(spec.resolve_device(torch.cuda.is_available()))
        self.device_name = device_name(self.device)
        if self.torch_threads > 0:
            torch.set_num_threads(self.torch_threads)
        tune_cpu_allocator()  # as pyhf-gpu-server does
        limit_blas_threads()
        self.address = worker.address
        self.warm = WarmModels(self.max_items, self.max_bytes)
        self.memory = FitMemory(release=host_memory_releaser(self.device))
        self.release = memory_releaser(self.device)
        self.hits = self.misses = self.missing = self.batches = 0
        self._lock = threading.Lock()
        if self.warm_up:  # torch's first kernels and fits, the task's imports: paid now
            warmup.infer(warmup.build(self.device, torch.float64))
            importlib.import_module("pyhf_gpu_server.cluster.tasks")

    def model(self, key: Hashable, recipe: ModelRecipe | None) -> tuple[Any, bool, float] | None:
        """(model, hit, build seconds) for ``key``, built from ``recipe`` on a miss; None when
        the model is not warm here and no recipe came."""
        with self._lock:
            self.batches += 1
            entry = self.warm.lookup(key)
            if entry is not None:
                self.hits += 1
                return entry.model, True, 0.0
            if recipe is None:
                self.missing += 1
                return None
        start = time.perf_counter()
        model = recipe.build(self.device)
        entry = CacheEntry(model, model_bytes(model), time.perf_counter() - start)
        with self._lock:
            self.misses += 1
            evicted = self.warm.insert(key, entry)
        if evicted:
            self.release()
        return model, False, entry.build_s

    def describe(self) -> dict[str, Any]:
        """This worker's device, warm models and cache counts (``/info``'s cluster part)."""
        with self._lock:
            return {
                "device": self.device,
                "device_name": self.device_name,
                "models": [m["model_id"] for m in self.warm.describe()],
                "warm": self.warm.describe(),
                "model_count": len(self.warm),
                "cache_hits": self.hits,
                "cache_misses": self.misses,
                "cache_bytes": self.warm.total_bytes,
                "models_missing": self.missing,
                "batches": self.batches,
            }


def models_of(worker: Any) -> WorkerModels:
    """The worker's :class:`WorkerModels`; a plain ``dask worker`` started without the preload
    gets one with the defaults (device ``auto``) at its first batch."""
    plugin = worker.plugins.get(PLUGIN_NAME)
    if plugin is None:
        with _INSTALL_LOCK:
            plugin = worker.plugins.get(PLUGIN_NAME)
            if plugin is None:
                plugin = WorkerModels(warm_up=False)
                plugin.setup(worker)
                worker.plugins[PLUGIN_NAME] = plugin
    return plugin
