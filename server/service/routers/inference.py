"""POST /<operation> for every operation of the registry (``operations.OPERATIONS``): one
synchronous answer, computed in batches, validated and serialised by the operation's
response model.

The body is a bare workspace (as ``pyhf cls`` reads it; options in the query string) or an
envelope ``{"workspace" | "workspace_id", "patches", "patchset", "patch_names", ...options}``.
A ``plot`` (envelope field, or ``?plot=<kind>&plot_format=png``) answers that plot of the
result, an image, instead of the JSON (see ``plotting``).

With ``Prefer: respond-async, wait=N`` (RFC 7240) a request still running after N seconds (0
when not given) becomes a job and answers 202 with its id and ``Location``, as ``POST /jobs``
does: the work goes on, with progress, where ``--request-timeout-s`` would have ended it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from asyncio import FIRST_COMPLETED
from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response

from pyhf_gpu_server.plots.errors import PlotAbandonedError

from .. import plotting
from ..dependencies import StateDep
from ..errors import RequestTimeout, Unprocessable
from ..jobrunner import ProgressRelay
from ..operations import OPERATIONS, Operation
from ..requests import Plan, envelope_from, parse_json, plan_request
from ..schemas import BODY_ERRORS, JobAccepted, JobStatus, error_responses
from ..state import ServiceState

router = APIRouter(tags=["inference"])
DISCONNECT_POLL_S = 0.25
# Bodies up to this size are parsed and planned on the event loop (a signal patch: quicker than
# the hop to a worker thread and back); larger ones (workspaces, patchsets) in a worker thread.
INLINE_PLAN_BYTES = 64 * 1024
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a request its client abandoned (never sent)

_ERRORS = error_responses(*BODY_ERRORS, 401, 404, 422, 429, 503, 504)
_SHAPES = (
    "One hypothesis answers one object; a list of `test_poi` answers a list; a `patchset` "
    "answers `{patch_name: result}`, where a patch that cannot be tested answers "
    '`{"error": {"status", "detail"}}` instead (200 when at least one patch was tested). Every '
    "result carries `meta` (device, dtype, model id, timings, fit status)."
)


async def plan_from_http(
    request: Request, operation: Operation, state: ServiceState
) -> tuple[Plan, plotting.PlotRequest | None, dict[str, Any]]:
    """Read the body and query of ``request`` into a validated :class:`Plan` (4xx if bad),
    the plot it asks for (checked to fit the operation's answer) and its envelope."""
    body = await request.body()
    query = {key: request.query_params.getlist(key) for key in request.query_params}

    def plan() -> tuple[Plan, plotting.PlotRequest | None, dict[str, Any]]:
        document = parse_json(body, state.settings.max_json_depth)
        document, plot = plotting.from_envelope(document)
        options, from_query = plotting.from_query(query)
        if plot is not None and from_query is not None:
            raise Unprocessable("ask for a plot in the envelope's 'plot' or in the query, not both")
        plot = plot or from_query
        envelope = envelope_from(document, options, operation)
        planned = plan_request(operation, envelope, state.workspaces, caller=request.state.caller)
        if plot is not None:
            plotting.check_fits(plot.kind, operation.name, envelope)
        return planned, plot, envelope

    if len(body) <= INLINE_PLAN_BYTES:  # a patch on an uploaded background: no thread hop
        return plan()
    return await run_in_threadpool(plan)


def _openapi(operation: Operation) -> dict[str, Any]:
    """Request body and query parameters of ``operation`` for the OpenAPI document."""
    envelope = operation.request_model.model_json_schema()
    bare = {
        "type": "object",
        "title": "Workspace",
        "description": "a bare HistFactory workspace; options go in the query string",
        "required": ["channels"],
    }
    options = operation.options_model.model_json_schema().get("properties", {})
    names = ["measurement", *options]
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"anyOf": [envelope, bare]}}},
        },
        "parameters": [
            {
                "name": name,
                "in": "query",
                "required": False,
                "description": "with a bare workspace body (`-` spellings accepted)",
                "schema": options.get(name, {"type": "string"}),
            }
            for name in names
        ]
        + plotting.openapi_query_parameters(plotting.PLOTS[operation.name]),
    }


async def _disconnected(request: Request) -> None:
    """Return once the client has closed the connection. The body is read, so the server's
    next message is the disconnect: awaited, not polled (a poll costs the event loop a
    cancelled receive). A server that answers further empty bodies instead is polled."""
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(DISCONNECT_POLL_S)


async def image_unless_gone(
    request: Request,
    plot: plotting.PlotRequest,
    operation: str,
    envelope: Any,
    result: Any,
    lookup: plotting.WorkspaceLookup,
    name: str,
) -> Response:
    """The image of ``plot``, drawn off the event loop; not drawn (or not written) once its
    client has gone (499, never sent), and the drawing lock passed on to the next render."""
    gone = threading.Event()

    async def watch() -> None:
        await _disconnected(request)
        gone.set()

    watcher = asyncio.ensure_future(watch())
    try:
        data = await run_in_threadpool(
            plotting.render, plot, operation, envelope, result, lookup, gone.is_set
        )
    except PlotAbandonedError:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    finally:
        watcher.cancel()
    return plotting.image(plot, data, name)


def respond_async_wait(prefer: str | None) -> float | None:
    """The seconds to wait before answering 202 that a ``Prefer`` header asks for (RFC 7240:
    ``respond-async``, optionally ``wait=N``; N = 0 when absent); ``None``: no
    ``respond-async``.

    >>> respond_async_wait("respond-async, wait=10"), respond_async_wait("respond-async")
    (10.0, 0.0)
    >>> respond_async_wait("return=minimal") is None, respond_async_wait(None) is None
    (True, True)
    """
    preferences = {}
    for part in (prefer or "").split(","):
        name, _, value = part.partition("=")
        preferences[name.strip().lower()] = value.strip().strip('"')
    if "respond-async" not in preferences:
        return None
    try:
        return max(0.0, float(preferences.get("wait") or 0.0))
    except ValueError:
        return 0.0


def job_accepted(
    job_id: str, status: JobStatus, headers: dict[str, str] | None = None
) -> JSONResponse:
    """The 202 of a job: its id, status and URL (also its ``Location``), and ``headers``."""
    url = f"/jobs/{job_id}"
    body = JobAccepted(id=job_id, status=status, url=url).model_dump()
    return JSONResponse(body, status_code=202, headers={"Location": url, **(headers or {})})


def _endpoint(operation: Operation):
    """The handler of POST /<operation>."""

    async def endpoint(request: Request, state: StateDep) -> Any:
        with state.scheduler.arriving():  # batches wait for this request's rows (bounded)
            plan, plot, envelope = await plan_from_http(request, operation, state)
            relay = ProgressRelay()
            run = asyncio.ensure_future(state.dispatcher.run(plan, on_progress=relay))
            await asyncio.sleep(0)  # the run announces its own preparation before this ends
        timeout = state.settings.request_timeout_s
        wait = None if plot is not None else respond_async_wait(request.headers.get("prefer"))
        gone = asyncio.ensure_future(_disconnected(request))
        first = timeout if wait is None else min(wait, timeout)
        done, _ = await asyncio.wait({run, gone}, timeout=first, return_when=FIRST_COMPLETED)
        if not done and wait is not None and wait < timeout:
            # the running request made a job (None: the job caps or the store refuse it)
            job_id = await state.jobs.adopt(
                envelope, plan, run, relay, request.state.caller, state.settings.max_jobs_per_caller
            )
            if job_id is not None:
                gone.cancel()
                return job_accepted(job_id, "running", {"Preference-Applied": "respond-async"})
            done, _ = await asyncio.wait(
                {run, gone}, timeout=timeout - first, return_when=FIRST_COMPLETED
            )
        gone.cancel()
        if run in done:
            if plot is not None:
                lookup = plotting.store_lookup(state.workspaces)
                name = f"{operation.name}-{plot.kind}"
                return await image_unless_gone(
                    request, plot, operation.name, envelope, run.result(), lookup, name
                )
            return run.result()  # validated and serialised by the operation's answer model
        # nobody will read the answer: cancelling the run drops its rows from the queue and
        # stops a batch that serves nobody else between two fit iterations
        run.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await run
        if gone in done:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        raise RequestTimeout(
            f"the request took longer than {timeout:g} s (--request-timeout-s); "
            "submit it as a job with POST /jobs"
        )

    endpoint.__name__ = operation.name.replace("-", "_")
    return endpoint


_ACCEPTED: dict[int | str, dict[str, Any]] = {
    202: {
        "model": JobAccepted,
        "description": "with `Prefer: respond-async[, wait=N]`, still running after N seconds: "
        "now a job (`Location`: GET it for progress and the result)",
    }
}


def _responses(operation: Operation) -> dict[int | str, dict[str, Any]]:
    """The error answers, the job a ``Prefer: respond-async`` request may become, and the
    images a ``plot`` answers instead of the JSON."""
    if not plotting.PLOTS[operation.name]:
        return {**_ACCEPTED, **_ERRORS}
    images: dict[str, dict[str, Any]] = {media: {} for media in plotting.MEDIA_TYPES.values()}
    return {200: {"content": images}, **_ACCEPTED, **_ERRORS}


for _operation in OPERATIONS.values():
    router.add_api_route(
        f"/{_operation.name}",
        _endpoint(_operation),
        methods=["POST"],
        summary=_operation.summary,
        description=_SHAPES,
        response_model=_operation.response_model,
        response_model_exclude_unset=True,  # keys a result does not have stay absent
        responses=_responses(_operation),
        openapi_extra=_openapi(_operation),
    )
