"""Uploaded workspaces expire and fit a disk quota (#13); those queued jobs need are kept.

Before: 200 uploads kept 115 MB forever. A real server over HTTP. A workspace's age is its
file's mtime (its last use), set back in the test to stand for the days that would pass.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from service_support import running_server, simple_workspace

from pyhf_gpu_server.service.workspace_store import WorkspaceStore

pytestmark = pytest.mark.timeout(300)


def upload(client, counts) -> str:
    response = client.post("/workspaces", json=simple_workspace(counts))
    assert response.status_code == 201, response.text
    return response.json()["workspace_id"]


def age(data_dir: Path, workspace_id: str, hours: float) -> None:
    path = data_dir / "workspaces" / f"{workspace_id}.json"
    then = time.time() - hours * 3600
    os.utime(path, (then, then))


def test_workspaces_unused_for_their_ttl_expire(tmp_path: Path):
    args = ["--workspace-ttl-hours", "24"]
    with running_server(tmp_path, args) as server, server.client() as client:
        old, recent = upload(client, [5.0, 10.0]), upload(client, [6.0, 10.0])
    age(tmp_path, old, 48)
    age(tmp_path, recent, 2)
    with running_server(tmp_path, args) as server, server.client() as client:
        deadline = time.monotonic() + 30
        while client.get(f"/workspaces/{old}").status_code != 404:  # expired at start
            assert time.monotonic() < deadline, "the expired workspace is still there"
            time.sleep(0.1)
        assert client.get(f"/workspaces/{recent}").status_code == 200
    assert "removed expired workspaces" in server.log()


def test_workspaces_jobs_need_are_kept(tmp_path: Path):
    """In-process: neither expiry nor the quota removes what queued or running jobs need."""
    needed: set[str] = set()
    store = WorkspaceStore(tmp_path, ttl_s=3600, quota_bytes=10**9, in_use=lambda: needed)
    needed_id = store.admit(simple_workspace([5.0, 10.0]), persist=True)
    needed.add(needed_id)
    other = store.admit(simple_workspace([6.0, 10.0]), persist=True)
    for digest in (needed_id, other):
        then = time.time() - 7200
        os.utime(tmp_path / f"{digest}.json", (then, then))
    assert store.expire() == 1
    assert (tmp_path / f"{needed_id}.json").exists()
    assert not (tmp_path / f"{other}.json").exists()


def test_the_quota_evicts_the_least_recently_used(tmp_path: Path):
    size = len(str(simple_workspace()))  # ~ one stored workspace
    quota_mb = 2.5 * size / 2**20  # room for two
    args = ["--workspace-quota-mb", f"{quota_mb:.9f}"]
    with running_server(tmp_path, args) as server, server.client() as client:
        first, second = upload(client, [5.0, 10.0]), upload(client, [6.0, 10.0])
        age(tmp_path, first, 1)  # used an hour ago: the least recent
        age(tmp_path, second, 0.5)
        third = upload(client, [7.0, 10.0])
        assert client.get(f"/workspaces/{first}").status_code == 404
        assert client.get(f"/workspaces/{second}").status_code == 200
        assert client.get(f"/workspaces/{third}").status_code == 200
        # what cannot fit even in an empty store is refused, naming the quota
        big = simple_workspace([1.0] * 400)
        response = client.post("/workspaces", json=big)
        assert response.status_code == 507, response.text
        assert "--workspace-quota-mb" in response.json()["detail"]
