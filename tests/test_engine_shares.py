"""Engine shares (CPU): a batch's elements fitted partly by a forked local worker, on its own
model of its share's elements. Every answer equals the device thread's own (any two stacks
holding an element agree to ~1e-12), rows in their order; a worker that dies, stalls, fails
or let its model go costs time, not results; nobody waiting stops the worker's fits too, and
the next batch is answered as before. Real forked workers; real servers (HTTP) with and
without a worker answer every operation alike (and a published patchset:
``test_local_workers.py``)."""

from __future__ import annotations

import math
import os
import pickle
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import WORKSPACES_DIR, load_json
from service_support import running_server

from pyhf_gpu_server.engine.translate import WorkspaceTranslator
from pyhf_gpu_server.inference.errors import FitStopped
from pyhf_gpu_server.service import engine_shares
from pyhf_gpu_server.service.admission import FitMemory, FitPlan
from pyhf_gpu_server.service.dispatch import (
    BatchContext,
    ComputedRow,
    EngineCall,
    ModelRecipe,
    run_rows,
)
from pyhf_gpu_server.service.engine_shares import EngineShares
from pyhf_gpu_server.service.local_workers import LocalWorkers
from pyhf_gpu_server.service.models_cache import CachedModel
from pyhf_gpu_server.service.requests import Row
from pyhf_gpu_server.service.schemas import ClsOptions

STAU = WORKSPACES_DIR / "atlas-susy-2018-04-stau"
SAME = 1e-10  # two stacks holding an element: the same answer (their sums differ at ~1e-12)


def stau_batch(count: int, options: ClsOptions | None = None) -> tuple[BatchContext, list[Row]]:
    """A batch of ``count`` heterogeneous stau signals (each with its own systematics): its
    context, warm in process, and one row per element at mu = 1 plus one at mu = 2."""
    translator = WorkspaceTranslator(load_json(STAU / "BkgOnly.json"))
    patches = load_json(STAU / "patchset.heterogeneous.json")["patches"][:count]
    layouts = tuple(translator.element(p["patch"], p["metadata"]["name"]) for p in patches)
    digests = tuple(p["metadata"]["name"] for p in patches)
    recipe = ModelRecipe(("stau", digests, "float64"), layouts, "float64")
    options = options or ClsOptions(test_poi=1.0)
    call = EngineCall("cls", options, digests, 8192, FitPlan("auto", 0), 4.0)
    cached = CachedModel(recipe.build("cpu"), recipe.model_id, False, 0.0)
    rows = [Row(d, 1.0) for d in digests] + [Row(digests[-1], 2.0)]
    return BatchContext(call, recipe, cached, FitMemory()), rows


@pytest.fixture(scope="module")
def batch() -> tuple[BatchContext, list[Row], list[ComputedRow]]:
    context, rows = stau_batch(6)
    return context, rows, run_rows(context, rows)


@pytest.fixture
def workers() -> Iterator[LocalWorkers]:
    forked = LocalWorkers.fork(1, engine=True)
    yield forked
    forked.close()


def assert_same(shared: list[ComputedRow], alone: list[ComputedRow]) -> None:
    assert len(shared) == len(alone)
    for s, a in zip(shared, alone, strict=True):
        for key in ("CLs_obs", "CLs_exp"):
            ours, theirs = getattr(s.result.answer, key), getattr(a.result.answer, key)
            assert ours == pytest.approx(theirs, abs=SAME)
        assert s.result.status.converged == a.result.status.converged
        assert s.model_id == a.model_id


def test_a_shared_batch_answers_as_the_device_thread_alone(batch, workers) -> None:
    context, rows, alone = batch
    shared = EngineShares(workers)(context, rows)
    assert_same(shared, alone)
    fitted_by = [row.worker for row in shared]
    worker = workers._workers[0].name
    assert set(fitted_by) == {None, worker}  # both fitted some, elements interleaved
    assert fitted_by[0] is None and fitted_by[1] == worker
    assert fitted_by[-1] == fitted_by[-2]  # an element's rows stay together
    assert all(row.worker_s > 0 for row in shared if row.worker is not None)
    assert workers.shared_batches == 1 and workers.count == 1


def test_a_worker_that_let_its_model_go_is_sent_it_again(batch, workers) -> None:
    context, rows, alone = batch
    shares = EngineShares(workers)
    assert_same(shares(context, rows), alone)  # sent with its model's layouts
    assert_same(shares(context, rows), alone)  # the worker's warm model
    # a batch the server believes the worker holds, which it never got: it answers that it
    # does not hold it, and the share goes again with the layouts
    other, other_rows = stau_batch(4)
    expected = run_rows(other, other_rows)
    its_share = other.recipe.share([r.element for r in other_rows[1:4:2]])  # elements 1, 3
    workers._workers[0].models.add(its_share.key)
    assert_same(shares(other, other_rows), expected)
    assert workers.shared_batches == 3 and workers.count == 1


def test_a_lone_element_s_rows_are_shared_but_not_a_lone_row(workers) -> None:
    lone, rows = stau_batch(1)  # one element, at mu = 1 and 2
    assert len(rows) == 2
    answered = EngineShares(workers)(lone, rows)
    assert_same(answered, run_rows(lone, rows))
    assert [r.worker is None for r in answered] == [True, False]
    assert all(r.worker is None for r in EngineShares(workers)(lone, rows[:1]))
    assert workers.shared_batches == 1


def test_toy_slices_are_shared_and_answer_as_in_process(workers) -> None:
    """A toy row's draws follow its hypothesis and slice, not the batch: its slices fitted
    by a worker give the statistics the device thread gives them."""
    toys = ClsOptions(test_poi=1.0, calctype="toybased", ntoys=60)
    context, _ = stau_batch(1, toys)
    element = context.call.digests[0]
    rows = [Row(element, 1.0, (0, 50)), Row(element, 1.0, (50, 60))]
    answered = EngineShares(workers)(context, rows)
    alone = run_rows(context, rows)
    assert [r.worker is None for r in answered] == [True, False]
    for s, a in zip(answered, alone, strict=True):  # the same toys; fits equal to ~1e-12
        for hypothesis in ("signal", "background"):
            ours, theirs = (getattr(r.result.part.toys, hypothesis)[0] for r in (s, a))
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-7)
    assert workers.shared_batches == 1


def test_a_dead_worker_costs_time_not_results(batch, workers) -> None:
    context, rows, alone = batch
    workers._workers[0].process.kill()
    workers._workers[0].process.join()
    assert_same(EngineShares(workers)(context, rows), alone)
    assert workers.count == 0
    assert all(r.worker is None for r in EngineShares(workers)(context, rows))


def test_a_stalled_worker_is_given_up(batch, workers, monkeypatch) -> None:
    context, rows, alone = batch
    monkeypatch.setattr(engine_shares, "WAIT_S", 0.5)
    monkeypatch.setattr(engine_shares, "WAIT_FACTOR", 0.0)
    stalled = workers._workers[0].process
    os.kill(stalled.pid, signal.SIGSTOP)  # alive, never answering
    assert_same(EngineShares(workers)(context, rows), alone)
    assert workers.count == 0 and not stalled.is_alive()


def test_nobody_waiting_stops_the_worker_and_the_next_batch_is_answered(batch, workers) -> None:
    context, rows, alone = batch
    shares = EngineShares(workers)
    with pytest.raises(FitStopped):
        shares(context, rows, lambda: True)
    assert workers.count == 1  # it stopped and answered: still in use
    assert_same(shares(context, rows), alone)
    assert workers.shared_batches == 1


def test_a_share_the_worker_failed_on_is_fitted_here(batch, monkeypatch) -> None:
    context, rows, alone = batch
    # patched before the fork: the worker answers every share with a failure
    failure = pickle.dumps(("failed", "RuntimeError: boom"))
    monkeypatch.setattr(engine_shares, "answer", lambda *_: failure)
    workers = LocalWorkers.fork(1, engine=True)
    try:
        answered = EngineShares(workers)(context, rows)
        assert_same(answered, alone)
        assert all(r.worker is None for r in answered)
        assert workers.count == 1  # it answered: still in use
    finally:
        workers.close()


OPERATIONS = {  # every operation, on two heterogeneous stau points: two elements a batch
    "cls": {"test_poi": [0.5, 1.0, 2.0]},
    "fit": {},
    "upper-limit": {},
    "significance": {},
    "ranking": {},
    "scan": {"x": {}},
    "yields": {},
}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_operation_answers_alike_with_and_without_a_worker(tmp_path: Path) -> None:
    patchset = load_json(STAU / "patchset.heterogeneous.json")
    body = {
        "workspace": load_json(STAU / "BkgOnly.json"),
        "patchset": patchset,
        "patch_names": [p["metadata"]["name"] for p in patchset["patches"][:2]],
    }
    answers: dict[str, dict[str, Any]] = {}
    for count in ("1", "0"):
        data_dir = tmp_path / count
        data_dir.mkdir()
        args = ["--local-workers", count, "--max-batch-size", "512"]
        with running_server(data_dir, args) as server, server.client(timeout_s=300) as client:
            for operation, options in OPERATIONS.items():
                response = client.post(f"/{operation}", json={**body, **options})
                assert response.status_code == 200, (operation, response.text)
                answers[count, operation] = response.json()
            shared = client.get("/info").json()["local_workers"]["shared_batches"]
            assert shared == (len(OPERATIONS) if count == "1" else 0)
    for operation in OPERATIONS:
        with_worker, without = answers["1", operation], answers["0", operation]
        assert_alike(with_worker, without, operation)
        fitted_by = {_meta(answer).get("worker") for answer in with_worker.values()}
        assert len(fitted_by) == 2 and None in fitted_by, operation


def assert_alike(ours: Any, theirs: Any, path: str) -> None:
    """The same JSON, numbers within :data:`SAME` (relative above 1), ``meta`` aside."""
    if isinstance(ours, dict):
        assert set(ours) == set(theirs), path
        for key in ours.keys() - {"meta"}:
            assert_alike(ours[key], theirs[key], f"{path}/{key}")
    elif isinstance(ours, list):
        assert len(ours) == len(theirs), path
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert_alike(a, b, f"{path}/{i}")
    elif isinstance(ours, float) and math.isfinite(ours):
        assert ours == pytest.approx(theirs, rel=SAME, abs=SAME), path
    else:
        assert ours == theirs, path


def _meta(answer: Any) -> dict[str, Any]:
    """A patch's ``meta`` (of its first row, for a list over POI values)."""
    return (answer[0] if isinstance(answer, list) else answer)["meta"]
