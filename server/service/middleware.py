"""Request guards. Pure ASGI middleware: request ids, access logs and metrics; the Bearer token
(checked on the headers, before any body is read; it names the caller, kept in the ASGI scope's
``state["caller"]``); body size limits, read deadline and gzip.
And the uvicorn protocol that closes connections whose request headers never complete.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
import zlib
from collections.abc import Collection
from typing import Any

import anyio
import h11
from starlette.datastructures import Headers, MutableHeaders
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..allocator import glibc_function
from .dependencies import authenticate
from .errors import Unauthorized
from .metrics import Metrics
from .settings import Callers

log = logging.getLogger("pyhf_gpu_server.service.access")

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_BODYLESS_METHODS = frozenset({"GET", "HEAD", "DELETE", "OPTIONS"})


#: Content-Security-Policy of every answer: the page loads its own script and stylesheet
#: and shows plots from blob URLs; nothing may frame it, no plugin, no other origin.
PAGE_POLICY = (
    "default-src 'self'; img-src 'self' blob: data:; object-src 'none'; "
    "frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
)
#: An SVG opened as a document: its own inline styles (matplotlib writes them), no script.
SVG_POLICY = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; frame-ancestors 'none'"


def add_security_headers(headers: MutableHeaders) -> None:
    """``nosniff`` (a JSON or SVG answer is never read as HTML or script), no framing, and a
    Content-Security-Policy (:data:`SVG_POLICY` for SVG answers, :data:`PAGE_POLICY` else)."""
    headers["X-Content-Type-Options"] = "nosniff"
    headers["X-Frame-Options"] = "DENY"
    svg = headers.get("content-type", "").startswith("image/svg+xml")
    headers["Content-Security-Policy"] = SVG_POLICY if svg else PAGE_POLICY


class RequestContextMiddleware:
    """Gives every request an id (``X-Request-ID``) and every answer the security headers
    (:func:`add_security_headers`), logs one JSON line and records metrics."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the request, then log and count it (also when it fails)."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get("x-request-id", "")
        request_id = given if _REQUEST_ID.match(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        start = time.perf_counter()
        status = 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = MutableHeaders(scope=message)
                headers["X-Request-ID"] = request_id
                add_security_headers(headers)
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            seconds = time.perf_counter() - start
            route = getattr(scope.get("route"), "path", "unmatched")
            labels = (route, scope["method"], str(status))
            self.metrics.requests.labels(*labels).inc()
            self.metrics.latency.labels(*labels).observe(seconds)
            log.info(
                "request",
                extra={
                    "request_id": request_id,
                    "method": scope["method"],
                    "path": scope["path"],
                    "route": route,
                    "status": status,
                    "duration_ms": round(seconds * 1000, 3),
                    "client": (scope.get("client") or ("-",))[0],
                    "caller": scope["state"].get("caller"),
                },
            )


class TokenAuthMiddleware:
    """401 for a request without ``Authorization: Bearer <token>``, decided on its headers alone.

    Sits outside :class:`BodyLimitMiddleware`, so an unauthenticated body is never read nor
    gunzipped; the answer closes the connection (its unread body is not drained). ``open_paths``,
    paths under ``open_prefixes`` and paths matching one of ``open_patterns`` (regular
    expressions, matched whole) need no token; with no token set, nothing does. An
    admitted request carries its caller's name in ``scope["state"]["caller"]`` (``None`` with
    auth off, and on the open paths).
    """

    def __init__(
        self,
        app: ASGIApp,
        callers: Callers | None,
        open_paths: Collection[str],
        open_prefixes: tuple[str, ...] = (),
        open_patterns: tuple[str, ...] = (),
    ) -> None:
        self.app = app
        self.callers = callers
        self.open_paths = frozenset(open_paths)
        self.open_prefixes = open_prefixes
        self.open_patterns = tuple(re.compile(pattern) for pattern in open_patterns)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Hand on an authenticated (or open) request; answer 401 to any other."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state["caller"] = None
        if self.callers is not None and not self._is_open(scope["path"]):
            try:
                state["caller"] = authenticate(
                    Headers(scope=scope).get("authorization", ""), self.callers
                )
            except Unauthorized as problem:
                headers = {**problem.headers, "Connection": "close"}
                await _reject(401, problem.detail, headers)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _is_open(self, path: str) -> bool:
        """Whether ``path`` needs no token."""
        return (
            path in self.open_paths
            or path.startswith(self.open_prefixes)
            or any(pattern.fullmatch(path) for pattern in self.open_patterns)
        )


#: A request body (decompressed) at least this large hands the host memory it and what was
#: parsed from it took back to the system once its answer is sent.
RELEASE_ABOVE = 8 << 20


class BodyLimitMiddleware:
    """Rejects bodies over ``max_bytes`` (declared, streamed or gunzipped: 413) and gunzips them.

    A body not complete within ``body_timeout_s`` of its headers answers 408 (slow senders).
    A ``Content-Encoding: gzip`` body reaches the app decompressed, with the header removed.
    After a body of at least :data:`RELEASE_ABOVE`, glibc's ``malloc_trim`` hands the heap it
    and its parsed objects took back to the system (the allocator keeps blocks under 64 MiB
    and one arena, :mod:`pyhf_gpu_server.allocator`).
    """

    def __init__(self, app: ASGIApp, max_bytes: int, body_timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.body_timeout_s = body_timeout_s
        self._trim = glibc_function("malloc_trim")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Read the whole body within the limits, then hand it on."""
        if scope["type"] != "http" or scope["method"] in _BODYLESS_METHODS:
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        problem = self._check_headers(headers)
        if problem is not None:
            await problem(scope, receive, send)
            return
        try:
            body = await asyncio.wait_for(self._read(receive), self.body_timeout_s)
        except asyncio.TimeoutError:  # closes the connection: the rest of the body is not awaited
            late = f"the request body did not arrive within {self.body_timeout_s:g} s"
            close = {"Connection": "close"}
            await _reject(408, f"{late} (--body-timeout-s)", close)(scope, receive, send)
            return
        if body is None:
            await self._too_large("body")(scope, receive, send)
            return
        if headers.get("content-encoding", "identity").lower() == "gzip":
            try:
                body = self._gunzip(body)
            except zlib.error as exc:
                await _reject(400, f"body is not valid gzip: {exc}")(scope, receive, send)
                return
            if body is None:
                await self._too_large("decompressed body")(scope, receive, send)
                return
        size = len(body)
        _set_body_headers(scope, size)
        try:
            await self.app(scope, _replay(body, receive), send)
        finally:
            del body
            if size >= RELEASE_ABOVE and self._trim is not None:
                await anyio.to_thread.run_sync(self._trim, 0)

    def _check_headers(self, headers: Headers) -> JSONResponse | None:
        """413 for a declared length over the limit, 415 for an unknown encoding."""
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return self._too_large("Content-Length")
        encoding = headers.get("content-encoding", "identity").lower()
        if encoding not in ("identity", "gzip"):
            return _reject(
                415, f"Content-Encoding {encoding!r} is not supported; send gzip or none"
            )
        return None

    async def _read(self, receive: Receive) -> bytes | None:
        """The streamed body, or ``None`` once it passes the limit."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)

    def _gunzip(self, body: bytes) -> bytes | None:
        """Decompressed ``body``, or ``None`` when it would pass the limit. Its members one
        after the other (RFC 1952: the client sends a gzip file it read as one of them)."""
        out: list[bytes] = []
        size, rest = 0, body
        while True:
            inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
            out.append(inflater.decompress(rest, self.max_bytes + 1 - size))
            size += len(out[-1])
            if size > self.max_bytes or inflater.unconsumed_tail:
                return None
            if not inflater.eof:
                raise zlib.error("truncated gzip stream")
            rest = inflater.unused_data
            if not rest:
                return b"".join(out)

    def _too_large(self, what: str) -> JSONResponse:
        """The 413 answer."""
        limit_mb = self.max_bytes / (1024 * 1024)
        return _reject(
            413,
            f"{what} is larger than the limit of {limit_mb:g} MiB (--max-body-mb); "
            "upload the workspace once with POST /workspaces and send small patches",
        )


def header_deadline_protocol(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request headers are not complete
    within ``timeout_s`` of its opening or of its previous answer (slowloris clients)."""

    class HeaderDeadlineProtocol(H11Protocol):
        """:class:`H11Protocol` with a deadline for each request's headers."""

        _header_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            """Start the first request's deadline."""
            super().connection_made(transport)
            self._arm_header_deadline()

        def on_response_complete(self) -> None:
            """Start the next request's deadline."""
            super().on_response_complete()
            self._arm_header_deadline()

        def connection_lost(self, exc: Exception | None) -> None:
            """Drop the deadline with the connection."""
            if self._header_deadline is not None:
                self._header_deadline.cancel()
            super().connection_lost(exc)

        def _arm_header_deadline(self) -> None:
            """(Re)start the timer."""
            if self._header_deadline is not None:
                self._header_deadline.cancel()
            self._header_deadline = self.loop.call_later(timeout_s, self._close_if_waiting)

        def _close_if_waiting(self) -> None:
            """Close the connection while it still waits for a request's headers."""
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadlineProtocol


def _reject(status: int, detail: Any, headers: dict[str, str] | None = None) -> JSONResponse:
    """A JSON error answered by the middleware itself."""
    return JSONResponse({"detail": detail}, status_code=status, headers=headers)


def _set_body_headers(scope: Scope, length: int) -> None:
    """Remove Content-Encoding and set Content-Length to ``length`` (in place: outer middleware
    reads what the router stores in this scope)."""
    headers = [
        (k, v) for k, v in scope["headers"] if k not in (b"content-encoding", b"content-length")
    ]
    headers.append((b"content-length", str(length).encode()))
    scope["headers"] = headers


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that yields ``body`` once, then waits on the real one (for disconnects)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
