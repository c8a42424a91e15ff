"""The web page: ``GET /`` (upload, run, watch and plot jobs) and ``GET /jobs/{id}/report``
(one job, bookmarkable), with their files under ``/static/`` (plain HTML, JS and CSS shipped
in the package: no CDN, works offline), and ``GET /tables``, the tables the page (and any
other caller) reads: the operations, their plot kinds and the plot options
(``pyhf_gpu_client.tables``, declared once).

Neither the pages nor their files hold data, so they need no token: with auth on, the page asks
for it and sends it as the Bearer header with every request it makes.
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

from pyhf_gpu_client import tables

STATIC_URL = "/static"
#: the report pages, open like ``/`` (matched whole by the auth middleware)
REPORT_PATTERN = r"/jobs/[^/]+/report"

router = APIRouter(include_in_schema=False)
#: ``GET /tables`` (in the API's schema)
tables_router = APIRouter(tags=["tables"])


def static_dir() -> Path:
    """The package's ``static`` folder (``index.html``, ``app.js``, ``style.css``)."""
    return Path(str(resources.files("pyhf_gpu_server.service").joinpath("static")))


@cache
def _template() -> str:
    return (static_dir() / "index.html").read_text(encoding="utf-8")


def _page(request: Request, mode: str) -> HTMLResponse:
    """The page, told whether the server needs a token and which view to show."""
    auth = "on" if request.app.state.settings.callers is not None else "off"
    html = _template().replace('data-auth=""', f'data-auth="{auth}"')
    html = html.replace('data-mode=""', f'data-mode="{mode}"')
    return HTMLResponse(html, headers={"Cache-Control": "no-cache"})


@router.get("/", response_class=HTMLResponse)
async def index(request: Request) -> HTMLResponse:
    """Upload a workspace (and a patchset), start a job, watch it, show its plots and table."""
    return _page(request, "index")


@router.get("/jobs/{job_id}/report", response_class=HTMLResponse)
async def report(job_id: str, request: Request) -> HTMLResponse:
    """One job's status, plots and results table (the page reads the id from its URL)."""
    return _page(request, "report")


@tables_router.get("/tables", summary="The operations, their plot kinds and the plot options")
async def get_tables() -> dict[str, Any]:
    """The operation names; the plot kinds each operation's answer offers (``plot_kinds``)
    and what a kind needs of the request to fit (``plot_needs``: a field, as a list or
    given); per plot kind (``plots``) its description, whether it draws one patch of a
    patchset's answer or all of them (``draws``), the options the service fills in
    (``inputs``) and its options as ``[type, default]``; the options every kind takes
    (``plot_common_options``: ``[type, default, what]``) and the image formats with their
    media types. The same tables as ``pyhf_gpu_client.tables``."""
    return tables.as_json()


def add_pages(app: FastAPI) -> None:
    """Serve the pages, their files and ``GET /tables`` on ``app``."""
    app.include_router(router)
    app.include_router(tables_router)
    app.mount(STATIC_URL, StaticFiles(directory=str(static_dir())), name="static")
