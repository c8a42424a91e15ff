"""Pre- and post-fit yields with uncertainties equal cabinetry's ``model_utils.prediction``.

cabinetry is run in the test on the same workspace (BkgOnly + the first patch of the shared
patchset): pre-fit exactly; post-fit fed OUR best fit, uncertainties and correlations (the
yield computation alone), and separately with cabinetry's own MINUIT fit, where the
remaining differences come from MINUIT (its minimum, and its finite-difference HESSE).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import cabinetry
import numpy as np
import pyhf
import pytest
import torch
from cabinetry.fit.results_containers import FitResults as CabinetryFitResults
from conftest import WORKSPACES_DIR, load_patchset, shared_workspace
from test_engine_device import small_patchset_model
from test_inference_support import (
    assert_on_fake_cuda,
    fake_cuda_fit,
    one_thread,  # noqa: F401 (fixture)
)
from torch._subclasses.fake_tensor import FakeTensorMode

from pyhf_gpu_server.engine import HistFactoryModel
from pyhf_gpu_server.inference import FitResults, YieldSet, fit, yields
from pyhf_gpu_server.inference.constraints import asimov_parameters, prefit_uncertainties
from pyhf_gpu_server.service.operations.yields import channel_yields

pytestmark = pytest.mark.usefixtures("one_thread")
logging.getLogger("cabinetry").setLevel(logging.WARNING)

SMALL = "atlas-susy-2018-31-sbottom-B"  # 3 channels of 1 bin, 60 parameters
STAU = "atlas-susy-2018-04-stau"  # 5 channels, 8 samples, histosys
THREE_L = "atlas-susy-2019-09-3l-onshell"  # 23 channels, 13 samples, 115 parameters
EXACT = 1e-9  # the same numbers computed in another order


@dataclass
class Case:
    model: HistFactoryModel
    cab_model: pyhf.Model
    cab_data: list[float]
    result: object  # YieldsResults


def first_patch(name: str) -> tuple[dict, pyhf.patchset.Patch, pyhf.Workspace]:
    workspace, patchset, _ = shared_workspace(name)
    patch = pyhf.PatchSet(patchset)[patchset["patches"][0]["metadata"]["name"]]
    return workspace, patch, patch.apply(pyhf.Workspace(workspace))


@pytest.fixture(scope="module", params=[SMALL, STAU, THREE_L])
def case(request) -> Case:
    workspace, patch, full = first_patch(request.param)
    model = HistFactoryModel.from_workspace(workspace, patches=[patch])
    cab_model, cab_data = cabinetry.model_utils.model_and_data(dict(full))
    return Case(model, cab_model, cab_data, yields(model))


def cabinetry_arrays(prediction) -> dict[str, np.ndarray]:
    """cabinetry's prediction in our layout: samples x bins, channels concatenated."""
    stdev_bins = np.concatenate([np.asarray(c) for c in prediction.total_stdev_model_bins], 1)
    stdev_channels = np.asarray(prediction.total_stdev_model_channels).T  # [S + 1, C]
    yields_ = np.concatenate([np.asarray(c) for c in prediction.model_yields], axis=1)
    return {
        "yields": yields_,
        "stdev": stdev_bins[:-1],
        "total": yields_.sum(0),
        "total_stdev": stdev_bins[-1],
        "channel_stdev": stdev_channels[:-1],
        "channel_total_stdev": stdev_channels[-1],
    }


def assert_matches(part: YieldSet, prediction, row: int, rtol: float) -> None:
    reference = cabinetry_arrays(prediction)
    n_samples = reference["yields"].shape[0]
    ours = {
        "yields": part.yields[row, :n_samples],
        "stdev": part.stdev[row, :n_samples],
        "total": part.total[row],
        "total_stdev": part.total_stdev[row],
        "channel_stdev": part.channel_stdev[row, :n_samples],
        "channel_total_stdev": part.channel_total_stdev[row],
    }
    for key, expected in reference.items():
        np.testing.assert_allclose(
            ours[key].numpy(), expected, rtol=rtol, atol=rtol * 1e-6, err_msg=key
        )
    channel_sums = np.stack([np.sum(c, axis=-1) for c in prediction.model_yields], axis=1)
    np.testing.assert_allclose(
        part.channel_yields[row, :n_samples].numpy(), channel_sums, rtol=rtol
    )


def test_prefit_matches_cabinetry(case):
    assert case.model.sample_names(0) == case.cab_model.config.samples
    np.testing.assert_array_equal(
        asimov_parameters(case.model)[0].numpy(),
        cabinetry.model_utils.asimov_parameters(case.cab_model),
    )
    np.testing.assert_allclose(
        prefit_uncertainties(case.model)[0].numpy(),
        cabinetry.model_utils.prefit_uncertainties(case.cab_model),
        rtol=1e-15,
    )
    assert_matches(case.result.prefit, cabinetry.model_utils.prediction(case.cab_model), 0, EXACT)


def test_postfit_fed_our_fit_matches_cabinetry(case):
    fitted = case.result.fit
    assert bool(case.result.converged[0])
    assert torch.isfinite(fitted.uncertainty).all()
    ours = CabinetryFitResults(
        fitted.bestfit[0].numpy(),
        fitted.uncertainty[0].numpy(),
        case.cab_model.config.par_names,
        fitted.corr_mat[0].numpy(),
        float(fitted.best_twice_nll[0]),
    )
    prediction = cabinetry.model_utils.prediction(case.cab_model, fit_results=ours)
    assert_matches(case.result.postfit, prediction, 0, EXACT)


def test_data_and_json_match_cabinetrys_tables(case):
    """``POST /yields``' answer (:func:`channel_yields`) holds the numbers of cabinetry's yield
    tables (per bin and per channel)."""
    result, cab_model = case.result, case.cab_model
    data = cabinetry.model_utils._data_per_channel(cab_model, case.cab_data)
    np.testing.assert_array_equal(result.data[0].numpy(), np.concatenate(data))
    assert result.converged.tolist() == [True]
    for label, fit_results in (("prefit", None), ("postfit", result.fit)):
        if fit_results is not None:
            f = fit_results
            fit_results = CabinetryFitResults(
                f.bestfit[0].numpy(),
                f.uncertainty[0].numpy(),
                cab_model.config.par_names,
                f.corr_mat[0].numpy(),
                float(f.best_twice_nll[0]),
            )
        prediction = cabinetry.model_utils.prediction(cab_model, fit_results=fit_results)
        tables = cabinetry.tabulate.yields(
            prediction, case.cab_data, per_bin=True, per_channel=True, save_tables=False
        )
        channels = {
            name: entry.model_dump()
            for name, entry in channel_yields(result, getattr(result, label), 0).items()
        }
        assert list(channels) == cab_model.config.channels
        per_bin = {r["sample"]: r for r in tables["yields_per_bin"]}
        per_channel = {r["sample"]: r for r in tables["yields_per_channel"]}
        for name, channel in channels.items():
            assert channel["bins"] == cab_model.config.channel_nbins[name]
            assert list(channel["samples"]) == cab_model.config.samples
            entries = {**channel["samples"], "total": channel["total"]}
            for sample, entry in entries.items():
                for b in range(channel["bins"]):
                    cell = f"{entry['yields'][b]:.2f} \u00b1 {entry['stdev'][b]:.2f}"
                    assert per_bin[sample][f"{name}\nbin {b + 1}"] == cell
                cell = f"{entry['channel_yield']:.2f} \u00b1 {entry['channel_stdev']:.2f}"
                assert per_channel[sample][name] == cell
            assert [f"{d:.2f}" for d in channel["data"]] == [
                per_bin["data"][f"{name}\nbin {b + 1}"] for b in range(channel["bins"])
            ]
            assert f"{channel['channel_data']:.2f}" == per_channel["data"][name]


@pytest.mark.slow
@pytest.mark.parametrize("name", [SMALL, STAU])
def test_postfit_close_to_cabinetrys_own_fit(name):
    """cabinetry's own MINUIT fit (tight tolerance, strategy 2), with the POI fixed at 1 (a
    free POI sits at its bound 0 here, where MINUIT's limit transformation changes its HESSE
    error): the minima agree (ours at least as low), so the yields agree to ~1e-4; the
    stdevs differ by up to a few per cent because MINUIT's HESSE is a finite-difference
    Hessian (weakly constrained nuisance parameters come out ~1.5% apart), while ours is
    exact: it equals the autograd Hessian of pyhf's own likelihood (pytorch backend)."""
    workspace, patch, full = first_patch(name)
    model = HistFactoryModel.from_workspace(workspace, patches=[patch])
    cab_model, cab_data = cabinetry.model_utils.model_and_data(dict(full))
    poi = cab_model.config.poi_index
    fixed = cab_model.config.suggested_fixed()
    fixed[poi] = True
    init = cab_model.config.suggested_init()
    init[poi] = 1.0
    theirs = cabinetry.fit.fit(
        cab_model, cab_data, fix_pars=fixed, init_pars=init, tolerance=1e-5, strategy=2
    )
    ours = fit(model, fixed_poi=1.0)
    result = yields(model, fit=ours)
    assert float(ours.best_twice_nll[0]) <= theirs.best_twice_nll + 1e-7
    np.testing.assert_allclose(ours.bestfit[0].numpy(), theirs.bestfit, atol=2e-4)
    prediction = cabinetry.model_utils.prediction(cab_model, fit_results=theirs)
    reference = cabinetry_arrays(prediction)
    n_samples = reference["yields"].shape[0]
    np.testing.assert_allclose(
        result.postfit.yields[0, :n_samples].numpy(), reference["yields"], rtol=2e-4, atol=1e-6
    )
    np.testing.assert_allclose(
        result.postfit.stdev[0, :n_samples].numpy(), reference["stdev"], rtol=6e-2, atol=1e-6
    )
    np.testing.assert_allclose(
        result.postfit.total_stdev[0].numpy(), reference["total_stdev"], rtol=3e-2
    )
    np.testing.assert_allclose(ours.uncertainty[0].numpy(), theirs.uncertainty, rtol=3e-2)
    np.testing.assert_allclose(
        ours.uncertainty[0].numpy(), exact_uncertainty(full, ours, fixed), rtol=1e-8
    )


def exact_uncertainty(full: pyhf.Workspace, ours: FitResults, fixed: list[bool]) -> np.ndarray:
    """``sqrt(diag(inv(H / 2)))`` of pyhf's ``-2 log L`` at our best fit, by autograd on
    pyhf's pytorch backend (restored to the previous backend afterwards)."""
    backend = pyhf.get_backend()
    pyhf.set_backend("pytorch", precision="64b")
    try:
        model, data = cabinetry.model_utils.model_and_data(dict(full))
        data = torch.as_tensor(data, dtype=torch.float64)
        x = ours.bestfit[0].clone()
        free = ~torch.tensor(fixed)

        def nll(values):
            return -model.logpdf(x.masked_scatter(free, values), data)[0]

        hessian = torch.autograd.functional.hessian(nll, x[free])
    finally:
        pyhf.set_backend(*backend)
    unc = torch.zeros_like(x)
    unc[free] = torch.linalg.inv(hessian).diagonal().sqrt()
    return unc.numpy()


def stacked_fit(stacked: HistFactoryModel, singles: list[FitResults]) -> FitResults:
    """One FitResults of the stacked model with each element's row set to its single fit
    (the parameters an element lacks: held at its start value, no uncertainty)."""
    rows = []
    for e, single in enumerate(singles):
        columns = torch.tensor(stacked.element_columns(e))
        x = stacked.init[e].clone()
        x[columns] = single.bestfit[0]
        unc = torch.zeros_like(x)
        unc[columns] = single.uncertainty[0]
        corr = torch.zeros(stacked.n_pars, stacked.n_pars, dtype=x.dtype)
        corr[columns.unsqueeze(1), columns.unsqueeze(0)] = single.corr_mat[0]
        rows.append((x, unc, corr, single))
    element = torch.arange(len(singles))
    cat = torch.cat
    return FitResults(
        bestfit=torch.stack([r[0] for r in rows]),
        uncertainty=torch.stack([r[1] for r in rows]),
        corr_mat=torch.stack([r[2] for r in rows]),
        best_twice_nll=cat([r[3].best_twice_nll for r in rows]),
        deviance=cat([r[3].deviance for r in rows]),
        converged=cat([r[3].converged for r in rows]),
        iterations=cat([r[3].iterations for r in rows]),
        labels=list(stacked.par_names),
        element=element,
        starts=cat([r[3].starts for r in rows]),
        starts_agreed=cat([r[3].starts_agreed for r in rows]),
    )


def test_stacked_model_equals_each_patch_alone():
    """Two patches of a heterogeneous patchset (different modifiers, so different parameter
    columns) in one model give each patch's yields alone, given the same fits."""
    workspace = shared_workspace(STAU)[0]
    patchset = load_patchset(WORKSPACES_DIR / STAU / "patchset.heterogeneous.json")
    names = [p["metadata"]["name"] for p in patchset["patches"]][:2]
    stacked = HistFactoryModel.from_patchset(workspace, patchset, patch_names=names)
    assert stacked.element_columns(0) != stacked.element_columns(1)
    singles = [
        HistFactoryModel.from_workspace(workspace, patches=[pyhf.PatchSet(patchset)[n]])
        for n in names
    ]
    fits = [fit(single) for single in singles]
    alone = [yields(single, fit=f) for single, f in zip(singles, fits, strict=True)]
    together = yields(stacked, fit=stacked_fit(stacked, fits))
    for e, (single, result) in enumerate(zip(singles, alone, strict=True)):
        assert stacked.sample_names(e) == single.sample_names(0)
        n = len(single.sample_names(0))
        for label in ("prefit", "postfit"):
            mine, theirs = getattr(together, label), getattr(result, label)
            for key in ("yields", "stdev", "channel_yields", "channel_stdev"):
                torch.testing.assert_close(
                    getattr(mine, key)[e, :n], getattr(theirs, key)[0, :n], rtol=1e-10, atol=1e-10
                )
                assert not getattr(mine, key)[e, n:].any()  # padding slots are empty
            for key in ("total", "total_stdev", "channel_total", "channel_total_stdev"):
                torch.testing.assert_close(
                    getattr(mine, key)[e], getattr(theirs, key)[0], rtol=1e-10, atol=1e-10
                )
        # the answers name each patch's own samples only (no padding slots)
        mine, theirs = (
            channel_yields(together, together.prefit, e),
            channel_yields(result, result.prefit, 0),
        )
        assert {c: list(v.samples) for c, v in mine.items()} == {
            c: list(v.samples) for c, v in theirs.items()
        }


def test_sample_rates_of_a_stacked_model_are_pyhfs():
    """The engine's per-sample rates (row's own element's samples, pyhf's order) equal
    pyhf's ``return_by_sample`` and sum to ``expected_data``."""
    workspace = shared_workspace(STAU)[0]
    patchset = load_patchset(WORKSPACES_DIR / STAU / "patchset.heterogeneous.json")
    names = [p["metadata"]["name"] for p in patchset["patches"]][:3]
    stacked = HistFactoryModel.from_patchset(workspace, patchset, patch_names=names)
    element = torch.arange(3).repeat(2)
    generator = torch.Generator().manual_seed(3)
    noise = torch.rand(6, stacked.n_pars, generator=generator, dtype=torch.float64) - 0.5
    pars = stacked.init.index_select(0, element) + 0.2 * noise
    rates = stacked.sample_rates(pars, element)
    assert rates.shape == (6, stacked.n_samples, stacked.n_main)
    torch.testing.assert_close(
        rates.sum(1),
        stacked.expected_data(pars, element, include_auxdata=False),
        rtol=1e-12,
        atol=0,
    )
    patches = pyhf.PatchSet(patchset)
    models = [patches[n].apply(pyhf.Workspace(workspace)).model() for n in names]
    for row in range(6):
        e = int(element[row])
        model = models[e]
        assert stacked.sample_names(e) == model.config.samples
        expected = model.main_model.expected_data(
            pars[row, stacked.element_columns(e)].numpy(), return_by_sample=True
        )
        np.testing.assert_allclose(
            rates[row, : len(model.config.samples)].numpy(), expected, rtol=1e-12, atol=1e-12
        )


def test_yields_on_fake_cuda():
    """Pre- and post-fit yields of a stacked model on a simulated cuda device: every output
    on the device, any cpu tensor in the computation would raise."""
    with FakeTensorMode():
        model = small_patchset_model("cuda")
        element = torch.arange(model.n_elements, device="cuda").repeat(2)
        B, P = element.shape[0], model.n_pars
        x = model.init.index_select(0, element)
        corr = torch.eye(P, dtype=model.dtype, device="cuda").expand(B, P, P)
        given = fake_cuda_fit(model, element, 0.1, corr)
        result = yields(model, fit=given)
        sample_rates = model.sample_rates(x, element)
        for part in (result.prefit, result.postfit):
            assert_on_fake_cuda(vars(part).values())
        assert_on_fake_cuda((result.data, result.channel_data, result.converged, sample_rates))
