"""FastAPI dependencies: the app's state and settings, and Bearer-token authentication."""

from __future__ import annotations

import dataclasses
import hmac
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from .errors import Unauthorized
from .settings import Settings
from .state import ServiceState

_bearer = HTTPBearer(
    auto_error=False,
    description="the server's API token (PYHF_GPU_API_TOKEN or PYHF_GPU_API_TOKEN_FILE)",
)


def get_state(request: Request) -> ServiceState:
    """The running service's state."""
    return request.app.state.service


def get_settings(request: Request) -> Settings:
    """The app's settings (available before start-up completes)."""
    return request.app.state.settings


def token_problem(authorization: str, expected: str) -> Unauthorized | None:
    """The 401 for an ``Authorization`` header that does not carry ``expected``, else ``None``.

    The comparison takes constant time.
    """
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return Unauthorized("this server needs 'Authorization: Bearer <token>'")
    if not hmac.compare_digest(given.strip().encode(), expected.encode()):
        return Unauthorized("the Bearer token is not valid")
    return None


def require_token(
    request: Request,
    settings: Annotated[Settings, Depends(get_settings)],
    _credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    """401 unless auth is off or the request carries the token.

    :class:`~.middleware.TokenAuthMiddleware` already refused such requests before their body
    was read; this dependency declares the Bearer scheme in the OpenAPI document (Swagger's
    *Authorize* button) and guards the routes wherever the app runs without that middleware.
    """
    expected = settings.api_token
    if not expected:
        return
    problem = token_problem(request.headers.get("authorization", ""), expected)
    if problem is not None:
        raise problem


def with_file_token(settings: Settings) -> Settings:
    """``settings`` with :attr:`~Settings.api_token` read from ``api_token_file`` (when set),
    and the file cleared (so a second call changes nothing).

    Raises ``ValueError`` (one line) for an unreadable or empty file, or when both are given.
    """
    if settings.api_token_file is None:
        return settings
    path = Path(settings.api_token_file)
    if settings.api_token:
        raise ValueError("give --api-token or --api-token-file, not both")
    try:
        token = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read --api-token-file {path}: {exc}") from None
    if not token:
        raise ValueError(f"--api-token-file {path} is empty")
    return dataclasses.replace(settings, api_token=token, api_token_file=None)


StateDep = Annotated[ServiceState, Depends(get_state)]
