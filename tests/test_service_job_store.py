"""The job store fails loudly and bounds its jobs (issue 13, items 2, 5 and 7).

Every test runs a real ``pyhf-gpu-server`` subprocess on 127.0.0.1: poison jobs are failed at
restart, parallel submissions never pass ``--max-queue``, an unusable data dir or database stops
the server with one line, an unwritable workspace store answers 503, a lost database is reported.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from service_support import ServerProcess, running_server, simple_workspace, wait_for_job

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

# one hypothesis per engine call, one job at a time: a job runs long enough to be killed
SLOW_JOBS = ["--max-batch-size", "1", "--max-concurrent-jobs", "1"]
SCAN = [0.05 * i for i in range(1, 200)]  # ~7 s of work with SLOW_JOBS, inside mu's bounds


def cls_job(signal: float = 5.0, test_poi: list[float] = SCAN) -> dict:
    """A CLs job on a small workspace, one hypothesis per POI value."""
    return {"operation": "cls", "workspace": simple_workspace((signal, 10.0)), "test_poi": test_poi}


def wait_for_status(client: httpx.Client, job_id: str, status: str, timeout_s: float = 60) -> None:
    """Until the job has ``status``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if client.get(f"/jobs/{job_id}").json()["status"] == status:
            return
        time.sleep(0.02)
    raise AssertionError(f"job {job_id} never became {status}")


def stored_job(data_dir: Path, job_id: str) -> dict:
    """A job's row read straight from the SQLite file."""
    with sqlite3.connect(data_dir / "jobs.sqlite3") as db:
        db.row_factory = sqlite3.Row
        return dict(db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone())


def start_and_fail(data_dir: Path) -> subprocess.CompletedProcess[str]:
    """Start the server where it must refuse to start; its exit code and output."""
    command = [sys.executable, "-m", "pyhf_gpu_server.cli", "--data-dir", str(data_dir)]
    command += ["--device", "cpu", "--port", "9"]  # never reached: it must exit before listening
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def assert_one_line_error(finished: subprocess.CompletedProcess[str], expected: str) -> None:
    """A non-zero exit with exactly one stderr line, ``pyhf-gpu-server: error: ...expected...``."""
    assert finished.returncode != 0, finished
    lines = finished.stderr.strip().splitlines()
    assert len(lines) == 1, finished.stderr
    assert lines[0].startswith("pyhf-gpu-server: error: "), lines
    assert expected in lines[0], lines
    assert "Traceback" not in finished.stderr + finished.stdout


def test_poison_job_is_failed_at_restart_not_rerun(tmp_path: Path) -> None:
    """kill -9 the server twice while it runs the same job (as the kernel's OOM killer would):
    the next start marks the job failed with the reason and keeps serving."""
    first = ServerProcess(tmp_path, SLOW_JOBS).start()
    with first.client() as client:
        job_id = client.post("/jobs", json=cls_job()).json()["id"]
        wait_for_status(client, job_id, "running")
    first.kill()

    second = ServerProcess(tmp_path, SLOW_JOBS).start()  # attempts 1 < 2: resumed
    with second.client() as client:
        wait_for_status(client, job_id, "running")
    second.kill()
    assert stored_job(tmp_path, job_id)["attempts"] == 2

    third = ServerProcess(tmp_path, SLOW_JOBS).start()
    try:
        with third.client() as client:
            view = client.get(f"/jobs/{job_id}").json()
            assert view["status"] == "failed", view
            assert view["error"] == {
                "status": 500,
                "detail": "the server process ended 2 times while running this job; "
                "not retried (--max-job-attempts 2)",
            }
            other = client.post("/jobs", json=cls_job(7.0, [1.0])).json()["id"]
            assert wait_for_job(client, other)["status"] == "succeeded"
            assert client.get("/healthz").status_code == 200
    finally:
        third.stop()
    assert "failed jobs whose runs ended the server process" in third.log()


def test_parallel_submissions_never_pass_the_queue_cap(tmp_path: Path) -> None:
    """40 POST /jobs at once against --max-queue 10: at most 10 jobs queued or running."""
    cap = 10
    limits = httpx.Limits(max_connections=40)
    with (
        running_server(tmp_path, [*SLOW_JOBS, "--max-queue", str(cap)]) as server,
        httpx.Client(base_url=server.url, timeout=60, limits=limits) as client,
    ):
        upload = client.post("/workspaces", json=simple_workspace())
        job = {"operation": "cls", "workspace_id": upload.json()["workspace_id"], "test_poi": SCAN}
        with ThreadPoolExecutor(40) as pool:
            answers = list(pool.map(lambda _: client.post("/jobs", json=job), range(40)))
        jobs = client.get("/jobs", params={"limit": 100}).json()["jobs"]
    statuses = sorted(answer.status_code for answer in answers)
    assert set(statuses) == {202, 429}, statuses
    assert all(a.headers["Retry-After"] for a in answers if a.status_code == 429)
    finished = sum(1 for j in jobs if j["status"] not in ("queued", "running"))
    # a job that finished during the burst frees its place; none may be taken twice
    assert statuses.count(202) <= cap + finished, (statuses.count(202), finished)
    assert len(jobs) == statuses.count(202)


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        ("truncate", "is damaged (database disk image is malformed); move it away or restore it"),
        ("garbage", "is not a SQLite database (file is not a database); move it away or restore"),
    ],
)
def test_unreadable_database_stops_the_server_with_one_line(
    tmp_path: Path, damage: str, expected: str
) -> None:
    """A database cut to half its size, or overwritten with text: exit code 1, one line."""
    path = tmp_path / "jobs.sqlite3"
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        db.execute("CREATE TABLE jobs (id INTEGER PRIMARY KEY, request TEXT)")
        db.executemany("INSERT INTO jobs (request) VALUES (?)", [("x" * 500,)] * 200)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"not sqlite\n" * 500)

    finished = start_and_fail(tmp_path)
    assert_one_line_error(finished, f"the job database {path} {expected}")
    assert finished.returncode == 1


def test_unwritable_data_dir_stops_the_server_with_one_line(tmp_path: Path) -> None:
    """Tests run as root here, where a read-only mode does not stop writes: the data dir is
    made unwritable by placing it under a regular file, so creating anything in it fails."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    data_dir = blocker / "data"

    finished = start_and_fail(data_dir)
    assert_one_line_error(
        finished,
        f"the data dir {data_dir} is not writable (Not a directory); "
        "fix it or pass another --data-dir",
    )


def test_unwritable_workspace_store_answers_503(tmp_path: Path) -> None:
    """Tests run as root here, where a read-only mode does not stop writes: ``workspaces/`` is
    replaced by a regular file, so no workspace can be written in it. The server starts (jobs
    by id still work); uploads and jobs with an inline workspace answer 503, /readyz 503."""
    (tmp_path / "workspaces").write_text("not a directory\n")
    store_problem = f"the workspace store {tmp_path / 'workspaces'} is not writable"
    with running_server(tmp_path) as server, server.client() as client:
        upload = client.post("/workspaces", json=simple_workspace())
        job = client.post("/jobs", json=cls_job(test_poi=[1.0]))
        ready = client.get("/readyz")
        alive = client.get("/healthz")
    for answer in (upload, job):
        assert answer.status_code == 503, answer.text
        assert store_problem in answer.json()["detail"], answer.text
        assert "Retry-After" in answer.headers
    assert ready.status_code == 503
    assert ready.json()["problems"] == [f"{store_problem} (not a directory)"]
    assert alive.status_code == 200


def test_lost_database_is_reported_not_silently_recreated(tmp_path: Path) -> None:
    """The database is deleted between two runs while workspaces/ and the marker remain: the
    server starts with an empty one, logs a warning and says so in /info."""
    with running_server(tmp_path) as server, server.client() as client:
        job_id = client.post("/jobs", json=cls_job(test_poi=[1.0])).json()["id"]
        assert wait_for_job(client, job_id)["status"] == "succeeded"
        assert client.get("/info").json()["job_store"]["recreated"] is False
    for leftover in tmp_path.glob("jobs.sqlite3*"):
        if leftover.name != "jobs.sqlite3.created":
            leftover.unlink()

    with running_server(tmp_path) as server, server.client() as client:
        job_store = client.get("/info").json()["job_store"]
        assert client.get(f"/jobs/{job_id}").status_code == 404
    warnings = [
        json.loads(line)
        for line in server.log().splitlines()
        if "was missing and has been created empty" in line
    ]
    assert [w["level"] for w in warnings] == ["warning"]
    assert job_store == {"recreated": True, "warning": warnings[0]["msg"]}
    assert str(tmp_path / "jobs.sqlite3") in job_store["warning"]
