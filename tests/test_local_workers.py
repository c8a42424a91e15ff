"""Local workers (processes forked before any thread) translating shares of a request's many
new patches: their elements equal the server process's own, bit for bit, errors included; a
worker that died, stalls or let the background go costs time, not results; a server with
one, which also fits shares of its engine calls (``test_engine_shares.py``), answers a
published patchset as one without (real servers, HTTP)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import WORKSPACES_DIR, load_json, load_patchset
from service_support import ServerProcess, running_server
from test_translator_parity import assert_layouts_equal

from pyhf_gpu_server.service import local_workers
from pyhf_gpu_server.service.elements import Background, Element, ElementStore, PatchSpec
from pyhf_gpu_server.service.local_workers import LocalWorkers
from pyhf_gpu_server.service.requests import patch_digest

SBOTTOM_B = "atlas-susy-2018-31-sbottom-B"
STAU = "atlas-susy-2018-04-stau"
NO_SIGNAL = "sbottom_1500_1495_60"  # its patch only removes a channel


def background(name: str) -> Background:
    spec = load_json(WORKSPACES_DIR / name / "BkgOnly.json")
    return Background(spec, name, spec["measurements"][0]["name"], None)


def patches(name: str, file: str, count: int | None = None) -> list[PatchSpec]:
    found = [
        PatchSpec(p["metadata"]["name"], patch_digest(p["patch"]), tuple(p["patch"]))
        for p in load_patchset(WORKSPACES_DIR / name / file)["patches"]
    ]
    return found[:count]


def assert_elements_equal(actual: list[Element], expected: list[Element]) -> None:
    assert [e.patch for e in actual] == [e.patch for e in expected]
    for a, e in zip(actual, expected, strict=True):
        if e.layout is None:
            assert a.layout is None
            assert (type(a.error), a.error.status_code, a.error.detail) == (
                type(e.error),
                e.error.status_code,
                e.error.detail,
            )
        else:
            assert a.error is None
            assert_layouts_equal(a.layout, e.layout)


@pytest.fixture
def workers() -> Iterator[LocalWorkers]:
    forked = LocalWorkers.fork(2, min_patches=4)
    yield forked
    forked.close()


@pytest.mark.parametrize(
    ("name", "file", "count"),
    [(SBOTTOM_B, "patchset.hepdata.json.gz", 40), (STAU, "patchset.heterogeneous.json", None)],
)
def test_the_workers_shares_equal_the_server_process_own(workers, name, file, count) -> None:
    chosen = patches(name, file, count)
    if name == SBOTTOM_B:  # a point that cannot be tested: its error comes back too
        chosen += [p for p in patches(name, file) if p.name == NO_SIGNAL]
    alone = ElementStore().elements(background(name), chosen)
    shared = ElementStore(workers=workers).elements(background(name), chosen)
    assert workers.used == 1 and workers.count == 2
    assert_elements_equal(shared, alone)
    assert any(e.error is not None for e in alone) == (name == SBOTTOM_B)


def test_few_new_patches_stay_in_the_server_process(workers) -> None:
    chosen = patches(STAU, "patchset.heterogeneous.json", 3)
    store = ElementStore(workers=workers)
    store.elements(background(STAU), chosen)
    assert workers.used == 0
    # cached elements are not new: a request of them with two new ones neither
    store.elements(background(STAU), patches(STAU, "patchset.heterogeneous.json", 5))
    assert workers.used == 0


def test_a_dead_worker_costs_time_not_results(workers) -> None:
    workers._workers[0].process.kill()
    workers._workers[0].process.join()
    chosen = patches(STAU, "patchset.heterogeneous.json")
    shared = ElementStore(workers=workers).elements(background(STAU), chosen)
    assert_elements_equal(shared, ElementStore().elements(background(STAU), chosen))
    assert workers.count == 1  # the dead one is not asked again; the other still is
    again = ElementStore(workers=workers).elements(background(STAU), chosen)
    assert_elements_equal(again, shared)
    assert workers.used == 2


def test_a_worker_that_does_not_answer_in_time_is_stopped(workers, monkeypatch) -> None:
    monkeypatch.setattr(local_workers, "SEND_TIMEOUT_S", 0.2)
    monkeypatch.setattr(local_workers, "BASE_TIMEOUT_S", 1.0)
    stalled = workers._workers[0].process
    os.kill(stalled.pid, signal.SIGSTOP)  # alive, never answering
    chosen = patches(SBOTTOM_B, "patchset.hepdata.json.gz", 40)
    shared = ElementStore(workers=workers).elements(background(SBOTTOM_B), chosen)
    assert_elements_equal(shared, ElementStore().elements(background(SBOTTOM_B), chosen))
    assert workers.count == 1 and not stalled.is_alive()


def test_a_worker_that_let_the_background_go_is_sent_it_again() -> None:
    workers = LocalWorkers.fork(1, min_patches=2)
    try:
        store = ElementStore(workers=workers)
        chosen = patches(STAU, "patchset.heterogeneous.json", 4)
        first = store.elements(background(STAU), chosen)
        # more backgrounds than a worker keeps (the same workspace under other digests)
        stau = background(STAU)
        for i in range(ElementStore().max_backgrounds + 1):
            store.elements(Background(stau.workspace, f"copy{i}", stau.measurement, None), chosen)
        assert background(STAU).key in workers._workers[0].backgrounds
        again = ElementStore(workers=workers).elements(background(STAU), chosen)
        assert_elements_equal(again, first)
        assert workers.count == 1 and workers.used == ElementStore().max_backgrounds + 3
    finally:
        workers.close()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_server_with_a_worker_answers_a_published_patchset_as_one_without(tmp_path) -> None:
    """The worker translates a share of the patches and fits a share of the engine call's
    elements (a CPU server): the answers are the same, the points it fitted say so."""
    patchset = load_patchset(WORKSPACES_DIR / SBOTTOM_B / "patchset.hepdata.json.gz")
    names = [*(p["metadata"]["name"] for p in patchset["patches"][:48]), NO_SIGNAL]
    answers, infos = [], []
    for count in (1, 0):
        args, data_dir = ["--local-workers", str(count)], tmp_path / str(count)
        data_dir.mkdir()
        with running_server(data_dir, args) as server, server.client(timeout_s=300) as client:
            body = {
                "workspace": background(SBOTTOM_B).workspace,
                "patchset": patchset,
                "patch_names": names,
            }
            response = client.post("/cls", json=body)
            assert response.status_code == 200, response.text
            answers.append(response.json())
            infos.append(client.get("/info").json()["local_workers"])
    with_worker, without = answers
    assert infos[0]["workers"] == 1 and infos[0]["shared_requests"] == 1
    assert infos[0]["shared_batches"] >= 1  # 48 rows: one engine call (64 rows at most)
    assert infos[1] == {"workers": 0, "shared_requests": 0, "shared_batches": 0}
    assert list(with_worker) == names
    assert with_worker[NO_SIGNAL] == without[NO_SIGNAL]
    fitted_by = {with_worker[name]["meta"].get("worker") for name in names[:-1]}
    assert len(fitted_by) == 2 and None in fitted_by  # the server and its worker
    for name in names[:-1]:
        for key in ("CLs_obs", "CLs_exp"):  # two stacks holding the point: ~1e-12 apart
            assert with_worker[name][key] == pytest.approx(without[name][key], abs=1e-10)
        assert "worker" not in without[name]["meta"]


def test_the_worker_count_setting() -> None:
    from pyhf_gpu_server.service.settings import Settings, default_local_workers

    assert Settings(local_workers=-1).local_worker_count == default_local_workers()
    assert Settings(local_workers=3).local_worker_count == 3
    assert 0 <= default_local_workers() <= 4
    with pytest.raises(ValueError, match="local_workers"):
        Settings(local_workers=-2)


def test_a_server_process_stops_its_workers(tmp_path) -> None:
    server = ServerProcess(tmp_path, ["--local-workers", "2"]).start()
    try:
        children = _children(server.process.pid)
        assert len(children) == 2
    finally:
        server.stop()
    for pid in children:
        assert not _alive(pid)


def _children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs within 5 s (an exited child not reaped yet counts as gone)."""
    for _ in range(50):
        stat = Path(f"/proc/{pid}/stat")
        if not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return False
        time.sleep(0.1)
    return True
