"""The sans-IO core shared by :class:`~pyhf_gpu_client.Client` and ``AsyncClient``.

Nothing here does I/O. Every operation is a *flow*: a generator that yields commands and
receives their outcomes::

    Request(...)  -> the driver sends it and ``send``s back the response (an ``httpx.Response``
                     or a :class:`Response`: whatever has their few attributes)
                     (or ``throw``s a :class:`~pyhf_gpu_client.exceptions.TransportError`)
    Sleep(s)      -> the driver sleeps ``s`` seconds (``time.sleep`` / ``asyncio.sleep``)

and finally returns the parsed result (``StopIteration.value``). A response is read whole,
so a plot's image (``image_of``) travels the same way as JSON. Workspace upload and
deduplication, retries with backoff and ``Retry-After`` and job polling live here, request
building and gzip in ``_request.py``, error mapping and response parsing in ``_response.py``,
plot options in ``_plot_options.py`` (re-exported here), all once; the drivers only differ in
how they send a request and how they sleep (``_client.py``, ``_stdlib.py``). Nothing here
imports httpx.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar
from urllib.parse import quote

from ._plot_options import check_plot_format, image_of, plot_params
from ._plot_options import plot_format as plot_format
from ._plot_options import plot_option as plot_option
from ._request import DEFAULT_SERVER as DEFAULT_SERVER
from ._request import DEFAULT_TIMEOUT as DEFAULT_TIMEOUT
from ._request import ENV_SERVER as ENV_SERVER
from ._request import ENV_TOKEN as ENV_TOKEN
from ._request import PROXY_VARIABLES as PROXY_VARIABLES
from ._request import ClientConfig, ClientState, Request, RetryPolicy, dumps
from ._request import Timeout as Timeout
from ._request import build_options as build_options
from ._request import query_params as query_params
from ._request import scan_options as scan_options
from ._response import Response as Response
from ._response import SSEParser as SSEParser
from ._response import TransportFailure as TransportFailure
from ._response import (
    error_from_response,
    explain_malformed,
    json_of,
    parse_retry_after,
    server_error,
)
from ._response import transport_error as transport_error
from .exceptions import (
    BadRequestError,
    BeyondBoundsWarning,
    DoubtfulResultWarning,
    JobCancelledError,
    JobFailedError,
    NotFoundError,
    TransportError,
    WaitTimeoutError,
    format_detail,
)
from .results import OPERATIONS, Job, Result, flagged, parse_result
from .tables import PLOT_FORMATS as PLOT_FORMATS
from .tables import PLOT_KINDS as PLOT_KINDS
from .tables import PLOT_MEDIA_TYPES
from .tables import default_plot_kind as default_plot_kind
from .tables import plot_kinds_for as plot_kinds_for
from .workspace import JSONFile, JSONSource, WorkspaceId, digest, load_json

RETRY_STATUSES = frozenset({429, 503})

T = TypeVar("T")


@dataclass(frozen=True)
class Sleep:
    """Ask the driver to wait ``seconds`` before resuming the flow."""

    seconds: float


Command = Request | Sleep
Flow = Generator[Command, Any, T]


@dataclass(frozen=True)
class Done(Generic[T]):
    """A flow's return value (what :func:`advance` answers once the flow has finished)."""

    value: T


def advance(flow: Flow[T], outcome: Any, error: TransportError | None) -> Command | Done[T]:
    """One step of a driver: ``flow`` resumed with the last command's ``outcome`` (or with its
    transport ``error`` thrown in); its next command, or :class:`Done` with its value. The
    blocking and the async drivers differ only in how they sleep and send."""
    try:
        return flow.throw(error) if error is not None else flow.send(outcome)
    except StopIteration as stop:
        return Done(stop.value)


def call(request: Request, policy: RetryPolicy) -> Flow[Any]:
    """Send ``request``; retry transport errors, 429 and 503 per ``policy``; raise on >= 400."""
    attempt = 0
    while True:
        attempt += 1
        try:
            response = yield request
        except TransportError as exc:
            if not exc.retryable or attempt >= policy.max_attempts:
                raise
            yield Sleep(policy.delay(attempt))
            continue
        if response.status_code in RETRY_STATUSES and attempt < policy.max_attempts:
            retry_after = parse_retry_after(response.headers.get("Retry-After"))
            yield Sleep(policy.delay(attempt, retry_after))
            continue
        if response.status_code >= 400:
            raise error_from_response(response)
        return response


def call_json(request: Request, policy: RetryPolicy) -> Flow[Any]:
    """:func:`call`, then the JSON body."""
    response = yield from call(request, policy)
    return json_of(response)


def resolve_workspace(
    workspace: Any, config: ClientConfig, state: ClientState, force_upload: bool = False
) -> Flow[dict[str, Any]]:
    """``{"workspace": spec}`` for small workspaces, else ``{"workspace_id": id}``.

    A large workspace is uploaded only when the server does not hold it yet: its id is pyhf's
    digest, checked with ``GET /workspaces/{id}``; ids seen by this client are not re-checked.
    """
    text = dumps(workspace)
    if len(text) < config.upload_threshold and not force_upload:
        return {"workspace": workspace}
    wid = yield from upload_workspace(workspace, config, state, text=text)
    return {"workspace_id": wid}


def upload_workspace(
    workspace: Any,
    config: ClientConfig,
    state: ClientState,
    check: bool = True,
    text: bytes | None = None,
) -> Flow[WorkspaceId]:
    """Make sure the server holds ``workspace``; return its id (skip the upload if it has it).
    ``text``: its JSON, where the caller has it already."""
    wid = WorkspaceId(digest(workspace))
    if wid in state.known_workspaces:
        return wid
    if check:
        exists = yield from has_workspace(wid, config)
        if exists:
            state.known_workspaces.add(wid)
            return wid
    body = workspace if text is None else JSONFile("workspace", "<workspace>", text)
    data = yield from call_json(
        Request("POST", "/workspaces", body=body, has_body=True), config.retry
    )
    server_id = str(data.get("id") or data.get("workspace_id") or data.get("digest") or wid)
    state.known_workspaces.add(server_id)
    return WorkspaceId(server_id)


def workspace_reference(
    workspace: JSONSource | WorkspaceId, config: ClientConfig, state: ClientState
) -> Flow[tuple[dict[str, Any], Any]]:
    """The request fields naming ``workspace`` (:func:`resolve_workspace`), and its spec:
    ``None`` for a :class:`WorkspaceId`, which is named as it is."""
    if isinstance(workspace, WorkspaceId):
        return {"workspace_id": str(workspace)}, None
    spec = load_json(workspace, "workspace")
    return (yield from resolve_workspace(spec, config, state)), spec


def has_workspace(workspace_id: str, config: ClientConfig) -> Flow[bool]:
    """Whether the server holds the workspace ``workspace_id`` (``GET /workspaces/{id}``)."""
    try:
        yield from call(Request("GET", f"/workspaces/{workspace_id}"), config.retry)
    except NotFoundError:
        return False
    except BadRequestError as exc:
        if exc.status == 405:  # no lookup route: treat as unknown, upload
            return False
        raise
    return True


def post_operation(
    operation: str,
    workspace: JSONSource,
    options: Mapping[str, Any],
    config: ClientConfig,
    state: ClientState,
    accept: str | None = None,
) -> Flow[Any]:
    """``POST /<operation>`` with the workspace (inline or by id) and ``options``; the answer.

    If the server forgot an uploaded workspace (404 on a ``workspace_id``), upload it again once
    (not a :class:`WorkspaceId`: the client does not have that workspace).
    """
    path = OPERATIONS[operation]
    prefer = None
    if accept is None and config.job_after is not None:
        prefer = f"respond-async, wait={config.job_after:g}"
    for attempt in (1, 2):
        ref, spec = yield from workspace_reference(workspace, config, state)
        body = {**ref, **options}
        request = Request("POST", path, body=body, has_body=True, accept=accept, prefer=prefer)
        try:
            return (yield from call(request, config.retry))
        except BadRequestError as exc:
            explain_malformed(request.body, exc)
            if not isinstance(exc, NotFoundError):
                raise
            if spec is None or "workspace_id" not in ref or attempt == 2:
                raise
            state.known_workspaces.discard(ref["workspace_id"])
            workspace = spec
    raise AssertionError("unreachable")  # pragma: no cover


def operation_flow(
    operation: str,
    workspace: JSONSource,
    options: Mapping[str, Any],
    config: ClientConfig,
    state: ClientState,
) -> Flow[Result]:
    """Run ``operation`` synchronously (``POST /cls`` etc.) and parse the answer; when the
    server made it a job (202, after ``config.job_after`` seconds), follow the job to its end,
    at most the read timeout."""
    response = yield from post_operation(operation, workspace, options, config, state)
    if response.status_code == 202:
        accepted = Job.from_json(json_of(response), operation=operation)
        if config.on_job_update is not None:
            config.on_job_update(accepted)
        timeout = config.timeout.read if isinstance(config.timeout, Timeout) else None
        try:
            job = yield from wait_flow(accepted.id, config, timeout, on_update=config.on_job_update)
        except JobFailedError as exc:  # the error the synchronous answer would have been
            error = exc.job.error if isinstance(exc.job.error, Mapping) else {}
            status = int(error.get("status", 500))
            raise server_error(status, error.get("detail"), "GET", f"/jobs/{accepted.id}") from exc
        return parse_result(operation, job.raw["result"])
    result = parse_result(operation, json_of(response))
    warn_if_doubtful(result)
    return result


def warn_if_doubtful(result: Any) -> None:
    """A :class:`DoubtfulResultWarning` for each flag in the results' ``meta``
    (:func:`~pyhf_gpu_client.results.flagged`): a :class:`BeyondBoundsWarning` (its subclass)
    for an answer past its model's limits."""
    for flag in flagged(result):
        category = BeyondBoundsWarning if flag.beyond_bounds else DoubtfulResultWarning
        warnings.warn(flag.line, category, stacklevel=4)


def submit_flow(
    operation: str,
    workspace: JSONSource,
    options: Mapping[str, Any],
    config: ClientConfig,
    state: ClientState,
) -> Flow[Job]:
    """``POST /jobs`` with ``{"operation": ..., workspace ref, options}``: the queued :class:`Job`."""
    ref, _ = yield from workspace_reference(workspace, config, state)
    body = {"operation": operation, **ref, **options}
    request = Request("POST", "/jobs", body=body, has_body=True, idempotent=False)
    try:
        data = yield from call_json(request, config.retry)
    except BadRequestError as exc:
        explain_malformed(body, exc)
        raise
    return Job.from_json(data, operation=operation)


def job_flow(job_id: str, config: ClientConfig) -> Flow[Job]:
    """``GET /jobs/{id}``."""
    data = yield from call_json(Request("GET", f"/jobs/{job_id}"), config.retry)
    return Job.from_json(data)


def cancel_flow(job_id: str, config: ClientConfig) -> Flow[Job]:
    """``DELETE /jobs/{id}``: the job as the server reports it after cancelling."""
    response = yield from call(Request("DELETE", f"/jobs/{job_id}"), config.retry)
    if response.status_code == 204 or not response.content:
        return Job(id=job_id, status="cancelled")
    return Job.from_json(json_of(response))


def list_jobs_flow(config: ClientConfig, status: str | None = None) -> Flow[list[Job]]:
    """``GET /jobs``: accepts a bare list or ``{"jobs": [...]}``/``{"items": [...]}``."""
    params = {"status": status} if status else None
    data = yield from call_json(Request("GET", "/jobs", params=params), config.retry)
    if isinstance(data, Mapping):
        data = data.get("jobs", data.get("items", []))
    return [Job.from_json(item) for item in data]


def wait_flow(
    job_id: str,
    config: ClientConfig,
    timeout: float | None = None,
    poll_interval: float = 0.25,
    max_poll_interval: float = 2.0,
    on_update: Callable[[Job], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Flow[Job]:
    """Poll ``GET /jobs/{id}`` until the job ends; return it (``job.result`` parsed).

    Raises:
        JobFailedError / JobCancelledError: the job ended without a result.
        WaitTimeoutError: ``timeout`` seconds passed first (the job keeps running).
    """
    deadline = None if timeout is None else clock() + timeout
    interval = poll_interval
    while True:
        job = yield from job_flow(job_id, config)
        if on_update is not None:
            on_update(job)
        if job.status == "succeeded":
            warn_if_doubtful(job.result)
            return job
        if job.status == "failed":
            raise JobFailedError(f"job {job.id} failed: {format_detail(job.error)}", job)
        if job.status == "cancelled":
            raise JobCancelledError(f"job {job.id} was cancelled", job)
        pause = interval
        if deadline is not None:
            left = deadline - clock()
            if left <= 0:
                raise WaitTimeoutError(
                    f"job {job.id} still {job.status} after {timeout:g} s (it goes on: wait "
                    f"for it again, e.g. `pyhf-gpu-client jobs wait {job.id}`, or cancel it)",
                    job,
                )
            pause = min(pause, left)
        yield Sleep(pause)
        interval = min(interval * 1.5, max_poll_interval)


def get_json_flow(path: str, config: ClientConfig, retry: bool = True) -> Flow[Any]:
    """``GET path`` and its JSON (``retry=False``: one attempt, e.g. a health probe)."""
    policy = config.retry if retry else RetryPolicy(max_attempts=1)
    return (yield from call_json(Request("GET", path), policy))


def get_text_flow(path: str, config: ClientConfig) -> Flow[str]:
    """``GET path`` as text (``/metrics``)."""
    response = yield from call(Request("GET", path), config.retry)
    return response.text


def plot_flow(
    job_id: str, kind: str, fmt: str, options: Mapping[str, Any], config: ClientConfig
) -> Flow[bytes]:
    """``GET /jobs/{id}/plots/{kind}.{fmt}?options``: the image of a finished job's result.

    The server answers 409 (``BadRequestError``) until the job succeeded, 422 for a kind that
    does not fit it (naming those that do), 404 for an unknown job or kind."""
    fmt = check_plot_format(fmt)
    request = Request(
        "GET",
        f"/jobs/{job_id}/plots/{quote(str(kind), safe='')}.{fmt}",
        params=plot_params(options) or None,
        accept=PLOT_MEDIA_TYPES[fmt],
    )
    response = yield from call(request, config.retry)
    return image_of(response, fmt)


def plot_kinds_flow(job_id: str, config: ClientConfig) -> Flow[list[str]]:
    """``GET /jobs/{id}/plots``: the kinds that fit the job."""
    data = yield from call_json(Request("GET", f"/jobs/{job_id}/plots"), config.retry)
    entries = data.get("plots", []) if isinstance(data, Mapping) else data
    return [str(e["kind"] if isinstance(e, Mapping) else e) for e in entries]


def render_flow(
    operation: str,
    workspace: JSONSource,
    options: Mapping[str, Any],
    kind: str,
    fmt: str,
    plot_options: Mapping[str, Any] | None,
    config: ClientConfig,
    state: ClientState,
) -> Flow[bytes]:
    """``POST /<operation>`` with ``"plot": {"kind", "format", ...plot_options}``: the image of
    its answer instead of the JSON (422 before any work when the kind does not fit)."""
    fmt = check_plot_format(fmt)
    extra = {k: v for k, v in (plot_options or {}).items() if v is not None}
    clash = sorted(set(extra) & {"kind", "format"})
    if clash:
        raise ValueError(f"give the plot's {' and '.join(clash)} as arguments, not plot options")
    plot = {"kind": str(kind), "format": fmt, **extra}
    body = {**options, "plot": plot}
    response = yield from post_operation(
        operation, workspace, body, config, state, accept=PLOT_MEDIA_TYPES[fmt]
    )
    return image_of(response, fmt)
