"""Every bad input gets a 4xx with a JSON detail (no traceback), and the server stays healthy.

Runs against a real server subprocess (uvicorn), talked to over HTTP.
"""

from __future__ import annotations

import copy
import gzip
import json
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from service_support import SMALL, ServerProcess, load, running_server, simple_workspace

pytestmark = pytest.mark.timeout(300)

TRACEBACK_MARKERS = ("Traceback", 'File "', "site-packages")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    data_dir = tmp_path_factory.mktemp("bad-inputs")
    # a one-request queue that waits 1.5 s to fill a batch: back-pressure is easy to provoke
    args = ["--max-body-mb", "1", "--max-queue", "1", "--max-batch-delay-ms", "1500"]
    with running_server(data_dir, args) as started:
        yield started


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def uploaded(client: httpx.Client) -> str:
    """The small shared workspace's id (uploaded once)."""
    response = client.post("/workspaces", json=load(SMALL, "BkgOnly.json"))
    assert response.status_code == 201, response.text
    return response.json()["workspace_id"]


def mutated(change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """A copy of the simple workspace, changed by ``change``."""
    spec = simple_workspace()
    change(spec)
    return spec


def _poi_fixed() -> dict[str, Any]:
    """The small valid workspace with its POI fixed by the measurement."""
    spec = simple_workspace()
    spec["measurements"][0]["config"]["parameters"] = [{"name": "mu", "fixed": True}]
    return spec


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def _gzip_bomb() -> bytes:
    return gzip.compress(b'{"channels": [' + b" " * (3 * 1024 * 1024) + b"]}")


# (name, method, path, request kwargs, expected status, text the detail must contain)
CASES: list[tuple[str, str, str, dict[str, Any], int, str]] = [
    *(
        (
            f"measurement fixes the POI ({route})",
            "POST",
            route,
            {"json": _poi_fixed()},
            422,
            "'mu' is fixed",
        )
        for route in ("/cls", "/upper-limit", "/significance")
    ),
    ("malformed JSON", "POST", "/cls", {"content": b'{"channels": ['}, 400, "malformed JSON"),
    ("empty body", "POST", "/cls", {"content": b""}, 400, "empty"),
    ("JSON array", "POST", "/cls", {"json": [1, 2]}, 422, "JSON list"),
    ("not a workspace", "POST", "/fit", {"json": {"foo": 1}}, 422, "neither"),
    (
        "schema violation",
        "POST",
        "/cls",
        {"json": mutated(lambda s: s["channels"][0]["samples"][0].pop("data"))},
        422,
        "channels[0].samples[0]",
    ),
    (
        "unknown modifier type",
        "POST",
        "/cls",
        {
            "json": mutated(
                lambda s: s["channels"][0]["samples"][0]["modifiers"][0].update(type="magic")
            )
        },
        422,
        "invalid workspace",
    ),
    (
        "NaN count",
        "POST",
        "/cls",
        {"content": json.dumps(simple_workspace((float("nan"), 1.0))).encode()},
        422,
        "NaN",
    ),
    (
        "infinite count",
        "POST",
        "/cls",
        {"content": json.dumps(simple_workspace((float("inf"), 1.0))).encode()},
        422,
        "Infinity",
    ),
    (
        "overflowing number",
        "POST",
        "/cls",
        {"content": json.dumps(simple_workspace()).replace("5.0", "1e999", 1).encode()},
        422,
        "out of range",
    ),
    (
        "negative observed count",
        "POST",
        "/cls",
        {"json": mutated(lambda s: s["observations"][0]["data"].__setitem__(1, -3.0))},
        422,
        "negative",
    ),
    (
        "sample bin-count mismatch",
        "POST",
        "/cls",
        {"json": mutated(lambda s: s["channels"][0]["samples"][0]["data"].append(1.0))},
        422,
        "bins",
    ),
    (
        "observation bin-count mismatch",
        "POST",
        "/cls",
        {"json": mutated(lambda s: s["observations"][0]["data"].pop())},
        422,
        "observations[0].data has 1 bins",
    ),
    (
        "workspace without its POI",
        "POST",
        "/cls",
        {"json": load(SMALL, "BkgOnly.json")},
        422,
        "mu_SIG",
    ),
    (
        "unknown measurement",
        "POST",
        "/cls?measurement=nope",
        {"json": simple_workspace()},
        422,
        "'nope'",
    ),
    ("bad test_stat", "POST", "/cls?test_stat=foo", {"json": simple_workspace()}, 422, "test_stat"),
    ("zero ntoys", "POST", "/cls?ntoys=0", {"json": simple_workspace()}, 422, "ntoys"),
    ("absurd ntoys", "POST", "/cls?ntoys=1000000000", {"json": simple_workspace()}, 422, "ntoys"),
    ("NaN test_poi", "POST", "/cls?test_poi=nan", {"json": simple_workspace()}, 422, "test_poi"),
    (
        "unknown query option",
        "POST",
        "/cls?tset_poi=1",
        {"json": simple_workspace()},
        422,
        "tset_poi",
    ),
    (
        "typo in envelope",
        "POST",
        "/cls",
        {"json": {"workspace": simple_workspace(), "test_pio": 1}},
        422,
        "test_pio",
    ),
    (
        "workspace and workspace_id",
        "POST",
        "/cls",
        {"json": {"workspace": simple_workspace(), "workspace_id": "a" * 64}},
        422,
        "exactly one",
    ),
    (
        "unknown workspace id",
        "POST",
        "/cls",
        {"json": {"workspace_id": "0" * 64}},
        404,
        "POST /workspaces",
    ),
    (
        "invalid patch operation",
        "POST",
        "/cls",
        {
            "json": {
                "workspace": simple_workspace(),
                "patches": [[{"op": "frobnicate", "path": "/x"}]],
            }
        },
        422,
        "patches[0]",
    ),
    (
        "patch that does not apply",
        "POST",
        "/cls",
        {
            "json": {
                "workspace": simple_workspace(),
                "patches": [[{"op": "remove", "path": "/channels/7"}]],
            }
        },
        422,
        "patch",
    ),
    (
        "patchset of another workspace",
        "POST",
        "/cls",
        {"json": {"workspace": simple_workspace(), "patchset": load(SMALL, "patchset.json")}},
        422,
        "patchset was made for",
    ),
    (
        "invalid patchset",
        "POST",
        "/cls",
        {"json": {"workspace": simple_workspace(), "patchset": {"metadata": {}}}},
        422,
        "patchset",
    ),
    (
        "upper-limit level out of range",
        "POST",
        "/upper-limit",
        {"json": {"workspace": simple_workspace(), "level": 2}},
        422,
        "level",
    ),
    (
        "decreasing scan",
        "POST",
        "/upper-limit",
        {"json": {"workspace": simple_workspace(), "scan": [3, 2, 1]}},
        422,
        "increase",
    ),
    ("nested 100 deep", "POST", "/cls", {"content": _nested(100)}, 422, "nested deeper than 64"),
    ("nested 100000 deep", "POST", "/fit", {"content": _nested(100_000)}, 422, "nested deeper"),
    (
        "declared body too large",
        "POST",
        "/cls",
        {"content": b" " * (2 * 1024 * 1024)},
        413,
        "--max-body-mb",
    ),
    (
        "gzip bomb",
        "POST",
        "/cls",
        {"content": _gzip_bomb(), "headers": {"Content-Encoding": "gzip"}},
        413,
        "decompressed body",
    ),
    (
        "invalid gzip",
        "POST",
        "/cls",
        {"content": b"not gzip at all", "headers": {"Content-Encoding": "gzip"}},
        400,
        "gzip",
    ),
    (
        "unsupported encoding",
        "POST",
        "/cls",
        {"content": b"{}", "headers": {"Content-Encoding": "br"}},
        415,
        "br",
    ),
    (
        "job without operation",
        "POST",
        "/jobs",
        {"json": {"workspace": simple_workspace()}},
        422,
        "operation",
    ),
    (
        "job with unknown operation",
        "POST",
        "/jobs",
        {"json": {"operation": "plot", "workspace": simple_workspace()}},
        422,
        "plot",
    ),
    (
        "job with invalid workspace",
        "POST",
        "/jobs",
        {"json": {"operation": "fit", "workspace": mutated(lambda s: s.pop("observations"))}},
        422,
        "observations",
    ),
    ("unknown job", "GET", "/jobs/doesnotexist", {}, 404, "doesnotexist"),
    ("cancel unknown job", "DELETE", "/jobs/doesnotexist", {}, 404, "doesnotexist"),
    ("events of unknown job", "GET", "/jobs/doesnotexist/events", {}, 404, "doesnotexist"),
    ("bad job list limit", "GET", "/jobs?limit=0", {}, 422, "limit"),
    ("malformed workspace id", "GET", "/workspaces/xyz", {}, 422, "workspace_id"),
    ("unknown route", "GET", "/nope", {}, 404, "Not Found"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_a_located_4xx(client: httpx.Client, case: tuple) -> None:
    _, method, path, kwargs, status, needle = case
    response = client.request(method, path, **kwargs)
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"detail"}
    assert needle in json.dumps(body["detail"]), body
    assert not any(marker in response.text for marker in TRACEBACK_MARKERS)


def test_unknown_patch_name_is_named(client: httpx.Client, uploaded: str) -> None:
    response = client.post(
        "/cls",
        json={
            "workspace_id": uploaded,
            "patchset": load(SMALL, "patchset.json"),
            "patch_names": ["sig_s1_x1", "no_such_patch"],
        },
    )
    assert response.status_code == 422
    assert "no_such_patch" in response.json()["detail"]


def test_streamed_body_over_the_limit(client: httpx.Client) -> None:
    def chunks() -> Iterator[bytes]:
        for _ in range(40):
            yield b" " * 65536

    response = client.post("/cls", content=chunks())  # chunked: no Content-Length
    assert response.status_code == 413
    assert "--max-body-mb" in response.json()["detail"]


def test_still_healthy_after_bad_inputs(
    client: httpx.Client, server: ServerProcess, uploaded: str
) -> None:
    for case in CASES:
        _, method, path, kwargs, _, _ = case
        client.request(method, path, **copy.deepcopy(kwargs))
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").status_code == 200
    assert server.process is not None and server.process.poll() is None
    assert "Traceback" not in server.log()


def test_data_dir_holds_real_files(server: ServerProcess, uploaded: str) -> None:
    assert (Path(server.data_dir) / "workspaces" / f"{uploaded}.json").is_file()
    assert (Path(server.data_dir) / "jobs.sqlite3").is_file()


def test_full_queue_answers_429_and_readyz_503(client: httpx.Client, server: ServerProcess) -> None:
    body = {"workspace": simple_workspace((2.0, 3.0)), "test_poi": 1.0}
    assert client.post("/cls", json=body).status_code == 200  # builds the model
    with ThreadPoolExecutor(max_workers=1) as pool:
        waiting = pool.submit(client.post, "/cls", json=body)
        deadline = time.monotonic() + 10
        while httpx.get(server.url + "/readyz").status_code != 503:
            assert time.monotonic() < deadline, "the queue never filled"
            time.sleep(0.05)
        refused = client.post("/cls", json=body)
        assert refused.status_code == 429, refused.text
        assert int(refused.headers["Retry-After"]) >= 1
        assert "--max-queue" in refused.json()["detail"]
        assert waiting.result().status_code == 200
    assert httpx.get(server.url + "/readyz").status_code == 200
