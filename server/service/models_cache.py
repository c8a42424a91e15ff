"""The warm model cache: built engine models kept on the device, LRU by count and memory.

Keys name everything a model depends on (workspace digest, measurement, patch digests, modifier
settings, device, dtype). Concurrent requests for a model being built wait for that one build.
Evicting a model drops the cache's reference and asks the device to release cached memory.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import torch

from pyhf_gpu_server.allocator import glibc_function
from pyhf_gpu_server.execution import model_id

from .metrics import Metrics


def model_bytes(model: Any) -> int:
    """Bytes of the distinct tensor storages a model holds (``model.tensors()`` when offered)."""
    tensors = model.tensors().values() if hasattr(model, "tensors") else ()
    storages: dict[int, int] = {}
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor):
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


@dataclass
class CacheEntry:
    """One warm model."""

    model: Any
    nbytes: int
    build_s: float
    hits: int = 0
    created_at: float = field(default_factory=time.time)


@dataclass(frozen=True)
class CachedModel:
    """What :meth:`ModelCache.get` answers."""

    model: Any
    model_id: str
    hit: bool
    build_s: float


@dataclass(eq=False, repr=False)
class WarmModels:
    """The LRU of built models, bounded by ``max_items`` and ``max_bytes`` of tensors: plain
    bookkeeping (no threads, no event loop), shared by the server's :class:`ModelCache` and a
    cluster worker's cache (:mod:`pyhf_gpu_server.cluster.plugin`)."""

    max_items: int
    max_bytes: int
    entries: OrderedDict[Hashable, CacheEntry] = field(init=False, default_factory=OrderedDict)

    def lookup(self, key: Hashable) -> CacheEntry | None:
        """The warm entry of ``key`` (counted as a hit, now the most recently used), or None."""
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
            entry.hits += 1
        return entry

    def insert(self, key: Hashable, entry: CacheEntry) -> int:
        """Add ``entry``; evict least recently used models over the count or memory bound
        (never the new one); the number evicted."""
        self.entries[key] = entry
        evicted = 0
        while len(self.entries) > 1 and (
            len(self.entries) > self.max_items or self.total_bytes > self.max_bytes
        ):
            self.entries.popitem(last=False)
            evicted += 1
        return evicted

    def clear(self) -> None:
        """Drop every model."""
        self.entries.clear()

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def total_bytes(self) -> int:
        """Tensor bytes of all warm models."""
        return sum(entry.nbytes for entry in self.entries.values())

    def describe(self) -> list[dict[str, Any]]:
        """The warm models, most recently used first (for /info)."""
        return [
            {
                "model_id": model_id(key),
                "elements": getattr(entry.model, "n_elements", None),
                "parameters": getattr(entry.model, "n_pars", None),
                "bytes": entry.nbytes,
                "hits": entry.hits,
                "build_ms": round(entry.build_s * 1000, 3),
                "created_at": entry.created_at,
            }
            for key, entry in reversed(self.entries.items())
        ]


class ModelCache:
    """:class:`WarmModels` for the event loop: models built on the build thread, concurrent
    requests for one model in the making wait for that one build, metrics kept."""

    def __init__(
        self,
        build_executor: Executor,
        device_executor: Executor,
        metrics: Metrics,
        *,
        max_items: int,
        max_bytes: int,
        release_memory: Callable[[], None] = lambda: None,
        on_built: Callable[[Any], object] | None = None,
    ) -> None:
        """Build models on ``build_executor``; free memory on ``device_executor`` after evictions;
        call ``on_built(model)`` after each build."""
        self._build_executor = build_executor
        self._device_executor = device_executor
        self._metrics = metrics
        self.warm = WarmModels(max_items, max_bytes)
        self._release_memory = release_memory
        self._on_built = on_built
        self._building: dict[Hashable, asyncio.Future[CacheEntry]] = {}

    async def get(self, key: Hashable, build: Callable[[], Any]) -> CachedModel:
        """The model for ``key``, built with ``build()`` on the build thread on a miss."""
        entry = self.warm.lookup(key)
        pending = self._building.get(key)
        if entry is None and pending is not None:
            entry = await asyncio.shield(pending)
        if entry is None:
            return await self._build(key, build)
        self._metrics.cache_hits.inc()
        return CachedModel(entry.model, model_id(key), True, 0.0)

    async def _build(self, key: Hashable, build: Callable[[], Any]) -> CachedModel:
        """Build on the build thread; others asking meanwhile share the result."""
        loop = asyncio.get_running_loop()
        pending: asyncio.Future[CacheEntry] = loop.create_future()
        self._building[key] = pending
        self._metrics.cache_misses.inc()
        start = time.perf_counter()
        try:
            model = await loop.run_in_executor(self._build_executor, build)
        except BaseException as exc:
            pending.set_exception(exc)
            pending.exception()  # retrieved: nobody else may be waiting
            raise
        finally:
            self._building.pop(key, None)
        entry = CacheEntry(model, model_bytes(model), time.perf_counter() - start)
        pending.set_result(entry)
        self._insert(key, entry)
        if self._on_built is not None:
            self._on_built(model)
        return CachedModel(model, model_id(key), False, entry.build_s)

    def _insert(self, key: Hashable, entry: CacheEntry) -> None:
        """Add ``entry``, evicting over the bounds (device memory freed after evictions)."""
        evicted = self.warm.insert(key, entry)
        if evicted:
            self._metrics.cache_evictions.inc(evicted)
            self._device_executor.submit(self._release_memory)
        self._metrics.cache_size.set(len(self.warm))
        self._metrics.cache_bytes.set(self.warm.total_bytes)

    def clear(self) -> None:
        """Drop every model."""
        self.warm.clear()
        self._metrics.cache_size.set(0)
        self._metrics.cache_bytes.set(0)

    @property
    def total_bytes(self) -> int:
        """Tensor bytes of all warm models."""
        return self.warm.total_bytes

    def describe(self) -> list[dict[str, Any]]:
        """The warm models, most recently used first (for /info)."""
        return self.warm.describe()


def host_memory_releaser(device: str) -> Callable[[], None]:
    """What hands the memory a large CPU fit freed back to the system (glibc's
    ``malloc_trim``; nothing on CUDA, whose caching allocator reuses it, or without glibc)."""
    trim = None if device.startswith("cuda") else glibc_function("malloc_trim")
    if trim is None:
        return lambda: None
    return lambda: trim(0)


def memory_releaser(device: str) -> Callable[[], None]:
    """What frees cached device memory after evictions and out-of-memory errors."""
    if device.startswith("cuda"):
        return torch.cuda.empty_cache
    return lambda: None
