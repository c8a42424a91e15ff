"""Jobs are never lost: they survive ``kill -9`` and SIGTERM, in a real SQLite (WAL) file, and
run again after a transient 503 (the job runner's retries, in process)."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import httpx
import pytest
from service_support import ServerProcess, simple_workspace, wait_for_job

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

# one row per engine call, one job at a time: the jobs take long enough to be interrupted
ARGS = ["--max-batch-size", "1", "--max-concurrent-jobs", "1"]


def submit_jobs(client: httpx.Client, count: int) -> list[str]:
    """``count`` CLs jobs with 6 hypotheses each."""
    ids = []
    for i in range(count):
        response = client.post(
            "/jobs",
            json={
                "operation": "cls",
                "workspace": simple_workspace((5.0 + i, 10.0)),
                "test_poi": [0.5, 1.0, 1.5, 2.0, 2.5, 3.0],
            },
        )
        assert response.status_code == 202, response.text
        ids.append(response.json()["id"])
    return ids


def stored_statuses(data_dir: Path) -> dict[str, str]:
    """Job statuses read straight from the SQLite file."""
    with sqlite3.connect(data_dir / "jobs.sqlite3") as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        return dict(db.execute("SELECT id, status FROM jobs").fetchall())


def stored_attempts(data_dir: Path, status: str) -> dict[str, int]:
    """The ``attempts`` (runs the server process did not survive) of the jobs with ``status``."""
    with sqlite3.connect(data_dir / "jobs.sqlite3") as db:
        query = "SELECT id, attempts FROM jobs WHERE status = ?"
        return dict(db.execute(query, (status,)).fetchall())


def wait_until_running(client: httpx.Client, job_ids: list[str], timeout_s: float = 120) -> None:
    """Until some job is running."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(client.get(f"/jobs/{j}").json()["status"] == "running" for j in job_ids):
            return
        time.sleep(0.05)
    raise AssertionError("no job started")


def test_jobs_survive_kill_9_and_sigterm(tmp_path: Path) -> None:
    first = ServerProcess(tmp_path, ARGS).start()
    with first.client() as client:
        job_ids = submit_jobs(client, 4)
        wait_until_running(client, job_ids)
    first.kill()
    before = stored_statuses(tmp_path)
    assert set(before) == set(job_ids)
    unfinished = [j for j, s in before.items() if s in ("queued", "running")]
    assert unfinished, f"every job finished before the kill: {before}"

    second = ServerProcess(tmp_path, ARGS).start()
    with second.client() as client:
        more = submit_jobs(client, 2)
        wait_until_running(client, more)
        # SIGTERM: graceful (uvicorn re-raises the signal after its shutdown, hence -15)
        assert second.stop() in (0, -15)
    assert "service stopped" in second.log()
    after_term = stored_statuses(tmp_path)
    assert not any(s == "failed" for s in after_term.values()), after_term
    assert all(s != "running" for s in after_term.values()), "running jobs went back to queued"
    # a graceful stop hands its run back: it does not count towards --max-job-attempts
    assert set(stored_attempts(tmp_path, "queued").values()) <= {0}  # (all may have finished)

    third = ServerProcess(tmp_path, ARGS).start()
    try:
        with third.client() as client:
            for job_id in job_ids + more:
                view = wait_for_job(client, job_id, timeout_s=300)
                assert view["status"] == "succeeded", view
                assert len(view["result"]) == 6
    finally:
        third.stop()
    if "running" in before.values():
        assert "re-queued interrupted jobs" in second.log()


class _FailingDispatcher:
    """Answers ``run`` with each of ``failures`` in turn, then a result."""

    def __init__(self, failures: list[Exception]) -> None:
        self.failures = failures
        self.calls = 0

    async def run(self, plan: object, lane: str, progress: object) -> dict[str, bool]:
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)
        return {"answered": True}


def test_a_job_runs_again_after_a_transient_503_not_after_a_lasting_one(monkeypatch) -> None:
    """The job runner's retries, unit by unit: a scheduler gone for a while (transient 503)
    costs waits; a hypothesis too large for the device (a 503 whenever it runs) fails at once;
    transient ones past the last wait fail the job."""
    import asyncio

    from pyhf_gpu_server.service import jobrunner
    from pyhf_gpu_server.service.errors import Unavailable

    monkeypatch.setattr(jobrunner, "UNAVAILABLE_RETRY_DELAYS_S", (0.0, 0.0))

    def run(failures: list[Exception]) -> tuple[object, int]:
        dispatcher = _FailingDispatcher(failures)
        runner = jobrunner.JobRunner(
            None, None, dispatcher, concurrency=1, max_queued=1, max_attempts=1, result_ttl_s=1
        )
        try:
            outcome = asyncio.run(runner._run_plan("job", None, lambda done, total: None))
        except Unavailable as exc:
            outcome = exc
        return outcome, dispatcher.calls

    gone = Unavailable("the Dask scheduler does not answer")
    assert run([gone, gone]) == ({"answered": True}, 3)
    too_large = Unavailable("out of memory for a single hypothesis", transient=False)
    assert run([too_large]) == (too_large, 1)
    assert run([gone, gone, gone]) == (gone, 3)


def test_a_deleted_job_database_is_noticed(tmp_path: Path) -> None:
    """The job database deleted while the server runs: /readyz 503 naming it, new jobs 503
    (not accepted into a file no restart would find), interactive requests still answered."""
    server = ServerProcess(tmp_path).start()
    try:
        with server.client() as client:
            body = {"operation": "fit", "workspace": simple_workspace()}
            first = client.post("/jobs", json=body).json()["id"]
            assert wait_for_job(client, first)["status"] == "succeeded"
            assert client.get("/readyz").status_code == 200
            for name in ("jobs.sqlite3", "jobs.sqlite3-wal", "jobs.sqlite3-shm"):
                (tmp_path / name).unlink(missing_ok=True)
            ready = client.get("/readyz")
            assert ready.status_code == 503
            assert any("jobs.sqlite3 was deleted" in p for p in ready.json()["problems"])
            refused = client.post("/jobs", json=body)
            assert refused.status_code == 503, refused.text
            assert "was deleted while the server ran" in refused.json()["detail"]
            assert client.post("/cls", json={"workspace": simple_workspace()}).status_code == 200
    finally:
        server.stop()
