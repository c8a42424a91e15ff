"""Runs asynchronous jobs from the durable :class:`JobStore` through the batching scheduler.

Jobs are validated (planned) when submitted, so bad input is a 4xx at ``POST /jobs``, not a
failed job. An inline workspace is stored on disk and the stored request refers to it by id, so
a restart can re-plan the job. Workers claim the oldest queued job; on shutdown a running job
goes back to ``queued`` and resumes at the next start (after a crash, at start-up, unless the
process has ended ``--max-job-attempts`` times while running it: then it is ``failed``).
A job whose batches could not run for a while (503: a Dask scheduler gone, workers losing its
model) runs again after each of :data:`UNAVAILABLE_RETRY_DELAYS_S`, and fails with that 503
only after the last.
A job belongs to the caller that submitted it (``None`` with auth off); one caller may have at
most ``--max-jobs-per-caller`` queued or running, all of them together ``--max-queue``.
A synchronous request whose client sent ``Prefer: respond-async`` becomes a job when it outlasts
its ``wait`` (:meth:`JobRunner.adopt`): stored as running, it goes on in its batches, in its
lane, losing no work.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import Awaitable, Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from .dispatch import Dispatcher
from .errors import QueueFull, ServiceError, Unavailable, Unprocessable
from .jobstore import JobStore, Refused, StoreError
from .operations import OPERATIONS
from .requests import Plan, envelope_from, plan_request
from .workspace_store import WorkspaceStore

log = logging.getLogger("pyhf_gpu_server.service.jobs")

PURGE_INTERVAL_S = 600.0
IDLE_POLL_S = 5.0
# a job's waits before it runs again after a transient 503 (about 2.5 minutes in all)
UNAVAILABLE_RETRY_DELAYS_S = (5.0, 10.0, 20.0, 40.0, 80.0)


@dataclass(eq=False)
class ProgressRelay:
    """The progress callback of a synchronous run: kept, and passed on to the job the run
    becomes (:meth:`JobRunner.adopt`)."""

    last: tuple[int, int] | None = None
    target: Callable[[int, int], None] | None = None

    def __call__(self, done: int, total: int) -> None:
        self.last = (done, total)
        if self.target is not None:
            self.target(done, total)


@dataclass(eq=False, repr=False)
class JobRunner:
    """Worker tasks that take queued jobs and run them in the ``jobs`` lane: up to
    ``concurrency`` at once; new ones refused past ``max_queued`` queued or running; a job whose
    process ended ``max_attempts`` times running it is failed at start."""

    store: JobStore
    workspaces: WorkspaceStore
    dispatcher: Dispatcher
    _: KW_ONLY
    concurrency: int
    max_queued: int
    max_attempts: int
    result_ttl_s: float
    _wakeup: asyncio.Event = field(init=False, default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(init=False, default_factory=list)
    _running: dict[str, asyncio.Task[None]] = field(init=False, default_factory=dict)
    _adopted: set[asyncio.Task[None]] = field(init=False, default_factory=set)
    _watchers: set[asyncio.Event] = field(init=False, default_factory=set)

    async def start(self) -> None:
        """Fail poison jobs, re-queue the others a crash left running, purge expired ones, start
        the workers."""
        poisoned = await asyncio.to_thread(self.store.fail_poison, self.max_attempts)
        if poisoned:
            log.warning(
                "failed jobs whose runs ended the server process (--max-job-attempts)",
                extra={"jobs": poisoned, "max_job_attempts": self.max_attempts},
            )
        requeued = await asyncio.to_thread(self.store.requeue_interrupted)
        if requeued:
            log.info("re-queued interrupted jobs", extra={"jobs": requeued})
        self._tasks = [
            asyncio.create_task(self._worker(), name=f"job-worker-{i}")
            for i in range(self.concurrency)
        ]
        self._tasks.append(asyncio.create_task(self._purge_forever(), name="job-purge"))

    async def stop(self) -> None:
        """Stop the workers; their running jobs go back to ``queued`` for the next start."""
        tasks = [*self._tasks, *self._adopted]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    async def submit(
        self, document: Any, caller: str | None = None, max_per_caller: int = 0
    ) -> str:
        """Validate and store a job (``{"operation": ..., ...}``) of ``caller``; its id. 4xx on
        bad input; 429 when ``--max-queue`` jobs, or ``max_per_caller`` (when positive) of
        ``caller``'s, are queued or running."""
        if not isinstance(document, dict) or "operation" not in document:
            raise Unprocessable(
                f"a job needs 'operation' (one of {', '.join(OPERATIONS)}) and the fields of "
                "that operation's request"
            )
        request = dict(document)
        operation = request.pop("operation")
        if not isinstance(operation, str) or operation not in OPERATIONS:
            raise Unprocessable(
                f"unknown operation {operation!r}; use one of {', '.join(OPERATIONS)}"
            )
        max_owned = max_per_caller if caller is not None and max_per_caller > 0 else None
        # before planning: a full queue costs no work (create() decides, atomically)
        counts = await asyncio.to_thread(self.store.counts)
        if counts["queued"] + counts["running"] >= self.max_queued:
            raise self._queue_full()
        if max_owned is not None and caller is not None:  # (one implies the other)
            owned = await asyncio.to_thread(self.store.unfinished_of, caller)
            if owned >= max_owned:
                raise self._caller_full(max_owned)
        kind = OPERATIONS[operation]
        envelope = envelope_from(request, {}, kind)
        plan = await asyncio.to_thread(plan_request, kind, envelope, self.workspaces, True, caller)
        self.dispatcher.admit(plan)
        try:
            job_id = await asyncio.to_thread(
                self._create, operation, envelope, plan, caller, max_owned
            )
        except StoreError as exc:
            raise Unavailable(f"cannot store the job: {exc}", 60) from None
        if job_id is Refused.QUEUE:
            raise self._queue_full()
        if job_id is Refused.OWNER:
            raise self._caller_full(max_per_caller)
        self._wakeup.set()
        self.changed()
        return job_id

    async def adopt(
        self,
        envelope: dict[str, Any],
        plan: Plan,
        run: asyncio.Future[Any],
        relay: ProgressRelay,
        caller: str | None = None,
        max_per_caller: int = 0,
    ) -> str | None:
        """Make the running synchronous request ``run`` (of ``envelope``, planned as ``plan``,
        reporting to ``relay``) a job of ``caller``: stored as running, its request on disk as
        a submitted job's is (a restart runs it again), its answer stored when ``run`` ends.
        Its id; ``None`` when the job caps are reached or it cannot be stored (the request
        then stays synchronous)."""
        max_owned = max_per_caller if caller is not None and max_per_caller > 0 else None
        try:
            if "workspace" in envelope:  # on disk, as a job's workspace is
                await asyncio.to_thread(
                    self.workspaces.admit, plan.background.workspace, True, caller
                )
            job_id = await asyncio.to_thread(
                self._create, plan.operation.name, envelope, plan, caller, max_owned, True
            )
        except (StoreError, ServiceError) as exc:
            log.warning("a request could not become a job", extra={"error": str(exc)})
            return None
        if isinstance(job_id, Refused):
            return None
        relay.target = self._progress(job_id)
        if relay.last is not None:
            relay(*relay.last)
        task = asyncio.create_task(self._record(job_id, run), name=f"job-{job_id}")
        self._running[job_id] = task
        self._adopted.add(task)
        task.add_done_callback(lambda _: self._forget(job_id, task))
        self.changed()
        return job_id

    def _create(
        self,
        operation: str,
        envelope: dict[str, Any],
        plan: Plan,
        caller: str | None,
        max_owned: int | None,
        running: bool = False,
    ) -> str | Refused:
        """Store the job of ``envelope`` (planned as ``plan``), queued or ``running``, within
        ``--max-queue`` and ``max_owned`` of ``caller``'s (``None``: no cap)."""
        return self.store.create(
            operation,
            _stored_request(envelope, plan),
            plan.n_work_rows,
            self.max_queued,
            owner=caller,
            max_owned=sys.maxsize if max_owned is None else max_owned,
            running=running,
        )

    def _forget(self, job_id: str, task: asyncio.Task[None]) -> None:
        """An adopted job's task has ended (its answer stored, or the server stopping)."""
        self._adopted.discard(task)
        self._running.pop(job_id, None)
        self.changed()

    def _queue_full(self) -> QueueFull:
        """The 429 answered when ``--max-queue`` jobs are queued or running."""
        return QueueFull(
            f"{self.max_queued} jobs are queued or running (--max-queue); retry later", 10
        )

    def _caller_full(self, max_per_caller: int) -> QueueFull:
        """The 429 answered when the caller has ``max_per_caller`` jobs queued or running."""
        return QueueFull(
            f"you have {max_per_caller} jobs queued or running, the most one caller may have "
            "(--max-jobs-per-caller); retry when one has finished",
            10,
        )

    async def cancel(self, job_id: str, caller: str | None = None) -> str | None:
        """Cancel a job; its status before, or ``None`` if unknown (or not ``caller``'s: see
        :meth:`JobStore.get`; ``None``: anyone's)."""
        before = await asyncio.to_thread(self.store.cancel, job_id, caller)
        if before is None:
            return None
        task = self._running.get(job_id)
        if task is not None:
            task.cancel()
        self.changed()
        return before

    def watch(self) -> asyncio.Event:
        """An event set whenever any job changes (for server-sent events); call :meth:`unwatch`."""
        event = asyncio.Event()
        self._watchers.add(event)
        return event

    def unwatch(self, event: asyncio.Event) -> None:
        """Stop notifying ``event``."""
        self._watchers.discard(event)

    def changed(self) -> None:
        """Wake every watcher."""
        for event in self._watchers:
            event.set()

    async def _worker(self) -> None:
        """Claim and run queued jobs, one at a time, until cancelled."""
        while True:
            self._wakeup.clear()
            job_id = await asyncio.to_thread(self.store.claim_next)
            if job_id is None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wakeup.wait(), IDLE_POLL_S)
                continue
            self.changed()
            task = asyncio.create_task(self._run(job_id), name=f"job-{job_id}")
            self._running[job_id] = task
            try:
                await asyncio.wait({task})
            except asyncio.CancelledError:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                self.store.requeue(job_id)
                raise
            finally:
                self._running.pop(job_id, None)
                self.changed()

    async def _run(self, job_id: str) -> None:
        """Plan and run one job; store its result, or its error as the 4xx detail."""

        async def answer() -> Any:
            operation, request = await asyncio.to_thread(self.store.request, job_id)
            plan = await asyncio.to_thread(
                plan_request, OPERATIONS[operation], request, self.workspaces
            )
            return await self._run_plan(job_id, plan, self._progress(job_id))

        await self._record(job_id, answer())

    def _progress(self, job_id: str) -> Callable[[int, int], None]:
        """The progress callback of a running job."""

        def progress(done: int, total: int) -> None:
            self.store.progress(job_id, done, total)
            self.changed()

        return progress

    async def _record(self, job_id: str, answer: Awaitable[Any]) -> None:
        """Store the result of the running job ``job_id`` once ``answer`` has it, or its error
        as the 4xx detail; cancelled (the server stopping), the job is queued again."""
        try:
            result = await answer
            await asyncio.to_thread(self.store.finish, job_id, result)
        except asyncio.CancelledError:  # (a cancelled job is no longer running: kept so)
            self.store.requeue(job_id)
            raise
        except ServiceError as exc:
            await asyncio.to_thread(
                self.store.fail, job_id, {"status": exc.status_code, "detail": exc.detail}
            )
        except Exception:
            log.exception("job failed", extra={"job_id": job_id})
            await asyncio.to_thread(
                self.store.fail, job_id, {"status": 500, "detail": "internal error; see the log"}
            )

    async def _run_plan(self, job_id: str, plan: Plan, progress: Callable[[int, int], None]) -> Any:
        """``plan``'s answer; after a transient 503, ``plan`` runs again (bounded waits)."""
        for delay in UNAVAILABLE_RETRY_DELAYS_S:
            try:
                return await self.dispatcher.run(plan, "jobs", progress)
            except Unavailable as exc:
                if not exc.transient:
                    raise
                log.warning(
                    "a job's batches could not run; it runs again",
                    extra={"job_id": job_id, "error": exc.detail, "retry_in_s": delay},
                )
                await asyncio.sleep(delay)
        return await self.dispatcher.run(plan, "jobs", progress)

    async def _purge_forever(self) -> None:
        """Delete finished jobs older than the result TTL and the uploaded workspaces unused
        for their TTL, now and periodically."""
        while True:
            purged = await asyncio.to_thread(self.store.purge, self.result_ttl_s)
            if purged:
                log.info("purged expired jobs", extra={"jobs": purged})
            expired = await asyncio.to_thread(self.workspaces.expire)
            if expired:
                log.info("removed expired workspaces", extra={"workspaces": expired})
            await asyncio.sleep(PURGE_INTERVAL_S)


def _stored_request(envelope: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """The request a job stores: ``envelope`` with an inline workspace as its id."""
    if "workspace" not in envelope:
        return envelope
    stored = {k: v for k, v in envelope.items() if k != "workspace"}
    stored["workspace_id"] = plan.background.workspace_digest
    return stored
