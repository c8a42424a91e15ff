"""Test helpers for the client: an in-memory fake service and a tiny real HTTP stub server."""

from __future__ import annotations

import gzip
import json
import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
from click.testing import CliRunner

from pyhf_gpu_client import cli

CLS_ANSWER = {
    "CLs_obs": 0.3599845631401915,
    "CLs_exp": [
        0.07807427911686156,
        0.17472571775474618,
        0.35998495263681285,
        0.6343568235898907,
        0.8809947004472013,
    ],
}


def simple_workspace(signal: float = 5.0) -> dict[str, Any]:
    """A one-bin workspace (like pyhf.simplemodels.uncorrelated_background), built by hand."""
    return {
        "channels": [
            {
                "name": "singlechannel",
                "samples": [
                    {
                        "name": "signal",
                        "data": [signal],
                        "modifiers": [{"name": "mu", "type": "normfactor", "data": None}],
                    },
                    {
                        "name": "background",
                        "data": [50.0],
                        "modifiers": [
                            {"name": "uncorr_bkguncrt", "type": "shapesys", "data": [7.0]}
                        ],
                    },
                ],
            }
        ],
        "observations": [{"name": "singlechannel", "data": [52.0]}],
        "measurements": [{"name": "Measurement", "config": {"poi": "mu", "parameters": []}}],
        "version": "1.0.0",
    }


def run_cli(url: str, *args: str) -> str:
    """``pyhf-gpu-client ARGS`` in-process (click's CliRunner) against the server at ``url``;
    its stdout (exit code 0 asserted)."""
    res = CliRunner().invoke(cli.main, list(args), env={"PYHF_GPU_SERVER": url})
    assert res.exit_code == 0, res.output
    return res.stdout


def assert_pyhf_format(text: str) -> Any:
    """The JSON of ``text``, asserted printed exactly as pyhf prints:
    ``json.dumps(obj, indent=4, sort_keys=True)`` and a newline."""
    obj = json.loads(text)
    assert text == json.dumps(obj, indent=4, sort_keys=True) + "\n"
    return obj


def assert_close(
    ours: Any, theirs: Any, tol: float = 1e-4, rel_tol: float = 0.0, path: str = ""
) -> None:
    """Same structure and keys; numbers within ``tol`` (absolute) or ``rel_tol`` (relative),
    anything else (null, strings) equal."""
    if isinstance(theirs, dict):
        assert isinstance(ours, dict) and sorted(ours) == sorted(theirs), path
        for key in theirs:
            assert_close(ours[key], theirs[key], tol, rel_tol, f"{path}/{key}")
    elif isinstance(theirs, list):
        assert isinstance(ours, list) and len(ours) == len(theirs), path
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert_close(a, b, tol, rel_tol, f"{path}/{i}")
    elif isinstance(theirs, int | float):
        assert math.isclose(ours, theirs, rel_tol=rel_tol, abs_tol=tol), (
            f"{path}: {ours} vs {theirs}"
        )
    else:
        assert ours == theirs, f"{path}: {ours} vs {theirs}"


def body_of(request: httpx.Request) -> Any:
    """The JSON body of a request, gunzipped when it says so."""
    content = request.content
    if request.headers.get("content-encoding") == "gzip":
        content = gzip.decompress(content)
    return json.loads(content) if content else None


@dataclass
class FakeService:
    """An in-memory stand-in for the service, as an ``httpx.MockTransport`` handler.

    ``script`` maps ``"METHOD /path"`` to a list of canned responses consumed in order (the last
    one repeats); unscripted routes get sensible defaults. Every request is recorded.
    """

    script: dict[str, list[httpx.Response | Exception]] = field(default_factory=dict)
    requests: list[httpx.Request] = field(default_factory=list)
    workspaces: set[str] = field(default_factory=set)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        """Answer one request."""
        self.requests.append(request)
        key = f"{request.method} {request.url.path}"
        if key in self.script:
            queue = self.script[key]
            answer = queue.pop(0) if len(queue) > 1 else queue[0]
            if isinstance(answer, Exception):
                raise answer
            return answer
        return self.default(request)

    def default(self, request: httpx.Request) -> httpx.Response:
        """Default answers: workspace store, /cls with the envelope's shape, health."""
        path = request.url.path
        if request.method == "GET" and path.startswith("/workspaces/"):
            wid = path.rsplit("/", 1)[1]
            if wid in self.workspaces:
                return httpx.Response(200, json={"workspace_id": wid})
            return httpx.Response(404, json={"detail": f"unknown workspace {wid}"})
        if request.method == "POST" and path == "/workspaces":
            from pyhf_gpu_client import digest

            wid = digest(body_of(request))
            self.workspaces.add(wid)
            return httpx.Response(201, json={"workspace_id": wid})
        if request.method == "POST" and path == "/cls":
            body = body_of(request)
            if "workspace_id" in body and body["workspace_id"] not in self.workspaces:
                return httpx.Response(404, json={"detail": "unknown workspace_id"})
            one = {**CLS_ANSWER, "meta": {"device": "cpu"}}
            poi = body.get("test_poi", 1.0)
            if isinstance(poi, list):
                answer: Any = [{**one, "meta": {"test_poi": x}} for x in poi]
            else:
                answer = one
            if "patchset" in body:
                names = body.get("patch_names") or [
                    p["metadata"]["name"] for p in body["patchset"]["patches"]
                ]
                answer = {name: answer for name in names}
            return httpx.Response(200, json=answer)
        if path in ("/healthz", "/readyz"):
            return httpx.Response(200, json={"status": "ok"})
        return httpx.Response(404, json={"detail": "Not Found"})

    def paths(self) -> list[str]:
        """``"METHOD /path"`` of every recorded request."""
        return [f"{r.method} {r.url.path}" for r in self.requests]


# ------------------------------------------------------------------ real-socket stub server


@dataclass
class StubReply:
    """One canned answer of :func:`stub_server`."""

    status: int
    body: Any
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0


class _QuietServer(ThreadingHTTPServer):
    """A stub server that does not print a client's hang-up (the timeout tests cause them)
    to stderr, where a later test capturing stderr would read it."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass


@contextmanager
def stub_server(replies: list[StubReply]) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """A real HTTP server on 127.0.0.1 answering ``replies`` in order (the last repeats).

    Yields ``(base_url, log)``; ``log`` records ``{"method", "path", "headers", "time"}``.
    """
    import time

    log: list[dict[str, Any]] = []
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            with lock:
                log.append(
                    {
                        "method": self.command,
                        "path": self.path,
                        "headers": dict(self.headers),
                        "time": time.monotonic(),
                    }
                )
                reply = replies.pop(0) if len(replies) > 1 else replies[0]
            time.sleep(reply.delay_s)
            payload = json.dumps(reply.body).encode()
            self.send_response(reply.status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            for name, value in reply.headers.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(payload)

        do_GET = do_POST = do_DELETE = _answer

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = _QuietServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", log
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def mock_client_factory(service: FakeService, **kwargs: Any) -> Callable[..., Any]:
    """A replacement of ``pyhf_gpu_client.cli._client`` that talks to ``service``."""
    from pyhf_gpu_client import Client

    def make(ctx: Any, progress: Any = None) -> Client:
        transport = httpx.MockTransport(service)
        return Client(
            "http://fake", transport=transport, backoff=0.0, on_job_update=progress, **kwargs
        )

    return make
