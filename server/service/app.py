"""The FastAPI application factory: ``create_app(settings)``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib import resources

import anyio
from fastapi import Depends, FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from .dependencies import require_token, with_file_token
from .errors import install_error_handlers
from .local_workers import LocalWorkers
from .metrics import Metrics
from .middleware import BodyLimitMiddleware, RequestContextMiddleware, TokenAuthMiddleware
from .routers import health, inference, jobs, pages, workspaces
from .settings import Settings
from .state import ConnectCluster, ServiceState

DESCRIPTION = """
pyhf-compatible HistFactory inference, batched on one device.

* `POST /cls`, `/fit`, `/upper-limit`, `/significance` answer synchronously (pyhf CLI JSON + `meta`).
* `POST /workspaces` uploads a workspace once; requests then send `workspace_id` and small patches.
* `POST /jobs` runs the same requests durably in the background (SQLite), with progress events.
* `GET /jobs/{id}/plots/{kind}.svg|png` draws a job's result; a `plot` in a request answers
  the image instead of JSON. The web page at `/` uploads, runs and shows jobs.

With an API token set, every route except `/healthz`, `/readyz`, this page,
`/openapi.json` and the web page's files needs `Authorization: Bearer <token>`: enter it with
*Authorize*.
"""

DOCS_ASSETS = "/docs/static"
# need no token: the probes, the API's description (no data) with the page showing it, and
# the web page (no data either: it asks for the token and sends it with every request)
OPEN_PATHS = ("/healthz", "/readyz", "/openapi.json", "/docs", "/")
OPEN_PREFIXES = (DOCS_ASSETS + "/", pages.STATIC_URL + "/")
OPEN_PATTERNS = (pages.REPORT_PATTERN,)


def create_app(
    settings: Settings,
    local_workers: LocalWorkers | None = None,
    connect_cluster: ConnectCluster | None = None,
) -> FastAPI:
    """A new app serving with ``settings``; its state is created at start-up (lifespan).
    ``local_workers`` (forked by the caller, which stops them) read shares of large
    patchsets; ``connect_cluster`` (``ClusterRunner.connect``) serves ``--dask-scheduler``.

    Raises ``ValueError`` when ``settings.api_token_file`` cannot be read.
    """
    settings = with_file_token(settings)
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.service = await ServiceState.open(
            settings, metrics, local_workers, connect_cluster
        )
        _build_routes(app)
        await anyio.to_thread.run_sync(lambda: None)  # the worker threads' backend, imported
        try:
            yield
        finally:
            await app.state.service.close()

    app = FastAPI(
        title="pyhf-gpu",
        version=health.package_version("pyhf-gpu") or "0",
        description=DESCRIPTION,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.settings = settings
    install_error_handlers(app)
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=settings.max_body_bytes,
        body_timeout_s=settings.body_timeout_s,
    )
    app.add_middleware(
        TokenAuthMiddleware,
        callers=settings.callers,
        open_paths=OPEN_PATHS,
        open_prefixes=OPEN_PREFIXES,
        open_patterns=OPEN_PATTERNS,
    )
    app.add_middleware(RequestContextMiddleware, metrics=metrics)
    authenticated = [Depends(require_token)]
    app.include_router(health.public)
    app.include_router(health.private)
    app.include_router(inference.router, dependencies=authenticated)
    app.include_router(workspaces.router, dependencies=authenticated)
    app.include_router(jobs.router, dependencies=authenticated)
    pages.add_pages(app)
    _add_docs(app)
    return app


def _build_routes(app: FastAPI) -> None:
    """Build every route before the first request: FastAPI builds an included router's
    routes (their dependants and pydantic adapters) when a request first walks that router,
    and a path that no route has walks them all."""
    scope = {"type": "http", "method": "GET", "path": "/ start-up", "root_path": ""}
    for route in app.router.routes:
        route.matches(scope)


def _add_docs(app: FastAPI) -> None:
    """/openapi.json and /docs, open to all (see :data:`OPEN_PATHS`).

    Swagger UI's files (Swagger UI 5, which reads OpenAPI 3.1) are shipped in the package's
    ``static/swagger`` folder and served under :data:`DOCS_ASSETS`: the page needs no CDN.
    """
    assets = resources.files("pyhf_gpu_server.service").joinpath("static", "swagger")
    app.mount(DOCS_ASSETS, StaticFiles(directory=str(assets)), name="docs-assets")

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url="/openapi.json",
            title="pyhf-gpu API",
            swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{DOCS_ASSETS}/favicon.png",
        )
