"""Request building of the sans-IO core (:mod:`pyhf_gpu_client.protocol`): the requests a
flow yields, the client's settings (:class:`ClientConfig`: headers, JSON bodies, gzip, query
parameters) and the envelope fields of an operation (:func:`build_options`)."""

from __future__ import annotations

import gzip
import json
import os
import random
import ssl
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import tables
from .exceptions import WorkspaceError
from .results import OPERATIONS, Job
from .workspace import JSONFile, load_patches, read_json_file, to_jsonable

DEFAULT_SERVER = "http://127.0.0.1:8000"
ENV_SERVER = "PYHF_GPU_SERVER"
ENV_TOKEN = "PYHF_GPU_API_TOKEN"
MAX_SEED = 2**64 - 1  # toy seeds are unsigned 64-bit integers (torch's generators)


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
    #: the ``Prefer`` header (RFC 7240), e.g. ``respond-async, wait=10``
    prefer: str | None = None


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


#: environment variables that route a plain-http request through a proxy (httpx's trust_env)
PROXY_VARIABLES = ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


@dataclass
class ClientConfig:
    """Everything that shapes requests. Shared, read-only, by a client and its flows; the
    fields are the arguments of :class:`~pyhf_gpu_client._base.ClientBase` (``timeout`` made a
    :class:`Timeout`), ``compress_min_bytes`` the smallest body ``compress`` gzips."""

    server: str = DEFAULT_SERVER
    token: str | None = None
    timeout: Timeout | float | None = field(default_factory=lambda: DEFAULT_TIMEOUT)
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    compress: bool = True
    compress_min_bytes: int = 1024
    upload_threshold: int = 64 * 1024
    user_agent: str = "pyhf-gpu-client"
    job_after: float | None = 10.0
    on_job_update: Callable[[Job], None] | None = None

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
        """httpx's ``verify``: its default (the system's CA certificates, slow to load) for an
        ``https://`` server or where a proxy may be reached over TLS; for a plain ``http://``
        server, where no TLS is ever spoken, an empty client context that costs nothing."""
        return ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT) if self.plain_http() else True

    def headers(self) -> dict[str, str]:
        """Headers of every request."""
        out = {"Accept": "application/json", "User-Agent": self.user_agent}
        if self.token:
            out["Authorization"] = f"Bearer {self.token}"
        return out

    def encode(self, request: Request) -> tuple[dict[str, str], bytes | None]:
        """The extra headers and body bytes of ``request`` (JSON, gzip when large enough)."""
        headers = {"Accept": request.accept} if request.accept else {}
        if request.prefer:
            headers["Prefer"] = request.prefer
        if not request.has_body:
            return headers, None
        parts = json_parts(request.body)
        headers["Content-Type"] = "application/json"
        texts = [part if isinstance(part, bytes) else part.text for part in parts]
        if not (self.compress and sum(map(len, texts)) >= self.compress_min_bytes):
            return headers, b"".join(texts)
        headers["Content-Encoding"] = "gzip"
        return headers, b"".join(map(_gzip_member, parts))

    def httpx_arguments(self, request: Request) -> dict[str, Any]:
        """Keyword arguments of ``httpx.(Async)Client.request`` for ``request``."""
        headers, content = self.encode(request)
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
        return [dumps(body)]
    parts: list[bytes | JSONFile] = []
    text = b"{"
    for i, (key, value) in enumerate(body.items()):
        text += (b"," if i else b"") + dumps(key) + b":"
        if isinstance(value, JSONFile):
            parts += [text, value]
            text = b""
        else:
            text += dumps(value)
    return [*parts, text + b"}"]


def dumps(value: Any) -> bytes:
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
        return {**axis, "values": [float(v) for v in values]}
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
    parameters = options.get("parameters")
    return {**options, "parameters": [parameters] if isinstance(parameters, str) else parameters}


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
