"""Guards that hold before any work: the token checked on the headers (no body read), header
and body read deadlines, the connection limit, the token from a file, quiet pyhf logs and a
/docs page that needs neither a CDN nor a token.

Each test talks raw HTTP/1.1 to a real server on 127.0.0.1 where a client library would hide
what matters (a body that never arrives, headers that never end).
"""

from __future__ import annotations

import gzip
import json
import logging
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from service_support import ServerProcess, running_server, simple_workspace

pytestmark = pytest.mark.timeout(120)

TOKEN = "guarded-token-7f3a"
HEADER_TIMEOUT_S = 2.0
BODY_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 32


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    data_dir = tmp_path_factory.mktemp("guards")
    token_file = data_dir / "token"
    token_file.write_text(TOKEN + "\n")
    args = [
        "--api-token-file",
        str(token_file),
        "--header-timeout-s",
        str(HEADER_TIMEOUT_S),
        "--body-timeout-s",
        str(BODY_TIMEOUT_S),
        "--max-connections",
        str(MAX_CONNECTIONS),
    ]
    with running_server(data_dir, args) as started:
        yield started


def _connect(server: ServerProcess) -> socket.socket:
    """A raw TCP connection to the server (closed by the caller)."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.settimeout(10)
    return sock


def _head(path: str, headers: dict[str, str], method: str = "POST") -> bytes:
    """A request's start line and headers, ended by the blank line."""
    lines = [
        f"{method} {path} HTTP/1.1",
        "Host: 127.0.0.1",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def test_unauthenticated_body_is_refused_before_it_is_read(server: ServerProcess) -> None:
    """8 MB declared, 100 bytes sent: the 401 comes at once (reading would wait, then 408)."""
    headers = {"Content-Length": "8000000", "Content-Encoding": "gzip"}
    with _connect(server) as sock:
        start = time.monotonic()
        sock.sendall(_head("/cls", headers) + b"\x1f\x8b" + b"\0" * 98)
        answer = _read_until_closed(sock)
        seconds = time.monotonic() - start
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    assert seconds < BODY_TIMEOUT_S / 2, seconds
    assert b'www-authenticate: bearer realm="pyhf-gpu"' in answer.lower()
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["detail"].startswith("this server needs")


def test_unauthenticated_gzip_bombs_cost_no_memory(server: ServerProcess) -> None:
    """12 parallel 60 MiB-in-61-kB gzip bodies without a token: refused unread, memory flat."""
    bomb = gzip.compress(b" " * (60 * 1024 * 1024), compresslevel=9)
    assert len(bomb) < 100_000
    headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    before = server.memory_mb()

    def post(_: int) -> int:
        return httpx.post(
            server.url + "/cls", content=bomb, headers=headers, timeout=20
        ).status_code

    with ThreadPoolExecutor(12) as pool:
        statuses = list(pool.map(post, range(12)))
    grown = server.memory_mb() - before
    print(f"resident memory after 12 unauthenticated gzip bombs: {grown:+.1f} MB")
    assert statuses == [401] * 12
    assert grown < 20, grown


def test_slow_body_is_cut_off(server: ServerProcess) -> None:
    """Headers sent, body never completed: 408 after --body-timeout-s, connection closed."""
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Length": "1000"}
    with _connect(server) as sock:
        start = time.monotonic()
        sock.sendall(_head("/workspaces", headers) + b'{"channels": [')
        answer = _read_until_closed(sock)
        seconds = time.monotonic() - start
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert BODY_TIMEOUT_S * 0.9 <= seconds < BODY_TIMEOUT_S + 3, seconds
    assert b"--body-timeout-s" in answer


def test_headers_that_never_end_are_cut_off(server: ServerProcess) -> None:
    """A slowloris connection (headers never finished) is closed after --header-timeout-s."""
    with _connect(server) as sock:
        start = time.monotonic()
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        time.sleep(HEADER_TIMEOUT_S / 2)
        sock.sendall(b"a")  # trickling bytes does not extend the deadline
        answer = _read_until_closed(sock)
        seconds = time.monotonic() - start
    assert answer == b""
    assert HEADER_TIMEOUT_S * 0.9 <= seconds < HEADER_TIMEOUT_S + 3, seconds


def test_connection_limit_answers_503(server: ServerProcess) -> None:
    """With --max-connections idle connections open, a new request gets 503; then 200 again."""
    idle = [_connect(server) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.3)  # the server accepts them
        assert httpx.get(server.url + "/healthz", timeout=5).status_code == 503
    finally:
        for sock in idle:
            sock.close()
    time.sleep(0.3)
    assert httpx.get(server.url + "/healthz", timeout=5).status_code == 200


def test_token_from_a_file_stays_off_the_command_line(server: ServerProcess) -> None:
    command_line = Path(f"/proc/{server.process.pid}/cmdline").read_bytes().split(b"\0")
    assert b"--api-token-file" in command_line
    assert not any(TOKEN.encode() in part for part in command_line)
    assert httpx.get(server.url + "/info").status_code == 401
    with server.client(token=TOKEN) as client:
        info = client.get("/info")
        assert info.status_code == 200, info.text
        assert info.json()["auth"] is True


@pytest.fixture
def restored_logging() -> Iterator[None]:
    """pyhf's loggers as a fresh server process has them (levels unset: tests run before in
    this process may have set some, as spey-pyhf sets ``pyhf.pdf`` to CRITICAL), and the root
    and pyhf loggers put back as they were after the test."""
    root = logging.getLogger()
    pyhf_loggers = [
        logger
        for name, logger in logging.Logger.manager.loggerDict.items()
        if (name == "pyhf" or name.startswith("pyhf.")) and isinstance(logger, logging.Logger)
    ]
    saved = (root.handlers[:], root.level, [logger.level for logger in pyhf_loggers])
    for logger in pyhf_loggers:
        logger.setLevel(logging.NOTSET)
    yield
    root.handlers[:], root.level = saved[0], saved[1]
    for logger, level in zip(pyhf_loggers, saved[2], strict=True):
        logger.setLevel(level)


@pytest.mark.parametrize(("level", "pyhf_lines_expected"), [("info", False), ("debug", True)])
def test_pyhf_info_lines_only_at_debug(
    restored_logging: None,
    capsys: pytest.CaptureFixture[str],
    level: str,
    pyhf_lines_expected: bool,
) -> None:
    """Building a pyhf model logs a line per modifier at INFO: kept at --log-level debug only."""
    import pyhf

    from pyhf_gpu_server.service.logs import configure_logging

    configure_logging(level)
    pyhf.Workspace(simple_workspace()).model()
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    pyhf_lines = [line for line in lines if line["logger"].startswith("pyhf.")]
    assert bool(pyhf_lines) is pyhf_lines_expected, pyhf_lines


def test_docs_load_offline_without_a_token(server: ServerProcess) -> None:
    """/docs and every file it references come from the server itself, with auth on."""
    page = httpx.get(server.url + "/docs", timeout=10)
    assert page.status_code == 200
    assert "cdn" not in page.text.lower()
    referenced = re.findall(r"""(?:src|href)=["'](/[^"']+)["']""", page.text)
    referenced += re.findall(r"""url: ?["'](/[^"']+)["']""", page.text)
    assert any(url.endswith(".js") for url in referenced), page.text
    assert "/openapi.json" in referenced
    for url in referenced:
        assert httpx.get(server.url + url, timeout=10).status_code == 200, url
    assert httpx.get(server.url + "/openapi.json").json()["info"]["title"] == "pyhf-gpu"
    assert httpx.get(server.url + "/docs/static-other").status_code == 401


def test_token_file_problems_are_one_line_errors(tmp_path: Path) -> None:
    from pyhf_gpu_server.service.dependencies import with_file_token
    from pyhf_gpu_server.service.settings import Settings

    token_file = tmp_path / "token"
    token_file.write_text(f"  {TOKEN}\n")
    resolved = with_file_token(Settings(api_token_file=token_file))
    assert resolved.api_token == TOKEN
    assert with_file_token(resolved) == resolved
    token_file.write_text("\n")
    for settings, problem in [
        (Settings(api_token_file=tmp_path / "absent"), "cannot read"),
        (Settings(api_token_file=token_file), "is empty"),
        (Settings(api_token="x", api_token_file=token_file), "not both"),
    ]:
        with pytest.raises(ValueError, match=problem):
            with_file_token(settings)


def test_an_unreadable_token_file_stops_the_server_with_one_line(tmp_path):
    command = [
        sys.executable, "-m", "pyhf_gpu_server.cli", "--data-dir", str(tmp_path),
        "--api-token-file", str(tmp_path / "missing"), "--port", "1",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.startswith("pyhf-gpu-server: error: cannot read --api-token-file")
    assert "Traceback" not in done.stderr
