"""End to end: published and heterogeneous patchsets through a real server on 127.0.0.1.

- a published HEPData patchset (sbottom, signals with their own systematics) in one request:
  pyhf's regression values within 1e-4, the point that adds no signal answered with its own
  error entry while every other point gets its result;
- distinct signal patches posted by concurrent clients on one uploaded background: few engine
  calls (from ``/metrics``), each answer equal to the same patch run alone;
- a job over a patchset records its failed patches;
- a published point whose free fit has two basins, the lower one at the POI's upper bound:
  answered at the global minimum, as pyhf with MINUIT (pyhf's default scipy stops in the other).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pyhf
import pytest
from conftest import WORKSPACES_DIR
from service_support import (
    ServerProcess,
    load,
    metric_value,
    running_server,
    wait_for_job,
)

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

SBOTTOM_B = "atlas-susy-2018-31-sbottom-B"
STAU = "atlas-susy-2018-04-stau"
NO_SIGNAL = "sbottom_1500_1495_60"  # its patch only removes a channel: no POI is left
# its free fit to data: a basin at mu_SIG ~ 1 and a lower one at mu_SIG's upper bound (10)
TWO_BASINS = "sbottom_1200_250_60"


def hepdata_patchset(name: str) -> dict[str, Any]:
    return json.loads(
        gzip.decompress((WORKSPACES_DIR / name / "patchset.hepdata.json.gz").read_bytes())
    )


def hepdata_reference(name: str) -> dict[str, Any]:
    return json.loads((WORKSPACES_DIR / name / "reference.hepdata.json").read_text())["results"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    data_dir = tmp_path_factory.mktemp("patchsets")
    # set to gather a burst of clients: arrivals up to 50 ms apart (2 loaded CI cores) join
    args = ["--max-batch-size", "256", "--max-batch-delay-ms", "200", "--batch-gap-ms", "50"]
    with running_server(data_dir, args) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    with server.client(timeout_s=300) as c:
        yield c


def upload(client: httpx.Client, name: str) -> str:
    response = client.post("/workspaces", json=load(name, "BkgOnly.json"))
    assert response.status_code == 201, response.text
    return response.json()["workspace_id"]


def engine_calls(client: httpx.Client) -> float:
    return metric_value(client.get("/metrics").text, "pyhf_gpu_batch_size_count")


def test_published_patchset_with_reference_points_and_an_odd_point(client: httpx.Client) -> None:
    workspace_id = upload(client, SBOTTOM_B)
    patchset = hepdata_patchset(SBOTTOM_B)
    reference = hepdata_reference(SBOTTOM_B)
    names = [p["metadata"]["name"] for p in patchset["patches"]]
    assert NO_SIGNAL in names
    chosen = [*reference, NO_SIGNAL, *names[:12]]
    response = client.post(
        "/cls",
        json={"workspace_id": workspace_id, "patchset": patchset, "patch_names": chosen},
    )
    assert response.status_code == 200, response.text
    answer = response.json()
    assert list(answer) == list(dict.fromkeys(chosen))
    for name, expected in reference.items():
        assert answer[name]["CLs_obs"] == pytest.approx(expected["CLs_obs"], abs=1e-4)
        assert answer[name]["CLs_exp"] == pytest.approx(expected["CLs_exp"], abs=1e-4)
    error = answer[NO_SIGNAL]["error"]
    assert error["status"] == 422
    assert "mu_SIG" in error["detail"] and "not declared" in error["detail"]
    tested = [name for name in answer if name != NO_SIGNAL]
    assert all(0 <= answer[name]["CLs_obs"] <= 1 for name in tested)
    assert all(answer[name]["meta"]["converged"] for name in tested)
    # the published points carry different systematics; they were stacked into one model
    assert len({answer[name]["meta"]["model_id"] for name in tested}) == 1


def test_a_patchset_where_no_patch_can_be_tested_is_a_422(client: httpx.Client) -> None:
    workspace_id = upload(client, SBOTTOM_B)
    response = client.post(
        "/cls",
        json={
            "workspace_id": workspace_id,
            "patchset": hepdata_patchset(SBOTTOM_B),
            "patch_names": [NO_SIGNAL],
        },
    )
    assert response.status_code == 422, response.text
    assert NO_SIGNAL in response.json()["detail"]


def test_distinct_signals_from_concurrent_clients_share_engine_calls(
    client: httpx.Client, server: ServerProcess
) -> None:
    workspace_id = upload(client, STAU)
    patchset = load(STAU, "patchset.heterogeneous.json")
    patches = patchset["patches"][:16]

    def post(patch: dict[str, Any]) -> dict[str, Any]:
        with server.client(timeout_s=300) as own:
            body = {"workspace_id": workspace_id, "patches": [patch["patch"]]}
            response = own.post("/cls", json=body)
            assert response.status_code == 200, response.text
            return response.json()

    post(patches[0])  # the background's translator and first model are warm
    before = engine_calls(client)
    with ThreadPoolExecutor(len(patches)) as pool:
        together = list(pool.map(post, patches))
    calls = engine_calls(client) - before
    assert calls <= 4, f"{len(patches)} requests took {calls} engine calls"
    assert max(r["meta"]["batch_rows"] for r in together) > 1
    for patch, answer in zip(patches, together, strict=True):
        alone = post(patch)  # after the burst: one request, one engine call
        assert answer["CLs_obs"] == pytest.approx(alone["CLs_obs"], rel=1e-9, abs=1e-12)
        assert answer["CLs_exp"] == pytest.approx(alone["CLs_exp"], rel=1e-9, abs=1e-12)


def test_a_published_point_with_two_basins_is_answered_at_the_global_minimum(
    client: httpx.Client,
) -> None:
    patchset = hepdata_patchset(SBOTTOM_B)
    workspace = pyhf.PatchSet(patchset).apply(
        pyhf.Workspace(load(SBOTTOM_B, "BkgOnly.json")), TWO_BASINS
    )
    model = workspace.model()
    data = workspace.data(model)
    previous = pyhf.get_backend()
    pyhf.set_backend("numpy", pyhf.optimize.minuit_optimizer(tolerance=1e-5))
    try:
        bestfit, twice_nll = pyhf.infer.mle.fit(data, model, return_fitted_val=True)
        cls_obs, cls_exp = pyhf.infer.hypotest(
            1.0, data, model, test_stat="qtilde", return_expected_set=True
        )
    finally:
        pyhf.set_backend(*previous)
    poi = model.config.poi_index
    assert bestfit[poi] == pytest.approx(10.0)  # MINUIT's minimum: on the upper bound

    body = {"workspace_id": upload(client, SBOTTOM_B), "patchset": patchset}
    fit = client.post("/fit", json={**body, "patch_names": [TWO_BASINS]})
    assert fit.status_code == 200, fit.text
    ours = fit.json()[TWO_BASINS]
    assert ours["mle_parameters"]["mu_SIG"][0] == pytest.approx(10.0)
    assert ours["twice_nll"] <= float(twice_nll) + 1e-6
    answer = client.post("/cls", json={**body, "patch_names": [TWO_BASINS]})
    assert answer.status_code == 200, answer.text
    ours = answer.json()[TWO_BASINS]
    assert ours["meta"]["converged"]
    assert ours["CLs_obs"] == pytest.approx(float(cls_obs), abs=5e-5)
    assert ours["CLs_exp"] == pytest.approx([float(v) for v in cls_exp], abs=5e-5)


def test_patchset_job_counts_its_failed_patches(client: httpx.Client) -> None:
    workspace_id = upload(client, SBOTTOM_B)
    patchset = hepdata_patchset(SBOTTOM_B)
    chosen = [NO_SIGNAL, *[p["metadata"]["name"] for p in patchset["patches"][:3]]]
    response = client.post(
        "/jobs",
        json={
            "operation": "cls",
            "workspace_id": workspace_id,
            "patchset": patchset,
            "patch_names": chosen,
        },
    )
    assert response.status_code == 202, response.text
    view = wait_for_job(client, response.json()["id"], timeout_s=300)
    assert view["status"] == "succeeded", view
    assert view["failed_patches"] == 1
    assert view["result"][NO_SIGNAL]["error"]["status"] == 422
    assert all("CLs_obs" in view["result"][n] for n in chosen[1:])


def test_patches_that_break_the_workspace_answer_their_own_422(client: httpx.Client) -> None:
    workspace_id = upload(client, SBOTTOM_B)
    patchset = load(SBOTTOM_B, "patchset.json")
    patches = patchset["patches"][:3]
    broken = [
        [*patches[1]["patch"], {"op": "remove", "path": "/observations/0"}],
        [*patches[2]["patch"], {"op": "replace", "path": "/observations/0/data/0", "value": -3}],
        [{"op": "remove", "path": "/channels/7"}],
    ]
    patchset = {
        **patchset,
        "patches": [
            patches[0],
            *(
                {"metadata": {"name": f"broken{i}", "values": [100 + i, 0]}, "patch": ops}
                for i, ops in enumerate(broken)
            ),
        ],
    }
    response = client.post("/cls", json={"workspace_id": workspace_id, "patchset": patchset})
    assert response.status_code == 200, response.text
    answer = response.json()
    assert "CLs_obs" in answer[patches[0]["metadata"]["name"]]
    details = [answer[f"broken{i}"]["error"] for i in range(3)]
    assert [d["status"] for d in details] == [422, 422, 422]
    assert "has no entry in 'observations'" in details[0]["detail"]
    assert "negative counts" in details[1]["detail"]
    assert "patch could not be applied" in details[2]["detail"]


def test_patches_that_cannot_share_a_model_run_apart_and_say_why(client: httpx.Client) -> None:
    workspace_id = upload(client, SBOTTOM_B)
    patchset = load(SBOTTOM_B, "patchset.json")
    first, second = patchset["patches"][:2]
    # the validation region removed: other channels, so another model
    apart = {
        "metadata": {"name": "without_VR", "values": [99, 99]},
        "patch": [*second["patch"], {"op": "remove", "path": "/channels/1"}],
    }
    body = {
        "workspace_id": workspace_id,
        "patchset": {**patchset, "patches": [first, second, apart]},
    }
    answer = client.post("/cls", json=body).json()
    names = [first["metadata"]["name"], second["metadata"]["name"]]
    assert all("stacked_apart" not in answer[n]["meta"] for n in names)
    assert answer[names[0]]["meta"]["model_id"] == answer[names[1]]["meta"]["model_id"]
    assert "channels and bins differ" in answer["without_VR"]["meta"]["stacked_apart"]
    assert answer["without_VR"]["meta"]["model_id"] != answer[names[0]]["meta"]["model_id"]
    alone = client.post(
        "/cls", json={"workspace_id": workspace_id, "patches": [apart["patch"]]}
    ).json()
    assert answer["without_VR"]["CLs_obs"] == pytest.approx(alone["CLs_obs"], rel=1e-9)


def test_fit_of_a_heterogeneous_patchset_reports_each_patch_own_parameters(
    client: httpx.Client,
) -> None:
    workspace_id = upload(client, STAU)
    patchset = load(STAU, "patchset.heterogeneous.json")
    patchset = {**patchset, "patches": patchset["patches"][:3]}
    answer = client.post("/fit", json={"workspace_id": workspace_id, "patchset": patchset})
    assert answer.status_code == 200, answer.text
    background = pyhf.Workspace(load(STAU, "BkgOnly.json"))
    for patch in patchset["patches"]:
        name = patch["metadata"]["name"]
        model = pyhf.PatchSet(patchset).apply(background, name).model()
        fit = answer.json()[name]
        assert list(fit["mle_parameters"]) == model.config.par_order
        assert sum(len(v) for v in fit["mle_parameters"].values()) == len(fit["corr_mat"])
        alone = client.post(
            "/fit", json={"workspace_id": workspace_id, "patches": [patch["patch"]]}
        ).json()
        assert fit["twice_nll"] == pytest.approx(alone["twice_nll"], rel=1e-9)
        assert fit["mle_parameters"]["mu_SIG"][0] == pytest.approx(
            alone["mle_parameters"]["mu_SIG"][0], rel=1e-6, abs=1e-8
        )
