"""Everything one running app owns: device, stores, cache, scheduler, job runner.

Created in the app's lifespan from its :class:`Settings` and closed on shutdown; nothing lives at
module level, so two apps in one process (tests) do not share device settings or state.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import torch

from pyhf_gpu_server.engine import KernelCache
from pyhf_gpu_server.execution import Runner, check_device, device_name, run_rows

from . import warmup
from .admission import FitLimits, FitMemory
from .compiling import BackgroundCompiler
from .dispatch import BatchModels, Dispatcher, ServiceScheduler
from .elements import ElementStore
from .engine_shares import EngineShares
from .jobrunner import JobRunner
from .jobstore import DATABASE_NAME, JobStore
from .local_workers import LocalWorkers
from .metrics import Metrics
from .models_cache import ModelCache, host_memory_releaser, memory_releaser
from .requests import Row
from .scheduler import Scheduler
from .settings import Settings
from .workspace_store import WorkspaceStore

__all__ = ["ServiceState", "device_name", "resolve_device"]  # device_name: from execution

log = logging.getLogger("pyhf_gpu_server.service")

DTYPES = {"float64": torch.float64, "float32": torch.float32}
# threads waiting on cluster batches: one per batch in flight (one per live worker), at most
MAX_CLUSTER_IN_FLIGHT = 256


class Cluster(Runner[Row], Protocol):
    """The Dask runner of cluster mode (:class:`pyhf_gpu_server.cluster.runner.ClusterRunner`),
    as the service uses it: the service never imports the cluster package; the composition
    root (``pyhf_gpu_server.cli``) passes its ``connect`` in."""

    warm_models: list[dict[str, Any]]

    def max_in_flight(self) -> int: ...
    def problems(self) -> list[str]: ...
    def describe(self) -> dict[str, Any]: ...
    def close(self) -> None: ...


#: connects to the Dask scheduler at an address (blocking): ``ClusterRunner.connect``
ConnectCluster = Callable[[str, Metrics], Cluster]


def _cluster_in_flight(cluster: Cluster) -> int:
    """Batches in flight in cluster mode: one per live worker, at most a bound."""
    return min(cluster.max_in_flight(), MAX_CLUSTER_IN_FLIGHT)


def resolve_device(settings: Settings) -> str:
    """The torch device the settings ask for; ``ValueError`` if CUDA is asked but absent."""
    return check_device(settings.resolve_device(torch.cuda.is_available()))


@dataclass
class ServiceState:
    """The parts of a running service."""

    settings: Settings
    device: str
    dtype: torch.dtype
    metrics: Metrics
    executor: ThreadPoolExecutor
    build_executor: ThreadPoolExecutor
    workspaces: WorkspaceStore
    jobstore: JobStore
    cache: ModelCache | None  # None in cluster mode: the workers hold the models
    scheduler: ServiceScheduler
    dispatcher: Dispatcher
    jobs: JobRunner
    compiler: BackgroundCompiler | None
    started_at: float
    cluster: Cluster | None = None  # cluster mode (--dask-scheduler)
    device_ok: bool = False

    @classmethod
    async def open(
        cls,
        settings: Settings,
        metrics: Metrics,
        local_workers: LocalWorkers | None = None,
        connect_cluster: ConnectCluster | None = None,
    ) -> ServiceState:
        """Create the parts, check the device (or connect to the Dask scheduler with
        ``connect_cluster``: cluster mode), start the scheduler and job workers;
        ``local_workers`` take shares of large patchsets."""
        device = resolve_device(settings)
        dtype = DTYPES[settings.dtype]
        # models are built (pyhf parsing: slow, CPU-bound) apart from the device thread, so a
        # large new workspace does not stall inference for the warm ones
        build_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pyhf-gpu-build")
        release = memory_releaser(device)
        cluster = None
        cache = None
        compiler = None
        # the one way this server runs engine calls, chosen here: on a Dask cluster, or in
        # process on the device thread (on a CPU, its batches shared with local workers)
        runner: Runner[Row] = run_rows
        max_in_flight: int | Callable[[], int] = 1
        if settings.dask_scheduler is not None:
            if connect_cluster is None:
                raise ValueError("--dask-scheduler: this server was started without the cluster")
            connect = partial(connect_cluster, settings.dask_scheduler, metrics)
            try:
                cluster = await asyncio.get_running_loop().run_in_executor(None, connect)
            except OSError:
                log.error(
                    "cannot reach the Dask scheduler",
                    extra={"dask_scheduler": settings.dask_scheduler},
                )
                raise
            runner = cluster
            max_in_flight = partial(_cluster_in_flight, cluster)
            executor = ThreadPoolExecutor(
                max_workers=MAX_CLUSTER_IN_FLIGHT, thread_name_prefix="pyhf-gpu-cluster"
            )
        else:
            executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pyhf-gpu-device")
            if local_workers is not None and local_workers.engine and device == "cpu":
                runner = EngineShares(local_workers)
            if settings.compile_enabled(device):
                compiler = BackgroundCompiler(KernelCache(), executor)
        jobstore = JobStore(settings.data_dir / DATABASE_NAME)
        workspaces = WorkspaceStore(
            settings.data_dir / "workspaces",
            ttl_s=settings.workspace_ttl_hours * 3600,
            quota_bytes=int(settings.workspace_quota_mb * 2**20),
            in_use=jobstore.active_workspaces,
        )
        if cluster is None:
            cache = ModelCache(
                build_executor,
                executor,
                metrics,
                max_items=settings.model_cache_size,
                max_bytes=int(settings.model_cache_memory_mb * 1024 * 1024),
                release_memory=release,
                on_built=None if compiler is None else compiler.submit,
            )
        limits = FitLimits(
            max_parameters=settings.max_parameters,
            max_bins=settings.max_bins,
            max_fit_bytes=int(settings.max_fit_memory_mb * 2**20),
            max_toys=settings.max_toys_per_request,
            max_model_bytes=settings.max_model_bytes,
        )
        models = BatchModels(
            cache,
            build_executor,
            device,
            dtype,
            limits=limits,
            fit_memory=FitMemory(release=host_memory_releaser(device)),
        )
        scheduler: ServiceScheduler = Scheduler(
            runner,
            executor,
            metrics,
            max_batch_size=settings.max_batch_size,
            max_batch_delay_s=settings.max_batch_delay_ms / 1000,
            batch_gap_s=settings.batch_gap_ms / 1000,
            prepare_wait_s=settings.prepare_wait_ms / 1000,
            max_pending=settings.max_queue,
            job_chunk_s=settings.job_chunk_s,
            release_memory=release,
            max_in_flight=max_in_flight,
            combine=models.combine,
        )
        elements = ElementStore(
            max_elements=settings.element_cache_size,
            workers=local_workers,
            max_layout_bytes=limits.max_model_bytes,
        )
        dispatcher = Dispatcher(models, scheduler, elements)
        jobs = JobRunner(
            jobstore,
            workspaces,
            dispatcher,
            concurrency=settings.max_concurrent_jobs,
            max_queued=settings.max_queue,
            max_attempts=settings.max_job_attempts,
            result_ttl_s=settings.result_ttl_hours * 3600,
        )
        state = cls(
            settings=settings,
            device=device,
            dtype=dtype,
            metrics=metrics,
            executor=executor,
            build_executor=build_executor,
            workspaces=workspaces,
            jobstore=jobstore,
            cache=cache,
            scheduler=scheduler,
            dispatcher=dispatcher,
            jobs=jobs,
            compiler=compiler,
            started_at=time.time(),
            cluster=cluster,
        )
        metrics.device_memory.set_function(state.device_memory_bytes)
        metrics.element_bytes.set_function(lambda: elements.total_bytes)
        metrics.fit_memory.set_function(lambda: dispatcher.fit_memory.current)
        metrics.fit_memory_peak.set_function(lambda: dispatcher.fit_memory.peak)
        if cluster is None:
            state.device_ok = await state.check_device()
            if state.device_ok:
                await state.warm_up()
        else:  # the workers' devices are checked by each worker; readiness asks the cluster
            state.device_ok = True
            await asyncio.get_running_loop().run_in_executor(
                build_executor, warmup.build, "cpu", dtype
            )
        scheduler.start()
        await jobs.start()
        log.info(
            "service started",
            extra={
                "device": device if cluster is None else f"dask {settings.dask_scheduler}",
                "dtype": settings.dtype,
                "data_dir": str(settings.data_dir),
            },
        )
        return state

    async def close(self) -> None:
        """Stop taking work; running jobs go back to ``queued``; free the device thread."""
        await self.jobs.stop()
        await self.scheduler.stop()
        if self.compiler is not None:
            self.compiler.shutdown()
        self.build_executor.shutdown(wait=True, cancel_futures=True)
        self.executor.shutdown(wait=True, cancel_futures=True)
        if self.cache is not None:
            self.cache.clear()
        if self.cluster is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.cluster.close)
        self.jobstore.close()
        log.info("service stopped")

    async def check_device(self) -> bool:
        """Whether a small computation on the device works (run on the device thread)."""

        def probe() -> bool:
            return float(torch.ones(4, device=self.device, dtype=self.dtype).sum()) == 4.0

        try:
            return await asyncio.get_running_loop().run_in_executor(self.executor, probe)
        except Exception:
            log.exception("the device does not work", extra={"device": self.device})
            return False

    async def warm_up(self) -> None:
        """Pay the one-time costs (schema compilation, torch's first kernels and fits) before
        the server is ready, on the build and device threads (see :mod:`.warmup`)."""
        loop = asyncio.get_running_loop()
        start = time.perf_counter()
        model = await loop.run_in_executor(
            self.build_executor, warmup.build, self.device, self.dtype
        )
        await loop.run_in_executor(self.executor, warmup.infer, model)
        log.info("warmed up", extra={"seconds": round(time.perf_counter() - start, 3)})

    def store_problems(self) -> list[str]:
        """Why jobs or workspaces cannot be stored now (each directory tried for real)."""
        problems = [self.jobstore.writable_problem(), self.workspaces.writable_problem()]
        return [problem for problem in problems if problem is not None]

    def device_memory_bytes(self) -> float:
        """Device memory in use: allocated CUDA memory, or on CPU the warm models' bytes and
        what the running fits hold."""
        if self.cluster is None and self.device.startswith("cuda"):
            return float(torch.cuda.memory_allocated(torch.device(self.device)))
        cached = 0 if self.cache is None else self.cache.total_bytes
        return float(cached + self.dispatcher.fit_memory.current)
