"""FastAPI dependencies: the app's state and settings, and Bearer-token authentication."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from .errors import Unauthorized
from .settings import Settings
from .state import ServiceState

_bearer = HTTPBearer(auto_error=False, description="the server's API token (PYHF_GPU_API_TOKEN)")


def get_state(request: Request) -> ServiceState:
    """The running service's state."""
    return request.app.state.service


def get_settings(request: Request) -> Settings:
    """The app's settings (available before start-up completes)."""
    return request.app.state.settings


def require_token(
    settings: Annotated[Settings, Depends(get_settings)],
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    """401 unless auth is off or ``Authorization: Bearer <token>`` matches (constant time)."""
    expected = settings.api_token
    if not expected:
        return
    if credentials is None or credentials.scheme.lower() != "bearer":
        raise Unauthorized("this server needs 'Authorization: Bearer <token>'")
    if not hmac.compare_digest(credentials.credentials.encode(), expected.encode()):
        raise Unauthorized("the Bearer token is not valid")


StateDep = Annotated[ServiceState, Depends(get_state)]
