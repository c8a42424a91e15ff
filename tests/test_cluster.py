"""Cluster mode (``--dask-scheduler``): a Dask scheduler, two ``pyhf-gpu-worker`` processes
(CPU, one thread, a ``GPU`` resource each) and a server subprocess on 127.0.0.1, against an
in-process server: every result equal within 1e-10 (the two stack the elements in other
batches, and the in-process one shares a batch's elements with its local worker: fits of
one element in two stacks agree to ~1e-12, their sums taken in another order); batches of one model stay on the worker
holding it; a job survives a worker killed mid-job, and its scheduler killed mid-job;
``/readyz`` fails with no worker.

Fast unit tests first (placement, the stacked shape without a model, no dask in process).
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import WORKSPACES_DIR, load_json
from service_support import (
    CLUSTER_ENV as ENV,
)
from service_support import (
    SMALL,
    Cluster,
    ServerProcess,
    load,
    running_server,
    wait_for_job,
)

from pyhf_gpu_server.cluster.placement import Placement, rendezvous

pytestmark = pytest.mark.timeout(300)

EXACT = 1e-10  # the same element fitted in two stacks (module docstring)


# ------------------------------------------------------------------------------ units
def test_rendezvous_is_stable_and_moves_only_a_lost_worker_s_models() -> None:
    workers = [f"tcp://10.0.0.{i}:9000" for i in range(5)]
    models = [f"model-{i}" for i in range(200)]
    owner = {m: rendezvous(m, workers)[0] for m in models}
    assert owner == {m: rendezvous(m, workers[::-1])[0] for m in models}
    assert len(set(owner.values())) == 5  # spread over every worker
    lost = workers[2]
    for m in models:
        if owner[m] != lost:
            assert rendezvous(m, [w for w in workers if w != lost])[0] == owner[m]


def test_placement_prefers_the_idle_holder_then_spills_to_idle_workers() -> None:
    placement = Placement()
    workers = ["a", "b"]
    owner, other = rendezvous("m", workers)
    assert placement.choose("k", "m", workers) == (owner, True)  # nobody holds it: recipe
    placement.holding(owner, "k")
    assert placement.choose("k", "m", workers) == (other, True)  # owner busy: spill
    placement.release(owner)
    placement.release(other)
    assert placement.choose("k", "m", workers) == (owner, False)  # warm: key only
    placement.release(owner)
    placement.lost(owner, "k")
    assert placement.choose("k", "m", workers) == (owner, True)
    placement.release(owner)
    placement.holding(other, "k")
    assert owner in placement.holds and placement.choose("k", "m", [other]) == (other, False)
    assert owner not in placement.holds  # gone workers are forgotten
    assert placement.choose("k", "m", []) == (None, True)


def test_stack_shape_equals_the_built_model_s() -> None:
    from pyhf_gpu_server.engine import HistFactoryModel
    from pyhf_gpu_server.engine.stacking import partition
    from pyhf_gpu_server.engine.translate import WorkspaceTranslator
    from pyhf_gpu_server.service.dispatch import model_shape, stack_shape

    files = sorted(p for p in WORKSPACES_DIR.glob("*/patchset*.json*") if "hepdata" not in p.name)
    assert files
    for file in files:
        translator = WorkspaceTranslator(load_json(file.parent / "BkgOnly.json"))
        patches = load_json(file)["patches"]
        layouts = [translator.element(p["patch"], p["metadata"]["name"]) for p in patches]
        for group in partition(layouts):
            members = [layouts[i] for i in group]
            estimated, built = stack_shape(members), model_shape(HistFactoryModel(members))
            # the Jacobian assembly's numbers: a bound without the stack, exact with it
            assert estimated.n_assembly >= built.n_assembly > 0, file
            assert replace(estimated, n_assembly=0) == replace(built, n_assembly=0), file


def test_in_process_mode_never_imports_dask(tmp_path: Path) -> None:
    code = f"""
import asyncio, sys
from pyhf_gpu_server.service.metrics import Metrics
from pyhf_gpu_server.service.settings import Settings
from pyhf_gpu_server.service.state import ServiceState
async def main():
    state = await ServiceState.open(Settings(device="cpu", data_dir={str(tmp_path)!r}), Metrics())
    assert state.cluster is None and state.scheduler.max_in_flight == 1
    await state.close()
asyncio.run(main())
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("dask", "distributed"))
assert not loaded, loaded
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


class FakeFuture:
    """A finished Dask future (the fake client ran the task at submit)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def add_done_callback(self, callback: Any) -> None:
        callback(self)

    def result(self) -> Any:
        return self.value

    def cancel(self) -> None:
        pass

    def release(self) -> None:
        pass


class FakeClient:
    """Runs each submitted batch at once on the worker it names, each worker with its own
    plugin; records what was sent."""

    def __init__(self, addresses: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
        from types import SimpleNamespace

        import pyhf_gpu_server.cluster.tasks as tasks

        self.workers = {a: SimpleNamespace(address=a, plugins={}) for a in addresses}
        self.sent: list[tuple[str, bool]] = []
        self.current = None
        self.scheduler = SimpleNamespace(identity=self._identity)  # Dask's scheduler RPC
        monkeypatch.setattr(tasks, "get_worker", lambda: self.current)

    status = "running"  # Dask's client: connecting, running, closing, closed

    def close(self) -> None:
        self.status = "closed"

    def sync(self, function: Any, **kwargs: Any) -> Any:
        return function(**kwargs)

    def _identity(self, n_workers: int = -1) -> dict[str, Any]:
        if self.scheduler_down:
            raise TimeoutError("the scheduler did not answer")
        return {"workers": {a: {"name": a, "resources": {"GPU": 1}} for a in self.workers}}

    scheduler_down = False

    def submit(
        self, function: Any, batch: Any, workers: list[str] | None = None, **options: Any
    ) -> FakeFuture:
        if options.get("allow_other_workers") and workers is None:  # as Dask's submit
            raise ValueError("Only use allow_other_workers= if using workers=")
        assert options["resources"] == {"GPU": 1}
        where = workers[0] if workers else next(iter(self.workers))  # Dask: any GPU worker
        self.current = self.workers[where]
        self.sent.append((where, batch.recipe is not None))
        return FakeFuture(function(pickle.loads(pickle.dumps(batch))))


def test_models_travel_once_per_worker_and_again_when_evicted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pyhf_gpu_server.cluster.plugin import PLUGIN_NAME
    from pyhf_gpu_server.cluster.runner import ClusterRunner
    from pyhf_gpu_server.service.metrics import Metrics

    recipe, context, rows, expected = _small_batch()

    client = FakeClient(["tcp://a:1", "tcp://b:1"], monkeypatch)
    runner = ClusterRunner(client, "tcp://scheduler:8786", Metrics())
    runner.workers(max_age_s=0)
    first = runner(context, rows, lambda: False)
    assert [r.result for r in first] == expected  # the same numbers as in process
    assert not first[0].hit and first[0].model_id == recipe.model_id
    owner = first[0].worker
    second = runner(context, rows, lambda: False)
    assert second[0].hit and second[0].worker == owner
    assert client.sent == [(owner, True), (owner, False)]  # the recipe went once
    client.workers[owner].plugins[PLUGIN_NAME].warm.clear()  # evicted on the worker
    third = runner(context, rows, lambda: False)
    assert [r.result for r in third] == expected and not third[0].hit
    assert client.sent[2:] == [(owner, False), (owner, True)]  # ModelMissing, then resent
    assert (runner.recipes_sent, runner.models_resent) == (2, 1)
    described = client.workers[owner].plugins[PLUGIN_NAME].describe()
    assert described["device"] == "cpu" and described["models"] == [recipe.model_id]
    assert (described["cache_hits"], described["cache_misses"]) == (1, 2)
    # the scheduler does not answer (a loaded machine): no worker known, the batch still runs
    client.scheduler_down = True
    assert runner.workers(max_age_s=0) == {}
    fourth = runner(context, rows, lambda: False)
    assert [r.result for r in fourth] == expected
    assert client.sent[-1] == (next(iter(client.workers)), True)  # placed by the scheduler


def test_live_workers_are_never_lost_to_the_client_s_periodic_refresh() -> None:
    """Dask's ``Client.scheduler_info`` returns a cache that the client's periodic refresh
    (which leaves the workers out) can overwrite before it returns: asked 300 times while
    the refresh runs every 5 ms, the runner must list both workers of a real cluster every
    time (``/info`` once lost a worker that had just fitted a batch)."""
    import dask
    from distributed import LocalCluster

    from pyhf_gpu_server.cluster.runner import ClusterRunner
    from pyhf_gpu_server.service.metrics import Metrics

    refresh = {"distributed.client.scheduler-info-interval": "5ms"}
    with (
        dask.config.set(refresh),
        LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=False,
            resources={"GPU": 1},
            dashboard_address=None,
        ) as local,
    ):
        runner = ClusterRunner.connect(local.scheduler_address, Metrics())
        try:
            counts = [len(runner.workers(max_age_s=0)) for _ in range(300)]
        finally:
            runner.close()
    assert counts == [2] * 300


def test_a_closed_client_answers_503_until_the_watcher_connects_a_new_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Dask closes its client for good once the scheduler has been gone longer than the
    client's timeout: batches answer 503 (not a 500 from ``ClosedClientError``), and once the
    scheduler answers again a new client runs them."""
    from pyhf_gpu_server.cluster.runner import ClusterRunner
    from pyhf_gpu_server.service.errors import Unavailable
    from pyhf_gpu_server.service.metrics import Metrics

    _, context, rows, expected = _small_batch()
    attempts: list[str] = []

    def reconnect() -> FakeClient:
        attempts.append("connect")
        if len(attempts) == 1:
            raise OSError("Timed out trying to connect to tcp://scheduler:8786")
        return FakeClient(["tcp://c:1"], monkeypatch)

    gone = FakeClient(["tcp://a:1"], monkeypatch)
    runner = ClusterRunner(gone, "tcp://scheduler:8786", Metrics(), reconnect)
    assert runner.reconnect_if_closed() is False and attempts == []  # running: left alone
    for status in ("connecting", "closed"):
        gone.status = status
        with pytest.raises(
            Unavailable, match=f"does not answer .the client is {status}"
        ) as refused:
            runner(context, rows, lambda: False)
        assert refused.value.transient
    assert runner.reconnect_if_closed() is False  # the scheduler is not back yet
    runner.workers(max_age_s=0)
    assert any("Timed out trying to connect" in p for p in runner.problems())
    assert runner.reconnect_if_closed() is True and runner.client is not gone
    runner.workers(max_age_s=0)
    assert runner.problems() == []
    answered = runner(context, rows, lambda: False)
    assert [r.result for r in answered] == expected and answered[0].worker == "tcp://c:1"


def _small_batch() -> tuple[Any, Any, list[Any], list[Any]]:
    """A two-element recipe of the small workspace, its batch context, three rows and their
    results in process."""
    from pyhf_gpu_server.engine.translate import WorkspaceTranslator
    from pyhf_gpu_server.execution import BatchContext, EngineCall, ModelRecipe
    from pyhf_gpu_server.service.admission import FitMemory, FitPlan
    from pyhf_gpu_server.service.operations import operation_named
    from pyhf_gpu_server.service.requests import Row
    from pyhf_gpu_server.service.schemas import ClsOptions

    spec = load(SMALL, "BkgOnly.json")
    patches = load(SMALL, "patchset.json")["patches"][:2]
    translator = WorkspaceTranslator(spec)
    layouts = tuple(translator.element(p["patch"], p["metadata"]["name"]) for p in patches)
    digests = ("d0", "d1")
    recipe = ModelRecipe(("background", digests, "float64"), layouts, "float64")
    options = ClsOptions(test_poi=1.0)
    call = EngineCall(
        "cls", options, digests, 64, FitPlan("auto", 0), 4.0, operations=operation_named
    )
    context = BatchContext(call, recipe, None, FitMemory())
    rows = [Row("d0", 1.0), Row("d1", 1.0), Row("d1", 2.0)]
    return recipe, context, rows, call.run(recipe.build("cpu"), rows, FitMemory())


# ------------------------------------------------------------------------------ processes
@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path_factory.mktemp("cluster"))
    cluster.start_scheduler()
    try:
        yield cluster
    finally:
        cluster.stop()


SERVER_ARGS = ["--max-batch-size", "64", "--max-batch-delay-ms", "20", "--job-chunk-s", "0.3"]


@pytest.fixture(scope="module")
def server(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    data_dir = tmp_path_factory.mktemp("api")
    args = [*SERVER_ARGS, "--dask-scheduler", cluster.address]
    with running_server(data_dir, args, ENV) as api:
        yield api


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    """The same server in process (no cluster)."""
    data_dir = tmp_path_factory.mktemp("local")
    with running_server(data_dir, SERVER_ARGS, ENV) as local, local.client() as client:
        yield client


@pytest.fixture(scope="module")
def workers(cluster: Cluster, client: httpx.Client) -> list[str]:
    names = ["w1", "w2"]
    for name in names:
        cluster.start_worker(name)
    cluster.wait_joined(client, names)
    return names


@pytest.fixture(scope="module")
def workspace_ids(client: httpx.Client, reference: httpx.Client) -> tuple[str, str]:
    spec = load(SMALL, "BkgOnly.json")
    ids = tuple(
        c.post("/workspaces", json=spec).json()["workspace_id"] for c in (client, reference)
    )
    assert ids[0] == ids[1]
    return ids


def assert_equal(ours: Any, theirs: Any, path: str = "") -> None:
    """Every number equal within :data:`EXACT` (``meta`` aside: how, not what)."""
    if isinstance(ours, dict):
        assert set(ours) == set(theirs), path
        for key in ours:
            if key != "meta":
                assert_equal(ours[key], theirs[key], f"{path}/{key}")
    elif isinstance(ours, list):
        assert len(ours) == len(theirs), path
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert_equal(a, b, f"{path}/{i}")
    elif isinstance(ours, float):
        assert abs(ours - theirs) <= EXACT, (path, ours, theirs)
    else:
        assert ours == theirs, path


def cluster_info(client: httpx.Client) -> dict[str, Any]:
    return client.get("/info").json()["cluster"]


# ------------------------------------------------------------------------------ end to end
def test_readyz_fails_while_no_worker_is_connected(client: httpx.Client) -> None:
    ready = client.get("/readyz")
    assert ready.status_code == 503
    assert any("no Dask worker" in p for p in ready.json()["problems"])
    assert cluster_info(client)["workers"] == []


def test_cls_equals_in_process(
    client: httpx.Client, reference: httpx.Client, workers: list[str]
) -> None:
    body = {"workspace": load(SMALL, "BkgOnly.json"), "test_poi": [0.0, 0.5, 1.0, 2.0]}
    body["patches"] = [load(SMALL, "patchset.json")["patches"][3]["patch"]]
    ours, theirs = (c.post("/cls", json=body) for c in (client, reference))
    assert ours.status_code == 200 and theirs.status_code == 200, ours.text
    assert_equal(ours.json(), theirs.json())
    meta = ours.json()[0]["meta"]
    assert meta["device"] == "cpu" and meta["worker"].startswith("tcp://127.0.0.1:")
    assert meta["timings"]["worker_ms"] <= meta["timings"]["compute_ms"]
    assert "worker" not in theirs.json()[0]["meta"]


def test_patchset_equals_in_process_and_stays_on_its_worker(
    client: httpx.Client,
    reference: httpx.Client,
    workers: list[str],
    workspace_ids: tuple[str, str],
) -> None:
    body = {"workspace_id": workspace_ids[0], "patchset": load(SMALL, "patchset.json")}
    theirs = reference.post("/cls", json=body).json()
    answers = [client.post("/cls", json=body) for _ in range(3)]
    assert all(a.status_code == 200 for a in answers), answers[0].text
    for answer in answers:
        assert_equal(answer.json(), theirs)
    metas = [row["meta"] for answer in answers for row in answer.json().values()]
    assert len({m["model_id"] for m in metas}) == 1 and len({m["worker"] for m in metas}) == 1
    assert [a.json()[next(iter(theirs))]["meta"]["cache"] for a in answers][1:] == ["hit", "hit"]
    model, holder = metas[0]["model_id"], metas[0]["worker"]
    found = {w["address"]: w for w in cluster_info(client)["workers"]}
    assert model in found[holder]["models"] and found[holder]["cache_hits"] >= 2
    assert all(model not in w["models"] for a, w in found.items() if a != holder)
    metrics = client.get("/metrics").text
    assert "pyhf_gpu_cluster_workers 2.0" in metrics
    assert f'pyhf_gpu_cluster_worker_cache_hits_total{{device="cpu",worker="{holder}"}}' in metrics


def test_job_finishes_with_every_result_when_a_worker_dies_mid_job(
    cluster: Cluster,
    client: httpx.Client,
    reference: httpx.Client,
    workers: list[str],
    workspace_ids: tuple[str, str],
) -> None:
    pois = [round(0.1 * i, 1) for i in range(1, 31)]  # 24 patches x 30 POIs: 720 rows
    body = {
        "operation": "cls",
        "workspace_id": workspace_ids[0],
        "patchset": load(SMALL, "patchset.json"),
        "test_poi": pois,
    }
    submitted = client.post("/jobs", json=body)
    assert submitted.status_code == 202, submitted.text
    job_id = submitted.json()["id"]
    victim = None
    deadline = time.monotonic() + 120
    while victim is None and time.monotonic() < deadline:
        view = client.get(f"/jobs/{job_id}").json()
        assert view["status"] in ("queued", "running"), "the job ended before a worker died"
        if view["progress"]["done"] >= 0.1 * view["progress"]["total"]:
            busy = [w for w in cluster_info(client)["workers"] if w["in_flight"]]
            if busy:
                victim = next(n for n in workers if n == busy[0]["name"])
        time.sleep(0.05)
    assert victim is not None
    cluster.kill(victim)
    view = wait_for_job(client, job_id, timeout_s=240)
    assert view["status"] == "succeeded", json.dumps(view)[:2000]
    assert view["progress"]["done"] == view["progress"]["total"] == 24 * len(pois)
    # the Dask scheduler drops the dead worker when it notices (the job may finish first)
    deadline = time.monotonic() + 30
    while len(cluster_info(client)["workers"]) != 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [w["name"] for w in cluster_info(client)["workers"]] == [
        n for n in workers if n != victim
    ]
    reference_body = {k: v for k, v in body.items() if k != "operation"}
    reference_body["workspace_id"] = workspace_ids[1]
    theirs = reference.post("/cls", json=reference_body)
    assert theirs.status_code == 200, theirs.text
    assert_equal(view["result"], theirs.json())


@pytest.mark.slow
def test_a_job_outlives_its_dask_scheduler_killed_mid_job(
    tmp_path: Path, reference: httpx.Client
) -> None:
    """The scheduler (and its worker) killed while a job's batch runs: requests meanwhile
    answer 503 at once, naming the scheduler; once a scheduler and a worker are back at the
    same address, the job runs again and finishes with every result, equal to in process."""
    cluster = Cluster(tmp_path)
    cluster.start_scheduler()
    try:
        args = [*SERVER_ARGS, "--dask-scheduler", cluster.address]
        with running_server(tmp_path, args, ENV) as api, api.client() as client:
            cluster.start_worker("w1")
            cluster.wait_joined(client, ["w1"])
            spec = load(SMALL, "BkgOnly.json")
            workspace_id = client.post("/workspaces", json=spec).json()["workspace_id"]
            body = {
                "workspace_id": workspace_id,
                "patchset": load(SMALL, "patchset.json"),
                "test_poi": [round(0.2 * i, 1) for i in range(1, 11)],  # 240 rows
            }
            submitted = client.post("/jobs", json={"operation": "cls", **body})
            assert submitted.status_code == 202, submitted.text
            job_id = submitted.json()["id"]
            deadline = time.monotonic() + 120
            while not any(w["in_flight"] for w in cluster_info(client)["workers"]):
                assert client.get(f"/jobs/{job_id}").json()["status"] in ("queued", "running")
                assert time.monotonic() < deadline, "no batch of the job ever ran"
                time.sleep(0.05)
            cluster.kill("scheduler")
            cluster.kill("w1")
            start = time.monotonic()
            during = client.post("/cls", json={**body, "patch_names": ["sig_s1_x1"]})
            assert during.status_code == 503, during.text
            assert cluster.address in during.json()["detail"]
            assert time.monotonic() - start < 15  # at once, not after the request timeout
            assert client.get(f"/jobs/{job_id}").json()["status"] == "running"

            cluster.start_scheduler()
            cluster.start_worker("w2")
            cluster.wait_joined(client, ["w2"])
            view = wait_for_job(client, job_id, timeout_s=240)
            assert view["status"] == "succeeded", json.dumps(view)[:2000]
            assert view["progress"]["done"] == view["progress"]["total"] == 240
    finally:
        cluster.stop()
    reference_id = reference.post("/workspaces", json=spec).json()["workspace_id"]
    theirs = reference.post("/cls", json={**body, "workspace_id": reference_id})
    assert theirs.status_code == 200, theirs.text
    assert_equal(view["result"], theirs.json())


# ------------------------------------------------------------------------------ scheduler
def test_scheduler_runs_max_in_flight_batches_at_once_split_evenly() -> None:
    import asyncio
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from pyhf_gpu_server.service.metrics import Metrics
    from pyhf_gpu_server.service.scheduler import Scheduler

    calls: list[tuple[str, int, float, float]] = []

    def runner(context: Any, rows: list[int], stop: Any) -> list[int]:
        start = time.perf_counter()
        time.sleep(0.05)
        calls.append((context, len(rows), start, time.perf_counter()))
        assert threading.current_thread().name.startswith("slot")
        return [r * r for r in rows]

    async def scenario() -> None:
        scheduler = Scheduler(
            runner,
            ThreadPoolExecutor(4, thread_name_prefix="slot"),
            Metrics(),
            max_batch_size=64,
            max_batch_delay_s=0.0,
            max_pending=100,
            max_in_flight=lambda: 2,
        )
        scheduler.start()
        big = scheduler.submit("a", "A", list(range(217)))
        assert [o.value for o in await big.future] == [i * i for i in range(217)]
        assert sorted(n for _, n, _, _ in calls) == [52, 55, 55, 55]  # not 64+64+64+25
        overlapping = [(a, b) for a in calls for b in calls if a is not b and a[2] < b[2] < a[3]]
        assert overlapping, "two batches ran at once"
        assert max(sum(c[2] <= t < c[3] for c in calls) for *_, t, _ in calls) <= 2
        calls.clear()
        job = scheduler.submit("j", "J", list(range(40)), lane="jobs", row_cost=1000)
        await asyncio.sleep(0.01)
        request = scheduler.submit("r", "R", [1])
        await request.future
        assert not job.future.done()  # interactive work still overtakes a job's chunks
        await job.future
        await scheduler.stop()

    asyncio.run(scenario())
