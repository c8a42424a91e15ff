"""GET /healthz, /readyz (no auth), /info and /metrics."""

from __future__ import annotations

import sys
from importlib import metadata
from typing import Any

import torch
from fastapi import APIRouter, Depends, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..dependencies import StateDep, require_token
from ..local_workers import LocalWorkers
from ..schemas import Liveness, Readiness, ServerInfo, error_responses
from ..state import ServiceState, device_name

public = APIRouter(tags=["health"])
private = APIRouter(tags=["health"], dependencies=[Depends(require_token)])


@public.get("/healthz", response_model=Liveness, summary="Liveness: the process answers")
async def healthz() -> dict[str, str]:
    """Always ``{"status": "ok"}`` while the event loop runs."""
    return {"status": "ok"}


@public.get(
    "/readyz",
    response_model=Readiness,
    responses={
        503: {"model": Readiness, "description": "the device, the queue or the store is not ready"}
    },
    summary="Readiness: the device works, the queue is not saturated, the stores are writable",
)
async def readyz(state: StateDep) -> JSONResponse:
    """503 while the device is unusable, the interactive queue is full, or jobs or workspaces
    cannot be stored."""
    problems = []
    if not state.device_ok:
        problems.append(f"device {state.device} failed its start-up check")
    if state.cluster is not None:
        problems.extend(await run_in_threadpool(state.cluster.problems))
    if state.scheduler.saturated:
        problems.append("the request queue is full")
    problems.extend(await run_in_threadpool(state.store_problems))
    body = {"status": "unready" if problems else "ready", "problems": problems}
    return JSONResponse(body, status_code=503 if problems else 200)


def package_version(package: str) -> str | None:
    """An installed package's version (``None``: not installed)."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


@private.get(
    "/info",
    response_model=ServerInfo,
    responses=error_responses(401),
    summary="Device, versions, limits and warm models",
)
async def info(state: StateDep) -> dict[str, Any]:
    """What this server runs on and holds."""
    settings = state.settings
    cluster = None
    if state.cluster is not None:
        cluster = await run_in_threadpool(state.cluster.describe)
    return {
        "device": state.device,
        "device_name": device_name(state.device),
        "dtype": settings.dtype,
        "compile": state.compiler is not None,
        "versions": {
            "pyhf-gpu": package_version("pyhf-gpu"),
            "torch": package_version("torch"),
            "pyhf": package_version("pyhf"),
            "fastapi": package_version("fastapi"),
            "python": sys.version.split()[0],
            "cuda": torch.version.cuda,
        },
        "limits": settings.limits(),
        "auth": settings.callers is not None,
        "queue": {
            "interactive": state.scheduler.pending_rows("interactive"),
            "jobs": state.scheduler.pending_rows("jobs"),
        },
        "batches_run": state.scheduler.batches_run,
        "local_workers": LocalWorkers.describe(state.dispatcher.elements.workers),
        "device_memory_bytes": state.device_memory_bytes(),
        "started_at": state.started_at,
        "job_store": state.jobstore.describe(),
        "cluster": cluster,
        "models": _warm_models(state),
    }


def _warm_models(state: ServiceState) -> list[dict[str, Any]]:
    """The warm models: this process's, or in cluster mode (no cache here) every worker's."""
    if state.cache is not None:
        return state.cache.describe()
    assert state.cluster is not None, "only cluster mode has no model cache"
    return state.cluster.warm_models


@private.get(
    "/metrics",
    summary="Prometheus metrics",
    response_class=Response,
    responses={
        200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}},
        **error_responses(401),
    },
)
async def metrics(state: StateDep) -> Response:
    """The text exposition of this app's registry."""
    counts = await run_in_threadpool(state.jobstore.counts)
    if state.cluster is not None:  # the cluster's gauges read this snapshot
        await run_in_threadpool(state.cluster.describe)
    for status, count in counts.items():
        state.metrics.jobs.labels(status).set(count)
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
