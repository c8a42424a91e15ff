"""Saturated-model goodness of fit equals cabinetry's ``fit.goodness_of_fit``.

cabinetry is run in the test: fed our best-fit ``-2 log L`` (``fit._goodness_of_fit``, the
function behind ``fit(..., goodness_of_fit=True)``) it gives the same p-value; its own fit
gives a p-value that differs only through its (slightly higher) minimum.
"""

from __future__ import annotations

import logging

import cabinetry
import numpy as np
import pyhf
import pytest
import scipy.stats
import torch
from cabinetry.fit import _goodness_of_fit
from conftest import WORKSPACES_DIR, load_patchset, shared_workspace
from test_engine_device import small_patchset_model
from test_inference_support import (
    assert_on_fake_cuda,
    fake_cuda_fit,
    one_thread,  # noqa: F401 (fixture)
)
from torch._subclasses.fake_tensor import FakeTensorMode

from pyhf_gpu_server.engine import HistFactoryModel
from pyhf_gpu_server.inference import FitResults, fit, goodness_of_fit
from pyhf_gpu_server.service.operations.fit import goodness_answer

pytestmark = pytest.mark.usefixtures("one_thread")
logging.getLogger("cabinetry").setLevel(logging.ERROR)

SMALL = "atlas-susy-2018-31-sbottom-B"
STAU = "atlas-susy-2018-04-stau"
THREE_L = "atlas-susy-2019-09-3l-onshell"


def first_patch(name: str):
    workspace, patchset, _ = shared_workspace(name)
    patch = pyhf.PatchSet(patchset)[patchset["patches"][0]["metadata"]["name"]]
    full = patch.apply(pyhf.Workspace(workspace))
    model = HistFactoryModel.from_workspace(workspace, patches=[patch])
    cab_model, cab_data = cabinetry.model_utils.model_and_data(dict(full))
    return model, cab_model, cab_data


def n_dof(cab_model) -> int:
    bins = sum(cab_model.config.channel_nbins.values())
    return bins - cabinetry.model_utils.unconstrained_parameter_count(cab_model)


@pytest.mark.parametrize("name", [SMALL, STAU, THREE_L])
def test_goodness_of_fit_matches_cabinetry(name):
    model, cab_model, _ = first_patch(name)
    # the observed data, and a second dataset with every main count raised by 2
    shifted = torch.cat([model.observed[0, : model.n_main] + 2, model.observed[0, model.n_main :]])
    data = torch.stack([model.observed[0], shifted])
    ours = fit(model, data, uncertainties=False)
    assert ours.converged.all()
    gof = goodness_of_fit(model, ours, data)
    assert gof.ndof.tolist() == [n_dof(cab_model)] * 2
    for row in range(2):
        best = float(ours.best_twice_nll[row])
        expected = _goodness_of_fit(cab_model, data[row].tolist(), best)
        assert abs(float(gof.p_value[row]) - expected) <= 1e-6 * max(expected, 1e-3)
        # the same Delta(-2 ln L) as cabinetry's best_twice_nll - 2 * saturated NLL
        assert float(gof.delta_twice_nll[row]) == pytest.approx(
            best - float(gof.saturated_twice_nll[row]), rel=1e-9, abs=1e-9
        )
        assert float(gof.p_value[row]) == pytest.approx(
            scipy.stats.chi2.sf(float(gof.delta_twice_nll[row]), int(gof.ndof[row])), rel=1e-10
        )
    answer = goodness_answer(gof)  # POST /fit's goodness_of_fit
    assert answer.ndof == n_dof(cab_model) and gof.converged.tolist()[0] is True
    assert answer.p_value == float(gof.p_value[0])


@pytest.mark.parametrize("name", [SMALL, STAU])
def test_close_to_cabinetrys_own_fit(name):
    """cabinetry's ``fit(goodness_of_fit=True)`` with its own MINUIT fit (default settings):
    its minimum is at most ~1e-3 higher than ours, and that alone is the difference: our
    formula at its ``best_twice_nll`` gives its p-value."""
    model, cab_model, cab_data = first_patch(name)
    ours = fit(model, uncertainties=False)
    gof = goodness_of_fit(model, ours)
    theirs = cabinetry.fit.fit(cab_model, cab_data, goodness_of_fit=True)
    excess = theirs.best_twice_nll - float(ours.best_twice_nll[0])
    assert -1e-7 <= excess <= 2e-3
    assert abs(float(gof.p_value[0]) - theirs.goodness_of_fit) <= 2e-3
    theirs_delta = theirs.best_twice_nll - float(gof.saturated_twice_nll[0])
    assert scipy.stats.chi2.sf(theirs_delta, int(gof.ndof[0])) == pytest.approx(
        theirs.goodness_of_fit, rel=1e-9
    )


def small_workspace(bins: int, fixed_poi: bool) -> dict:
    spec = pyhf.simplemodels.uncorrelated_background(
        [12.0, 11.0][:bins], [50.0, 52.0][:bins], [3.0, 7.0][:bins]
    ).spec
    parameters = [{"name": "mu", "fixed": True, "inits": [1.0]}] if fixed_poi else []
    return {
        **spec,
        "observations": [{"name": "singlechannel", "data": [51.0, 48.0][:bins]}],
        "measurements": [{"name": "m", "config": {"poi": "mu", "parameters": parameters}}],
        "version": "1.0.0",
    }


@pytest.mark.parametrize(("bins", "fixed_poi", "dof"), [(1, False, 0), (2, False, 1), (2, True, 2)])
def test_degrees_of_freedom(bins, fixed_poi, dof):
    """Fixed parameters do not count; without degrees of freedom the p-value is NaN (as
    cabinetry's)."""
    workspace = small_workspace(bins, fixed_poi)
    model = HistFactoryModel.from_workspace(workspace)
    cab_model, cab_data = cabinetry.model_utils.model_and_data(workspace)
    ours = fit(model, uncertainties=False)
    gof = goodness_of_fit(model, ours)
    assert int(gof.ndof[0]) == dof == n_dof(cab_model)
    expected = _goodness_of_fit(cab_model, cab_data, float(ours.best_twice_nll[0]))
    if dof == 0:
        assert np.isnan(expected) and torch.isnan(gof.p_value[0])
        assert goodness_answer(gof).p_value is None
    else:
        assert float(gof.p_value[0]) == pytest.approx(expected, rel=1e-9)


def test_stacked_model_equals_each_patch_alone():
    """Two patches of a heterogeneous patchset in one model: each row's goodness of fit is
    its patch's alone, given the same best fits."""
    workspace = shared_workspace(STAU)[0]
    patchset = load_patchset(WORKSPACES_DIR / STAU / "patchset.heterogeneous.json")
    names = [p["metadata"]["name"] for p in patchset["patches"]][:2]
    stacked = HistFactoryModel.from_patchset(workspace, patchset, patch_names=names)
    singles = [
        HistFactoryModel.from_workspace(workspace, patches=[pyhf.PatchSet(patchset)[n]])
        for n in names
    ]
    fits = [fit(single, uncertainties=False) for single in singles]
    bestfit = stacked.init.clone()
    for e, single in enumerate(fits):
        bestfit[e, stacked.element_columns(e)] = single.bestfit[0]
    together = goodness_of_fit(stacked, _with_bestfit(fits, bestfit, stacked.par_names))
    for e, (single, f) in enumerate(zip(singles, fits, strict=True)):
        alone = goodness_of_fit(single, f)
        assert int(together.ndof[e]) == int(alone.ndof[0])
        for key in ("p_value", "delta_twice_nll", "saturated_twice_nll"):
            torch.testing.assert_close(
                getattr(together, key)[e], getattr(alone, key)[0], rtol=1e-10, atol=1e-10
            )


def _with_bestfit(fits: list[FitResults], bestfit: torch.Tensor, labels: list[str]) -> FitResults:
    """The fits' rows stacked, with ``bestfit`` in the stacked model's columns."""
    B, P = bestfit.shape

    def cat(key):
        return torch.cat([getattr(f, key) for f in fits])

    return FitResults(
        bestfit=bestfit,
        uncertainty=torch.full_like(bestfit, torch.nan),
        corr_mat=torch.full((B, P, P), torch.nan, dtype=bestfit.dtype),
        best_twice_nll=cat("best_twice_nll"),
        deviance=cat("deviance"),
        converged=cat("converged"),
        iterations=cat("iterations"),
        labels=list(labels),
        element=torch.arange(B),
        starts=cat("starts"),
        starts_agreed=cat("starts_agreed"),
    )


def test_goodness_of_fit_on_fake_cuda():
    with FakeTensorMode():
        model = small_patchset_model("cuda")
        element = torch.arange(model.n_elements, device="cuda").repeat(2)
        B, P = element.shape[0], model.n_pars
        corr = torch.zeros(B, P, P, dtype=model.dtype, device="cuda")
        given = fake_cuda_fit(model, element, float("nan"), corr)
        assert_on_fake_cuda(vars(goodness_of_fit(model, given)).values())
