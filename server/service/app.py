"""The FastAPI application factory: ``create_app(settings)``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse

from .dependencies import require_token
from .errors import install_error_handlers
from .metrics import Metrics
from .middleware import BodyLimitMiddleware, RequestContextMiddleware
from .routers import health, inference, jobs, workspaces
from .settings import Settings
from .state import ServiceState

DESCRIPTION = """
pyhf-compatible HistFactory inference, batched on one device.

* `POST /cls`, `/fit`, `/upper-limit`, `/significance` answer synchronously (pyhf CLI JSON + `meta`).
* `POST /workspaces` uploads a workspace once; requests then send `workspace_id` and small patches.
* `POST /jobs` runs the same requests durably in the background (SQLite), with progress events.

With an API token set, every route except `/healthz` and `/readyz` needs
`Authorization: Bearer <token>` (this page and `/openapi.json` included).
"""


def create_app(settings: Settings) -> FastAPI:
    """A new app serving with ``settings``; its state is created at start-up (lifespan)."""
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.service = await ServiceState.open(settings, metrics)
        try:
            yield
        finally:
            await app.state.service.close()

    app = FastAPI(
        title="pyhf-gpu",
        version=_package_version(),
        description=DESCRIPTION,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.settings = settings
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(RequestContextMiddleware, metrics=metrics)
    authenticated = [Depends(require_token)]
    app.include_router(health.public)
    app.include_router(health.private)
    app.include_router(inference.router, dependencies=authenticated)
    app.include_router(workspaces.router, dependencies=authenticated)
    app.include_router(jobs.router, dependencies=authenticated)
    _add_docs(app)
    return app


def _add_docs(app: FastAPI) -> None:
    """/openapi.json and /docs (Swagger UI), behind the same auth as the API."""

    @app.get("/openapi.json", include_in_schema=False, dependencies=[Depends(require_token)])
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False, dependencies=[Depends(require_token)])
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="pyhf-gpu API")


def _package_version() -> str:
    """The installed pyhf-gpu version."""
    from importlib import metadata

    try:
        return metadata.version("pyhf-gpu")
    except metadata.PackageNotFoundError:
        return "0"
