"""What comes back, decoded, for the sans-IO core (:mod:`pyhf_gpu_client.protocol`): responses
read whole, transport failures and error answers as the client's exceptions (the server's
``detail``, ``Retry-After``), JSON bodies and ``text/event-stream`` events."""

from __future__ import annotations

import contextlib
import email.utils
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from ._request import Request
from .exceptions import (
    AuthenticationError,
    BadRequestError,
    NotFoundError,
    RateLimitedError,
    ServerError,
    ServiceUnavailableError,
    TimeoutError,
    TransportError,
)
from .workspace import JSONFile


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


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """``Retry-After`` as seconds: delta-seconds or an HTTP date; ``None`` if absent/invalid."""
    if not value:
        return None
    value = value.strip()
    with contextlib.suppress(ValueError):
        return max(float(value), 0.0)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(when.timestamp() - (time.time() if now is None else now), 0.0)


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


#: the exception of an answer's status, where not :class:`BadRequestError` (4xx) or
#: :class:`ServerError`
_ERRORS: dict[int, type[ServerError]] = {
    401: AuthenticationError,
    403: AuthenticationError,
    404: NotFoundError,
    429: RateLimitedError,
    503: ServiceUnavailableError,
}


def error_from_response(response: Any) -> ServerError:
    """A :class:`ServerError` subclass carrying the status and the server's ``detail``."""
    status = response.status_code
    try:
        payload = response.json()
        detail = payload.get("detail", payload) if isinstance(payload, dict) else payload
    except (ValueError, UnicodeDecodeError):
        detail = response.text.strip() or response.reason_phrase
    retry_after = parse_retry_after(response.headers.get("Retry-After"))
    method, url = _request_of(response)
    return server_error(status, detail, method, url, retry_after)


def server_error(
    status: int, detail: Any, method: str = "", url: str = "", retry_after: float | None = None
) -> ServerError:
    """The :class:`ServerError` subclass of ``status`` (also for a job's stored error, so that
    a request the server made a job fails as its answer would have)."""
    cls = _ERRORS.get(status) or (BadRequestError if 400 <= status < 500 else ServerError)
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


def explain_malformed(body: Any, error: BadRequestError) -> None:
    """Raise the :class:`WorkspaceError` of a :class:`JSONFile` in ``body`` that is not JSON
    when the server answered ``error`` (400: the body's JSON is malformed)."""
    if error.status == 400 and isinstance(body, dict):
        for value in body.values():
            if isinstance(value, JSONFile):
                value.parsed()


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
