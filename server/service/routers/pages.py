"""The web page: ``GET /`` (upload, run, watch and plot jobs) and ``GET /jobs/{id}/report``
(one job, bookmarkable), with their files under ``/static/`` (plain HTML, JS and CSS shipped
in the package: no CDN, works offline).

Neither the pages nor their files hold data, so they need no token: with auth on, the page asks
for it and sends it as the Bearer header with every request it makes.
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

STATIC_URL = "/static"
#: the report pages, open like ``/`` (matched whole by the auth middleware)
REPORT_PATTERN = r"/jobs/[^/]+/report"

router = APIRouter(include_in_schema=False)


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


def add_pages(app: FastAPI) -> None:
    """Serve the pages and their files on ``app``."""
    app.include_router(router)
    app.mount(STATIC_URL, StaticFiles(directory=str(static_dir())), name="static")
