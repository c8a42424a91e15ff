"""``Prefer: respond-async, wait=N`` (RFC 7240): a computation still running after N seconds
becomes a job (202, ``Location``) that goes on where ``--request-timeout-s`` would have ended
it; its answer is the synchronous one. The client asks for it after ``job_after`` seconds and
follows the job (the command line: ``--job-after``, progress on stderr). Real servers over
HTTP, a real SQLite job store, the console script as a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from service_support import ServerProcess, running_server, simple_workspace, wait_for_job

from pyhf_gpu_client import Client

pytestmark = pytest.mark.timeout(300)

CLIENT_EXE = Path(sys.executable).with_name("pyhf-gpu-client")
# seeded toys: the same draws whichever way the request runs, about a second or more of fits
TOYS = {
    "workspace": simple_workspace(),
    "test_poi": [0.5, 1.0, 1.5, 2.0],
    "calctype": "toybased",
    "ntoys": 3000,
    "seed": 11,
}
ASYNC_NOW = {"Prefer": "respond-async, wait=0"}


@pytest.fixture(scope="module")
def synchronous(server: ServerProcess) -> list[dict[str, Any]]:
    """The toys' answer without the preference (200)."""
    with server.client() as client:
        response = client.post("/cls", json=TOYS)
    assert response.status_code == 200, response.text
    return response.json()


def cls_values(answer: list[dict[str, Any]]) -> list[tuple[float, list[float]]]:
    return [(point["CLs_obs"], point["CLs_exp"]) for point in answer]


def test_a_request_past_its_wait_becomes_a_job_with_the_synchronous_answer(server, synchronous):
    with server.client() as client:
        response = client.post("/cls", json=TOYS, headers=ASYNC_NOW)
        assert response.status_code == 202, response.text
        accepted = response.json()
        assert response.headers["Location"] == accepted["url"] == f"/jobs/{accepted['id']}"
        assert response.headers["Preference-Applied"] == "respond-async"
        assert accepted["status"] == "running"
        job = wait_for_job(client, accepted["id"])
        listed = {j["id"]: j for j in client.get("/jobs").json()["jobs"]}
    assert job["status"] == "succeeded", job
    assert job["operation"] == "cls"
    assert job["progress"]["done"] == job["progress"]["total"] > 0
    assert cls_values(job["result"]) == cls_values(synchronous)
    assert listed[accepted["id"]]["status"] == "succeeded"


def test_a_request_done_within_its_wait_answers_at_once(server):
    body = {"workspace": simple_workspace(), "test_poi": 1.0}
    with server.client() as client:
        plain = client.post("/cls", json=body)
        preferred = client.post("/cls", json=body, headers={"Prefer": "respond-async, wait=60"})
    assert plain.status_code == preferred.status_code == 200, preferred.text
    assert "Preference-Applied" not in preferred.headers
    assert cls_values([preferred.json()]) == cls_values([plain.json()])


def test_a_job_made_of_a_request_can_be_cancelled(server):
    heavy = {**TOYS, "ntoys": 100_000}  # a minute or more: only the cancellation ends it
    with server.client() as client:
        response = client.post("/cls", json=heavy, headers=ASYNC_NOW)
        assert response.status_code == 202, response.text
        job_id = response.json()["id"]
        assert client.delete(f"/jobs/{job_id}").status_code == 200
        assert wait_for_job(client, job_id, timeout_s=30)["status"] == "cancelled"
        start = time.monotonic()  # the device is free again: a small request is served at once
        small = client.post("/cls", json={"workspace": simple_workspace(), "test_poi": 1.0})
    assert small.status_code == 200, small.text
    assert time.monotonic() - start < 10


def test_a_job_made_of_a_request_runs_again_after_a_restart(tmp_path, synchronous):
    """Stored as a submitted job is (its inline workspace on disk): a server stopped while it
    runs queues it again, and the next one answers it."""
    with running_server(tmp_path) as first, first.client() as client:
        response = client.post("/cls", json={**TOYS, "ntoys": 12_000}, headers=ASYNC_NOW)
        assert response.status_code == 202, response.text
        job_id = response.json()["id"]
        assert client.get(f"/jobs/{job_id}").json()["status"] == "running"
        first.stop()
    with running_server(tmp_path) as second, second.client() as client:
        job = wait_for_job(client, job_id, timeout_s=240)
    assert job["status"] == "succeeded", job
    assert len(job["result"]) == 4


def test_the_client_and_the_command_line_follow_the_job(server, synchronous, tmp_path):
    updates: list[Any] = []
    with Client(server.url, job_after=0, on_job_update=updates.append) as client:
        results = client.cls(
            TOYS["workspace"],
            TOYS["test_poi"],
            calctype="toybased",
            ntoys=TOYS["ntoys"],
            seed=TOYS["seed"],
        )
    assert [(r.cls_obs, r.cls_exp) for r in results] == cls_values(synchronous)
    assert updates[0].status == "running" and updates[-1].status == "succeeded"

    path = tmp_path / "ws.json"
    path.write_text(json.dumps(TOYS["workspace"]))
    command = [str(CLIENT_EXE), "--server", server.url, "cls", str(path)]
    toys = ["--calctype", "toybased", "--ntoys", "3000", "--seed", "11"]
    followed = subprocess.run(
        [*command, "--job-after", "0", *toys, "--test-poi", "1.0"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYHF_GPU_SERVER": ""},
    )
    plain = subprocess.run(
        [*command, *toys, "--test-poi", "1.0"], capture_output=True, text=True, timeout=120
    )
    assert followed.returncode == plain.returncode == 0, followed.stderr + plain.stderr
    assert json.loads(followed.stdout) == json.loads(plain.stdout)
    assert "job " in followed.stderr and "succeeded" in followed.stderr
    assert "job " not in plain.stderr


def test_the_preference_is_in_the_openapi_document(server):
    document = httpx.get(server.url + "/openapi.json", timeout=30).json()
    for operation in ("cls", "ranking", "scan"):
        responses = document["paths"][f"/{operation}"]["post"]["responses"]
        assert responses["202"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/JobAccepted"
        }
