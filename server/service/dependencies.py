"""FastAPI dependencies: the app's state and settings, and Bearer-token authentication
(which names the caller: see :class:`~.settings.Callers`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from .errors import Unauthorized
from .settings import Callers, Settings
from .state import ServiceState

_bearer = HTTPBearer(
    auto_error=False,
    description="the server's API token (PYHF_GPU_API_TOKEN or PYHF_GPU_API_TOKEN_FILE)",
)


async def get_state(request: Request) -> ServiceState:
    """The running service's state."""
    return request.app.state.service


async def get_settings(request: Request) -> Settings:
    """The app's settings (available before start-up completes)."""
    return request.app.state.settings


def authenticate(authorization: str, callers: Callers) -> str:
    """The name of the caller whose token an ``Authorization`` header carries.

    Raises :class:`~.errors.Unauthorized` for a missing, malformed or unknown token. Every
    token is compared in constant time (:meth:`Callers.caller`).
    """
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise Unauthorized("this server needs 'Authorization: Bearer <token>'")
    caller = callers.caller(given.strip())
    if caller is None:
        raise Unauthorized("the Bearer token is not valid")
    return caller


async def require_token(
    request: Request,
    settings: Annotated[Settings, Depends(get_settings)],
    _credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> str | None:
    """401 unless auth is off or the request carries a known token; the caller's name
    (``None`` when auth is off), also kept in the request's ``state.caller``.

    :class:`~.middleware.TokenAuthMiddleware` already refused such requests before their body
    was read; this dependency declares the Bearer scheme in the OpenAPI document (Swagger's
    *Authorize* button) and guards the routes wherever the app runs without that middleware.
    """
    callers = settings.callers
    caller = None
    if callers is not None:
        caller = authenticate(request.headers.get("authorization", ""), callers)
    request.scope.setdefault("state", {})["caller"] = caller
    return caller


def parse_token_file(text: str, source: str) -> str | Callers:
    """The token of a one-token file, or the callers of a ``NAME TOKEN`` file.

    Blank lines and lines starting with ``#`` are ignored. One line of one field is a bare
    token (as before callers had names); otherwise every line is ``NAME TOKEN`` (whitespace
    separated), names and tokens unique. Raises ``ValueError`` (one line, naming ``source``
    and the line, never a token) for anything else.
    """
    lines = [
        (number, line.split())
        for number, line in enumerate(text.splitlines(), 1)
        if line.strip() and not line.lstrip().startswith("#")
    ]
    if not lines:
        raise ValueError(f"{source} is empty")
    if len(lines) == 1 and len(lines[0][1]) == 1:
        return lines[0][1][0]
    names: dict[str, int] = {}
    tokens: dict[str, int] = {}
    for number, fields in lines:
        if len(fields) != 2:
            raise ValueError(
                f"{source} line {number}: expected 'NAME TOKEN' (one caller per line), "
                f"found {len(fields)} field{'' if len(fields) == 1 else 's'}"
            )
        name, token = fields
        if name in names:
            raise ValueError(
                f"{source} line {number}: the caller name {name!r} is also on line {names[name]}"
            )
        if token in tokens:
            raise ValueError(
                f"{source} line {number}: the same token is also on line {tokens[token]}; "
                "every caller needs its own"
            )
        names[name] = tokens[token] = number
    return Callers(tuple((fields[0], fields[1]) for _, fields in lines))


def with_file_token(settings: Settings) -> Settings:
    """``settings`` with :attr:`~Settings.api_token` read from ``api_token_file`` (when set),
    and the file cleared (so a second call changes nothing): the token of a one-token file,
    or the :class:`~.settings.Callers` of a ``NAME TOKEN`` file (see :func:`parse_token_file`).

    Raises ``ValueError`` (one line) for an unreadable, empty or malformed file, or when both
    are given.
    """
    if settings.api_token_file is None:
        return settings
    path = Path(settings.api_token_file)
    if settings.api_token:
        raise ValueError("give --api-token or --api-token-file, not both")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read --api-token-file {path}: {exc}") from None
    token = parse_token_file(text, f"--api-token-file {path}")
    return settings.model_copy(update={"api_token": token, "api_token_file": None})


StateDep = Annotated[ServiceState, Depends(get_state)]
CallerDep = Annotated[str | None, Depends(require_token)]
"""The authenticated caller's name; ``None`` when auth is off (then every caller is one)."""
