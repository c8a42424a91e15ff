"""Errors the service answers with, and the mapping of library exceptions to 4xx answers.

Every answer is JSON ``{"detail": ...}``; no traceback ever reaches a client.
"""

from __future__ import annotations

import logging
from typing import Any

import jsonpatch
import jsonpointer
import pydantic
import pyhf.exceptions
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pyhf_gpu_server.engine.errors import EngineError, ModelTooLargeError
from pyhf_gpu_server.inference.errors import InferenceError

log = logging.getLogger("pyhf_gpu_server.service")

MAX_DETAIL_CHARS = 2000
# every exception class pyhf defines: raised on bad specs, POIs, patches, modifiers, data
_PYHF_ERRORS = tuple(
    cls
    for cls in vars(pyhf.exceptions).values()
    if isinstance(cls, type) and issubclass(cls, Exception) and cls.__module__.startswith("pyhf")
)
# what :func:`translate` maps to a 4xx, answered where raised (never as a server fault)
_CLIENT_ERRORS = (
    *_PYHF_ERRORS,
    EngineError,
    InferenceError,
    jsonpatch.JsonPatchException,
    jsonpointer.JsonPointerException,
    pydantic.ValidationError,
)


class ServiceError(Exception):
    """An error with an HTTP status; ``detail`` is what the client reads."""

    status_code = 400

    def __init__(
        self, detail: Any, *, status_code: int | None = None, headers: dict[str, str] | None = None
    ) -> None:
        """Keep the detail (a message or a list of located problems), status and headers."""
        super().__init__(detail if isinstance(detail, str) else repr(detail))
        self.detail = detail
        if status_code is not None:
            self.status_code = status_code
        self.headers = headers or {}


class BadRequest(ServiceError):
    """The body or query could not be read at all (400)."""


class Unauthorized(ServiceError):
    """Missing or wrong Bearer token (401)."""

    status_code = 401

    def __init__(self, detail: str) -> None:
        """Ask for a Bearer token."""
        super().__init__(detail, headers={"WWW-Authenticate": 'Bearer realm="pyhf-gpu"'})


class NotFound(ServiceError):
    """An unknown job or workspace id (404)."""

    status_code = 404


class Conflict(ServiceError):
    """The resource is in a state that forbids the operation (409)."""

    status_code = 409


class Unprocessable(ServiceError):
    """Readable JSON that is not a valid request, workspace or model (422)."""

    status_code = 422


class QueueFull(ServiceError):
    """Back-pressure: the queue is full (429, with Retry-After)."""

    status_code = 429

    def __init__(self, detail: str, retry_after_s: int = 1) -> None:
        """Tell the client when to come back."""
        super().__init__(detail, headers={"Retry-After": str(retry_after_s)})


class NotImplementedHere(ServiceError):
    """501: this server was installed without what the request needs (an extra)."""

    status_code = 501


class Unavailable(ServiceError):
    """The device could not serve the request (503, with Retry-After)."""

    status_code = 503

    def __init__(self, detail: str, retry_after_s: int = 5, transient: bool = True) -> None:
        """Tell the client when to come back; ``transient``: whether the same work may run
        later (a job runs it again), not fail the same way whenever it runs."""
        super().__init__(detail, headers={"Retry-After": str(retry_after_s)})
        self.transient = transient


class InsufficientStorage(ServiceError):
    """The workspace store is full of workspaces that jobs still need (507)."""

    status_code = 507


class RequestTimeout(ServiceError):
    """The request ran out of time (504)."""

    status_code = 504


def _clip(text: str) -> str:
    """Shorten a message that embeds large JSON instances."""
    return text if len(text) <= MAX_DETAIL_CHARS else text[:MAX_DETAIL_CHARS] + " ..."


def describe_invalid_specification(exc: pyhf.exceptions.InvalidSpecification, what: str) -> str:
    """pyhf's schema message with its JSON path, without the (possibly huge) instance dump."""
    message = getattr(exc.parent, "message", str(exc))
    where = exc.path or "(top level)"
    return _clip(f"invalid {what} at {where}: {message} (schema {exc.schema})")


def pydantic_detail(exc: pydantic.ValidationError, prefix: tuple[str, ...] = ("body",)) -> list:
    """FastAPI-style located problems ``[{"loc", "msg", "type"}]`` of a pydantic error."""
    return [
        {"loc": [*prefix, *err["loc"]], "msg": err["msg"], "type": err["type"]}
        for err in exc.errors(include_url=False, include_context=False, include_input=False)
    ]


def translate(exc: BaseException, what: str = "workspace") -> ServiceError | None:
    """The 4xx a library exception stands for, or ``None`` for a real server fault.

    pyhf's own errors (invalid spec, unknown POI, bad patch...), jsonpatch conflicts and the
    engine's :class:`UnsupportedModelError` are the client's input problems: 422 with the message.
    """
    if isinstance(exc, ServiceError):
        return exc
    if isinstance(exc, pyhf.exceptions.InvalidSpecification):
        return Unprocessable(describe_invalid_specification(exc, what))
    if isinstance(exc, InferenceError):
        return Unprocessable(_clip(str(exc)))
    if isinstance(exc, ModelTooLargeError):
        return Unprocessable(_clip(f"the {what} is too large: {exc} (--max-model-memory-mb)"))
    if isinstance(exc, (*_PYHF_ERRORS, EngineError)):
        return Unprocessable(_clip(f"{type(exc).__name__}: {exc}"))
    if isinstance(exc, (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException)):
        return Unprocessable(_clip(f"patch could not be applied: {exc}"))
    if isinstance(exc, pydantic.ValidationError):
        return Unprocessable(pydantic_detail(exc))
    return None


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    """FastAPI's 422 for query/path problems, without echoing inputs back."""
    assert isinstance(exc, RequestValidationError)
    detail = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors()]
    return JSONResponse({"detail": detail}, status_code=422)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own errors (404 for unknown routes, 405) as JSON."""
    assert isinstance(exc, StarletteHTTPException)
    return JSONResponse(
        {"detail": exc.detail}, status_code=exc.status_code, headers=getattr(exc, "headers", None)
    )


async def _client_error(request: Request, exc: Exception) -> JSONResponse:
    """A :class:`ServiceError`, or a library error that stands for bad input
    (:func:`translate`): its 4xx."""
    mapped = translate(exc)
    assert mapped is not None
    return JSONResponse(
        {"detail": mapped.detail}, status_code=mapped.status_code, headers=mapped.headers
    )


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    """A real server fault: a 500 without a traceback (which goes to the log)."""
    request_id = request.scope.get("state", {}).get("request_id", "-")
    log.error("unhandled error", exc_info=exc, extra={"request_id": request_id})
    return JSONResponse(
        {"detail": f"internal server error (request id {request_id}); see the server log"},
        status_code=500,
    )


def install_error_handlers(app: FastAPI) -> None:
    """Register the JSON error handlers on ``app``."""
    app.add_exception_handler(ServiceError, _client_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    for client_error in _CLIENT_ERRORS:
        app.add_exception_handler(client_error, _client_error)
    app.add_exception_handler(Exception, _unexpected_error)
