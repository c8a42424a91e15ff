"""Bearer-token auth (on via PYHF_GPU_API_TOKEN), request timeouts, request ids and JSON logs."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest
from service_support import ServerProcess, running_server, simple_workspace

pytestmark = pytest.mark.timeout(300)

TOKEN = "correct-horse-battery-staple"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    data_dir = tmp_path_factory.mktemp("auth")
    env = {"PYHF_GPU_API_TOKEN": TOKEN, "PYHF_GPU_REQUEST_TIMEOUT_S": "0.05"}
    with running_server(data_dir, env=env) as started:
        yield started


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/openapi.json", "/docs"])
def test_probes_and_docs_need_no_token(server: ServerProcess, path: str) -> None:
    assert httpx.get(server.url + path).status_code == 200


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/info"),
        ("GET", "/metrics"),
        ("GET", "/jobs"),
        ("POST", "/cls"),
        ("POST", "/workspaces"),
        ("POST", "/jobs"),
    ],
)
def test_everything_else_needs_the_token(server: ServerProcess, method: str, path: str) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}):
        response = httpx.request(method, server.url + path, headers=headers, json={})
        assert response.status_code == 401, (headers, response.text)
        assert response.headers["WWW-Authenticate"].startswith("Bearer")
        assert "detail" in response.json()


def test_the_right_token_is_accepted(server: ServerProcess) -> None:
    with server.client(token=TOKEN) as client:
        assert client.get("/info").json()["auth"] is True
        uploaded = client.post("/workspaces", json=simple_workspace())
        assert uploaded.status_code == 201


def test_slow_request_times_out_with_504(server: ServerProcess) -> None:
    with server.client(token=TOKEN) as client:
        # 5000 toys take about a second, far past the server's 50 ms request timeout
        toys = {"calctype": "toybased", "ntoys": 5000}
        response = client.post("/cls", params=toys, json=simple_workspace((3.0, 4.0)))
        assert response.status_code == 504
        assert "POST /jobs" in response.json()["detail"]
        assert client.get("/healthz").status_code == 200


def test_request_ids_and_json_access_log(server: ServerProcess) -> None:
    response = httpx.get(server.url + "/healthz", headers={"X-Request-ID": "test-id-42"})
    assert response.headers["X-Request-ID"] == "test-id-42"
    deadline = time.monotonic() + 5
    access: list[dict] = []
    while not access and time.monotonic() < deadline:  # the line is written after the answer
        time.sleep(0.05)
        lines = [json.loads(line) for line in server.log().splitlines() if line.startswith("{")]
        access = [line for line in lines if line.get("request_id") == "test-id-42"]
    assert access and access[0]["status"] == 200 and "duration_ms" in access[0]


def test_auth_off_by_default(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Covered by every other server in the suite; here explicitly, in process (ASGI)."""
    import asyncio

    from pyhf_gpu_server.service.app import create_app
    from pyhf_gpu_server.service.settings import Settings

    app = create_app(Settings(data_dir=tmp_path_factory.mktemp("noauth"), device="cpu"))

    async def scenario() -> tuple[int, int]:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                info = await client.get("/info")
                ready = await client.get("/readyz")
                return info.status_code, ready.status_code

    assert asyncio.run(scenario()) == (200, 200)
