"""Durable job store: asynchronous jobs and their results in SQLite (WAL) under ``--data-dir``.

A job is written before it is acknowledged, so it survives a crash or ``kill -9``: at start,
:meth:`JobStore.requeue_interrupted` puts jobs that were ``running`` back to ``queued``.
Every method is synchronous and thread-safe; async code calls them through a thread.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
import uuid
from pathlib import Path
from typing import Any

FINAL_STATUSES = ("succeeded", "failed", "cancelled")
STATUSES = ("queued", "running", *FINAL_STATUSES)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    operation TEXT NOT NULL,
    status TEXT NOT NULL,
    request TEXT NOT NULL,
    done INTEGER NOT NULL DEFAULT 0,
    total INTEGER NOT NULL DEFAULT 0,
    result TEXT,
    error TEXT,
    attempts INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL
);
CREATE INDEX IF NOT EXISTS jobs_status_created ON jobs (status, created_at);
CREATE INDEX IF NOT EXISTS jobs_created ON jobs (created_at);
"""


class JobStore:
    """Jobs in one SQLite file (WAL mode)."""

    def __init__(self, path: Path) -> None:
        """Open (or create) the database at ``path``."""
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA busy_timeout=5000")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        """Close the connection."""
        with self._lock:
            self._db.close()

    def _execute(self, sql: str, params: tuple[Any, ...] = ()) -> sqlite3.Cursor:
        """Run one statement under the lock (each is its own transaction)."""
        with self._lock:
            return self._db.execute(sql, params)

    def create(self, operation: str, request: dict[str, Any], total: int) -> str:
        """Store a new queued job; its id."""
        job_id = uuid.uuid4().hex
        self._execute(
            "INSERT INTO jobs (id, operation, status, request, total, created_at) "
            "VALUES (?, ?, 'queued', ?, ?, ?)",
            (job_id, operation, json.dumps(request), total, time.time()),
        )
        return job_id

    def get(self, job_id: str, with_result: bool = True) -> dict[str, Any] | None:
        """The public view of a job (see ``schemas.JobView``), or ``None``."""
        row = self._execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return None if row is None else _view(row, with_result)

    def request(self, job_id: str) -> tuple[str, dict[str, Any]]:
        """The operation and stored request of a job."""
        row = self._execute(
            "SELECT operation, request FROM jobs WHERE id = ?", (job_id,)
        ).fetchone()
        return row["operation"], json.loads(row["request"])

    def list(self, limit: int, status: str | None = None) -> list[dict[str, Any]]:
        """Jobs newest first (without results)."""
        if status is None:
            rows = self._execute(
                "SELECT * FROM jobs ORDER BY created_at DESC LIMIT ?", (limit,)
            ).fetchall()
        else:
            rows = self._execute(
                "SELECT * FROM jobs WHERE status = ? ORDER BY created_at DESC LIMIT ?",
                (status, limit),
            ).fetchall()
        return [_view(row, with_result=False) for row in rows]

    def counts(self) -> dict[str, int]:
        """Jobs per status."""
        rows = self._execute("SELECT status, COUNT(*) AS n FROM jobs GROUP BY status").fetchall()
        found = {row["status"]: row["n"] for row in rows}
        return {status: found.get(status, 0) for status in STATUSES}

    def claim_next(self) -> str | None:
        """Mark the oldest queued job running and return its id (``None`` if none is queued)."""
        with self._lock:
            row = self._db.execute(
                "UPDATE jobs SET status = 'running', started_at = ?, attempts = attempts + 1 "
                "WHERE id = (SELECT id FROM jobs WHERE status = 'queued' "
                "ORDER BY created_at LIMIT 1) RETURNING id",
                (time.time(),),
            ).fetchone()
        return None if row is None else row["id"]

    def progress(self, job_id: str, done: int, total: int) -> None:
        """Record progress of a running job."""
        self._execute(
            "UPDATE jobs SET done = ?, total = ? WHERE id = ? AND status = 'running'",
            (done, total, job_id),
        )

    def finish(self, job_id: str, result: Any) -> bool:
        """Store a running job's result; ``False`` if it was cancelled meanwhile."""
        cursor = self._execute(
            "UPDATE jobs SET status = 'succeeded', result = ?, done = total, finished_at = ? "
            "WHERE id = ? AND status = 'running'",
            (json.dumps(result), time.time(), job_id),
        )
        return cursor.rowcount == 1

    def fail(self, job_id: str, error: Any) -> None:
        """Mark a running job failed with ``error`` (the 4xx detail it would have answered)."""
        self._execute(
            "UPDATE jobs SET status = 'failed', error = ?, finished_at = ? "
            "WHERE id = ? AND status = 'running'",
            (json.dumps(error), time.time(), job_id),
        )

    def cancel(self, job_id: str) -> str | None:
        """Cancel a queued or running job; its status before (``None`` if no such job)."""
        with self._lock:
            row = self._db.execute("SELECT status FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if row is None:
                return None
            if row["status"] in ("queued", "running"):
                self._db.execute(
                    "UPDATE jobs SET status = 'cancelled', finished_at = ? WHERE id = ?",
                    (time.time(), job_id),
                )
            return row["status"]

    def requeue_interrupted(self) -> int:
        """Put ``running`` jobs (interrupted by a crash or shutdown) back in the queue."""
        cursor = self._execute(
            "UPDATE jobs SET status = 'queued', started_at = NULL WHERE status = 'running'"
        )
        return cursor.rowcount

    def requeue(self, job_id: str) -> None:
        """Put one running job back in the queue (graceful shutdown)."""
        self._execute(
            "UPDATE jobs SET status = 'queued', started_at = NULL WHERE id = ? AND status = 'running'",
            (job_id,),
        )

    def purge(self, older_than_s: float) -> int:
        """Delete finished jobs that finished more than ``older_than_s`` seconds ago."""
        cursor = self._execute(
            "DELETE FROM jobs WHERE status IN ('succeeded', 'failed', 'cancelled') "
            "AND finished_at < ?",
            (time.time() - older_than_s,),
        )
        return cursor.rowcount


def _view(row: sqlite3.Row, with_result: bool) -> dict[str, Any]:
    """A stored row as the API shows it."""
    view: dict[str, Any] = {
        "id": row["id"],
        "operation": row["operation"],
        "status": row["status"],
        "progress": {"done": row["done"], "total": row["total"]},
        "created_at": row["created_at"],
        "started_at": row["started_at"],
        "finished_at": row["finished_at"],
    }
    if with_result:
        view["result"] = None if row["result"] is None else json.loads(row["result"])
        view["error"] = None if row["error"] is None else json.loads(row["error"])
        view["failed_patches"] = _failed_patches(view["result"])
    return view


def _failed_patches(result: Any) -> int | None:
    """How many patches of a patchset job's ``{patch: result}`` answered an error entry."""
    if not isinstance(result, dict) or not result:
        return None
    entries = [v for v in result.values() if isinstance(v, dict)]
    if len(entries) != len(result):  # one result, not {patch: result}
        return None
    return sum(1 for v in entries if set(v) == {"error"})
