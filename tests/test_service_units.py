"""Warm model cache (LRU by count and bytes, shared builds), background compile, job store."""

from __future__ import annotations

import asyncio
import math
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from service_support import SMALL, load

from pyhf_gpu_server.service.compiling import BackgroundCompiler
from pyhf_gpu_server.service.jobstore import JobStore
from pyhf_gpu_server.service.metrics import Metrics
from pyhf_gpu_server.service.models_cache import ModelCache, model_bytes

pytestmark = pytest.mark.timeout(60)


class FakeModel:
    """Holds one tensor of ``n`` float64 values; records compile switch-over."""

    def __init__(self, n: int) -> None:
        self.values = torch.zeros(n, dtype=torch.float64)
        self.compiled_with: Any = None
        self.switch_thread = ""

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"values": self.values, "view": self.values[:1]}

    def enable_compile(self, kernels: Any) -> None:
        self.compiled_with = kernels
        self.switch_thread = threading.current_thread().name


def test_model_bytes_counts_shared_storage_once() -> None:
    assert model_bytes(FakeModel(100)) == 800


def test_cache_is_lru_by_count_and_bytes_and_shares_builds() -> None:
    async def scenario() -> None:
        metrics = Metrics()
        builds: list[str] = []
        executor = ThreadPoolExecutor(1)
        cache = ModelCache(executor, executor, metrics, max_items=3, max_bytes=8 * 250)

        def builder(name: str, n: int = 10):
            def build() -> FakeModel:
                builds.append(name)
                time.sleep(0.05)
                return FakeModel(n)

            return build

        first = await asyncio.gather(*(cache.get("a", builder("a")) for _ in range(5)))
        assert builds == ["a"] and not first[0].hit and all(r.hit for r in first[1:])
        assert len({id(r.model) for r in first}) == 1
        for key in ("b", "c", "d"):
            await cache.get(key, builder(key))
        assert [m["model_id"] for m in cache.describe()] == [
            r.model_id for r in [await cache.get(k, builder(k)) for k in ("b", "c", "d")]
        ][::-1]
        assert (await cache.get("a", builder("a"))).hit is False  # evicted by count
        await cache.get("big", builder("big", 240))
        assert len(cache.describe()) <= 2 and cache.total_bytes <= 8 * 250
        sample = metrics.registry.get_sample_value
        assert sample("pyhf_gpu_model_cache_evictions_total") >= 2
        assert sample("pyhf_gpu_model_cache_size") == len(cache.describe())

        def broken() -> FakeModel:
            raise ValueError("cannot build")

        with pytest.raises(ValueError):
            await cache.get("bad", broken)
        assert "bad" not in [m["model_id"] for m in cache.describe()]

    asyncio.run(scenario())


def test_background_compile_switches_on_the_device_thread() -> None:
    class Kernels:
        def __init__(self) -> None:
            self.warm_thread = ""

        def warm(self, model: Any) -> None:
            self.warm_thread = threading.current_thread().name
            self.warm_in_inference_mode = torch.is_inference_mode_enabled()

    device = ThreadPoolExecutor(1, thread_name_prefix="device")
    kernels = Kernels()
    compiler = BackgroundCompiler(kernels, device)
    model = FakeModel(1)
    compiler.submit(model).result(timeout=10)
    assert model.compiled_with is kernels
    assert kernels.warm_thread.startswith("pyhf-gpu-compile")
    assert kernels.warm_in_inference_mode  # traced in the mode engine calls run in
    assert model.switch_thread.startswith("device")

    class Failing(Kernels):
        def warm(self, model: Any) -> None:
            raise RuntimeError("no compiler")

    eager = FakeModel(1)
    BackgroundCompiler(Failing(), device).submit(eager).result(timeout=10)
    assert eager.compiled_with is None
    compiler.shutdown()


def test_engine_calls_run_in_inference_mode_with_the_numbers_of_plain_mode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An engine call (here fits with uncertainties: ``torch.func`` Hessians) runs in
    ``torch.inference_mode`` and answers what the same operation answers outside it."""
    from pyhf_gpu_server.engine.translate import WorkspaceTranslator
    from pyhf_gpu_server.service import operations
    from pyhf_gpu_server.service.admission import FitMemory, FitPlan
    from pyhf_gpu_server.service.dispatch import EngineCall, ModelRecipe
    from pyhf_gpu_server.service.requests import Row
    from pyhf_gpu_server.service.schemas import FitOptions

    translator = WorkspaceTranslator(load(SMALL, "BkgOnly.json"))
    patches = load(SMALL, "patchset.json")["patches"][:2]
    layouts = tuple(translator.element(p["patch"], p["metadata"]["name"]) for p in patches)
    recipe = ModelRecipe(("background", ("d0", "d1"), "float64"), layouts, "float64")
    call = EngineCall("fit", FitOptions(), ("d0", "d1"), 64, FitPlan("auto", 0), 2.0)
    rows = [Row("d0", None), Row("d1", None)]

    fit = operations.operation_named("fit")
    modes = []

    class Spy:
        def __getattr__(self, name: str) -> Any:
            return getattr(fit, name)

        def run(self, *args: Any) -> Any:
            modes.append(torch.is_inference_mode_enabled())
            return fit.run(*args)

    monkeypatch.setitem(operations.OPERATIONS, "fit", Spy())
    model = recipe.build("cpu")
    answers = call.run(model, rows, FitMemory())
    assert modes == [True] and not torch.is_inference_mode_enabled()
    plain = fit.run(model, call.engine_rows(model, rows, None), call.options)
    assert answers == plain
    errors = [u for row in answers for us in row.answer.uncertainties.values() for u in us]
    assert all(math.isfinite(u) for u in errors) and max(errors) > 0  # the Hessian was taken


def test_each_result_model_is_the_answer_its_operation_makes_plus_meta() -> None:
    """A result's shape is declared once: its ``*Answer`` (what ``Operation.run`` makes per
    row), which the result model extends by ``meta`` alone."""
    from pydantic import BaseModel

    from pyhf_gpu_server.service import operations, schemas
    from pyhf_gpu_server.service.operations.scan import Scan2DResult

    results = {op.result_model for op in operations.OPERATIONS.values()} | {Scan2DResult}
    for result in results:
        (answer,) = [b for b in result.__bases__ if b.__name__.endswith("Answer")]
        assert issubclass(answer, BaseModel) and result.__bases__ == (answer,)
        assert list(result.model_fields) == [*answer.model_fields, "meta"]
        assert result.model_fields["meta"].annotation is schemas.ResultMeta


def test_docstring_examples_of_the_operations_and_the_dispatcher() -> None:
    import doctest

    from pyhf_gpu_server.service import dispatch
    from pyhf_gpu_server.service.operations import base, fit

    for module in (fit, dispatch, base):
        failures, attempted = doctest.testmod(module)
        assert attempted > 0 and failures == 0, module.__name__


def test_job_store_lifecycle_in_sqlite_wal(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "jobs.sqlite3")
    first = store.create("cls", {"workspace_id": "x"}, total=3)
    second = store.create("fit", {"workspace_id": "y"}, total=1)
    assert store.claim_next() == first
    store.progress(first, 2, 3)
    assert store.get(first)["progress"] == {"done": 2, "total": 3}
    assert store.requeue_interrupted() == 1  # as after a crash
    assert store.claim_next() == first
    assert store.finish(first, {"CLs_obs": 0.5})
    assert store.get(first)["result"] == {"CLs_obs": 0.5}
    assert store.cancel(second) == "queued" and store.get(second)["status"] == "cancelled"
    assert store.claim_next() is None
    assert [j["id"] for j in store.list(10)] == [second, first]
    assert store.counts()["succeeded"] == 1
    assert store.purge(older_than_s=-1) == 2
    store.close()
    with sqlite3.connect(tmp_path / "jobs.sqlite3") as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
