"""The analysers' operations of #14 through a real server on 127.0.0.1: ranking, profile
scans (1D, 2D), pre/post-fit yields and the fit's goodness of fit; each with a patchset (one
answer per patch, equal to each patch alone) and as a job with progress, against cabinetry
and pyhf computed here (the inference tests hold the full parity: tests/test_inference_*).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import cabinetry
import numpy as np
import pyhf
import pytest
from service_support import SMALL, load, wait_for_job

pytestmark = pytest.mark.timeout(600)

BACKGROUND = load(SMALL, "BkgOnly.json")
PATCHSET = load(SMALL, "patchset.json")
FIRST, SECOND = (p["metadata"]["name"] for p in PATCHSET["patches"][:2])
RANKED = ["lumi", "ttbar_Gen", "staterror_SR_cuts[0]"]


@pytest.fixture(autouse=True)
def pyhf_backend_restored() -> Iterator[None]:
    """The tests set pyhf's (process-wide) backend and optimizer: restore them after each."""
    backend, optimizer = pyhf.get_backend()
    yield
    pyhf.set_backend(backend, optimizer)


def one_patch(name: str) -> dict:
    return {"workspace": BACKGROUND, "patchset": PATCHSET, "patch_names": [name]}


def both_patches() -> dict:
    return {"workspace": BACKGROUND, "patchset": PATCHSET, "patch_names": [FIRST, SECOND]}


def pyhf_model(name: str) -> tuple[pyhf.Model, list[float]]:
    workspace = pyhf.PatchSet(PATCHSET).apply(pyhf.Workspace(BACKGROUND), name)
    model = workspace.model()
    return model, workspace.data(model)


def post(client, path: str, body: dict) -> dict:
    response = client.post(path, json=body, timeout=600)
    assert response.status_code == 200, response.text[:500]
    return response.json()


def without_meta(result: dict) -> dict:
    return {k: v for k, v in result.items() if k != "meta"}


@pytest.mark.parametrize(
    ("path", "options"),
    [
        ("/ranking", {"parameters": RANKED}),
        ("/scan", {"x": {"range": [0.0, 2.0], "steps": 5}}),
        ("/yields", {}),
        ("/fit", {"goodness_of_fit": True}),
    ],
)
def test_a_patchset_answers_each_patch_as_alone_in_one_engine_call(client, path, options):
    together = post(client, path, {**both_patches(), **options})
    assert list(together) == [FIRST, SECOND]
    assert together[FIRST]["meta"]["batch_rows"] == 2  # both patches, one engine call
    for name in (FIRST, SECOND):
        alone = post(client, path, {**one_patch(name), **options})[name]
        np.testing.assert_allclose(
            flat(without_meta(together[name])), flat(without_meta(alone)), rtol=1e-8, atol=1e-10
        )


def flat(value) -> list[float]:
    """Every number in a JSON value, in order (None as NaN)."""
    if isinstance(value, dict):
        return [x for v in value.values() for x in flat(v)]
    if isinstance(value, list):
        return [x for v in value for x in flat(v)]
    if isinstance(value, (bool, str)):
        return []
    return [np.nan if value is None else float(value)]


def test_ranking_is_sorted_by_impact_and_its_impacts_are_pois_of_refits(client):
    """Each impact is the POI of a fit with the parameter fixed at best fit plus its
    post-fit uncertainty (a /fit of the same model with that parameter fixed, here through
    pyhf's own fit at tight tolerance), minus the POI's best fit."""
    result = post(client, "/ranking", {**one_patch(FIRST), "parameters": RANKED})[FIRST]
    up, down = result["postfit_up"], result["postfit_down"]
    impact = [abs(u) + abs(d) for u, d in zip(up, down, strict=True)]
    assert impact == sorted(impact, reverse=True)
    assert sorted(result["labels"]) == sorted(RANKED)
    model, data = pyhf_model(FIRST)
    pyhf.set_backend("numpy", pyhf.optimize.scipy_optimizer(tolerance=1e-12))
    labels = model.config.par_names
    for k, label in enumerate(result["labels"]):
        column = labels.index(label)
        init = model.config.suggested_init()
        fixed = model.config.suggested_fixed()
        init[column] = result["bestfit"][k] + result["uncertainty"][k]
        fixed[column] = True
        refit = pyhf.infer.mle.fit(data, model, init_pars=init, fixed_params=fixed)
        poi = float(refit[model.config.poi_index])
        expected = poi - result["poi"]["bestfit"]
        assert result["postfit_up"][k] == pytest.approx(expected, abs=2e-3 * max(1, abs(poi)))


def test_scan_values_are_pyhfs_profile_likelihood(client):
    values = [0.0, 0.5, 1.0]
    body = {**one_patch(FIRST), "x": {"parameter": "mu_SIG", "values": values}}
    result = post(client, "/scan", body)[FIRST]
    assert result["name"] == "mu_SIG" and result["parameter_values"] == values
    model, data = pyhf_model(FIRST)
    pyhf.set_backend("numpy", pyhf.optimize.scipy_optimizer(tolerance=1e-12))
    free = float(pyhf.infer.mle.fit(data, model, return_fitted_val=True)[1])
    for value, found in zip(values, result["delta_nlls"], strict=True):
        fixed = pyhf.infer.mle.fixed_poi_fit(value, data, model, return_fitted_val=True)[1]
        assert found == pytest.approx(float(fixed) - free, abs=1e-6)


def test_a_2d_scan_has_its_minimum_near_the_best_fit(client):
    body = {
        **one_patch(FIRST),
        "x": {"range": [0.0, 2.0], "steps": 3},
        "y": {"parameter": "lumi", "values": [0.98, 1.0, 1.02]},
    }
    result = post(client, "/scan", body)[FIRST]
    grid = np.asarray(result["delta_nlls"])
    assert result["names"] == ["mu_SIG", "lumi"] and grid.shape == (3, 3)
    assert grid.min() >= -1e-8 and np.unravel_index(grid.argmin(), grid.shape) == (0, 1)


def test_prefit_yields_are_cabinetrys(client):
    """Pre-fit yields need no fit: cabinetry's prediction of the same model, exactly."""
    result = post(client, "/yields", one_patch(FIRST))[FIRST]
    model, _ = pyhf_model(FIRST)
    logging.getLogger("cabinetry").setLevel(logging.WARNING)
    pyhf.set_backend("numpy")
    theirs = cabinetry.model_utils.prediction(model)
    for c, channel in enumerate(model.config.channels):
        ours = result["prefit"][channel]
        for s, sample in enumerate(model.config.samples):
            np.testing.assert_allclose(
                ours["samples"][sample]["yields"], theirs.model_yields[c][s], rtol=1e-10
            )
            np.testing.assert_allclose(
                ours["samples"][sample]["stdev"],
                theirs.total_stdev_model_bins[c][s],
                rtol=1e-8,
                atol=1e-12,
            )
        np.testing.assert_allclose(
            ours["total"]["stdev"], theirs.total_stdev_model_bins[c][-1], rtol=1e-8
        )


def test_goodness_of_fit_is_cabinetrys_for_the_same_minimum(client):
    result = post(client, "/fit", {**one_patch(FIRST), "goodness_of_fit": True})[FIRST]
    model, data = pyhf_model(FIRST)
    pyhf.set_backend("numpy")
    theirs = cabinetry.fit._goodness_of_fit(model, data, result["twice_nll"])
    assert result["goodness_of_fit"]["p_value"] == pytest.approx(theirs, rel=1e-8)
    assert 0 < result["goodness_of_fit"]["p_value"] < 1


@pytest.mark.parametrize(
    ("operation", "options"),
    [
        ("ranking", {"parameters": ["lumi"]}),
        ("scan", {"x": {"values": [0.0, 1.0]}}),
        ("yields", {}),
    ],
)
def test_each_operation_runs_as_a_job_with_progress(client, operation, options):
    body = {**both_patches(), **options}
    submitted = client.post("/jobs", json={"operation": operation, **body})
    assert submitted.status_code == 202, submitted.text[:300]
    view = wait_for_job(client, submitted.json()["id"], timeout_s=300)
    assert view["status"] == "succeeded", view
    assert view["progress"] == {"done": 2, "total": 2}
    synchronous = post(client, f"/{operation}", body)
    for name in (FIRST, SECOND):
        np.testing.assert_allclose(
            flat(without_meta(view["result"][name])),
            flat(without_meta(synchronous[name])),
            rtol=1e-10,
            atol=1e-12,
        )


@pytest.mark.parametrize(
    ("path", "body", "needle"),
    [
        ("/scan", {"x": {"parameter": "nope", "range": [0, 1]}}, "'nope' is not in this model"),
        ("/scan", {"x": {"values": [0, 1], "range": [0, 1]}}, "at most one of 'values'"),
        ("/scan", {"x": {"values": [1, 0]}}, "must increase"),
        ("/scan", {"x": {"values": [0, 1], "steps": 3}}, "'steps' goes with 'range'"),
        ("/ranking", {"parameters": ["nope"]}, "'nope' is not in this model"),
        ("/ranking", {"parameters": ["mu_SIG"]}, "cannot be ranked against itself"),
    ],
)
def test_bad_options_answer_422_naming_what(client, path, body, needle):
    response = client.post(path, json={**one_patch(FIRST), **body})
    assert response.status_code == 422, response.text[:300]
    assert needle in response.text


def test_the_operations_are_in_the_openapi_document(client, tmp_path: Path):
    paths = client.get("/openapi.json").json()["paths"]
    for path in ("/ranking", "/scan", "/yields"):
        assert "200" in paths[path]["post"]["responses"]


def with_signal_systematic() -> dict:
    """``FIRST`` as published, ``SECOND`` with a signal systematic of its own (as published
    patchsets have): a parameter one patch has and the other does not."""
    patchset = {**PATCHSET, "patches": [dict(p) for p in PATCHSET["patches"][:2]]}
    second = patchset["patches"][1]
    ops = [dict(op, value=dict(op["value"])) for op in second["patch"]]
    sample = ops[0]["value"]
    sample["modifiers"] = [
        *sample["modifiers"],
        {"name": "sig_theory", "type": "normsys", "data": {"hi": 1.2, "lo": 0.85}},
    ]
    patchset["patches"][1] = {**second, "patch": ops}
    return {"workspace": BACKGROUND, "patchset": patchset}


@pytest.mark.parametrize(
    ("path", "options", "problem"),
    [
        ("/scan", {"x": {"parameter": "sig_theory"}}, "'sig_theory' is not in this model"),
        ("/ranking", {"parameters": ["sig_theory", "lumi"]}, "'sig_theory' is not in this model"),
    ],
)
def test_a_patch_without_the_named_parameter_answers_its_own_error(client, path, options, problem):
    """Before, one such patch failed the whole batch (other requests' rows included); now it
    answers its own 422 entry and the other patch its result, equal to that patch alone."""
    body = {**with_signal_systematic(), **options}
    answer = post(client, path, body)
    assert answer[FIRST]["error"]["status"] == 422
    assert problem in answer[FIRST]["error"]["detail"]
    alone = post(client, path, {**body, "patch_names": [SECOND]})[SECOND]
    np.testing.assert_allclose(
        np.asarray(without_meta(answer[SECOND])["delta_nlls" if path == "/scan" else "postfit_up"]),
        np.asarray(alone["delta_nlls" if path == "/scan" else "postfit_up"]),
        rtol=0,
        atol=1e-9,
    )


def test_a_scan_without_a_grid_spans_each_patchs_best_fit_three_sigma(client):
    """cabinetry's default grid, per patch: 11 points over the best fit +- 3 uncertainties
    (within the bounds); the patches' grids differ."""
    body = {**with_signal_systematic(), "patch_names": [SECOND], "x": {"parameter": "sig_theory"}}
    result = post(client, "/scan", body)[SECOND]
    centre, sigma = result["bestfit"], result["uncertainty"]
    np.testing.assert_allclose(
        result["parameter_values"],
        np.linspace(centre - 3 * sigma, centre + 3 * sigma, 11),
        atol=1e-12,
    )
    grids = post(client, "/scan", {**both_patches(), "x": {"parameter": "ttbar_Gen", "steps": 5}})
    assert len(grids[FIRST]["parameter_values"]) == 5
    assert grids[FIRST]["parameter_values"] != grids[SECOND]["parameter_values"]
