"""Jobs run in chunks sized by time (#13): a large toy job on a real server holds the device
for about ``--job-chunk-s`` at a time, so small interactive requests posted while it runs are
answered in about one chunk, not after the whole job.

Before: a job's chunk was ``max_batch_size`` rows whatever a row cost (64 toy-based rows of
100000 toys: about an hour), and interactive requests waited behind it.
"""

from __future__ import annotations

import time

import pytest
from service_support import running_server, simple_workspace, wait_for_job

pytestmark = pytest.mark.timeout(300)

POIS = [0.25 * (i + 1) for i in range(40)]


def test_small_requests_wait_one_chunk_of_a_large_toy_job(tmp_path):
    """40 toy-based rows of 5000 toys (~0.3 s each here, ~12 s in all); with 0.5 s chunks
    every small request posted meanwhile is answered in under 3 s, and the job still gives
    all 40 results."""
    job_body = {
        "operation": "cls",
        "workspace": simple_workspace(),
        "test_poi": POIS,
        "calctype": "toybased",
        "ntoys": 5000,
        "seed": 7,
    }
    with running_server(tmp_path, ["--job-chunk-s", "0.5"]) as server, server.client() as client:
        small = {"workspace": simple_workspace((4.0, 8.0)), "test_poi": 1.0}
        assert client.post("/cls", json=small).status_code == 200  # warm
        start = time.monotonic()
        submitted = client.post("/jobs", json=job_body)
        assert submitted.status_code == 202, submitted.text[:300]
        job_id = submitted.json()["id"]
        waits, progress = [], set()
        while True:
            view = client.get(f"/jobs/{job_id}").json()
            if view["status"] != "queued" and view["status"] != "running":
                break
            progress.add(view["progress"]["done"])
            sent = time.monotonic()
            assert client.post("/cls", json=small).status_code == 200
            waits.append(time.monotonic() - sent)
            time.sleep(0.2)
        job_s = time.monotonic() - start
        view = wait_for_job(client, job_id)
    assert view["status"] == "succeeded", view
    assert len(view["result"]) == len(POIS)
    assert len(waits) >= 5 and job_s > 3, (len(waits), job_s)
    assert max(waits) < 3.0, waits
    assert len(progress - {0}) >= 3, progress  # the job advanced chunk by chunk
