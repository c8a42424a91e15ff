"""``pyhf-gpu-worker SCHEDULER``: a Dask worker with one device, a ``GPU=1`` resource and the
warm model cache (:class:`~.plugin.WorkerModels`), for ``pyhf-gpu-server --dask-scheduler``.

Also a Dask preload, for workers started by other tools (dask-jobqueue, Dask Gateway,
``dask cuda worker``)::

    dask worker tcp://HOST:8786 --nthreads 1 --resources GPU=1 \\
        --preload pyhf_gpu_server.cluster.worker --pyhf-device cuda

(``--pyhf-*`` options, or ``PYHF_GPU_WORKER_*`` variables, configure the cache.) Where
dask-cuda starts one worker per GPU it sets ``CUDA_VISIBLE_DEVICES`` for each, so ``cuda``
(the default ``auto`` too) is that worker's own GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

import click

ENV_PREFIX = "PYHF_GPU_WORKER_"


def _env(name: str, default: str) -> str:
    return os.environ.get(ENV_PREFIX + name, default)


@click.command(context_settings={"ignore_unknown_options": True})
@click.option("--pyhf-device", default=lambda: _env("DEVICE", "auto"), show_default="auto")
@click.option(
    "--pyhf-model-cache-size", type=int, default=lambda: int(_env("MODEL_CACHE_SIZE", "32"))
)
@click.option(
    "--pyhf-model-cache-memory-mb",
    type=float,
    default=lambda: float(_env("MODEL_CACHE_MEMORY_MB", "4096")),
)
@click.option("--pyhf-torch-threads", type=int, default=lambda: int(_env("TORCH_THREADS", "0")))
@click.option("--pyhf-warm-up/--pyhf-no-warm-up", default=True)
async def dask_setup(
    worker: Any,
    pyhf_device: str,
    pyhf_model_cache_size: int,
    pyhf_model_cache_memory_mb: float,
    pyhf_torch_threads: int,
    pyhf_warm_up: bool,
) -> None:
    """The preload: add the model cache plugin before the worker joins the scheduler."""
    from .plugin import WorkerModels

    plugin = WorkerModels(
        pyhf_device,
        max_items=pyhf_model_cache_size,
        max_bytes=int(pyhf_model_cache_memory_mb * 2**20),
        torch_threads=pyhf_torch_threads,
        warm_up=pyhf_warm_up,
    )
    await worker.plugin_add(plugin, catch_errors=False)


def build_parser() -> argparse.ArgumentParser:
    """The ``pyhf-gpu-worker`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="pyhf-gpu-worker",
        description="A Dask worker serving pyhf-gpu-server --dask-scheduler on one device.",
    )
    parser.add_argument("scheduler", help="the Dask scheduler, e.g. tcp://HOST:8786")
    parser.add_argument(
        "--device", default="auto", help="auto (cuda when available, else cpu), cpu, cuda, cuda:N"
    )
    parser.add_argument(
        "--nthreads", type=int, default=1, help="Dask task threads (one batch runs at a time)"
    )
    parser.add_argument("--name", default=None, help="the worker's name (default: its address)")
    parser.add_argument("--model-cache-size", type=int, default=32, help="most models kept warm")
    parser.add_argument(
        "--model-cache-memory-mb",
        type=float,
        default=4096.0,
        help="most device memory (MiB) warm models hold",
    )
    parser.add_argument(
        "--torch-threads", type=int, default=0, help="torch CPU threads (0: torch's default)"
    )
    parser.add_argument(
        "--http-address",
        default=":0",
        help="the worker's HTTP server (/health, /metrics), e.g. :8789 (default: any port)",
    )
    parser.add_argument("--host", default=None, help="the address to listen on (default: any)")
    parser.add_argument(
        "--contact-address", default=None, help="the address others reach it at, tcp://HOST:PORT"
    )
    parser.add_argument("--memory-limit", default="auto", help="Dask's worker memory limit")
    parser.add_argument("--local-directory", default=None, help="Dask's scratch directory")
    parser.add_argument(
        "--nanny",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the worker under a Dask nanny, which restarts it if it dies",
    )
    parser.add_argument(
        "--warm-up",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fit a small model on the device before joining",
    )
    return parser


def preload_argv(args: argparse.Namespace) -> list[str]:
    """The preload's options from the command line."""
    return [
        "--pyhf-device",
        args.device,
        "--pyhf-model-cache-size",
        str(args.model_cache_size),
        "--pyhf-model-cache-memory-mb",
        str(args.model_cache_memory_mb),
        "--pyhf-torch-threads",
        str(args.torch_threads),
        "--pyhf-warm-up" if args.warm_up else "--pyhf-no-warm-up",
    ]


async def serve(args: argparse.Namespace) -> None:
    """Run the worker (or its nanny) until it closes or SIGTERM/SIGINT."""
    import dask
    from distributed import Nanny, Worker

    # one long task at a time: Dask's statistical profiler (a stack sample every 10 ms, under
    # the GIL) would only slow the fits down
    dask.config.set({"distributed.worker.profile.enabled": False})
    server_class = Nanny if args.nanny else Worker
    server = server_class(
        args.scheduler,
        nthreads=args.nthreads,
        name=args.name,
        resources={"GPU": 1},
        preload=["pyhf_gpu_server.cluster.worker"],
        preload_argv=preload_argv(args),
        dashboard_address=args.http_address,
        host=args.host,
        contact_address=args.contact_address,
        memory_limit=args.memory_limit,
        local_directory=args.local_directory,
    )
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, lambda: asyncio.ensure_future(server.close()))
    async with server:
        await server.finished()


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the options, serve until stopped."""
    args = build_parser().parse_args(argv)
    from pyhf_gpu_server.service.settings import Settings

    try:
        Settings(device=args.device)
    except ValueError as exc:
        print(f"pyhf-gpu-worker: error: {exc}", file=sys.stderr)
        return 2
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
