"""Prometheus metrics, registered in a per-app :class:`~prometheus_client.CollectorRegistry`."""

from __future__ import annotations

from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    """The service's metrics. Create one per app; nothing is registered globally. The memory
    gauges are read at every scrape (``set_function``, by the service's state)."""

    def __init__(self) -> None:
        """Create and register every metric in a fresh registry."""
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        counter, gauge = partial(Counter, registry=r), partial(Gauge, registry=r)
        histogram = partial(Histogram, registry=r)
        by_answer = ["route", "method", "status"]
        self.requests = counter(
            "pyhf_gpu_requests",
            "HTTP requests answered, by route template, method and status",
            by_answer,
        )
        self.latency = histogram(
            "pyhf_gpu_request_duration_seconds",
            "HTTP request latency, by route template, method and status",
            by_answer,
            buckets=LATENCY_BUCKETS,
        )
        self.queue_depth = gauge(
            "pyhf_gpu_queue_depth", "hypotheses (rows) waiting for the device, by lane", ["lane"]
        )
        self.batch_size = histogram(
            "pyhf_gpu_batch_size", "hypotheses (rows) per engine call", buckets=BATCH_BUCKETS
        )
        self.batch_seconds = histogram(
            "pyhf_gpu_batch_duration_seconds", "seconds per engine call", buckets=LATENCY_BUCKETS
        )
        self.oom_splits = counter(
            "pyhf_gpu_oom_splits", "batches split in two after a device out-of-memory"
        )
        self.cache_hits = counter("pyhf_gpu_model_cache_hits", "warm model cache hits")
        self.cache_misses = counter(
            "pyhf_gpu_model_cache_misses", "warm model cache misses (models built)"
        )
        self.cache_evictions = counter(
            "pyhf_gpu_model_cache_evictions", "models evicted from the warm cache"
        )
        self.cache_size = gauge("pyhf_gpu_model_cache_size", "models in the warm cache")
        self.cache_bytes = gauge("pyhf_gpu_model_cache_bytes", "tensor bytes held by warm models")
        self.device_memory = gauge(
            "pyhf_gpu_device_memory_bytes",
            "device memory in use (torch.cuda.memory_allocated; on cpu the warm models' bytes)",
        )
        self.jobs = gauge("pyhf_gpu_jobs", "jobs in the job store, by status", ["status"])
        self.element_bytes = gauge(
            "pyhf_gpu_element_cache_bytes",
            "host bytes held by translated patches (the layouts models are built from)",
        )
        self.fit_memory = gauge(
            "pyhf_gpu_fit_memory_bytes",
            "bytes the fits of the engine call running now hold (estimated per row and solver)",
        )
        self.fit_memory_peak = gauge(
            "pyhf_gpu_fit_memory_peak_bytes",
            "the most bytes the fits of one engine call held since the start",
        )
        # process_resident_memory_bytes & co.: what the whole process holds (Linux)
        ProcessCollector(registry=r)
