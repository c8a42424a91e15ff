"""The command line's client over ``http.client`` (``StdlibClient``) against a real HTTP
server on 127.0.0.1 (the standard library's, in a thread): it sends what httpx's ``Client``
sends, keeps its connection alive and opens a new one when the server closed it, decodes gzip
answers, and fails as ``Client`` does (connection refused, read timeout). End to end against
the real service: ``test_client_e2e.py`` (its commands speak through it)."""

from __future__ import annotations

import gzip
import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar
from urllib.parse import parse_qs, urlsplit

import click
import pytest

import pyhf_gpu_client as pgc
from pyhf_gpu_client import cli, protocol
from pyhf_gpu_client._stdlib import StdlibClient


class _Echo(BaseHTTPRequestHandler):
    """Answers every request with what it received, as JSON; the path picks a behaviour:
    ``/gzip`` answers gzip-encoded, ``/close`` closes the connection after answering (without
    saying so), ``/slow`` waits 1 s first."""

    protocol_version = "HTTP/1.1"
    connections: ClassVar[set[int]] = set()

    def log_message(self, *args: object) -> None:
        pass

    def _answer(self) -> None:
        _Echo.connections.add(self.client_address[1])  # the client's port: one per connection
        url = urlsplit(self.path)
        if url.path.endswith("/slow"):
            time.sleep(1.0)
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        echo = {
            "method": self.command,
            "path": url.path,
            "query": parse_qs(url.query),
            "headers": {k.lower(): v for k, v in self.headers.items()},
            "body": body.decode(),
        }
        content = json.dumps(echo).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        if url.path.endswith("/gzip"):
            content = gzip.compress(content)
            self.send_header("Content-Encoding", "gzip")
        self.send_header("Content-Length", str(len(content)))
        self.end_headers()
        self.wfile.write(content)
        if url.path.endswith("/close"):
            self.close_connection = True

    do_GET = do_POST = _answer


class _EchoServer(ThreadingHTTPServer):
    """Closing waits for every handler (the slow one's client is gone by then: its broken
    pipe is expected, not printed into a later test's captured output)."""

    daemon_threads = False

    def handle_error(self, request: object, client_address: object) -> None:
        pass


@pytest.fixture
def echo_server() -> Iterator[str]:
    server = _EchoServer(("127.0.0.1", 0), _Echo)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Echo.connections.clear()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in protocol.PROXY_VARIABLES:
        monkeypatch.delenv(variable, raising=False)


def _request(**kwargs: object) -> protocol.Request:
    return protocol.Request(**kwargs)  # type: ignore[arg-type]


def test_sends_what_httpx_sends(echo_server):
    """Method, path, query (booleans, lists, None left out), headers (token, Accept, gzip
    body) and body: equal through both clients."""
    request = _request(
        method="POST",
        path="/cls",
        body={"workspace_id": "abc", "patches": [[{"op": "add", "path": "/x", "value": 1}]] * 50},
        has_body=True,
        params={"test_poi": [0.5, 1.0], "exact": True, "skip": None, "name": "a b/c"},
    )
    answers = []
    with pgc.Client(echo_server, token="s3cret") as httpx_client:
        answers.append(httpx_client._send(request).json())
    with StdlibClient(echo_server, token="s3cret") as stdlib_client:
        answers.append(stdlib_client._send(request).json())
    for answer in answers:
        for name in ("host", "user-agent", "accept-encoding", "connection", "content-length"):
            answer["headers"].pop(name, None)
    assert answers[0] == answers[1]
    assert answers[1]["query"] == {"test_poi": ["0.5", "1.0"], "exact": ["true"], "name": ["a b/c"]}
    assert answers[1]["headers"]["authorization"] == "Bearer s3cret"
    assert answers[1]["headers"]["content-encoding"] == "gzip"  # over 1 KiB
    assert json.loads(answers[1]["body"])["workspace_id"] == "abc"


def test_keeps_its_connection_and_reopens_a_closed_one(echo_server):
    """Requests share one connection; after the server closed it (without saying so), the
    next request goes out again on a new one, transparently."""
    with StdlibClient(echo_server) as client:
        for _ in range(3):
            assert client._send(_request(method="GET", path="/info")).status_code == 200
        assert len(_Echo.connections) == 1
        client._send(_request(method="GET", path="/close"))
        answer = client._send(_request(method="GET", path="/info"))
        assert answer.json()["path"] == "/info" and len(_Echo.connections) == 2


def test_decodes_gzip_answers_and_keeps_the_server_path(echo_server):
    with StdlibClient(echo_server + "/prefix/") as client:
        answer = client._send(_request(method="GET", path="/gzip"))
    assert answer.headers.get("content-type") == "application/json"  # any case
    assert answer.json()["path"] == "/prefix/gzip"


def test_fails_as_the_httpx_client_does(echo_server):
    """A refused connection is a retryable TransportError; an answer slower than the timeout
    a TimeoutError that names --timeout (not retried: the request may have reached the
    server); neither leaks a socket or http.client exception."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    refused = _request(method="GET", path="/info")
    for client in (pgc.Client, StdlibClient):
        with (
            client(f"http://127.0.0.1:{closed_port}") as unreachable,
            pytest.raises(pgc.TransportError) as info,
        ):
            unreachable._send(refused)
        assert info.value.retryable and "cannot connect" in str(info.value)
        with (
            client(echo_server, timeout=0.3) as impatient,
            pytest.raises(pgc.TimeoutError, match="--timeout") as info,
        ):
            impatient._send(_request(method="POST", path="/slow", idempotent=False))
        assert not info.value.retryable


def test_refuses_what_it_does_not_speak(monkeypatch):
    """https and proxies are httpx's (the command line picks ``Client`` there)."""
    with pytest.raises(ValueError, match="plain http"):
        StdlibClient("https://gpu-node:8000")
    monkeypatch.setenv("HTTP_PROXY", "http://proxy:3128")
    with pytest.raises(ValueError, match="plain http"):
        StdlibClient("http://gpu-node:8000")


def test_the_command_line_picks_its_client(monkeypatch):
    """``http.client`` for a plain-http server, httpx's ``Client`` for TLS or a proxy."""

    def client_for(server: str):
        ctx = click.Context(cli.main)
        ctx.meta[cli._META] = {"server": server}
        return cli._client(ctx)

    assert isinstance(client_for("http://gpu-node:8000"), StdlibClient)
    assert isinstance(client_for("gpu-node:8000"), StdlibClient)  # http:// by default
    assert isinstance(client_for("https://gpu-node"), pgc.Client)
    monkeypatch.setenv("HTTP_PROXY", "http://proxy:3128")
    assert isinstance(client_for("http://gpu-node:8000"), pgc.Client)
