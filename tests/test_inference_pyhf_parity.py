"""Parity with pyhf computed in the test: fits, q / qtilde / q0 hypotests, upper limits,
significance, on pyhf.simplemodels and on the smallest shared workspace (sbottom-B)."""

from __future__ import annotations

from functools import cache

import numpy as np
import pyhf
import pytest
import torch
from conftest import shared_workspace
from pyhf_global import pyhf_upper_limit
from scipy.stats import norm
from test_inference_support import DEVICE, as_workspace, one_thread  # noqa: F401 (fixture)

from pyhf_gpu_server.engine import HistFactoryModel
from pyhf_gpu_server.inference import (
    FitOptions,
    MinimizeOptions,
    fit,
    fixed_poi_fit,
    hypotest,
    significance,
    upper_limit,
)
from pyhf_gpu_server.service.operations.fit import fit_answer

TEST_POIS = [0.2, 0.5, 1.0, 1.5, 2.5]
TIGHT = FitOptions(minimize=MinimizeOptions(tol=1e-12))

pytestmark = pytest.mark.usefixtures("one_thread")


SIMPLE = {
    "uncorrelated": (
        lambda: pyhf.simplemodels.uncorrelated_background([12.0, 11.0], [50.0, 52.0], [3.0, 7.0]),
        [51.0, 48.0],
    ),
    "correlated": (
        lambda: pyhf.simplemodels.correlated_background(
            [12.0, 11.0], [50.0, 52.0], [45.0, 47.0], [55.0, 59.0]
        ),
        [53.0, 57.0],
    ),
    "excess": (
        lambda: pyhf.simplemodels.uncorrelated_background([12.0, 11.0], [50.0, 52.0], [3.0, 7.0]),
        [62.0, 61.0],
    ),
    "strong": (  # p-values of 1e-89 .. 1e-18: the normal distribution's far tail
        lambda: pyhf.simplemodels.uncorrelated_background([90.0, 70.0], [50.0, 52.0], [2.0, 3.0]),
        [112.0, 96.0],
    ),
}


@cache
def simple(name: str) -> tuple[pyhf.Model, list[float], HistFactoryModel]:
    make, observations = SIMPLE[name]
    pyhf_model = make()
    ours = HistFactoryModel.from_workspace(as_workspace(pyhf_model, observations), device=DEVICE)
    return pyhf_model, observations + pyhf_model.config.auxdata, ours


@pytest.fixture(autouse=True)
def numpy_backend():
    pyhf.set_backend("numpy")


@pytest.mark.parametrize("name", sorted(SIMPLE))
@pytest.mark.parametrize("test_stat", ["qtilde", "q"])
def test_hypotest_scan_matches_pyhf(name, test_stat):
    pyhf_model, data, model = simple(name)
    bounds = None
    pyhf_bounds = pyhf_model.config.suggested_bounds()
    if test_stat == "q":  # pyhf's q example: the POI may go negative
        pyhf_bounds[pyhf_model.config.poi_index] = [-10.0, 10.0]
        bounds = torch.tensor(pyhf_bounds, dtype=model.dtype, device=model.device)
    ours = hypotest(model, TEST_POIS, test_stat=test_stat, bounds=bounds)  # one batched call
    assert ours.converged.all()
    for i, mu in enumerate(TEST_POIS):
        obs, exp = pyhf.infer.hypotest(
            mu,
            data,
            pyhf_model,
            par_bounds=pyhf_bounds,
            test_stat=test_stat,
            return_expected_set=True,
        )
        assert ours.cls_obs[i].item() == pytest.approx(float(obs), abs=5e-5)
        assert ours.cls_exp[i].tolist() == pytest.approx([float(e) for e in exp], abs=5e-5)


@pytest.mark.parametrize("name", ["excess", "correlated"])
def test_q0_and_significance_match_pyhf(name):
    pyhf_model, data, model = simple(name)
    p0, p0_exp = pyhf.infer.hypotest(
        0.0, data, pyhf_model, test_stat="q0", return_expected_set=True
    )
    ours = hypotest(model, 0.0, test_stat="q0")
    assert ours.observed().item() == pytest.approx(float(p0), abs=2e-4)
    assert ours.expected()[0].tolist() == pytest.approx([float(p) for p in p0_exp], abs=2e-4)
    found = significance(model)
    assert found.p0_obs.item() == pytest.approx(float(p0), abs=2e-4)
    assert found.z_obs.item() == pytest.approx(
        -float(torch.special.ndtri(torch.tensor(float(p0)))), abs=5e-3
    )


def test_far_tail_p_values_and_significances_match_pyhf_relatively():
    """CLs and p0 far below 1e-16 (an excess of 8.7 sigma), to their relative precision:
    pyhf's, from scipy's ``ndtr``, with its fits at a tight tolerance; Z as cabinetry's
    ``norm.isf(p0)``. (``torch.special.ndtr`` returns 0 there.)"""
    pyhf_model, data, model = simple("strong")
    pyhf.set_backend("numpy", pyhf.optimize.scipy_optimizer(tolerance=1e-12))
    for mu in (1.0, 2.0):
        obs, exp = pyhf.infer.hypotest(mu, data, pyhf_model, return_expected_set=True)
        ours = hypotest(model, mu, options=TIGHT)
        assert 0 < ours.cls_exp.min() < 1e-30
        assert ours.cls_obs.item() == pytest.approx(float(obs), rel=1e-5)
        assert ours.cls_exp[0].tolist() == pytest.approx([float(e) for e in exp], rel=1e-5)
    p0, p0_exp = pyhf.infer.hypotest(
        0.0, data, pyhf_model, test_stat="q0", return_expected_set=True
    )
    found = significance(model, options=TIGHT)
    assert 1e-20 < found.p0_obs.item() < 1e-16
    assert found.p0_obs.item() == pytest.approx(float(p0), rel=1e-5)
    assert found.p0_exp_set[0].tolist() == pytest.approx([float(p) for p in p0_exp], rel=1e-5)
    assert found.z_obs.item() == pytest.approx(float(norm.isf(float(p0))), rel=1e-6)
    assert found.z_exp.item() == pytest.approx(float(norm.isf(float(p0_exp[2]))), rel=1e-6)


@pytest.mark.parametrize("name", ["uncorrelated", "correlated"])
def test_upper_limits_match_pyhf(name):
    pyhf_model, data, model = simple(name)
    obs, exp = pyhf_upper_limit(data, pyhf_model)
    ours = upper_limit(model)
    assert ours.converged.all()
    assert ours.obs.item() == pytest.approx(float(obs), rel=1e-3)
    assert ours.exp[0].tolist() == pytest.approx([float(e) for e in exp], rel=1e-3)

    scan = np.linspace(0.0, 5.0, 11)
    obs, exp = pyhf.infer.intervals.upper_limits.upper_limit(
        data, pyhf_model, scan=scan, level=0.05
    )
    ours = upper_limit(model, scan=scan)
    assert ours.obs.item() == pytest.approx(float(obs), rel=1e-3)
    assert ours.exp[0].tolist() == pytest.approx([float(e) for e in exp], rel=1e-3)


def test_upper_limits_below_every_first_probe_match_pyhf():
    """A strong signal puts every limit below the root search's first tested values, so
    brackets are approached from above: the limits still equal pyhf's."""
    pyhf_model = pyhf.simplemodels.uncorrelated_background([600.0, 550.0], [50.0, 52.0], [3.0, 7.0])
    observations = [51.0, 48.0]
    model = HistFactoryModel.from_workspace(as_workspace(pyhf_model, observations), device=DEVICE)
    data = observations + pyhf_model.config.auxdata
    obs, exp = pyhf_upper_limit(data, pyhf_model)
    ours = upper_limit(model)
    assert ours.obs.item() < 0.03
    assert ours.converged.all()
    assert ours.obs.item() == pytest.approx(float(obs), rel=1e-3)
    assert ours.exp[0].tolist() == pytest.approx([float(e) for e in exp], rel=1e-3)


def test_later_calculator_calls_start_warm_and_find_the_same_results():
    """The root search calls one calculator again and again; those calls start their fits at
    earlier minima. Their results equal a fresh calculator's (cold starts)."""
    from pyhf_gpu_server.inference.hypotest import make_calculator, run_calculator
    from pyhf_gpu_server.inference.rows import rows_of

    _, _, model = simple("correlated")
    first, later = torch.tensor([1.0, 3.0]), torch.tensor([1.2, 2.0, 2.9])
    datasets, elements, _ = rows_of(model).datasets()
    calc = make_calculator(model, datasets, elements)
    zeros = torch.zeros(3, dtype=torch.long, device=model.device)
    run_calculator(calc, first.to(model.dtype).to(model.device), zeros[:2])
    warm = run_calculator(calc, later.to(model.dtype).to(model.device), zeros)
    starts = calc.conditional_minima[2]
    assert starts.shape[0] == 5 and not torch.allclose(starts[0], model.init[0])
    cold = hypotest(model, later.tolist())
    assert warm.converged.all()
    assert warm.cls_obs.tolist() == pytest.approx(cold.cls_obs.tolist(), abs=1e-7)
    assert warm.cls_exp.flatten().tolist() == pytest.approx(
        cold.cls_exp.flatten().tolist(), abs=1e-7
    )


def test_upper_limit_beyond_the_poi_bound_widens_it():
    _, _, model = simple("uncorrelated")
    bounds = model.bounds[0].clone()
    bounds[model.poi_index, 1] = 0.5  # every limit lies above this bound
    ours = upper_limit(model, bounds=bounds)
    wide = upper_limit(model)
    assert ours.converged.all()
    assert ours.obs.item() == pytest.approx(wide.obs.item(), rel=1e-4)
    assert ours.exp[0].tolist() == pytest.approx(wide.exp[0].tolist(), rel=1e-4)


def test_fits_are_at_least_as_good_as_pyhf_on_simplemodels():
    for name in SIMPLE:
        pyhf_model, data, model = simple(name)
        _, free = pyhf.infer.mle.fit(data, pyhf_model, return_fitted_val=True)
        ours = fit(model)
        assert ours.converged.all()
        assert ours.best_twice_nll.item() <= float(free) + 1e-6
        for mu in (0.0, 1.0, 3.0):
            _, fixed = pyhf.infer.mle.fixed_poi_fit(mu, data, pyhf_model, return_fitted_val=True)
            assert fixed_poi_fit(model, mu).best_twice_nll.item() <= float(fixed) + 1e-6


def _empty_bin_workspace(background: dict, observed: list[float]) -> dict:
    signal = {
        "name": "signal",
        "data": [1.0, 0.0 if observed[1] == 0 else 1.0],
        "modifiers": [{"name": "mu", "type": "normfactor", "data": None}],
    }
    return {
        "channels": [{"name": "SR", "samples": [signal, background]}],
        "observations": [{"name": "SR", "data": observed}],
        "measurements": [{"name": "m", "config": {"poi": "mu", "parameters": []}}],
        "version": "1.0.0",
    }


#: bins of zero rate and no events, whose Poisson term is linear in the rate there
EMPTY_BINS = {
    # a signal region with no events and a data-driven background (a free shapefactor, as
    # in an ABCD estimate): the best fit empties its first bin (POI and shapefactor on
    # their bound 0)
    "emptied": _empty_bin_workspace(
        {
            "name": "bkg",
            "data": [2.0, 8.0],
            "modifiers": [{"name": "sf", "type": "shapefactor", "data": None}],
        },
        [0.0, 10.0],
    ),
    # a bin where no sample predicts anything and nothing was seen (a histogram's empty tail)
    "empty": _empty_bin_workspace(
        {
            "name": "bkg",
            "data": [5.0, 0.0],
            "modifiers": [{"name": "n", "type": "normsys", "data": {"hi": 1.1, "lo": 0.9}}],
        },
        [7.0, 0.0],
    ),
}


@pytest.mark.parametrize("case", sorted(EMPTY_BINS))
@pytest.mark.parametrize("curvature", ["gauss-newton", "hessian", "fisher"])
def test_fits_with_a_bin_of_zero_rate_and_no_events_converge_to_pyhfs_minimum(case, curvature):
    """A bin of zero rate and zero events has a zero second derivative (not ``0 / 0``: a
    NaN curvature made every step fail, and the fit end not converged above the minimum)."""
    spec = EMPTY_BINS[case]
    workspace = pyhf.Workspace(spec)
    pyhf_model = workspace.model()
    data = workspace.data(pyhf_model)
    pyhf.set_backend("numpy", pyhf.optimize.scipy_optimizer(tolerance=1e-12))
    best, free = pyhf.infer.mle.fit(data, pyhf_model, return_fitted_val=True)
    model = HistFactoryModel.from_workspace(spec, device=DEVICE)
    options = FitOptions(curvature=curvature)
    ours = fit(model, options=options)
    assert ours.converged.all()
    assert ours.best_twice_nll.item() == pytest.approx(float(free), abs=1e-8)
    assert ours.bestfit[0].tolist() == pytest.approx(best.tolist(), abs=1e-5)
    found = hypotest(model, 1.0, options=options)
    assert found.converged.all()
    assert found.cls_obs.item() == pytest.approx(
        float(pyhf.infer.hypotest(1.0, data, pyhf_model)), rel=1e-6
    )


def _sample(name: str, data: list[float], *factors: str) -> dict:
    modifiers = [{"name": f, "type": "normfactor", "data": None} for f in factors]
    return {"name": name, "data": data, "modifiers": modifiers}


#: the signal of channel B also scaled by a free normfactor ``k``: at mu = 0 the likelihood
#: is flat in ``k``, and the data pull mu down there at k = 1 but up at k = 10
GATED = {
    "channels": [
        {
            "name": "A",
            "samples": [_sample("signal", [3.0, 6.0], "mu"), _sample("bkg", [26.9, 88.6])],
        },
        {
            "name": "B",
            "samples": [_sample("signal", [1.4, 2.2], "mu", "k"), _sample("bkg", [42.1, 8.8])],
        },
    ],
    "observations": [{"name": "A", "data": [12.0, 100.0]}, {"name": "B", "data": [34.0, 13.0]}],
    "measurements": [{"name": "m", "config": {"poi": "mu", "parameters": []}}],
    "version": "1.0.0",
}


@pytest.mark.parametrize("test_stat", ["qtilde", "q"])
def test_a_second_signal_normfactor_does_not_hold_the_free_fit_at_poi_zero(test_stat):
    """The free fit to the data starts at the Asimov fit's minimum (POI 0), where a free
    factor of the signal alone is flat; it also starts at the init, as pyhf's does, so it
    finds pyhf's minimum (mu = 0.1, k = 10) rather than staying at mu = 0 (CLs 0.50 for
    pyhf's 0.43)."""
    workspace = pyhf.Workspace(GATED)
    pyhf_model = workspace.model()
    data = workspace.data(pyhf_model)
    pyhf.set_backend("numpy", pyhf.optimize.scipy_optimizer(tolerance=1e-12))
    cls = pyhf.infer.hypotest(0.7, data, pyhf_model, test_stat=test_stat)
    model = HistFactoryModel.from_workspace(GATED, device=DEVICE)
    assert model.has_poi_gated_params
    found = hypotest(model, 0.7, test_stat=test_stat)
    assert found.converged.all()
    assert found.cls_obs.item() == pytest.approx(float(cls), rel=1e-6)
    _, _, uncorrelated = simple("uncorrelated")
    assert not uncorrelated.has_poi_gated_params  # a shapesys: constrained


def test_uncertainties_come_from_the_inverse_hessian_of_the_nll():
    pyhf_model, _, model = simple("correlated")
    ours = fit(model)
    x = ours.bestfit[0].detach().clone()
    H = torch.autograd.functional.hessian(lambda z: model.twice_nll(z[None], model.observed)[0], x)
    free = ~model.fixed[0]
    cov = torch.linalg.inv(0.5 * H[free][:, free])
    assert torch.allclose(ours.uncertainty[0][free], cov.diagonal().sqrt(), rtol=1e-6)
    assert torch.allclose(ours.corr_mat[0].diagonal()[free], torch.ones_like(cov.diagonal()))
    answer = fit_answer(ours)  # POST /fit's
    assert set(answer.mle_parameters) == set(pyhf_model.config.par_order)
    assert answer.twice_nll == pytest.approx(ours.best_twice_nll.item())


@pytest.mark.slow
def test_poi_fixed_fits_on_sbottom_b_are_at_least_as_good_as_pyhf():
    workspace, patchset, _ = shared_workspace("atlas-susy-2018-31-sbottom-B")
    patched = pyhf.PatchSet(patchset).apply(pyhf.Workspace(workspace), "sig_s1_x1")
    pyhf_model = patched.model()
    data = patched.data(pyhf_model)
    model = HistFactoryModel.from_workspace(patched, device=DEVICE)
    pois = [0.0, 1.0, 4.0]
    ours = fixed_poi_fit(
        model, torch.tensor(pois, dtype=model.dtype), element=[0, 0, 0], uncertainties=False
    )
    assert ours.converged.all()
    for i, mu in enumerate(pois):
        _, theirs = pyhf.infer.mle.fixed_poi_fit(mu, data, pyhf_model, return_fitted_val=True)
        assert ours.best_twice_nll[i].item() <= float(theirs) + 1e-6
        assert ours.bestfit[i, model.poi_index].item() == mu


def test_explicit_datasets_and_rows_give_the_same_results_as_observed_data():
    _, _, model = simple("uncorrelated")
    pois = torch.tensor([0.5, 1.0, 2.0], dtype=model.dtype, device=model.device)
    implicit = hypotest(model, pois)
    explicit = hypotest(model, pois, data=model.observed.expand(3, -1))
    assert torch.allclose(implicit.cls_exp, explicit.cls_exp, atol=1e-9)
    single = hypotest(model, 1.0)
    assert single.cls_obs.item() == pytest.approx(implicit.cls_obs[1].item(), abs=1e-9)
    assert fit(model, data=model.observed).best_twice_nll.item() == pytest.approx(
        fit(model).best_twice_nll.item(), abs=1e-9
    )


def precision_workspace(seed: int = 7) -> dict:
    """A precision-measurement-like likelihood: three channels of 20, 15 and 10 bins with
    5e3-8e4 events each, a 2 % signal peak (POI bounds [-5, 10]), two free background
    normalisations, shared normsys and histosys (tilts) of a few per cent, per-bin staterror
    of 1 %: 60 parameters, most per-bin, in a narrow high-statistics valley."""
    rng = np.random.default_rng(seed)
    channels, observations = [], []
    for c, (bins, scale) in enumerate([(20, 2e4), (15, 5e3), (10, 8e4)]):
        x = np.linspace(0, 1, bins)
        backgrounds = [
            scale * np.exp(-3 * x) * (0.5 + rng.random()),
            scale * 0.3 * (1 + x),
            scale * 0.1 * np.ones(bins),
        ]
        peak = 0.02 * scale * np.exp(-(((x - 0.5) / 0.15) ** 2))
        signal_modifiers = [
            {"name": "mu", "type": "normfactor", "data": None},
            {"name": "lumi", "type": "lumi", "data": None},
            {"name": "sig_th", "type": "normsys", "data": {"hi": 1.05, "lo": 0.95}},
        ]
        samples = [{"name": "signal", "data": peak.tolist(), "modifiers": signal_modifiers}]
        for k, nominal in enumerate(backgrounds):
            norm = {"name": f"norm_b{k}", "type": "normfactor", "data": None}
            modifiers = [
                norm if k < 2 else {"name": "lumi", "type": "lumi", "data": None},
                {"name": f"staterror_c{c}", "type": "staterror", "data": (0.01 * nominal).tolist()},
            ]
            for j in rng.choice(12, 4, replace=False):
                if j % 2:
                    band = {"hi": 1 + 0.03 * rng.random(), "lo": 1 - 0.03 * rng.random()}
                    modifiers.append({"name": f"sys{j}", "type": "normsys", "data": band})
                else:
                    tilt = 0.02 * rng.standard_normal() * (x - 0.5)
                    shape = {
                        "hi_data": (nominal * (1 + tilt)).tolist(),
                        "lo_data": (nominal * (1 - tilt)).tolist(),
                    }
                    modifiers.append({"name": f"sys{j}", "type": "histosys", "data": shape})
            samples.append({"name": f"b{k}", "data": nominal.tolist(), "modifiers": modifiers})
        expected = sum(backgrounds) + peak
        channels.append({"name": f"c{c}", "samples": samples})
        observations.append({"name": f"c{c}", "data": rng.poisson(expected).astype(float).tolist()})
    lumi = {
        "name": "lumi",
        "auxdata": [1.0],
        "sigmas": [0.017],
        "bounds": [[0.9, 1.1]],
        "inits": [1.0],
    }
    mu = {"name": "mu", "bounds": [[-5.0, 10.0]], "inits": [1.0]}
    return {
        "channels": channels,
        "observations": observations,
        "measurements": [{"name": "m", "config": {"poi": "mu", "parameters": [lumi, mu]}}],
        "version": "1.0.0",
    }


def test_fits_of_a_high_statistics_precision_likelihood_reach_minuits_minima():
    """On a likelihood of 1e4-1e5 events per bin, pyhf's scipy (tolerance 1e-12) stops up to
    ~1e-3 above the minimum of -2 log L; MINUIT (strategy 2) reaches it. Our free fit and our
    fits at mu = 0 and 1 equal MINUIT's minima, and are at or below scipy's."""
    spec = precision_workspace()
    workspace = pyhf.Workspace(spec)
    model = workspace.model()
    data = workspace.data(model)
    ours = HistFactoryModel.from_workspace(spec, device=DEVICE)
    for poi in (None, 0.0, 1.0):
        result = fit(ours) if poi is None else fixed_poi_fit(ours, poi)
        assert result.converged.item() and result.starts_agreed.item()
        minimum = {}
        for name, optimizer in (
            ("minuit", pyhf.optimize.minuit_optimizer(tolerance=1e-6, strategy=2)),
            ("scipy", pyhf.optimize.scipy_optimizer(tolerance=1e-12)),
        ):
            pyhf.set_backend("numpy", optimizer)
            args = (data, model) if poi is None else (poi, data, model)
            infer = pyhf.infer.mle.fit if poi is None else pyhf.infer.mle.fixed_poi_fit
            try:  # MINUIT's own flags are not always set at its minimum: its value is read
                _, twice_nll = infer(*args, return_fitted_val=True)
            except pyhf.exceptions.FailedMinimization as failed:
                twice_nll = failed.result.fun  # the objective is -2 log L
            minimum[name] = float(twice_nll)
        pyhf.set_backend("numpy")
        value = result.best_twice_nll.item()
        assert value == pytest.approx(minimum["minuit"], abs=1e-6), (poi, value, minimum)
        assert value <= minimum["scipy"] + 1e-9, (poi, value, minimum)
