"""Per-caller tokens (``NAME TOKEN`` lines in --api-token-file): each caller sees only its own
jobs, and --max-jobs-per-caller caps one caller's share of the job queue."""

from __future__ import annotations

import contextlib
import json
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from service_support import ServerProcess, running_server, simple_workspace, wait_for_job

from pyhf_gpu_server.service.jobstore import JobStore, Refused

pytestmark = pytest.mark.timeout(300)

TOKENS = {
    "alice": "alice-token-9f2c",
    "bob": "bob-token-41d7",
    "carol": "carol-token-c0de",
    "dave": "dave-token-77aa",
}
TOKEN_FILE = "# callers of the test server\n\n" + "".join(
    f"{name}   {token}\n" for name, token in TOKENS.items()
)


def quick_job() -> dict:
    """A job that finishes in well under a second."""
    return {"operation": "cls", "workspace": simple_workspace(), "test_poi": 1.0}


def slow_job() -> dict:
    """A job that runs for minutes (toys), unless cancelled."""
    return {
        "operation": "cls",
        "workspace": simple_workspace((3.0, 4.0)),
        "test_poi": [0.5, 1.0, 1.5, 2.0],
        "calctype": "toybased",
        "ntoys": 100_000,
    }


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    data_dir = tmp_path_factory.mktemp("callers")
    token_file = data_dir / "tokens"
    token_file.write_text(TOKEN_FILE)
    args = ["--api-token-file", str(token_file), "--max-jobs-per-caller", "1"]
    with running_server(data_dir, args) as started:
        yield started


@contextlib.contextmanager
def as_caller(server: ServerProcess, name: str) -> Iterator[httpx.Client]:
    with server.client(token=TOKENS[name], timeout_s=60) as client:
        yield client


def test_each_caller_sees_only_its_own_jobs(server: ServerProcess) -> None:
    with as_caller(server, "alice") as alice, as_caller(server, "bob") as bob:
        submitted = {}
        for name, client in (("alice", alice), ("bob", bob)):
            response = client.post("/jobs", json=quick_job())
            assert response.status_code == 202, response.text
            submitted[name] = response.json()["id"]
        for name, client in (("alice", alice), ("bob", bob)):
            assert wait_for_job(client, submitted[name])["status"] == "succeeded"
            assert [job["id"] for job in client.get("/jobs").json()["jobs"]] == [submitted[name]]
            assert client.get("/jobs", params={"status": "succeeded"}).json()["jobs"]

        mine = alice.get(f"/jobs/{submitted['alice']}")
        assert mine.status_code == 200 and mine.json()["result"]["CLs_obs"] > 0
        # bob cannot tell alice's job from an unknown id, on any of its routes
        unknown = bob.get("/jobs/" + "0" * 32)
        assert unknown.status_code == 404
        for method, path in (
            ("GET", f"/jobs/{submitted['alice']}"),
            ("GET", f"/jobs/{submitted['alice']}/events"),
            ("DELETE", f"/jobs/{submitted['alice']}"),
        ):
            response = bob.request(method, path)
            assert response.status_code == 404, (method, path, response.text)
            assert response.json()["detail"] == unknown.json()["detail"].replace(
                "0" * 32, submitted["alice"]
            )
        assert alice.get(f"/jobs/{submitted['alice']}").json()["status"] == "succeeded"


def test_the_request_log_names_the_caller(server: ServerProcess) -> None:
    with as_caller(server, "bob") as bob:
        assert bob.get("/jobs", headers={"X-Request-ID": "callers-log-1"}).status_code == 200
    deadline = time.monotonic() + 5
    lines: list[dict] = []
    while not lines and time.monotonic() < deadline:  # written after the answer
        time.sleep(0.05)
        lines = [json.loads(line) for line in server.log().splitlines() if line.startswith("{")]
        lines = [line for line in lines if line.get("request_id") == "callers-log-1"]
    assert lines and lines[0]["caller"] == "bob"
    assert TOKENS["bob"] not in server.log()


def test_unknown_tokens_are_refused(server: ServerProcess) -> None:
    for headers in ({}, {"Authorization": "Bearer alice"}, {"Authorization": "Bearer x"}):
        assert httpx.get(server.url + "/jobs", headers=headers).status_code == 401


def test_one_caller_cannot_take_the_whole_queue(server: ServerProcess) -> None:
    with as_caller(server, "carol") as carol, as_caller(server, "dave") as dave:
        first = carol.post("/jobs", json=slow_job())
        assert first.status_code == 202, first.text
        try:
            refused = carol.post("/jobs", json=quick_job())
            assert refused.status_code == 429, refused.text
            assert "--max-jobs-per-caller" in refused.json()["detail"]
            assert int(refused.headers["Retry-After"]) > 0
            # another caller is still admitted
            other = dave.post("/jobs", json=quick_job())
            assert other.status_code == 202, other.text
        finally:
            cancelled = carol.delete(f"/jobs/{first.json()['id']}")
        assert cancelled.status_code == 200, cancelled.text
        assert wait_for_job(dave, other.json()["id"])["status"] == "succeeded"
        # a finished job no longer counts
        again = carol.post("/jobs", json=quick_job())
        assert again.status_code == 202, again.text
        assert wait_for_job(carol, again.json()["id"])["status"] == "succeeded"


def _old_database(path: Path) -> str:
    """A job database as versions before job owners wrote it, holding one finished job."""
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        db.executescript(
            """
            CREATE TABLE jobs (
                id TEXT PRIMARY KEY, operation TEXT NOT NULL, status TEXT NOT NULL,
                request TEXT NOT NULL, done INTEGER NOT NULL DEFAULT 0,
                total INTEGER NOT NULL DEFAULT 0, result TEXT, error TEXT,
                attempts INTEGER NOT NULL DEFAULT 0, created_at REAL NOT NULL,
                started_at REAL, finished_at REAL
            );
            """
        )
        db.execute(
            "INSERT INTO jobs (id, operation, status, request, total, result, created_at, "
            "finished_at) VALUES ('legacy', 'cls', 'succeeded', '{}', 1, '{\"CLs_obs\": 0.5}', "
            "?, ?)",
            (time.time() - 10, time.time() - 5),
        )
    return "legacy"


def test_a_single_bare_token_file_still_works(tmp_path: Path) -> None:
    legacy = _old_database(tmp_path / "jobs.sqlite3")
    token_file = tmp_path / "token"
    token_file.write_text("  only-one-token \n")
    with running_server(tmp_path, ["--api-token-file", str(token_file)]) as server:
        assert httpx.get(server.url + "/jobs").status_code == 401
        with server.client(token="only-one-token", timeout_s=60) as client:
            assert client.get("/info").json()["auth"] is True
            submitted = client.post("/jobs", json=quick_job())
            assert submitted.status_code == 202, submitted.text
            job_id = submitted.json()["id"]
            assert wait_for_job(client, job_id)["status"] == "succeeded"
            # the job stored before jobs had owners is everyone's
            listed = [job["id"] for job in client.get("/jobs").json()["jobs"]]
            assert listed == [job_id, legacy]
            assert client.get(f"/jobs/{legacy}").json()["result"] == {"CLs_obs": 0.5}
    with contextlib.closing(sqlite3.connect(tmp_path / "jobs.sqlite3")) as db:
        owners = dict(db.execute("SELECT id, owner FROM jobs").fetchall())
    assert owners == {job_id: "default", legacy: None}


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("alice secret-1\nalice secret-2\n", "line 2: the caller name 'alice' is also on line 1"),
        ("alice secret-1\n# bob\nbob secret-1\n", "line 3: the same token is also on line 1"),
        ("alice secret-1\nbob secret 2\n", "line 2: expected 'NAME TOKEN'"),
    ],
    ids=["repeated name", "repeated token", "three fields"],
)
def test_a_malformed_token_file_stops_the_server_with_one_line(
    tmp_path: Path, text: str, problem: str
) -> None:
    token_file = tmp_path / "tokens"
    token_file.write_text(text)
    command = [
        sys.executable, "-m", "pyhf_gpu_server.cli", "--data-dir", str(tmp_path),
        "--api-token-file", str(token_file), "--port", "1",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.startswith(f"pyhf-gpu-server: error: --api-token-file {token_file} ")
    assert problem in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "secret" not in done.stderr  # no token is shown


def test_job_store_owners_caps_and_migration(tmp_path: Path) -> None:
    path = tmp_path / "jobs.sqlite3"
    legacy = _old_database(path)
    store = JobStore(path)
    try:
        first = store.create("cls", {}, 1, 10, owner="alice", max_owned=1)
        assert isinstance(first, str)
        assert store.create("cls", {}, 1, 10, owner="alice", max_owned=1) is Refused.OWNER
        second = store.create("cls", {}, 1, 2, owner="bob", max_owned=1)
        assert isinstance(second, str)
        assert store.create("cls", {}, 1, 2, owner="carol", max_owned=1) is Refused.QUEUE
        assert store.unfinished_of("alice") == 1 and store.unfinished_of("carol") == 0

        assert [j["id"] for j in store.list(10, visible_to="alice")] == [first, legacy]
        assert [j["id"] for j in store.list(10)] == [second, first, legacy]
        assert store.list(10, "queued", visible_to="bob")[0]["id"] == second
        assert store.get(first, visible_to="bob") is None
        assert store.get(legacy, visible_to="bob") is not None
        assert store.get(first, visible_to="alice") is not None and store.get(first) is not None
        assert store.cancel(first, visible_to="bob") is None
        assert store.cancel(first, visible_to="alice") == "queued"
        assert isinstance(store.create("cls", {}, 1, 10, owner="alice", max_owned=1), str)
    finally:
        store.close()
    JobStore(path).close()  # opening a migrated database again changes nothing


def test_uploaded_workspaces_belong_to_their_callers(server: ServerProcess) -> None:
    """Carol's upload: Dave's GET, /cls and job by its id answer 404 as an unknown id would;
    once Dave uploads the same workspace, it is his too; Carol's requests still work."""
    workspace = simple_workspace((2.5, 3.5))
    with as_caller(server, "carol") as carol, as_caller(server, "dave") as dave:
        uploaded = carol.post("/workspaces", json=workspace)
        assert uploaded.status_code == 201, uploaded.text
        workspace_id = uploaded.json()["workspace_id"]
        assert carol.get(f"/workspaces/{workspace_id}").status_code == 200
        unknown = dave.get(f"/workspaces/{'0' * 64}").json()["detail"]
        other = dave.get(f"/workspaces/{workspace_id}")
        assert other.status_code == 404
        assert other.json()["detail"] == unknown.replace("0" * 64, workspace_id)
        assert dave.post("/cls", json={"workspace_id": workspace_id}).status_code == 404
        job = dave.post("/jobs", json={"operation": "fit", "workspace_id": workspace_id})
        assert job.status_code == 404, job.text
        assert carol.post("/cls", json={"workspace_id": workspace_id}).status_code == 200
        assert dave.post("/workspaces", json=workspace).status_code == 201
        assert dave.post("/cls", json={"workspace_id": workspace_id}).status_code == 200


def test_the_workspace_quota_is_each_callers_own(tmp_path: Path) -> None:
    """--workspace-quota-mb is each caller's: Dave filling his (507) leaves Carol's room and
    her workspace alone (one store for all: her second upload would not fit)."""
    token_file = tmp_path / "tokens"
    token_file.write_text(TOKEN_FILE)
    args = ["--api-token-file", str(token_file), "--workspace-quota-mb", "0.001"]  # 1048 bytes
    with (
        running_server(tmp_path, args) as server,
        as_caller(server, "carol") as carol,
        as_caller(server, "dave") as dave,
    ):
        first = carol.post("/workspaces", json=simple_workspace((1.0, 2.0)))  # 458 bytes
        assert first.status_code == 201, first.text
        for k in range(2):
            response = dave.post("/workspaces", json=simple_workspace((3.0 + k, 4.0)))
            assert response.status_code == 201, response.text
        full = dave.post("/workspaces", json=simple_workspace((9.0, 4.0)))
        assert full.status_code == 507, full.text
        assert "--workspace-quota-mb" in full.json()["detail"]
        second = carol.post("/workspaces", json=simple_workspace((1.5, 2.0)))
        assert second.status_code == 201, second.text
        assert carol.get(f"/workspaces/{first.json()['workspace_id']}").status_code == 200
