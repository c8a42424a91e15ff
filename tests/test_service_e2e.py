"""End to end: a real server subprocess, HTTP with httpx, the shared ATLAS workspace.

pyhf parity (reference.json within 1e-4), batching of concurrent requests (read from the
``pyhf_gpu_batch_size`` histogram), the other operations' shapes, jobs with events and cancel.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pyhf
import pytest
from hand_built import symmetric_workspace
from service_support import (
    SMALL,
    ServerProcess,
    load,
    metric_value,
    running_cluster_server,
    running_server,
    simple_workspace,
    wait_for_job,
)

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

TOLERANCE = 1e-4
REFERENCE = load(SMALL, "reference.json")["reference"]["results"]


@pytest.fixture(scope="module", params=["in-process", "cluster"])
def server(request, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The same tests, unchanged, against a server with its own device thread and against a
    cluster-mode server (a Dask scheduler and two ``pyhf-gpu-worker`` processes, #16)."""
    data_dir = tmp_path_factory.mktemp("e2e")
    args = ["--max-batch-size", "64", "--max-batch-delay-ms", "20"]
    start = running_cluster_server if request.param == "cluster" else running_server
    with start(data_dir, args) as s:
        yield s


@pytest.fixture(scope="module")
def workspace_id(client: httpx.Client) -> str:
    spec = load(SMALL, "BkgOnly.json")
    response = client.post("/workspaces", json=spec)
    assert response.status_code == 201, response.text
    assert response.json()["workspace_id"] == pyhf.utils.digest(spec)
    return response.json()["workspace_id"]


def batches(client: httpx.Client) -> float:
    """Engine calls so far."""
    return metric_value(client.get("/metrics").text, "pyhf_gpu_batch_size_count")


def close(a: Any, b: Any, tolerance: float) -> bool:
    """Numbers (nested in lists) agree within ``tolerance``."""
    if isinstance(a, list):
        return len(a) == len(b) and all(close(x, y, tolerance) for x, y in zip(a, b, strict=True))
    return abs(a - b) <= tolerance


def post_file_like_curl(server: ServerProcess, path: str, file: Path) -> tuple[int, str]:
    """``curl -s -X POST URL --data-binary @file`` (httpx when curl is not installed)."""
    curl = shutil.which("curl")
    if curl is None:
        response = httpx.post(server.url + path, content=file.read_bytes(), timeout=120)
        return response.status_code, response.text
    done = subprocess.run(
        [
            curl,
            "-s",
            "-X",
            "POST",
            "-H",
            "Content-Type: application/json",
            "--data-binary",
            f"@{file}",
            "-w",
            "\\n%{http_code}",
            server.url + path,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    body, _, status = done.stdout.rpartition("\n")
    return int(status), body


def test_curl_style_cls_matches_pyhf(server: ServerProcess, tmp_path: Path) -> None:
    """A bare patched workspace file, options in the query string, sent as curl sends it."""
    patchset = pyhf.PatchSet(load(SMALL, "patchset.json"))
    reference = REFERENCE[1]
    spec = patchset.apply(pyhf.Workspace(load(SMALL, "BkgOnly.json")), reference["patch"])
    file = tmp_path / "workspace.json"
    file.write_text(json.dumps(dict(spec)))
    status, text = post_file_like_curl(
        server, "/cls?test_poi=1.0&test_stat=qtilde&calctype=asymptotics", file
    )
    assert status == 200, text
    result = json.loads(text)
    assert set(result) == {"CLs_obs", "CLs_exp", "meta"}
    assert close(result["CLs_obs"], reference["CLs_obs"], TOLERANCE)
    assert close(result["CLs_exp"], reference["CLs_exp"], TOLERANCE)
    meta = result["meta"]
    assert meta["device"] == "cpu" and meta["dtype"] == "float64" and meta["converged"] is True
    assert {"build_ms", "queue_ms", "compute_ms", "total_ms"} <= set(meta["timings"])


def test_patchset_envelope_matches_every_reference(client: httpx.Client, workspace_id: str) -> None:
    response = client.post(
        "/cls",
        json={
            "workspace_id": workspace_id,
            "patchset": load(SMALL, "patchset.json"),
            "patch_names": [r["patch"] for r in REFERENCE],
            "test_poi": 1.0,
        },
    )
    assert response.status_code == 200, response.text
    results = response.json()
    assert list(results) == [r["patch"] for r in REFERENCE]
    for reference in REFERENCE:
        got = results[reference["patch"]]
        assert close(got["CLs_obs"], reference["CLs_obs"], TOLERANCE), reference["patch"]
        assert close(got["CLs_exp"], reference["CLs_exp"], TOLERANCE), reference["patch"]
        assert got["meta"]["patch"] == reference["patch"]
        assert got["meta"]["batch_rows"] == len(REFERENCE)  # one engine call for the patchset


def test_concurrent_requests_are_batched_and_equal_sequential(client: httpx.Client) -> None:
    """32 clients at once: fewer engine calls than requests, the same numbers as one by one."""
    spec = simple_workspace((4.0, 9.0))
    pois = [0.5 + 0.05 * i for i in range(32)]

    def cls(poi: float) -> dict[str, Any]:
        response = client.post("/cls", json={"workspace": spec, "test_poi": poi})
        assert response.status_code == 200, response.text
        return response.json()

    cls(1.0)  # build and warm the model
    before = batches(client)
    with ThreadPoolExecutor(max_workers=32) as pool:
        concurrent = list(pool.map(cls, pois))
    calls = batches(client) - before
    assert calls < len(pois), f"{calls} engine calls for {len(pois)} concurrent requests"
    assert max(r["meta"]["batch_rows"] for r in concurrent) > 1

    sequential = [cls(poi) for poi in pois]
    for alone, batched in zip(sequential, concurrent, strict=True):
        assert alone["meta"]["batch_rows"] == 1
        assert close(alone["CLs_obs"], batched["CLs_obs"], 1e-8)
        assert close(alone["CLs_exp"], batched["CLs_exp"], 1e-8)


def test_list_of_test_poi_answers_a_list(client: httpx.Client) -> None:
    response = client.post("/cls", json={"workspace": simple_workspace(), "test_poi": [0.5, 1, 2]})
    assert response.status_code == 200, response.text
    results = response.json()
    assert [r["meta"]["test_poi"] for r in results] == [0.5, 1.0, 2.0]
    assert results[0]["CLs_obs"] > results[2]["CLs_obs"]


def test_fit_answers_pyhf_fit_value_json(client: httpx.Client) -> None:
    spec = simple_workspace()
    response = client.post("/fit", json=spec)
    assert response.status_code == 200, response.text
    result = response.json()
    assert {"mle_parameters", "twice_nll", "uncertainties", "corr_mat", "meta"} <= set(result)
    workspace = pyhf.Workspace(spec)
    model = workspace.model()
    pars, twice_nll = pyhf.infer.mle.fit(workspace.data(model), model, return_fitted_val=True)
    assert set(result["mle_parameters"]) == set(model.config.par_map)
    assert close(result["mle_parameters"]["mu"][0], float(pars[model.config.poi_index]), 1e-3)
    assert close(result["twice_nll"], float(twice_nll), 1e-4)
    assert len(result["uncertainties"]["uncorr_bkguncrt"]) == 2
    assert len(result["corr_mat"]) == model.config.npars


def test_fit_leaves_the_saddle_of_an_even_shift(client: httpx.Client) -> None:
    """Workspaces whose histosys and normsys have ``hi == lo`` (pyhf's init is a saddle there,
    ``hand_built.symmetric_workspace``): each free fit is a minimum (its Hessian's
    uncertainties finite) at or below pyhf's."""
    pyhf.set_backend("numpy", "scipy")
    for seed in range(4):
        spec = symmetric_workspace(seed)
        response = client.post("/fit", json=spec)
        assert response.status_code == 200, response.text
        result = response.json()
        model = pyhf.Workspace(spec).model()
        _, twice_nll = pyhf.infer.mle.fit(
            pyhf.Workspace(spec).data(model), model, return_fitted_val=True
        )
        assert result["meta"]["converged"] is True
        assert result["twice_nll"] <= float(twice_nll) + 1e-6, seed
        widths = [w for values in result["uncertainties"].values() for w in values]
        assert all(w is not None and w > 0 for w in widths), (seed, result["uncertainties"])


def test_upper_limit_and_significance_shapes(client: httpx.Client) -> None:
    limit = client.post("/upper-limit", json={"workspace": simple_workspace(), "level": 0.05})
    assert limit.status_code == 200, limit.text
    body = limit.json()
    assert len(body["upper_limit_exp"]) == 5 and body["level"] == 0.05
    assert body["upper_limit_obs"] > 0
    found = client.post("/significance", json=simple_workspace())
    assert found.status_code == 200, found.text
    assert "meta" in found.json()


def test_gzip_body_is_accepted(client: httpx.Client) -> None:
    import gzip

    raw = json.dumps({"workspace": simple_workspace(), "test_poi": 1.0}).encode()
    response = client.post("/cls", content=gzip.compress(raw), headers={"Content-Encoding": "gzip"})
    assert response.status_code == 200, response.text
    assert 0 <= response.json()["CLs_obs"] <= 1
    members = b"".join(gzip.compress(raw[i : i + 50]) for i in range(0, len(raw), 50))
    again = client.post("/cls", content=members, headers={"Content-Encoding": "gzip"})
    assert again.status_code == 200, again.text  # several gzip members: one body (RFC 1952)
    assert again.json()["CLs_obs"] == response.json()["CLs_obs"]
    cut = client.post("/cls", content=members[:-3], headers={"Content-Encoding": "gzip"})
    assert cut.status_code == 400 and "gzip" in cut.json()["detail"]


def test_job_for_a_patchset_with_events_and_listing(
    client: httpx.Client, workspace_id: str
) -> None:
    names = [r["patch"] for r in REFERENCE]
    submitted = client.post(
        "/jobs",
        json={
            "operation": "cls",
            "workspace_id": workspace_id,
            "patchset": load(SMALL, "patchset.json"),
            "patch_names": names,
        },
    )
    assert submitted.status_code == 202, submitted.text
    job_id = submitted.json()["id"]
    assert submitted.headers["Location"] == f"/jobs/{job_id}"
    events = []
    with client.stream("GET", f"/jobs/{job_id}/events") as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        for line in stream.iter_lines():
            if line.startswith("event: "):
                events.append(line.removeprefix("event: "))
    assert events[-1] == "done"
    view = wait_for_job(client, job_id)
    assert view["status"] == "succeeded", view
    assert view["progress"] == {"done": len(names), "total": len(names)}
    assert list(view["result"]) == names
    for reference in REFERENCE:
        assert close(view["result"][reference["patch"]]["CLs_obs"], reference["CLs_obs"], TOLERANCE)
    listed = client.get("/jobs", params={"limit": 5}).json()["jobs"]
    assert listed[0]["id"] == job_id and listed[0]["result"] is None


def test_cancel_a_queued_job(client: httpx.Client) -> None:
    jobs = [
        client.post(
            "/jobs", json={"operation": "cls", "workspace": simple_workspace(), "test_poi": poi}
        ).json()["id"]
        for poi in (0.5, 1.0, 1.5, 2.0)
    ]
    cancelled = client.delete(f"/jobs/{jobs[-1]}")
    final = wait_for_job(client, jobs[-1])
    if cancelled.status_code == 200:
        assert final["status"] == "cancelled"
    else:  # it had already finished
        assert cancelled.status_code == 409 and final["status"] == "succeeded"
    assert client.delete(f"/jobs/{jobs[0]}").status_code in (200, 409)


def test_info_and_metrics(client: httpx.Client, workspace_id: str) -> None:
    for _ in range(2):  # a warm model and a hit on it, whichever tests ran before
        body = {"workspace": simple_workspace(), "test_poi": 1.0}
        assert client.post("/cls", json=body).status_code == 200
    info = client.get("/info").json()
    assert info["device"] == "cpu" and info["versions"]["pyhf"] == pyhf.__version__
    assert info["models"], "warm models are listed"
    text = client.get("/metrics").text
    for name in (
        "pyhf_gpu_requests_total",
        "pyhf_gpu_request_duration_seconds_bucket",
        "pyhf_gpu_queue_depth",
        "pyhf_gpu_batch_size_bucket",
        "pyhf_gpu_model_cache_hits_total",
        "pyhf_gpu_model_cache_misses_total",
        "pyhf_gpu_model_cache_size",
        "pyhf_gpu_device_memory_bytes",
    ):
        assert name in text, name
    assert metric_value(text, "pyhf_gpu_model_cache_hits_total") > 0
    assert 'route="/cls"' in text
