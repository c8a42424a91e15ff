"""Profile-likelihood scans against pyhf's own fits, computed in the test (the 119-parameter
stau scan's: in ``tests/data/pyhf_scan_stau.json``, written by its script with the same fits).

The reference for ``-2 Delta ln L`` at a scan point is ``pyhf.infer.mle.fit`` with the scanned
parameter(s) fixed (their value as the start value, as cabinetry's ``scan``) less pyhf's free
fit, both with scipy at ``tolerance=1e-12`` (the published workspaces use pyhf's smooth default
interpolation codes, so one start finds the minimum; :mod:`pyhf_global`'s many starts are for
kinked likelihoods).
"""

from __future__ import annotations

import doctest
import importlib
import json
from functools import cache
from pathlib import Path

import cabinetry
import numpy as np
import pyhf
import pytest
import torch
from conftest import shared_workspace
from hand_built import all_modifiers_workspace
from test_inference_support import DEVICE, one_thread  # noqa: F401 (fixture)

from pyhf_gpu_server.engine import HistFactoryModel
from pyhf_gpu_server.inference import FitOptions, MinimizeOptions, scan, scan2d
from pyhf_gpu_server.service.operations.scan import scan_answer

pytestmark = pytest.mark.usefixtures("one_thread")

SBOTTOM_B = "atlas-susy-2018-31-sbottom-B"
STAU = "atlas-susy-2018-04-stau"


@pytest.fixture(autouse=True)
def numpy_backend():
    backend = pyhf.get_backend()
    pyhf.set_backend("numpy", pyhf.optimize.scipy_optimizer(tolerance=1e-12))
    yield
    pyhf.set_backend(*backend)


@cache
def published(name: str, patch: int = 0):
    """(our model, pyhf model, data) of a shared workspace and its ``patch``-th patch."""
    workspace, patchset, _ = shared_workspace(name)
    entry = patchset["patches"][patch]
    ours = HistFactoryModel.from_workspace(workspace, patches=[entry["patch"]], device=DEVICE)
    ws = pyhf.PatchSet(patchset).apply(pyhf.Workspace(workspace), entry["metadata"]["name"])
    model = ws.model()
    return ours, model, ws.data(model)


@cache
def pyhf_minimum(name: str) -> float:
    _, model, data = published(name)
    return float(pyhf.infer.mle.fit(data, model, return_fitted_val=True)[1])


def pyhf_delta(name: str, point: dict[str, float]) -> float:
    """pyhf's ``-2 Delta ln L`` with the parameters of ``point`` fixed at their values."""
    _, model, data = published(name)
    init, fixed = model.config.suggested_init(), model.config.suggested_fixed()
    for label, value in point.items():
        i = model.config.par_names.index(label)
        init[i], fixed[i] = value, True
    value = pyhf.infer.mle.fit(
        data, model, init_pars=init, fixed_params=fixed, return_fitted_val=True
    )[1]
    return float(value) - pyhf_minimum(name)


def test_poi_scan_matches_pyhf():
    """sbottom-B, first patch (best-fit POI at its bound 0): a POI scan."""
    ours_model = published(SBOTTOM_B)[0]
    values = [0.0, 1.0, 5.0]
    res = scan(ours_model, "mu_SIG", values)
    assert res.converged.all() and res.points_converged.all()
    expected = [pyhf_delta(SBOTTOM_B, {"mu_SIG": v}) for v in values]
    got = res.delta_nlls[0].tolist()
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)
    print("POI scan, worst |difference|:", np.max(np.abs(np.subtract(got, expected))))
    row = scan_answer(res).model_dump()
    assert row["name"] == "mu_SIG" and row["parameter_values"] == values
    assert row["bestfit"] == pytest.approx(0.0, abs=1e-8)


def test_nuisance_scan_and_2d_scan_match_pyhf():
    """A nuisance-parameter scan, and a 2D (POI, nuisance) grid checked on two points."""
    ours_model, _, _ = published(SBOTTOM_B)
    res = scan(ours_model, "ttbar_Gen", [-1.0, 0.5])
    expected = [pyhf_delta(SBOTTOM_B, {"ttbar_Gen": v}) for v in (-1.0, 0.5)]
    np.testing.assert_allclose(res.delta_nlls[0].tolist(), expected, rtol=0, atol=1e-6)
    xs, ys = [0.0, 1.0, 3.0], [-1.0, 0.0, 0.5, 1.0]
    two = scan2d(ours_model, ("mu_SIG", "ttbar_Gen"), xs, ys)  # 12 fits + 1 in one call
    assert two.delta_nlls.shape == (1, 3, 4) and two.converged.all()
    print(
        "nuisance scan, worst |difference|:", np.max(np.abs(res.delta_nlls[0].numpy() - expected))
    )
    for i, j in [(1, 0), (2, 3)]:
        expected = pyhf_delta(SBOTTOM_B, {"mu_SIG": xs[i], "ttbar_Gen": ys[j]})
        assert two.delta_nlls[0, i, j].item() == pytest.approx(expected, abs=1e-6)
        print("2D scan point, |difference|:", abs(two.delta_nlls[0, i, j].item() - expected))
    # the 2D grid's column at mu_SIG = 0 is the 1D scan of ttbar_Gen with the POI at 0; the
    # free fits are the same
    assert two.bestfit[0, 1].item() == pytest.approx(res.bestfit[0].item(), abs=1e-8)
    assert two.uncertainty[0, 1].item() == pytest.approx(res.uncertainty[0].item(), rel=1e-8)
    row = scan_answer(two).model_dump()
    assert row["names"] == ["mu_SIG", "ttbar_Gen"] and len(row["delta_nlls"]) == 3


#: the stau scan of ``tests/data/pyhf_scan_stau.json`` (written by its script with
#: :func:`pyhf_delta`)
STAU_SCAN = {"TopSystHardCodeSR1": [-1.0, 1.0]}


def test_scan_matches_pyhf_on_stau():
    """The 119-parameter stau workspace (first patch): a nuisance-parameter scan, against
    pyhf's values in ``tests/data/pyhf_scan_stau.json`` (a pyhf fit takes ~6 s here)."""
    reference = json.loads((Path(__file__).parent / "data/pyhf_scan_stau.json").read_text())
    ((label, values),) = STAU_SCAN.items()
    assert (reference["parameter"], reference["values"]) == (label, values)
    ours_model, _, _ = published(STAU)
    res = scan(ours_model, label, values)
    assert res.converged.all()
    expected = reference["delta_nlls"]
    np.testing.assert_allclose(res.delta_nlls[0].tolist(), expected, rtol=0, atol=1e-6)
    print("stau scan, worst |difference|:", np.max(np.abs(res.delta_nlls[0].numpy() - expected)))


def test_scan_matches_cabinetry_fields():
    """cabinetry's own ``scan`` (MINUIT) on the hand-built workspace: same fields, values to
    MINUIT's precision."""
    workspace = all_modifiers_workspace()
    workspace["measurements"][0]["config"]["parameters"].append(
        {"name": "shape_free", "fixed": True}  # else the POI and shapefactor are degenerate
    )
    ours = scan(HistFactoryModel.from_workspace(workspace, device=DEVICE), "jes", [-1.0, 0.0, 1.0])
    ws = pyhf.Workspace(workspace)
    model = ws.model()
    pyhf.set_backend("numpy")
    theirs = cabinetry.fit.scan(
        model, ws.data(model), "jes", par_range=(-1.0, 1.0), n_steps=3, tolerance=1e-6
    )
    row = scan_answer(ours).model_dump()
    assert {"name", "bestfit", "uncertainty", "parameter_values", "delta_nlls"} <= set(row)
    assert row["name"] == theirs.name
    assert row["parameter_values"] == pytest.approx(list(theirs.parameter_values))
    assert row["delta_nlls"] == pytest.approx(list(theirs.delta_nlls), abs=1e-4)
    assert row["bestfit"] == pytest.approx(theirs.bestfit, abs=1e-3)


def finite_difference_uncertainty(model, data, best, label: str, h: float = 1e-4) -> float:
    """The uncertainty of ``label`` from the inverse of pyhf's ``-2 log L`` Hessian at
    ``best``, by central differences over the free parameters."""
    free = [i for i, fixed in enumerate(model.config.suggested_fixed()) if not fixed]
    steps = np.eye(len(best))[free] * h

    def twice_nll(shift) -> float:
        return float(-2 * model.logpdf(np.asarray(best) + shift, data)[0])

    H = np.array(
        [
            [
                (twice_nll(a + b) - twice_nll(a - b) - twice_nll(b - a) + twice_nll(-a - b))
                / (4 * h * h)
                for b in steps
            ]
            for a in steps
        ]
    )
    k = free.index(model.config.par_names.index(label))
    return float(np.sqrt(np.linalg.inv(H / 2)[k, k]))


def test_automatic_grid_is_cabinetrys_default():
    """No values: cabinetry's default grid (``fit.scan``: 11 points over the best fit +- 3
    uncertainties), per row and within the bounds. The uncertainty is checked against pyhf's
    own Hessian (central differences of its ``logpdf``, here) and the profile at two grid
    points against pyhf's fixed fits; the 2D scan's automatic axes are the 1D ones."""
    workspace = all_modifiers_workspace()
    workspace["measurements"][0]["config"]["parameters"].append(
        {"name": "shape_free", "fixed": True}
    )
    model = HistFactoryModel.from_workspace(workspace, device=DEVICE)
    ours = scan(model, "jes")
    assert ours.converged.all() and ours.parameter_values.shape == (1, 11)
    centre, sigma = ours.bestfit[0].item(), ours.uncertainty[0].item()
    expected = np.linspace(centre - 3 * sigma, centre + 3 * sigma, 11)
    np.testing.assert_allclose(ours.parameter_values[0].numpy(), expected, rtol=0, atol=1e-12)
    ws = pyhf.Workspace(workspace)
    pyhf_model = ws.model()
    data = ws.data(pyhf_model)
    best, minimum = pyhf.infer.mle.fit(data, pyhf_model, return_fitted_val=True)
    theirs = finite_difference_uncertainty(pyhf_model, data, best, "jes")
    assert sigma == pytest.approx(theirs, rel=1e-4)
    k = pyhf_model.config.par_names.index("jes")
    for i in (0, 8):
        init, fixed = pyhf_model.config.suggested_init(), pyhf_model.config.suggested_fixed()
        init[k], fixed[k] = ours.parameter_values[0, i].item(), True
        value = pyhf.infer.mle.fit(
            data, pyhf_model, init_pars=init, fixed_params=fixed, return_fitted_val=True
        )[1]
        assert ours.delta_nlls[0, i].item() == pytest.approx(float(value - minimum), abs=1e-6)
    # clipped to the bounds [0, 10]: the POI of sbottom-B's first patch sits at 0, and its
    # uncertainty there is large
    poi = scan(published(SBOTTOM_B)[0], "mu_SIG", steps=5)
    assert poi.bestfit[0].item() == pytest.approx(0.0, abs=1e-8)
    assert 3 * poi.uncertainty[0].item() > 10.0
    assert poi.parameter_values[0].tolist() == [0.0, 2.5, 5.0, 7.5, 10.0]
    both = scan2d(model, ("jes", "mu"), steps=(3, 4))
    assert both.delta_nlls.shape == (1, 3, 4) and both.converged.all()
    torch.testing.assert_close(
        both.parameter_values[1], scan(model, "mu", steps=4).parameter_values
    )
    torch.testing.assert_close(
        both.parameter_values[0], scan(model, "jes", steps=3).parameter_values
    )


def test_stacked_elements_equal_each_alone():
    """Two patches stacked in one model: one call scans both, each row equal to its patch
    scanned alone."""
    workspace, patchset, _ = shared_workspace(SBOTTOM_B)
    names = [p["metadata"]["name"] for p in patchset["patches"]][:2]
    stacked = HistFactoryModel.from_patchset(workspace, patchset, patch_names=names, device=DEVICE)
    both = scan(stacked, "mu_SIG", [0.0, 0.5, 2.0])
    both2 = scan2d(stacked, ("mu_SIG", "ttbar_Gen"), [0.0, 2.0], [-0.5, 0.5])
    for e in range(2):
        alone_model = published(SBOTTOM_B, e)[0]
        alone = scan(alone_model, "mu_SIG", [0.0, 0.5, 2.0])
        alone2 = scan2d(alone_model, ("mu_SIG", "ttbar_Gen"), [0.0, 2.0], [-0.5, 0.5])
        torch.testing.assert_close(both.delta_nlls[e], alone.delta_nlls[0], rtol=0, atol=1e-8)
        torch.testing.assert_close(both2.delta_nlls[e], alone2.delta_nlls[0], rtol=0, atol=1e-8)
        torch.testing.assert_close(both.bestfit[e], alone.bestfit[0], rtol=0, atol=1e-8)


def test_bad_scans_are_refused():
    ours_model, _, _ = published(SBOTTOM_B)
    with pytest.raises(ValueError, match=r"'mu_SIG' must lie within its bounds \[0.0, 10.0\]"):
        scan(ours_model, "mu_SIG", [-1.0, 0.0, 1.0])
    with pytest.raises(ValueError, match=r"'mu_SIG' must lie within its bounds \[0.0, 10.0\]"):
        scan2d(ours_model, ("ttbar_Gen", "mu_SIG"), [0.0], [1.0, 11.0])
    with pytest.raises(ValueError, match="'nope' is not in the model"):
        scan(ours_model, "nope", [0.0])
    with pytest.raises(ValueError, match="two different parameters"):
        scan2d(ours_model, ("mu_SIG", "mu_SIG"), [0.0], [1.0])
    fixed_model = HistFactoryModel.from_workspace(all_modifiers_workspace(), device=DEVICE)
    with pytest.raises(ValueError, match="'res' is fixed"):
        scan(fixed_model, "res", [0.0])
    # user bounds that admit a negative POI (q-like) allow a scan there
    bounds = ours_model.bounds[0].clone()
    bounds[ours_model.poi_index, 0] = -1.0
    res = scan(ours_model, "mu_SIG", [-0.5, 0.0], bounds=bounds)
    assert res.delta_nlls.shape == (1, 2)


def test_scans_run_on_fake_cuda(monkeypatch):
    """The batched free and conditional fits, the Hessian and the differences of a 1D and a
    2D scan on a simulated cuda device (the exact Hessian swapped for the Fisher matrix: see
    ``test_inference_ranking.test_ranking_runs_on_fake_cuda``)."""
    from test_engine_device import small_patchset_model
    from test_inference_ranking import fisher_hessian
    from test_inference_support import assert_on_fake_cuda
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr("pyhf_gpu_server.inference.objective.TwiceNLL.hessian", fisher_hessian)
    options = FitOptions(minimize=MinimizeOptions(max_iter=3, check_every=0))
    with FakeTensorMode():
        model = small_patchset_model("cuda:0")
        one = scan(model, "mu_SIG", [0.0, 1.0, 2.0], options=options)
        two = scan2d(model, ("mu_SIG", "ttbar_Gen"), [0.0, 1.0], [-1.0, 0.0, 1.0], options=options)
        auto = scan2d(
            model, ("mu_SIG", "ttbar_Gen"), None, [-1.0, 1.0], options=options, steps=(3, 3)
        )
        tensors = (one.delta_nlls, one.uncertainty, one.converged, two.delta_nlls, two.bestfit)
        assert_on_fake_cuda((*tensors, auto.delta_nlls, *auto.parameter_values))
        assert two.delta_nlls.shape == (model.n_elements, 2, 3)
        assert auto.parameter_values[0].shape == (model.n_elements, 3)


def test_docstring_examples():
    failures, attempted = doctest.testmod(
        importlib.import_module("pyhf_gpu_server.inference.scan"), optionflags=doctest.ELLIPSIS
    )
    assert attempted > 0 and failures == 0
