"""The batching scheduler with a stand-in runner: batching, lanes, splitting, OOM, cancel."""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pytest

from pyhf_gpu_server.service.errors import QueueFull, Unavailable
from pyhf_gpu_server.service.metrics import Metrics
from pyhf_gpu_server.service.scheduler import Scheduler, is_out_of_memory

pytestmark = pytest.mark.timeout(60)


@dataclass
class Recorder:
    """A runner that squares rows and records every call (and its thread)."""

    delay_s: float = 0.0
    oom_above: int | None = None
    calls: list[tuple[Any, list[Any]]] = field(default_factory=list)
    threads: set[str] = field(default_factory=set)

    def __call__(self, context: Any, rows: list[Any], stop: Any = None) -> list[Any]:
        self.calls.append((context, list(rows)))
        self.threads.add(threading.current_thread().name)
        if self.oom_above is not None and len(rows) > self.oom_above:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        time.sleep(self.delay_s)
        return [row * row for row in rows]


def make(runner: Recorder, **kwargs: Any) -> tuple[Scheduler, Metrics]:
    """A started scheduler with defaults overridable by ``kwargs``."""
    metrics = Metrics()
    options = {"max_batch_size": 64, "max_batch_delay_s": 0.02, "max_pending": 100, **kwargs}
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="device")
    scheduler = Scheduler(runner, executor, metrics, **options)
    scheduler.start()
    return scheduler, metrics


def batch_count(metrics: Metrics) -> float:
    """How many engine calls the histogram saw."""
    return metrics.registry.get_sample_value("pyhf_gpu_batch_size_count") or 0.0


def scenario(test: Callable[[], Awaitable[None]]) -> Callable[[], None]:
    """An ``async`` test body as a plain test: it runs in a fresh event loop."""

    @functools.wraps(test)
    def run() -> None:
        asyncio.run(test())

    return run


@scenario
async def test_concurrent_items_share_one_call_and_get_their_own_rows() -> None:
    runner = Recorder()
    scheduler, metrics = make(runner)
    items = [scheduler.submit("key", "ctx", [i, i + 100]) for i in range(10)]
    results = await asyncio.gather(*(item.future for item in items))
    assert [[o.value for o in r] for r in results] == [[i * i, (i + 100) ** 2] for i in range(10)]
    assert len(runner.calls) == 1 and len(runner.calls[0][1]) == 20
    assert all(o.batch_rows == 20 for r in results for o in r)
    assert batch_count(metrics) == 1
    assert runner.threads == {"device_0"}
    await scheduler.stop()


@scenario
async def test_a_lone_item_does_not_wait_out_a_long_delay_but_a_stream_still_batches() -> None:
    """The window closes once no rows arrived for ``batch_gap_s`` (5 ms), not at the 2 s delay;
    items arriving closer together than that keep it open and share one call."""
    runner = Recorder()
    scheduler, metrics = make(runner, max_batch_delay_s=2.0)
    start = time.monotonic()
    lone = scheduler.submit("lone", None, list(range(24)))
    await lone.future
    assert time.monotonic() - start < 0.5
    items = []
    for i in range(8):
        items.append(scheduler.submit("stream", None, [i]))
        await asyncio.sleep(scheduler.batch_gap_s / 4)
    await asyncio.gather(*(item.future for item in items))
    assert [len(rows) for _, rows in runner.calls] == [24, 8]
    assert batch_count(metrics) == 2
    await scheduler.stop()


@scenario
async def test_a_batch_waits_for_rows_of_its_group_still_being_prepared_within_a_bound() -> None:
    """Rows of requests still arriving (``arriving``) or being prepared (``preparing``) join
    the batch of their group, well after the delay and the gap, instead of running in a
    second call; a preparation that takes longer holds the batch for ``prepare_wait_s`` at
    most."""
    runner = Recorder()
    scheduler, metrics = make(runner, prepare_wait_s=2.0)

    async def prepared(row: int, seconds: float):
        with scheduler.preparing("background"):
            await asyncio.sleep(seconds)
            return scheduler.submit("key", None, [row], group="background")

    async def arrives(row: int, seconds: float):  # read and checked, then prepared
        with scheduler.arriving():
            await asyncio.sleep(seconds)
            task = asyncio.ensure_future(prepared(row, seconds))
            await asyncio.sleep(0)  # its preparation is announced before the arrival ends
        return await task

    first = scheduler.submit("key", None, [0], group="background")
    late = await asyncio.gather(prepared(1, 0.1), prepared(2, 0.2), arrives(5, 0.1))
    await asyncio.gather(first.future, *(item.future for item in late))
    assert [rows for _, rows in runner.calls] == [[0, 1, 2, 5]]

    scheduler.prepare_wait_s = 0.3
    start = time.monotonic()
    with scheduler.preparing("background"):
        lone = scheduler.submit("key", None, [3], group="background")
        await lone.future
        waited = time.monotonic() - start
    assert 0.3 <= waited < 1.5
    ungrouped = scheduler.submit("key", None, [4])
    with scheduler.preparing("background"):
        start = time.monotonic()
        await ungrouped.future
        assert time.monotonic() - start < 0.25
    assert batch_count(metrics) == 3
    await scheduler.stop()


@scenario
async def test_different_keys_do_not_mix_and_large_items_are_chunked() -> None:
    runner = Recorder()
    scheduler, _ = make(runner, max_batch_size=4)
    progress: list[tuple[int, int]] = []
    big = scheduler.submit(
        "a", "A", list(range(10)), on_progress=lambda d, t: progress.append((d, t))
    )
    other = scheduler.submit("b", "B", [7])
    assert [o.value for o in await big.future] == [i * i for i in range(10)]
    assert [o.value for o in await other.future] == [49]
    assert sorted(len(rows) for _, rows in runner.calls) == [1, 2, 4, 4]
    assert all(ctx == "A" for ctx, rows in runner.calls if len(rows) != 1)
    assert progress == [(4, 10), (8, 10), (10, 10)]
    await scheduler.stop()


@scenario
async def test_batching_off_runs_one_row_per_call() -> None:
    runner = Recorder()
    scheduler, metrics = make(runner, max_batch_size=1)
    items = [scheduler.submit("k", None, [i]) for i in range(5)]
    await asyncio.gather(*(i.future for i in items))
    assert batch_count(metrics) == 5
    await scheduler.stop()


@scenario
async def test_interactive_work_overtakes_a_queued_job() -> None:
    runner = Recorder(delay_s=0.01)
    scheduler, _ = make(runner, max_batch_size=2, max_batch_delay_s=0.0)
    job = scheduler.submit("job", "J", list(range(20)), lane="jobs")
    await asyncio.sleep(0.015)  # the job's first chunk is running
    request = scheduler.submit("req", "R", [3])
    await request.future
    assert not job.future.done()
    order = [ctx for ctx, _ in runner.calls]
    assert order.index("R") <= 2, order
    await job.future
    await scheduler.stop()


@scenario
async def test_out_of_memory_splits_then_503_for_a_single_row() -> None:
    runner = Recorder(oom_above=2)
    scheduler, metrics = make(runner)
    item = scheduler.submit("k", None, list(range(8)))
    assert [o.value for o in await item.future] == [i * i for i in range(8)]
    assert metrics.registry.get_sample_value("pyhf_gpu_oom_splits_total") == 3
    runner.oom_above = 0
    failing = scheduler.submit("k", None, [1])
    with pytest.raises(Unavailable):
        await failing.future
    await scheduler.stop()


@scenario
async def test_runner_errors_reach_every_caller_of_the_batch() -> None:
    def broken(context: Any, rows: list[Any], stop: Any = None) -> list[Any]:
        raise ValueError("bad model")

    metrics = Metrics()
    scheduler = Scheduler(
        broken,
        ThreadPoolExecutor(1),
        metrics,
        max_batch_size=8,
        max_batch_delay_s=0.01,
        max_pending=10,
    )
    scheduler.start()
    items = [scheduler.submit("k", None, [i]) for i in range(3)]
    for item in items:
        with pytest.raises(ValueError, match="bad model"):
            await item.future
    await scheduler.stop()


@scenario
async def test_full_queue_answers_429_and_cancel_drops_rows() -> None:
    runner = Recorder(delay_s=0.05)
    scheduler, _ = make(runner, max_pending=2, max_batch_size=1, max_batch_delay_s=0.0)
    first = scheduler.submit("k", None, [1])
    await asyncio.sleep(0.01)  # running now
    second = scheduler.submit("k", None, [2])
    third = scheduler.submit("k", None, [3])
    assert scheduler.saturated
    with pytest.raises(QueueFull) as caught:
        scheduler.submit("k", None, [4])
    assert caught.value.status_code == 429 and "Retry-After" in caught.value.headers
    scheduler.cancel(second)
    await first.future
    await third.future
    assert [rows for _, rows in runner.calls] == [[1], [3]]
    await scheduler.stop()


@scenario
async def test_stop_fails_waiting_callers_with_503() -> None:
    runner = Recorder(delay_s=0.05)
    scheduler, _ = make(runner, max_batch_size=1, max_batch_delay_s=0.0)
    scheduler.submit("k", None, [1])
    waiting = scheduler.submit("k", None, [2])
    await asyncio.sleep(0.01)
    await scheduler.stop()
    with pytest.raises(Unavailable):
        await waiting.future


def test_out_of_memory_detection() -> None:
    assert is_out_of_memory(RuntimeError("CUDA out of memory."))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    oom = getattr(__import__("torch"), "OutOfMemoryError", None)
    if oom is not None:
        assert is_out_of_memory(oom("x"))


class PerRowCost(Recorder):
    """A runner whose calls take ``seconds_per_row`` per row (a toy-based row, say)."""

    def __init__(self, seconds_per_row: float) -> None:
        super().__init__()
        self.seconds_per_row = seconds_per_row

    def __call__(self, context: Any, rows: list[Any], stop: Any = None) -> list[Any]:
        self.delay_s = self.seconds_per_row * len(rows)
        return super().__call__(context, rows, stop)


@scenario
async def test_job_chunks_are_sized_by_measured_time_and_interactive_work_waits_one_chunk() -> None:
    """Jobs run chunks of about ``job_chunk_s``: the first one row (nothing measured yet), the
    next from the measured 20 ms per row (10 rows of 0.2 s); an interactive
    request arriving meanwhile waits for one chunk only, not for the job's 40 rows (0.8 s)."""
    runner = PerRowCost(0.02)
    scheduler, _ = make(runner, max_batch_size=64, job_chunk_s=0.2)
    job = scheduler.submit("job", "J", list(range(40)), lane="jobs", row_cost=100)
    await asyncio.sleep(0.05)  # the first chunk is running
    start = time.monotonic()
    small = scheduler.submit("small", "S", [3])
    assert [o.value for o in await small.future] == [9]
    waited = time.monotonic() - start
    assert [o.value for o in await job.future] == [i * i for i in range(40)]
    sizes = [len(rows) for ctx, rows in runner.calls if ctx == "J"]
    assert sizes[0] == 1  # nothing measured yet
    assert max(sizes) <= 12 and len(sizes) >= 4, sizes  # ~10 rows of 20 ms each
    assert sum(sizes) == 40
    assert waited < 0.2 + 0.15, waited  # one chunk at most (plus scheduling)
    await scheduler.stop()


@scenario
async def test_interactive_chunks_are_not_limited_by_time() -> None:
    runner = PerRowCost(0.001)
    scheduler, _ = make(runner, max_batch_size=64, job_chunk_s=0.001)
    item = scheduler.submit("key", "I", list(range(50)), row_cost=1000)
    await item.future
    assert [len(rows) for _, rows in runner.calls] == [50]
    await scheduler.stop()


@scenario
async def test_a_steady_stream_of_requests_does_not_starve_jobs() -> None:
    """Interactive items arrive faster than the device serves them; the job still gets a chunk
    every few chunk lengths and finishes while the stream goes on."""
    runner = PerRowCost(0.01)
    scheduler, _ = make(runner, max_batch_size=4, max_batch_delay_s=0.0, job_chunk_s=0.05)
    job = scheduler.submit("job", "J", list(range(6)), lane="jobs", row_cost=1)
    stream: list[Any] = []
    deadline = time.monotonic() + 5.0
    while not job.future.done() and time.monotonic() < deadline:
        stream.append(scheduler.submit(f"k{len(stream)}", "I", [1, 2]))  # 20 ms each
        await asyncio.sleep(0.01)  # twice what the device serves
    assert job.future.done(), "the job starved"
    assert [o.value for o in await job.future] == [i * i for i in range(6)]
    assert sum(1 for item in stream if not item.future.done()) > 0  # the stream went on
    await asyncio.gather(*(item.future for item in stream))
    await scheduler.stop()


@scenario
async def test_job_rows_longer_than_the_overdue_span_still_let_interactive_work_in() -> None:
    """A job whose every row takes longer than JOB_SHARE_ROUNDS chunk lengths (a row of many
    toys): interactive requests arriving while a job row runs are served right after it,
    not after the whole job (#37)."""
    runner = PerRowCost(0.3)  # > JOB_SHARE_ROUNDS x 0.05 s
    scheduler, _ = make(runner, max_batch_size=4, max_batch_delay_s=0.0, job_chunk_s=0.05)
    # a row costs 100 fits: one row a chunk, from the prior and from the measured time
    job = scheduler.submit("job", "J", list(range(6)), lane="jobs", row_cost=100)
    waits = []
    for _ in range(3):
        await asyncio.sleep(0.1)  # a job row is running
        start = time.monotonic()
        small = scheduler.submit("small", "S", [3])
        assert [o.value for o in await small.future] == [9]
        waits.append(time.monotonic() - start)
    assert not job.future.done()  # served between the job's rows, not after them
    # the rest of one job row and its own (0.3 s: the runner's rows all cost that); before
    # the fix the first waited for all six job rows (2.0 s)
    assert max(waits) < 0.3 + 0.3 + 0.15, waits
    assert [o.value for o in await job.future] == [i * i for i in range(6)]
    await scheduler.stop()
