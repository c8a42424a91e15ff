"""Pure ASGI middleware: request ids, access logs and metrics; body size limits and gzip."""

from __future__ import annotations

import logging
import re
import time
import uuid
import zlib

from starlette.datastructures import Headers, MutableHeaders
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .metrics import Metrics

log = logging.getLogger("pyhf_gpu_server.service.access")

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_BODYLESS_METHODS = frozenset({"GET", "HEAD", "DELETE", "OPTIONS"})


class RequestContextMiddleware:
    """Gives every request an id (``X-Request-ID``), logs one JSON line and records metrics."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        """Wrap ``app``; record into ``metrics``."""
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
                MutableHeaders(scope=message)["X-Request-ID"] = request_id
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
                },
            )


class BodyLimitMiddleware:
    """Rejects bodies over ``max_bytes`` (declared, streamed or gunzipped: 413) and gunzips them.

    A ``Content-Encoding: gzip`` body reaches the app decompressed, with the header removed.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        """Wrap ``app`` with a limit of ``max_bytes``."""
        self.app = app
        self.max_bytes = max_bytes

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
        body = await self._read(receive)
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
        _set_body_headers(scope, len(body))
        await self.app(scope, _replay(body, receive), send)

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
        """Decompressed ``body``, or ``None`` when it would pass the limit."""
        inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
        out = inflater.decompress(body, self.max_bytes + 1)
        if len(out) > self.max_bytes or inflater.unconsumed_tail:
            return None
        if not inflater.eof:
            raise zlib.error("truncated gzip stream")
        return out

    def _too_large(self, what: str) -> JSONResponse:
        """The 413 answer."""
        limit_mb = self.max_bytes / (1024 * 1024)
        return _reject(
            413,
            f"{what} is larger than the limit of {limit_mb:g} MiB (--max-body-mb); "
            "upload the workspace once with POST /workspaces and send small patches",
        )


def _reject(status: int, detail: str) -> JSONResponse:
    """A JSON error answered by the middleware itself."""
    return JSONResponse({"detail": detail}, status_code=status)


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
