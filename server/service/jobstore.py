"""Durable job store: asynchronous jobs and their results in SQLite (WAL) under ``--data-dir``.

A job is written before it is acknowledged, so it survives a crash or ``kill -9``: at start,
:meth:`JobStore.requeue_interrupted` puts jobs that were ``running`` back to ``queued``, unless
the server process has ended while running them ``--max-job-attempts`` times (a poison job):
those are marked ``failed``. ``attempts`` counts the runs a job's process did not survive (a
graceful shutdown hands its run back). Each job records its ``owner``, the API caller that
submitted it (``NULL`` with auth off, and for jobs stored before owners were recorded: those are
visible to every caller). The store fails loudly: :func:`preflight` checks the data
dir and the database before the server starts, and a database missing from a data dir that held
one (see :data:`MARKER_NAME`) is reported as recreated. Every method is synchronous and
thread-safe; async code calls them through a thread.
"""

from __future__ import annotations

import builtins
import contextlib
import enum
import json
import logging
import sqlite3
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger("pyhf_gpu_server.service.jobs")

FINAL_STATUSES = ("succeeded", "failed", "cancelled")
STATUSES = ("queued", "running", *FINAL_STATUSES)
DATABASE_NAME = "jobs.sqlite3"
# written next to the database when it is first created: a later start that finds the marker but
# not the database knows jobs were lost
MARKER_NAME = "jobs.sqlite3.created"

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
    finished_at REAL,
    owner TEXT
);
CREATE INDEX IF NOT EXISTS jobs_status_created ON jobs (status, created_at);
CREATE INDEX IF NOT EXISTS jobs_created ON jobs (created_at);
"""


# Visibility of a job to the caller ``?``: its own, and those nobody owns (see the module's text).
_VISIBLE = "(owner = ? OR owner IS NULL)"


def _one(job_id: str, visible_to: str | None) -> tuple[str, tuple[str, ...]]:
    """The ``WHERE`` clause and parameters of job ``job_id``, if ``visible_to`` that caller
    (``None``: anyone's)."""
    if visible_to is None:
        return "WHERE id = ?", (job_id,)
    return f"WHERE id = ? AND {_VISIBLE}", (job_id, visible_to)


class Refused(enum.Enum):
    """Why :meth:`JobStore.create` stored no job: the cap that was reached."""

    QUEUE = "queue"
    """``max_unfinished`` jobs (everyone's) are queued or running."""
    OWNER = "owner"
    """``max_owned`` of the owner's jobs are queued or running."""


class StoreError(Exception):
    """The data dir or the job database cannot be used; the message is one line for an operator."""


def writable_problem(directory: Path) -> str | None:
    """Why files cannot be created in ``directory`` (created if missing), or ``None``.

    Tried for real (a probe file is created and removed), so it also catches read-only mounts
    and permissions that ``os.access`` misjudges."""
    if directory.exists() and not directory.is_dir():
        return f"{directory} is not writable (not a directory)"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-probe-"):
            pass
    except OSError as exc:
        return f"{directory} is not writable ({exc.strerror or exc})"
    return None


def preflight(data_dir: Path) -> None:
    """Raise :class:`StoreError` unless the data dir is writable and its database (if any) sound."""
    problem = writable_problem(data_dir)
    if problem is not None:
        raise StoreError(f"the data dir {problem}; fix it or pass another --data-dir")
    path = data_dir / DATABASE_NAME
    if path.exists():
        check_database(path)


def check_database(path: Path) -> None:
    """Raise :class:`StoreError` unless ``path`` is a SQLite database that passes ``quick_check``."""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=rw", uri=True)) as db:
            verdict = [row[0] for row in db.execute("PRAGMA quick_check").fetchall()]
    except sqlite3.DatabaseError as exc:
        kind = "is not a SQLite database" if "not a database" in str(exc) else "is damaged"
        raise StoreError(
            f"the job database {path} {kind} ({exc}); move it away or restore it"
        ) from None
    if verdict != ["ok"]:
        raise StoreError(
            f"the job database {path} is damaged (quick_check: {'; '.join(verdict[:3])}); "
            "move it away or restore it"
        )


def _identity(path: Path) -> tuple[int, int] | None:
    """The file at ``path`` (device, inode), or ``None`` where there is none."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return (stat.st_dev, stat.st_ino)


class JobStore:
    """Jobs in one SQLite file (WAL mode)."""

    def __init__(self, path: Path) -> None:
        """Open (or create) the database at ``path``; note whether it replaced a lost one."""
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        existed = path.exists() and path.stat().st_size > 0  # SQLite reads 0 bytes as empty
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA busy_timeout=5000")
        self._db.executescript(_SCHEMA)
        self._identity = _identity(path)  # the file this connection writes
        self._migrate()
        self.recreated_warning = None if existed else _lost_database_warning(path)
        if self.recreated_warning is not None:
            log.warning(self.recreated_warning)
        marker = path.parent / MARKER_NAME
        if not marker.exists():
            marker.write_text(f"{path.name} created at {time.time()}\n")

    def _migrate(self) -> None:
        """Bring a database written by an older version up to :data:`_SCHEMA`: add ``owner``
        (existing jobs have none) and its index. Only when missing (an up-to-date database is
        not written), in one write transaction, so concurrent openers agree."""

        def missing() -> tuple[bool, bool]:
            """Whether the ``owner`` column, and its index, are missing."""
            columns = {row["name"] for row in self._db.execute("PRAGMA table_info(jobs)")}
            index = self._db.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'index' AND name = 'jobs_owner_status'"
            ).fetchone()
            return "owner" not in columns, index is None

        with self._lock:
            if not any(missing()):
                return
            with self._transaction():
                if missing()[0]:  # (another process may have migrated meanwhile)
                    self._db.execute("ALTER TABLE jobs ADD COLUMN owner TEXT")
                self._db.execute(
                    "CREATE INDEX IF NOT EXISTS jobs_owner_status ON jobs (owner, status)"
                )

    def file_problem(self) -> str | None:
        """Why the file this store writes is no longer the database at its path (deleted or
        replaced while the server ran: what it stores now would be gone after a restart),
        or ``None``."""
        now = _identity(self.path)
        if now == self._identity:
            return None
        what = "was deleted" if now is None else "was replaced by another file"
        return (
            f"the job database {self.path} {what} while the server ran: jobs stored now would "
            "be lost; restart the server"
        )

    def writable_problem(self) -> str | None:
        """Why jobs cannot be stored: the database's file gone (:meth:`file_problem`) or its
        directory not writable (tried for real); or ``None``."""
        problem = self.file_problem()
        if problem is not None:
            return problem
        problem = writable_problem(self.path.parent)
        return None if problem is None else f"the job store {problem}"

    def describe(self) -> dict[str, Any]:
        """The store's state for ``/info``: whether this start recreated a lost database."""
        return {"recreated": self.recreated_warning is not None, "warning": self.recreated_warning}

    def close(self) -> None:
        """Close the connection."""
        with self._lock:
            self._db.close()

    def _execute(self, sql: str, params: tuple[Any, ...] = ()) -> sqlite3.Cursor:
        """Run one statement under the lock (each is its own transaction)."""
        with self._lock:
            return self._db.execute(sql, params)

    def create(
        self,
        operation: str,
        request: dict[str, Any],
        total: int,
        max_unfinished: int = sys.maxsize,
        *,
        owner: str | None = None,
        max_owned: int = sys.maxsize,
        running: bool = False,
    ) -> str | Refused:
        """Store a new queued job of ``owner`` (``running``: one already running, its first
        attempt); its id, or why not: :attr:`Refused.QUEUE` when
        ``max_unfinished`` jobs are already queued or running, :attr:`Refused.OWNER` when
        ``max_owned`` of ``owner``'s are (defaults: no caps; ``max_owned`` needs an owner).
        Counting and inserting are one transaction, so concurrent submissions (also from other
        processes) never pass a cap together."""
        job_id = uuid.uuid4().hex
        with self._lock, self._transaction():
            (unfinished,) = self._db.execute(
                "SELECT COUNT(*) FROM jobs WHERE status IN ('queued', 'running')"
            ).fetchone()
            if unfinished >= max_unfinished:
                return Refused.QUEUE
            if owner is not None and self._unfinished_of(owner) >= max_owned:
                return Refused.OWNER
            now = time.time()
            self._db.execute(
                "INSERT INTO jobs (id, operation, status, request, total, created_at, owner, "
                "started_at, attempts) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    job_id,
                    operation,
                    "running" if running else "queued",
                    json.dumps(request),
                    total,
                    now,
                    owner,
                    now if running else None,
                    int(running),
                ),
            )
        return job_id

    def unfinished_of(self, owner: str) -> int:
        """How many of ``owner``'s jobs are queued or running."""
        with self._lock:
            return self._unfinished_of(owner)

    def _unfinished_of(self, owner: str) -> int:
        """:meth:`unfinished_of`, under the lock already held."""
        (count,) = self._db.execute(
            "SELECT COUNT(*) FROM jobs WHERE owner = ? AND status IN ('queued', 'running')",
            (owner,),
        ).fetchone()
        return count

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """``BEGIN IMMEDIATE`` (the write lock at once) ... ``COMMIT``, or ``ROLLBACK`` on error.

        A failed write (the database became read-only, the disk is full, its file was
        deleted: :meth:`file_problem`) is a :class:`StoreError`.
        """
        problem = self.file_problem()
        if problem is not None:
            raise StoreError(problem)
        try:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
        except sqlite3.OperationalError as exc:
            raise StoreError(f"the job database {self.path} cannot be written ({exc})") from None

    def get(
        self, job_id: str, with_result: bool = True, visible_to: str | None = None
    ) -> dict[str, Any] | None:
        """The public view of a job (see ``schemas.JobView``), or ``None`` (also when
        ``visible_to`` is a caller other than its owner; ``None``: anyone's job)."""
        where, params = _one(job_id, visible_to)
        row = self._execute(f"SELECT * FROM jobs {where}", params).fetchone()
        return None if row is None else _view(row, with_result)

    def request(self, job_id: str) -> tuple[str, dict[str, Any]]:
        """The operation and stored request of a job."""
        row = self._execute(
            "SELECT operation, request FROM jobs WHERE id = ?", (job_id,)
        ).fetchone()
        return row["operation"], json.loads(row["request"])

    def active_workspaces(self) -> set[str]:
        """Ids of the stored workspaces that queued or running jobs still need."""
        rows = self._execute(
            "SELECT request FROM jobs WHERE status IN ('queued', 'running')"
        ).fetchall()
        return {
            workspace_id
            for row in rows
            if (workspace_id := json.loads(row["request"]).get("workspace_id"))
        }

    def list(
        self, limit: int, status: str | None = None, visible_to: str | None = None
    ) -> list[dict[str, Any]]:
        """Jobs newest first (without results): those ``visible_to`` that caller (``None``:
        everyone's), with ``status`` (``None``: any)."""
        where, params = [], []
        if status is not None:
            where.append("status = ?")
            params.append(status)
        if visible_to is not None:
            where.append(_VISIBLE)
            params.append(visible_to)
        clause = f"WHERE {' AND '.join(where)} " if where else ""
        rows = self._execute(
            f"SELECT * FROM jobs {clause}ORDER BY created_at DESC LIMIT ?", (*params, limit)
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

    def cancel(self, job_id: str, visible_to: str | None = None) -> str | None:
        """Cancel a queued or running job; its status before (``None`` if no such job, or
        none ``visible_to`` that caller: see :meth:`get`)."""
        with self._lock:
            where, params = _one(job_id, visible_to)
            row = self._db.execute(f"SELECT status FROM jobs {where}", params).fetchone()
            if row is None:
                return None
            if row["status"] in ("queued", "running"):
                self._db.execute(
                    "UPDATE jobs SET status = 'cancelled', finished_at = ? WHERE id = ?",
                    (time.time(), job_id),
                )
            return row["status"]

    # builtins.list: in this class, list is the method above
    def fail_poison(self, max_attempts: int) -> builtins.list[str]:
        """Mark ``failed`` the unfinished jobs whose process ended ``max_attempts`` times while
        running them (at start, before :meth:`requeue_interrupted`); their ids."""
        with self._lock, self._transaction():
            rows = self._db.execute(
                "SELECT id, attempts FROM jobs "
                "WHERE status IN ('queued', 'running') AND attempts >= ?",
                (max_attempts,),
            ).fetchall()
            for row in rows:
                self._db.execute(
                    "UPDATE jobs SET status = 'failed', error = ?, finished_at = ? WHERE id = ?",
                    (
                        json.dumps(_poison_error(row["attempts"], max_attempts)),
                        time.time(),
                        row["id"],
                    ),
                )
        return [row["id"] for row in rows]

    def requeue_interrupted(self) -> int:
        """Put ``running`` jobs (their process ended while running them) back in the queue."""
        cursor = self._execute(
            "UPDATE jobs SET status = 'queued', started_at = NULL WHERE status = 'running'"
        )
        return cursor.rowcount

    def requeue(self, job_id: str) -> None:
        """Put one running job back in the queue (graceful shutdown: not a failed attempt)."""
        self._execute(
            "UPDATE jobs SET status = 'queued', started_at = NULL, attempts = attempts - 1 "
            "WHERE id = ? AND status = 'running'",
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


def _poison_error(attempts: int, max_attempts: int) -> dict[str, Any]:
    """The error of a job failed at start because its runs kept ending the server process."""
    return {
        "status": 500,
        "detail": f"the server process ended {attempts} times while running this job; "
        f"not retried (--max-job-attempts {max_attempts})",
    }


def _lost_database_warning(path: Path) -> str | None:
    """The warning for a database just created in a data dir that held one before, or ``None``."""
    if (path.parent / MARKER_NAME).exists():
        sign = f"{MARKER_NAME} says it was created before"
    elif any((path.parent / "workspaces").glob("*.json")):
        sign = "workspaces/ holds stored workspaces"
    else:
        return None
    return (
        f"the job database {path} was missing and has been created empty, but {sign}: "
        "jobs submitted before are lost"
    )


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
