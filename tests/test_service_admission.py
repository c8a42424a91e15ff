"""Admission by cost (#13): models that can never fit are refused before any work, with a 422
naming the limit, and engine calls are split into chunks that fit the fit-memory bound.

Before: a 129 kB workspace (one channel, 6000 bins, a staterror) grew the server past 9 GB in
65 s; 10^5 staterror bins answered 500 after trying to allocate 240 GB. A real server over
HTTP; its resident memory read from /proc.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from service_support import SMALL, ServerProcess, load, running_server, simple_workspace

pytestmark = pytest.mark.timeout(300)


def staterror_workspace(bins: int) -> dict:
    """One channel of ``bins`` bins: a signal (normfactor) and a background with a staterror."""
    return {
        "channels": [
            {
                "name": "wide",
                "samples": [
                    {
                        "name": "signal",
                        "data": [1.0] * bins,
                        "modifiers": [{"name": "mu", "type": "normfactor", "data": None}],
                    },
                    {
                        "name": "background",
                        "data": [10.0] * bins,
                        "modifiers": [{"name": "stat", "type": "staterror", "data": [1.0] * bins}],
                    },
                ],
            }
        ],
        "observations": [{"name": "wide", "data": [10.0] * bins}],
        "measurements": [{"name": "m", "config": {"poi": "mu", "parameters": []}}],
        "version": "1.0.0",
    }


def resident_mb(server: ServerProcess) -> float:
    status = Path(f"/proc/{server.process.pid}/status").read_text()
    line = next(line for line in status.splitlines() if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


@pytest.fixture(scope="module")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(tmp_path_factory.mktemp("admission-default")) as server:
        yield server


@pytest.mark.parametrize(
    ("bins", "needle"),
    [
        (6000, "6001 parameters, more than the 5000 this server fits (--max-parameters)"),
        (100_000, "100000 bins, more than the 50000 this server fits (--max-bins)"),
    ],
)
def test_a_model_too_large_to_fit_is_refused_before_any_work(default_server, bins, needle):
    before = resident_mb(default_server)
    start = time.monotonic()
    with default_server.client() as client:
        response = client.post("/cls", json={"workspace": staterror_workspace(bins)})
    seconds = time.monotonic() - start
    assert response.status_code == 422, response.text[:300]
    assert needle in response.json()["detail"]
    assert seconds < 30
    assert resident_mb(default_server) - before < 800  # was > 9 GB
    with default_server.client() as client:  # and the server still serves
        assert client.post("/cls", json={"workspace": simple_workspace()}).status_code == 200


def signal_point() -> dict:
    """The small published likelihood with its first signal patch (60 parameters, 3 bins)."""
    patchset = load(SMALL, "patchset.json")
    first = patchset["patches"][0]["metadata"]["name"]
    return {"workspace": load(SMALL, "BkgOnly.json"), "patchset": patchset, "patch_names": [first]}


def test_limits_name_themselves(tmp_path: Path):
    for sub in ("p", "m"):
        (tmp_path / sub).mkdir()
    args = ["--max-parameters", "50"]
    with running_server(tmp_path / "p", args) as server, server.client() as client:
        response = client.post("/cls", json=signal_point())
        assert response.status_code == 422
        assert "more than the 50 this server fits (--max-parameters)" in response.json()["detail"]
    args = ["--max-fit-memory-mb", "0.1"]
    with running_server(tmp_path / "m", args) as server, server.client() as client:
        response = client.post("/fit", json=signal_point())
        assert response.status_code == 422
        assert "(--max-fit-memory-mb)" in response.json()["detail"]
        assert "MiB" in response.json()["detail"]


def test_rows_split_to_fit_the_memory_bound_give_the_same_answers(default_server, tmp_path):
    """A bound of one row per minimiser call: the same CLs as one call for all rows."""
    body = {"workspace": simple_workspace(), "test_poi": [0.5, 1.0, 1.5, 2.0, 3.0]}
    with default_server.client() as client:
        whole = client.post("/cls", json=body).json()
    one_row = ["--max-fit-memory-mb", "0.0005"]  # 524 bytes: a 3-parameter row needs 408
    with running_server(tmp_path, one_row) as server, server.client() as client:
        split = client.post("/cls", json=body)
    assert split.status_code == 200, split.text
    for a, b in zip(whole, split.json(), strict=True):
        assert a["CLs_obs"] == pytest.approx(b["CLs_obs"], abs=1e-10)
        assert a["CLs_exp"] == pytest.approx(b["CLs_exp"], abs=1e-10)
