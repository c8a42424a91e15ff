"""The sans-IO core shared by :class:`~pyhf_gpu_client.Client` and ``AsyncClient``.

Nothing here does I/O. Every operation is a *flow*: a generator that yields commands and
receives their outcomes::

    Request(...)  -> the driver sends it and ``send``s back the response (an ``httpx.Response``
                     or a :class:`Response`: whatever has their few attributes)
                     (or ``throw``s a :class:`~pyhf_gpu_client.exceptions.TransportError`)
    Sleep(s)      -> the driver sleeps ``s`` seconds (``time.sleep`` / ``asyncio.sleep``)

and finally returns the parsed result (``StopIteration.value``). A response is read whole,
so a plot's image (``image_of``) travels the same way as JSON. Request building, gzip
encoding, workspace upload/deduplication, retries with backoff and ``Retry-After``, error
mapping, job polling and response parsing all live here, once; the two clients only differ
in how they send a request and how they sleep (see ``_client.py``; the command line's
``_stdlib.py`` sends over the standard library's ``http.client``). Nothing here imports httpx.
"""

from __future__ import annotations

import email.utils
import gzip
import json
import os
import random
import ssl
import time
import warnings
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar
from urllib.parse import quote

from . import tables
from .exceptions import (
    AuthenticationError,
    BadRequestError,
    BeyondBoundsWarning,
    DoubtfulResultWarning,
    JobCancelledError,
    JobFailedError,
    NotFoundError,
    RateLimitedError,
    ServerError,
    ServiceUnavailableError,
    TimeoutError,
    TransportError,
    WaitTimeoutError,
    WorkspaceError,
    format_detail,
)
from .results import OPERATIONS, Job, Result, flagged, parse_result
from .tables import PLOT_FORMATS, PLOT_KINDS, PLOT_MEDIA_TYPES
from .workspace import (
    JSONFile,
    JSONSource,
    WorkspaceId,
    digest,
    load_json,
    load_patches,
    read_json_file,
    to_jsonable,
)

__all__ = [
    "DEFAULT_SERVER",
    "DEFAULT_TIMEOUT",
    "ENV_SERVER",
    "ENV_TOKEN",
    "PLOT_FORMATS",
    "PLOT_KINDS",
    "PLOT_MEDIA_TYPES",
    "ClientConfig",
    "ClientState",
    "Flow",
    "Request",
    "Response",
    "RetryPolicy",
    "SSEParser",
    "Sleep",
    "Timeout",
    "default_plot_kind",
    "plot_format",
    "plot_kinds_for",
    "plot_option",
]

DEFAULT_SERVER = "http://127.0.0.1:8000"
ENV_SERVER = "PYHF_GPU_SERVER"
ENV_TOKEN = "PYHF_GPU_API_TOKEN"
MAX_SEED = 2**64 - 1  # toy seeds are unsigned 64-bit integers (torch's generators)
RETRY_STATUSES = frozenset({429, 503})

T = TypeVar("T")


@dataclass(frozen=True)
class Timeout:
    """Seconds for each phase of a request (``None``: no limit), as ``httpx.Timeout`` has
    them (one converts to the other, :meth:`of`)."""

    connect: float | None
    read: float | None
    write: float | None
    pool: float | None

    @classmethod
    def of(cls, value: Any) -> Timeout | None:
        """``value`` as a :class:`Timeout`: seconds (connecting at most 10 of them), an
        ``httpx.Timeout`` (or anything with its four attributes), or ``None`` (no limit)."""
        if value is None or isinstance(value, Timeout):
            return value
        if isinstance(value, (int, float)):
            seconds = float(value)
            return cls(min(10.0, seconds), seconds, seconds, seconds)
        return cls(value.connect, value.read, value.write, value.pool)


#: long enough for a patchset batch on a busy server; connecting must be quick
DEFAULT_TIMEOUT = Timeout.of(600.0)


@dataclass(frozen=True)
class Request:
    """One HTTP request to the service, described, not sent.

    ``body`` is any JSON value (encoded by :meth:`ClientConfig.encode`) when ``has_body``.
    """

    method: str
    path: str
    body: Any = None
    params: Mapping[str, Any] | None = None
    has_body: bool = False
    #: sending it again is harmless (GETs, computations); a POST /jobs is not retried on
    #: errors that may have reached the server
    idempotent: bool = True
    #: the ``Accept`` header when not JSON (an image: ``image/png``, ``image/svg+xml``)
    accept: str | None = None


@dataclass(frozen=True)
class Sleep:
    """Ask the driver to wait ``seconds`` before resuming the flow."""

    seconds: float


Command = Request | Sleep
Flow = Generator[Command, Any, T]


@dataclass(frozen=True)
class Response:
    """A response read whole, as a driver without httpx hands it to a flow: the attributes
    of ``httpx.Response`` that flows read (``headers``: any mapping whose ``get`` ignores
    case, e.g. ``http.client``'s)."""

    status_code: int
    reason_phrase: str
    headers: Any
    content: bytes
    request: Request

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        return json.loads(self.content)


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded retries of connection errors, 429 and 503, with exponential backoff.

    Attributes:
        max_attempts: total attempts (1 disables retrying).
        backoff: first delay in seconds; doubled per attempt, with jitter in [50%, 100%].
        max_backoff: cap of the computed delay.
        max_retry_after: cap of a server's ``Retry-After`` (honoured exactly below it).
    """

    max_attempts: int = 5
    backoff: float = 0.5
    max_backoff: float = 30.0
    max_retry_after: float = 120.0

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
        if retry_after is not None:
            return min(max(retry_after, 0.0), self.max_retry_after)
        base = min(self.max_backoff, self.backoff * 2 ** (attempt - 1))
        return base * random.uniform(0.5, 1.0)


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """``Retry-After`` as seconds: delta-seconds or an HTTP date; ``None`` if absent/invalid."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(float(value), 0.0)
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when is None:
        return None
    return max(when.timestamp() - (time.time() if now is None else now), 0.0)


#: environment variables that route a plain-http request through a proxy (httpx's trust_env)
PROXY_VARIABLES = ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


@dataclass
class ClientConfig:
    """Everything that shapes requests. Shared, read-only, by a client and its flows.

    Attributes:
        server: base URL (``--server`` / ``PYHF_GPU_SERVER``).
        token: API token sent as ``Authorization: Bearer <token>``.
        timeout: a :class:`Timeout` (an ``httpx.Timeout`` or seconds become one).
        retry: the :class:`RetryPolicy`.
        compress: gzip request bodies of at least ``compress_min_bytes`` bytes.
        upload_threshold: workspaces of at least this many JSON bytes are uploaded once to
            ``POST /workspaces`` and referenced by id; smaller ones travel inline.
    """

    server: str = DEFAULT_SERVER
    token: str | None = None
    timeout: Timeout | float | None = field(default_factory=lambda: DEFAULT_TIMEOUT)
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    compress: bool = True
    compress_min_bytes: int = 1024
    upload_threshold: int = 64 * 1024
    user_agent: str = "pyhf-gpu-client"

    def __post_init__(self) -> None:
        self.server = self.server.rstrip("/")
        if not self.server.startswith(("http://", "https://")):
            self.server = "http://" + self.server
        self.timeout = Timeout.of(self.timeout)

    def plain_http(self) -> bool:
        """Whether requests go to an ``http://`` server directly: no TLS, no proxy settings
        (redirects are not followed)."""
        proxied = any(os.environ.get(v) for v in PROXY_VARIABLES)
        return self.server.startswith("http://") and not proxied

    def tls_verify(self) -> ssl.SSLContext | bool:
        """httpx's ``verify``: its default (the system's CA certificates, ~20 ms to load) for an
        ``https://`` server or where a proxy may be reached over TLS; for a plain ``http://``
        server, where no TLS is ever spoken, an empty client context that costs nothing to
        build."""
        return ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT) if self.plain_http() else True

    def headers(self) -> dict[str, str]:
        """Headers of every request."""
        out = {"Accept": "application/json", "User-Agent": self.user_agent}
        if self.token:
            out["Authorization"] = f"Bearer {self.token}"
        return out

    def encode(self, request: Request) -> tuple[dict[str, str], bytes | None]:
        """The extra headers and body bytes of ``request`` (JSON, gzip when large enough)."""
        if not request.has_body:
            return {}, None
        parts = json_parts(request.body)
        headers = {"Content-Type": "application/json"}
        texts = [part if isinstance(part, bytes) else part.text for part in parts]
        if not (self.compress and sum(map(len, texts)) >= self.compress_min_bytes):
            return headers, b"".join(texts)
        headers["Content-Encoding"] = "gzip"
        return headers, b"".join(map(_gzip_member, parts))

    def httpx_arguments(self, request: Request) -> dict[str, Any]:
        """Keyword arguments of ``httpx.(Async)Client.request`` for ``request``."""
        headers, content = self.encode(request)
        if request.accept:
            headers["Accept"] = request.accept
        return {
            "method": request.method,
            "url": request.path,
            "content": content,
            "headers": headers,
            "params": query_params(request),
        }


def json_parts(body: Any) -> list[bytes | JSONFile]:
    """``body`` as JSON, in pieces: encoded text, and a :class:`JSONFile` body or the
    :class:`JSONFile` values of a top-level object as they are (joined, the pieces are the
    body's JSON).

    Example:
        >>> part = JSONFile("patchset", "ps.json", b'{"patches": []}')
        >>> pieces = json_parts({"workspace_id": "e7", "patchset": part, "test_poi": 1.0})
        >>> b"".join(p if isinstance(p, bytes) else p.text for p in pieces)
        b'{"workspace_id":"e7","patchset":{"patches": []},"test_poi":1.0}'
    """
    if isinstance(body, JSONFile):
        return [body]
    if not (isinstance(body, dict) and any(isinstance(v, JSONFile) for v in body.values())):
        return [_dumps(body)]
    parts: list[bytes | JSONFile] = []
    text = b"{"
    for i, (key, value) in enumerate(body.items()):
        text += (b"," if i else b"") + _dumps(key) + b":"
        if isinstance(value, JSONFile):
            parts += [text, value]
            text = b""
        else:
            text += _dumps(value)
    return [*parts, text + b"}"]


def _dumps(value: Any) -> bytes:
    """Compact JSON of ``value`` (non-finite numbers refused: no likelihood can use them).
    What JSON has no type for (numpy values, other mappings and sequences, pyhf patch
    objects) is converted where the encoder meets it (:func:`to_jsonable`): plain JSON, the
    common case, is encoded as it is, without a converted copy first."""
    try:
        return json.dumps(
            value, separators=(",", ":"), allow_nan=False, default=to_jsonable
        ).encode("utf-8")
    except ValueError as exc:  # NaN / Infinity: not JSON
        raise WorkspaceError(f"the request contains a non-finite number: {exc}") from exc
    except TypeError as exc:  # no JSON form
        raise WorkspaceError(f"the request contains a value that is not JSON: {exc}") from exc


def _gzip_member(part: bytes | JSONFile) -> bytes:
    """One gzip member of a body: a file's own gzip bytes, else the part compressed."""
    if isinstance(part, JSONFile):
        return part.compressed or gzip.compress(part.text, compresslevel=6, mtime=0)
    return gzip.compress(part, compresslevel=6, mtime=0)


def explain_malformed(body: Any, error: BadRequestError) -> None:
    """Raise the :class:`WorkspaceError` of a :class:`JSONFile` in ``body`` that is not JSON
    when the server answered ``error`` (400: the body's JSON is malformed)."""
    if error.status == 400 and isinstance(body, dict):
        for value in body.values():
            if isinstance(value, JSONFile):
                value.parsed()


def query_params(request: Request) -> dict[str, Any] | None:
    """The query parameters of ``request`` (``None`` values left out), as httpx sends them."""
    if not request.params:
        return None
    return {k: _param(v) for k, v in request.params.items() if v is not None}


def _param(value: Any) -> Any:
    """A query value as httpx sends it: booleans as ``true``/``false``, a list or tuple as a
    repeated parameter."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return [_param(v) for v in value]
    return value


@dataclass
class ClientState:
    """What a client remembers between calls: workspace ids the server is known to hold."""

    known_workspaces: set[str] = field(default_factory=set)


# --------------------------------------------------------------------------- transport errors


TransportFailure = Literal["connect-timeout", "read-timeout", "connect", "failed"]


def transport_error(kind: TransportFailure, exc: BaseException, request: Request) -> TransportError:
    """The client's exception for a transport failure of ``kind``: ``"connect-timeout"``,
    ``"read-timeout"``, ``"connect"`` or ``"failed"`` (the connection failed later).

    Connect errors/timeouts never reached the server: always retryable. A read timeout or a
    dropped connection after sending may have reached it: retryable only when idempotent.
    """
    where = f"{request.method} {request.path}"
    if kind == "connect-timeout":
        return TimeoutError(f"timed out connecting ({where}): {exc}", retryable=True)
    if kind == "read-timeout":
        return TimeoutError(
            f"the server did not answer in time ({where}); raise --timeout: {exc}",
            retryable=False,
        )
    if kind == "connect":
        return TransportError(f"cannot connect to the server ({where}): {exc}", retryable=True)
    return TransportError(f"connection failed ({where}): {exc}", retryable=request.idempotent)


# ------------------------------------------------------------------------------ responses


def error_from_response(response: Any) -> ServerError:
    """A :class:`ServerError` subclass carrying the status and the server's ``detail``."""
    status = response.status_code
    try:
        payload = response.json()
        detail = payload.get("detail", payload) if isinstance(payload, dict) else payload
    except (ValueError, UnicodeDecodeError):
        detail = response.text.strip() or response.reason_phrase
    retry_after = parse_retry_after(response.headers.get("Retry-After"))
    cls: type[ServerError]
    if status in (401, 403):
        cls = AuthenticationError
    elif status == 404:
        cls = NotFoundError
    elif status == 429:
        cls = RateLimitedError
    elif status == 503:
        cls = ServiceUnavailableError
    elif 400 <= status < 500:
        cls = BadRequestError
    else:
        cls = ServerError
    method, url = _request_of(response)
    return cls(status, detail, method=method, url=url, retry_after=retry_after)


def _request_of(response: Any) -> tuple[str, str]:
    """The method and URL (or path) of the request ``response`` answers; empty if unknown."""
    try:
        request = response.request
    except RuntimeError:  # an httpx.Response made without its request (tests)
        return "", ""
    url = getattr(request, "url", None) or getattr(request, "path", "")
    return request.method, str(url)


def json_of(response: Any) -> Any:
    """The JSON body of a successful response (a ``ServerError`` if it is not JSON)."""
    try:
        return response.json()
    except (ValueError, UnicodeDecodeError) as exc:
        raise ServerError(
            response.status_code, f"the server answered non-JSON: {response.text[:200]!r}"
        ) from exc


# ---------------------------------------------------------------------------------- flows


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
    text = _dumps(workspace)
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


SCAN_AXIS = ("parameter", "values", "range", "steps")


def scan_axis(
    parameter: str | None = None,
    values: Sequence[float] | None = None,
    range: Sequence[float] | None = None,
    steps: int | None = None,
    *,
    required: bool = False,
) -> dict[str, Any] | None:
    """One axis of ``POST /scan``: ``{"parameter", "values"}``, ``{"parameter", "range",
    "steps"}``, or with no grid ``{"parameter", "steps"}`` (the server's automatic grid:
    each patch's best fit +- 3 uncertainties, cabinetry's default). None when neither a
    parameter nor a grid is given, unless the axis is ``required`` (the first).

    ``steps`` applies to ``range`` and the automatic grid (the server's default is 11).
    """
    if parameter is None and values is None and range is None and not required:
        return None
    if values is not None and range is not None:
        what = f"the scan of {parameter!r}" if parameter else "a scan axis"
        raise ValueError(f"{what} takes values or range, not both")
    axis: dict[str, Any] = {} if parameter is None else {"parameter": str(parameter)}
    if values is not None:
        axis["values"] = [float(v) for v in values]
        return axis
    if range is not None:
        bounds = [float(v) for v in range]
        if len(bounds) != 2:
            raise ValueError(f"a scan range is [low, high], not {list(range)!r}")
        axis["range"] = bounds
    if steps is not None:
        axis["steps"] = int(steps)
    return axis


def scan_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The ``x`` (and ``y``) axes of ``POST /scan`` from the client's keywords
    ``parameter``, ``values``, ``range``, ``steps`` and their ``_y`` twins (axes given
    ready-made as ``x``/``y`` pass through)."""
    out = dict(options)
    for axis, suffix in (("x", ""), ("y", "_y")):
        keywords = {key: out.pop(key + suffix, None) for key in SCAN_AXIS}
        given = out.get(axis) is not None
        built = scan_axis(**keywords, required=axis == "x" and not given)
        if built is not None:
            if given:
                raise ValueError(f"give the {axis} axis either as {axis}= or by its keywords")
            out[axis] = built
    return out


def ranking_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """``parameters`` of ``POST /ranking`` as a list (one label may be given as a string)."""
    out = dict(options)
    if isinstance(out.get("parameters"), str):
        out["parameters"] = [out["parameters"]]
    return out


#: operations whose client keywords are not the server's fields as they are
OPTION_BUILDERS: dict[str, Callable[[Mapping[str, Any]], dict[str, Any]]] = {
    tables.SCAN: scan_options,
    tables.RANKING: ranking_options,
}


def build_options(
    operation: str,
    *,
    patches: Sequence[Any] | None = None,
    patchset: Any = None,
    patch_names: Sequence[str] | None = None,
    measurement: str | None = None,
    **options: Any,
) -> dict[str, Any]:
    """The envelope fields other than the workspace, ``None`` values dropped.

    ``options`` are operation parameters such as ``test_poi`` (a number or a list),
    ``test_stat``, ``calctype``, ``ntoys``, ``level``; they are passed through as given, but
    for those of :data:`OPTION_BUILDERS` (a scan's ``parameter``/``values``/``range``/``steps``
    become its ``x`` and ``y`` axes).
    """
    if operation not in OPERATIONS:
        raise ValueError(f"unknown operation {operation!r}; one of {sorted(OPERATIONS)}")
    if operation in OPTION_BUILDERS:
        options = OPTION_BUILDERS[operation](options)
    body: dict[str, Any] = {}
    loaded = load_patches(patches)
    if loaded:
        body["patches"] = loaded
    if patchset is not None:
        body["patchset"] = read_json_file(patchset, "patchset")
    if patch_names:
        if patchset is None:
            raise ValueError("patch_names needs a patchset")
        body["patch_names"] = list(patch_names)
    if measurement is not None:
        body["measurement"] = measurement
    for key, value in options.items():
        if value is None:
            continue
        if key == "test_poi" and not isinstance(value, (int, float)):
            value = [float(v) for v in value]
        body[key] = value
    return body


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
    for attempt in (1, 2):
        ref, spec = yield from workspace_reference(workspace, config, state)
        request = Request("POST", path, body={**ref, **options}, has_body=True, accept=accept)
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
    """Run ``operation`` synchronously (``POST /cls`` etc.) and parse the answer."""
    response = yield from post_operation(operation, workspace, options, config, state)
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
                raise WaitTimeoutError(f"job {job.id} still {job.status} after {timeout:g} s", job)
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


# ---------------------------------------------------------------------------------- plots


def plot_kinds_for(operation: str, options: Mapping[str, Any]) -> tuple[str, ...]:
    """The plot kinds of ``operation``'s answer to a request with ``options`` (its envelope
    fields or the client's keywords): ``cls`` draws ``brazil`` for a list of ``test_poi`` and
    ``exclusion`` for a patchset; the other operations their :data:`PLOT_KINDS`
    (``tables.PLOT_NEEDS``).

    >>> plot_kinds_for("cls", {"test_poi": [0.5, 1.0]}), plot_kinds_for("cls", {"test_poi": 1})
    (('brazil',), ())
    """
    return tables.plot_kinds_for(operation, options)


def default_plot_kind(operation: str, options: Mapping[str, Any]) -> str | None:
    """The plot a request implies: ``exclusion`` for a patchset CLs, ``brazil`` for a CLs scan,
    ``pulls`` for a fit, the operation's only kind otherwise; None when none fits."""
    return tables.default_plot_kind(operation, options)


def plot_format(path: Any) -> str:
    """``png`` or ``svg`` from a file name's suffix (``ValueError`` for any other)."""
    suffix = str(path).rpartition(".")[2].lower() if "." in str(path) else ""
    if suffix not in PLOT_FORMATS:
        shown = f".{suffix}" if suffix else "none"
        raise ValueError(
            f"the plot format is the file's suffix, .png or .svg (not {shown}): {str(path)!r}"
        )
    return suffix


def check_plot_format(fmt: str) -> str:
    """``fmt`` lower-cased when it is ``png`` or ``svg``, else ``ValueError``."""
    value = str(fmt).lower().lstrip(".")
    if value not in PLOT_FORMATS:
        raise ValueError(f"plot format {fmt!r}; one of {', '.join(PLOT_FORMATS)}")
    return value


def plot_option(text: str, kind: str | None = None) -> tuple[str, Any]:
    """``KEY=VALUE`` -> ``(key, typed value)`` for a plot option (``-`` in KEY read as ``_``)
    of plot ``kind`` (where kinds type an option differently: ``test_poi``).

    The renderer's options get its types (``top=5`` an int, ``log_y=true`` a bool,
    ``channels=SR,CR`` a list, ``figsize=6,4`` numbers); other keys a JSON value, else the text.

    >>> plot_option("top=5"), plot_option("channels=SR,CR"), plot_option("label=ATLAS Internal")
    (('top', 5), ('channels', ['SR', 'CR']), ('label', 'ATLAS Internal'))
    """
    key, sep, raw = str(text).partition("=")
    name = key.strip().replace("-", "_")
    if not sep or not name:
        raise ValueError(f"a plot option is KEY=VALUE, not {text!r}")
    of = tables.option_type(name, kind)
    value = raw.strip()
    if of is not None and of != "json":
        try:
            return name, tables.read_option(of, [value])
        except ValueError:
            what = tables.TYPE_WORDS[of] + (" (a comma list)" if of.endswith("s") else "")
            raise ValueError(f"plot option {name!r} must be {what}, not {value!r}") from None
    try:
        return name, json.loads(value)
    except ValueError:
        return name, raw


def plot_params(options: Mapping[str, Any]) -> dict[str, Any]:
    """The query parameters of a job plot (lists repeated, booleans ``true``/``false``)."""
    params: dict[str, Any] = {}
    for name, value in options.items():
        if value is None:
            continue
        if isinstance(value, Mapping) or (
            isinstance(value, (list, tuple)) and any(isinstance(v, (Mapping, list)) for v in value)
        ):
            raise ValueError(
                f"plot option {name!r}: a query takes a value or a list, not {value!r}"
            )
        params[name] = list(value) if isinstance(value, tuple) else value
    return params


def image_of(response: Any, fmt: str) -> bytes:
    """The image bytes of a plot answer (a ``ServerError`` when it is not the image asked for)."""
    media = response.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != PLOT_MEDIA_TYPES[fmt]:
        raise ServerError(
            response.status_code,
            f"the server answered {media or 'without a content type'}, not the {fmt} image "
            "asked for (a server that draws no plots?)",
        )
    return response.content


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


# ------------------------------------------------------------------------------ SSE


@dataclass
class SSEParser:
    """Incremental ``text/event-stream`` parser: feed lines, get ``{"event", "data", "id"}``.

    ``data`` is decoded as JSON when it parses, else kept as text.
    """

    _event: str = "message"
    _data: list[str] = field(default_factory=list)
    _id: str | None = None

    def feed(self, line: str) -> dict[str, Any] | None:
        """Consume one line (without its newline); return an event when a blank line ends one."""
        if line == "":
            if not self._data:
                self._event = "message"
                return None
            text = "\n".join(self._data)
            try:
                data: Any = json.loads(text)
            except ValueError:
                data = text
            event = {"event": self._event, "data": data, "id": self._id}
            self._event, self._data = "message", []
            return event
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        elif name == "id":
            self._id = value
        return None

    def feed_lines(self, lines: Iterable[str]) -> list[dict[str, Any]]:
        """Feed several lines; the completed events."""
        return [e for e in (self.feed(line) for line in lines) if e is not None]
