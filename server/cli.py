"""``pyhf-gpu-server``: run the service with uvicorn (options from flags or PYHF_GPU_* variables)."""

from __future__ import annotations

import gc
import sys
from collections.abc import Sequence

import uvicorn

from pyhf_gpu_server.allocator import tune_cpu_allocator
from pyhf_gpu_server.blas import limit_blas_threads
from pyhf_gpu_server.service.app import create_app
from pyhf_gpu_server.service.dependencies import with_file_token
from pyhf_gpu_server.service.jobstore import StoreError, preflight
from pyhf_gpu_server.service.local_workers import LocalWorkers
from pyhf_gpu_server.service.logs import configure_logging
from pyhf_gpu_server.service.middleware import header_deadline_protocol
from pyhf_gpu_server.service.settings import settings_from_args
from pyhf_gpu_server.service.state import resolve_device

# The server keeps hundreds of thousands of long-lived objects (workspaces, translations, warm
# models): with CPython's default thresholds every large request pays several full collections
# over all of them. Young objects are still collected, in larger steps.
GC_THRESHOLDS = (50_000, 20, 100)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse settings, check the device, serve until SIGTERM/SIGINT (then shut down gracefully)."""
    settings = settings_from_args(argv)
    configure_logging(settings.log_level)
    try:
        settings = with_file_token(settings)
        device = resolve_device(settings)
    except ValueError as exc:
        print(f"pyhf-gpu-server: error: {exc}", file=sys.stderr)
        return 2
    try:
        preflight(settings.data_dir)
    except StoreError as exc:
        print(f"pyhf-gpu-server: error: {exc}", file=sys.stderr)
        return 1
    gc.set_threshold(*GC_THRESHOLDS)
    tune_cpu_allocator()  # freed tensor memory reused, not page-faulted in again
    limit_blas_threads()  # numpy's BLAS threads would spin on the engine's cores
    # forked now, before the server starts any thread: a child has only the forking thread;
    # on a CPU device they also fit shares of engine calls (a GPU fits every row itself)
    engine = device == "cpu" and settings.dask_scheduler is None
    workers = LocalWorkers.fork(
        settings.local_worker_count,
        engine=engine,
        max_layout_bytes=settings.max_model_bytes,
    )
    connect_cluster = None
    if settings.dask_scheduler is not None:  # dask imported in cluster mode only
        from pyhf_gpu_server.cluster.runner import ClusterRunner

        connect_cluster = ClusterRunner.connect
    try:
        uvicorn.run(
            create_app(settings, local_workers=workers, connect_cluster=connect_cluster),
            host=settings.host,
            port=settings.port,
            log_config=None,
            log_level=settings.log_level,
            access_log=False,
            timeout_graceful_shutdown=max(1, round(settings.graceful_timeout_s)),
            proxy_headers=False,
            limit_concurrency=settings.max_connections,
            http=header_deadline_protocol(settings.header_timeout_s),
        )
    finally:
        workers.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
