"""Abandoned work releases the device (#13): a request that answered 504, or whose client
disconnected, stops its fits between two iterations, and the next request is served at once.

Before: 8 POI values x 20000 toys with a 10 s request timeout answered 504 at 10 s and kept
the device busy for 49 s; four small requests behind it got 504 too. A real server over HTTP.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from service_support import ServerProcess, running_server, simple_workspace

pytestmark = pytest.mark.timeout(300)

# minutes of toy fits on 2 CPU cores: nothing here may wait for them
HEAVY = {
    "workspace": simple_workspace(),
    "test_poi": [0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0],
    "calctype": "toybased",
    "ntoys": 100_000,
    "seed": 1,
}
SMALL = {"workspace": simple_workspace([6.0, 9.0]), "test_poi": 1.0}
REQUEST_TIMEOUT_S = 4.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = ["--request-timeout-s", str(REQUEST_TIMEOUT_S), "--max-batch-delay-ms", "0"]
    with running_server(tmp_path_factory.mktemp("cancellation"), args) as started:
        yield started


def small_request_seconds(server: ServerProcess) -> float:
    start = time.monotonic()
    with server.client() as client:
        response = client.post("/cls", json=SMALL)
    assert response.status_code == 200, response.text
    return time.monotonic() - start


def test_a_timed_out_request_releases_the_device(server):
    small_request_seconds(server)  # warm
    start = time.monotonic()
    with server.client() as client:
        response = client.post("/cls", json=HEAVY)
    assert response.status_code == 504, response.text
    assert time.monotonic() - start < REQUEST_TIMEOUT_S + 2
    waited = small_request_seconds(server)
    assert waited < 2.0, f"the small request waited {waited:.2f} s behind abandoned toys"


def test_a_disconnected_client_releases_the_device(server):
    small_request_seconds(server)
    start = time.monotonic()
    with pytest.raises(httpx.ReadTimeout), server.client(timeout_s=1.0) as client:
        client.post("/cls", json=HEAVY)  # gives up after 1 s and closes its connection
    waited = small_request_seconds(server)
    # answered before the server's own timeout would have ended the heavy request
    assert time.monotonic() - start < REQUEST_TIMEOUT_S
    assert waited < 2.0, f"the small request waited {waited:.2f} s behind a gone client"
    assert server.process.poll() is None
