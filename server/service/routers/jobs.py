"""Asynchronous jobs: POST /jobs (202), GET /jobs, GET/DELETE /jobs/{id}, GET /jobs/{id}/events,
and the plots of a job's result: GET /jobs/{id}/plots, GET /jobs/{id}/plots/{kind}.{svg,png}.

With auth on, a job belongs to the caller that submitted it: ``GET /jobs`` lists the caller's
own, and another caller's job answers 404 as an unknown id would (see ``jobstore``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .. import plotting
from ..dependencies import CallerDep, StateDep
from ..errors import Conflict, NotFound
from ..jobstore import FINAL_STATUSES
from ..operations import OPERATIONS, JobList, JobView
from ..requests import parse_json
from ..schemas import BODY_ERRORS, JobAccepted, JobStatus, error_responses
from ..state import ServiceState
from .inference import image_unless_gone, job_accepted

router = APIRouter(prefix="/jobs", tags=["jobs"])

KEEPALIVE_S = 15.0


def _job_schema(operation: str) -> dict[str, Any]:
    """The JSON schema of a job of ``operation``: its envelope plus ``operation``."""
    schema = OPERATIONS[operation].request_model.model_json_schema()
    schema["title"] = f"{schema['title']} job"
    schema["properties"] = {"operation": {"const": operation}, **schema["properties"]}
    schema["required"] = ["operation", *schema.get("required", [])]
    return schema


def _not_found(job_id: str) -> NotFound:
    """The 404 for an unknown job id, or another caller's job (the same, on purpose)."""
    return NotFound(f"no job with id {job_id!r} (finished jobs expire after --result-ttl-hours)")


async def _job(
    state: ServiceState, job_id: str, caller: str | None, with_result: bool = True
) -> dict[str, Any]:
    """The view of the job, when ``caller`` may see it (``None``: auth off), or 404."""
    view = await run_in_threadpool(state.jobstore.get, job_id, with_result, caller)
    if view is None:
        raise _not_found(job_id)
    return view


@router.post(
    "",
    status_code=202,
    response_model=JobAccepted,
    responses=error_responses(*BODY_ERRORS, 401, 404, 422, 429, 503, 507),
    summary="Submit a cls, fit, upper-limit or significance request as a durable job",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {
                    "schema": {
                        "description": "'operation' plus the fields of that operation's "
                        "envelope (workspace or workspace_id, patches/patchset, options)",
                        "anyOf": [_job_schema(operation) for operation in OPERATIONS],
                    }
                }
            },
        }
    },
)
async def submit_job(request: Request, state: StateDep, caller: CallerDep) -> JSONResponse:
    """Validated now (4xx on bad input), stored in SQLite, run in the background.

    429 when ``--max-queue`` jobs are queued or running, or ``--max-jobs-per-caller`` of the
    caller's."""
    body = await request.body()
    document = await run_in_threadpool(parse_json, body, state.settings.max_json_depth)
    job_id = await state.jobs.submit(document, caller, state.settings.max_jobs_per_caller)
    return job_accepted(job_id, "queued")


@router.get(
    "",
    response_model=JobList,
    responses=error_responses(401, 422),
    summary="List the caller's jobs, newest first",
)
async def list_jobs(
    state: StateDep,
    caller: CallerDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
    status: Annotated[JobStatus | None, Query()] = None,
) -> dict[str, Any]:
    """Jobs without their results (fetch one for its result). With auth on, the caller's own
    (and any stored before jobs had owners); with auth off, all."""
    return {"jobs": await run_in_threadpool(state.jobstore.list, limit, status, caller)}


@router.get(
    "/{job_id}",
    response_model=JobView,
    responses=error_responses(401, 404, 422),
    summary="Status, progress and result of a job",
)
async def get_job(job_id: str, state: StateDep, caller: CallerDep) -> JSONResponse:
    """For a patchset the result is keyed by patch name; a failed job has ``error``.

    The stored result is sent as it is (the synchronous answer, as ``JobView`` declares it),
    not parsed again."""
    return JSONResponse(await _job(state, job_id, caller))


@router.delete(
    "/{job_id}",
    response_model=JobView,
    responses=error_responses(401, 404, 409, 422),
    summary="Cancel a queued or running job",
)
async def cancel_job(job_id: str, state: StateDep, caller: CallerDep) -> dict[str, Any]:
    """409 if the job already finished."""
    before = await state.jobs.cancel(job_id, caller)
    if before is None:
        raise _not_found(job_id)
    if before in FINAL_STATUSES:
        raise Conflict(f"job {job_id!r} already {before}; nothing to cancel")
    return await _job(state, job_id, caller, with_result=False)


@router.get(
    "/{job_id}/events",
    summary="Progress as server-sent events",
    response_class=StreamingResponse,
    responses={200: {"content": {"text/event-stream": {}}}, **error_responses(401, 404, 422)},
)
async def job_events(job_id: str, state: StateDep, caller: CallerDep) -> StreamingResponse:
    """``event: progress`` on every change, then one ``event: done`` with the final status."""
    await _job(state, job_id, caller, with_result=False)
    return StreamingResponse(
        _events(state, job_id, caller),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


@router.get(
    "/{job_id}/plots",
    response_model=plotting.JobPlots,
    responses=error_responses(401, 404, 422),
    summary="The plot kinds that fit a job, and their URLs",
)
async def job_plots(job_id: str, state: StateDep, caller: CallerDep) -> dict[str, Any]:
    """Kinds by operation: cls ``brazil`` (a list of test_poi) and ``exclusion`` (a
    patchset); upper-limit ``brazil``; fit ``pulls`` and ``correlation``; ``ranking``,
    ``scan``, ``yields``; significance none. They can be drawn once the job succeeded."""
    view = await _job(state, job_id, caller, with_result=False)
    operation, stored = await _stored_request(state, job_id)
    return {
        "id": job_id,
        "operation": operation,
        "status": view["status"],
        "plots": plotting.links(job_id, operation, stored),
    }


_IMAGES: dict[str, dict[str, dict[str, Any]]] = {
    "content": {media: {} for media in plotting.MEDIA_TYPES.values()}
}


@router.get(
    "/{job_id}/plots/{kind}.{fmt}",
    response_class=Response,
    responses={
        200: {**_IMAGES, "description": "the plot (image/svg+xml or image/png)"},
        **error_responses(401, 404, 409, 422),
    },
    summary="A plot of a job's result, as SVG or PNG",
)
async def job_plot(
    job_id: str,
    kind: Annotated[str, Path(description="the plot kind: " + ", ".join(plotting.KIND_NAMES))],
    fmt: Annotated[str, Path(description="svg or png")],
    request: Request,
    state: StateDep,
    caller: CallerDep,
) -> Response:
    """``kind`` one of brazil, exclusion, pulls, ranking, correlation, yields, scan (see
    ``GET /jobs/{id}/plots`` for those that fit the job); ``fmt`` ``svg`` or ``png``. Query
    options go to the renderer: ``dpi``, ``figsize`` (``w,h`` inches), ``title``, ``label``
    (e.g. ``ATLAS Internal``), ``rlabel``; ``patch`` (of a patchset job; default the first
    tested); ``top``, ``threshold``, ``level``, ``channels``, ``stage``, ``log_y``,
    ``parameters``, ``axes``, ``labels``, ``xlabel``, ``test_poi``, ... as the kind takes them.

    404 for an unknown job, kind or format; 422 for a kind that does not fit the job (naming
    those that do) or a bad option; 409 until the job succeeded."""
    view = await _job(state, job_id, caller)
    plotting.check_kind(kind)
    plotting.check_format(fmt)
    operation, stored = await _stored_request(state, job_id)
    plotting.check_fits(kind, operation, stored)
    if view["status"] != "succeeded":
        status = view["status"]
        raise Conflict(
            f"job {job_id!r} is {status}; its plots can be drawn once it succeeded"
            if status not in FINAL_STATUSES
            else f"job {job_id!r} {status}; it has no result to plot"
        )
    query = {key: request.query_params.getlist(key) for key in request.query_params}
    plot = plotting.PlotRequest(kind, fmt, plotting.query_options(query, kind=kind))
    lookup = plotting.store_lookup(state.workspaces)
    return await image_unless_gone(
        request, plot, operation, stored, view["result"], lookup, f"{job_id}-{kind}"
    )


async def _stored_request(state: ServiceState, job_id: str) -> tuple[str, dict[str, Any]]:
    """The operation and stored request of a job; 404 when it expired meanwhile."""
    try:
        return await run_in_threadpool(state.jobstore.request, job_id)
    except TypeError:  # no such row any more
        raise _not_found(job_id) from None


async def _events(state: ServiceState, job_id: str, caller: str | None) -> AsyncIterator[str]:
    """Server-sent events for one job of ``caller`` until it finishes (or expires)."""
    changed = state.jobs.watch()
    last: tuple[Any, ...] | None = None
    try:
        while True:
            view = await run_in_threadpool(state.jobstore.get, job_id, False, caller)
            if view is None:
                yield _event("done", {"id": job_id, "status": "expired"})
                return
            snapshot = (view["status"], view["progress"]["done"], view["progress"]["total"])
            if view["status"] in FINAL_STATUSES:
                yield _event("done", view)
                return
            if snapshot != last:
                yield _event("progress", view)
                last = snapshot
            changed.clear()
            try:
                await asyncio.wait_for(changed.wait(), KEEPALIVE_S)
            except TimeoutError:
                yield ": keep-alive\n\n"
    finally:
        with contextlib.suppress(Exception):
            state.jobs.unwatch(changed)


def _event(name: str, data: dict[str, Any]) -> str:
    """One server-sent event."""
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"
