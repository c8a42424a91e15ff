"""``pyhf_gpu_client.cabinetry`` against cabinetry computed here, through a real server.

The published model is ATLAS-SUSY-2018-31 region A (66 parameters) with the generated signal
``sig_s1_x1``, whose POI fits off its bound (0.77 +- 2.5), so that its impacts and its
observed significance are not truncated at 0. cabinetry's fits run MINUIT at
``tolerance=1e-6`` (its default leaves the flat POI ~0.01 off the minimum, a few percent of
an impact). Two differences are by construction (``tests/test_inference_ranking.py``): post-fit
uncertainties are the exact Hessian's here and MINUIT's HESSE in its bounded internal
coordinates there (0.7% smaller for bounded nuisance parameters, 16% for this POI near its
bound), and post-fit impacts move with them; so uncertainties and impacts are compared at
3e-2 relative, the POI's uncertainty not at all.

cabinetry's upper limit runs ~40 hypothesis tests of 4 MINUIT fits each (400 s on the
published model here), so limits, and significances, are compared on a small model
(``simple_workspace``, 2 bins). cabinetry's
ranking is restricted to the largest few parameters by zeroing the others' uncertainties
(its loop skips a parameter whose uncertainties are 0; ``tests/test_inference_ranking.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import cabinetry
import numpy as np
import pyhf
import pytest
from service_support import ServerProcess, load, simple_workspace

from pyhf_gpu_client import BeyondBoundsWarning, Client
from pyhf_gpu_client import cabinetry as gpu_cabinetry

ANALYSIS, SIGNAL = "atlas-susy-2018-31-sbottom-A", "sig_s1_x1"
MINUIT_TOLERANCE = 1e-6
IMPACT_RTOL = 3e-2  # ranking impacts (and post-fit uncertainties): see the module docstring
LIMIT_RTOL = 1e-3  # limits, p-values and significances
RANKED = 1  # cabinetry's ranking of the largest RANKED impacts (4 MINUIT fits each)

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.filterwarnings("ignore::pyhf_gpu_client.BeyondBoundsWarning"),
]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[Client]:
    with Client(server.url, timeout=600) as c:
        yield c


@pytest.fixture(autouse=True)
def pyhf_backend_restored() -> Iterator[None]:
    """cabinetry sets pyhf's (process-wide) optimizer: restore it after each test."""
    backend = pyhf.get_backend()
    yield
    pyhf.set_backend(*backend)


@pytest.fixture(scope="module")
def spec() -> dict:
    """The published background with the signal applied, as a workspace dict."""
    workspace = pyhf.PatchSet(load(ANALYSIS, "patchset.json")).apply(
        pyhf.Workspace(load(ANALYSIS, "BkgOnly.json")), SIGNAL
    )
    return dict(workspace)


@pytest.fixture(scope="module")
def published(spec: dict) -> tuple[pyhf.pdf.Model, list[float]]:
    return cabinetry.model_utils.model_and_data(spec)


@pytest.fixture(scope="module")
def small() -> tuple[pyhf.pdf.Model, list[float]]:
    return cabinetry.model_utils.model_and_data(simple_workspace())


@pytest.fixture(scope="module")
def their_fit(published) -> cabinetry.fit.FitResults:
    return cabinetry.fit.fit(*published, tolerance=MINUIT_TOLERANCE)


@pytest.fixture(scope="module")
def our_fit(published, client) -> cabinetry.fit.FitResults:
    return gpu_cabinetry.fit(*published, goodness_of_fit=True, client=client)


def assert_figure(path: Path) -> None:
    """cabinetry saved a figure there, and not an empty one."""
    assert path.is_file(), sorted(p.name for p in path.parent.iterdir())
    assert path.stat().st_size > 5_000


def assert_within_sigma(ours, theirs, sigma, fraction: float = 1e-2) -> None:
    """Best fits within ``fraction`` of an uncertainty of each other (MINUIT's flat
    directions are ~1e-3 of one off at tolerance 1e-6)."""
    gap = np.abs(np.asarray(ours) - np.asarray(theirs)) / np.asarray(sigma)
    assert np.all(gap <= fraction), f"worst: {np.max(gap):.3g} uncertainties apart"


# ----------------------------------------------------------------------------------- fit


def test_fit_matches_cabinetry_and_feeds_its_pulls_and_prediction(
    published, their_fit, our_fit, tmp_path
):
    model, data = published
    ours, theirs = our_fit, their_fit
    assert isinstance(ours, cabinetry.fit.FitResults)
    assert ours.labels == theirs.labels == model.config.par_names
    assert ours.best_twice_nll <= theirs.best_twice_nll + 1e-6  # at least as low a minimum
    assert ours.best_twice_nll == pytest.approx(theirs.best_twice_nll, abs=1e-4)
    free = ~np.asarray(model.config.suggested_fixed())
    assert_within_sigma(ours.bestfit[free], theirs.bestfit[free], ours.uncertainty[free])
    nuisance = free & (np.arange(model.config.npars) != model.config.poi_index)
    np.testing.assert_allclose(
        ours.uncertainty[nuisance], theirs.uncertainty[nuisance], rtol=IMPACT_RTOL
    )
    np.testing.assert_allclose(np.diag(ours.corr_mat)[free], 1.0, atol=1e-9)
    i, j = model.config.par_names.index("ttbar_ISR_Up"), model.config.poi_index
    assert ours.corr_mat[i, j] == pytest.approx(theirs.corr_mat[i, j], abs=5e-2)
    # cabinetry's saturated-model p-value of its own minimum, from ours
    gof = cabinetry.fit._goodness_of_fit(model, data, ours.best_twice_nll)
    assert ours.goodness_of_fit == pytest.approx(gof, rel=1e-6)
    assert ours.minos_uncertainty == {}

    cabinetry.visualize.pulls(ours, figure_folder=tmp_path)
    assert_figure(tmp_path / "pulls.pdf")
    prediction = cabinetry.model_utils.prediction(model, fit_results=ours)
    expected = cabinetry.model_utils.prediction(model, fit_results=theirs)
    for a, b in zip(prediction.model_yields, expected.model_yields, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-3)
    cabinetry.visualize.data_mc(prediction, data, figure_folder=tmp_path, close_figure=True)
    for channel in model.config.channels:
        assert_figure(tmp_path / f"{channel}_postfit.pdf")


# ------------------------------------------------------------------------------- ranking


def cabinetry_ranking(
    model,
    data,
    nominal: cabinetry.fit.FitResults,
    labels: list[str],
    monkeypatch: pytest.MonkeyPatch,
    tolerance: float | None = MINUIT_TOLERANCE,
) -> cabinetry.fit.RankingResults:
    """cabinetry's own ranking loop around its own ``nominal`` fit, over ``labels`` only (the
    other parameters' pre- and post-fit uncertainties zeroed, so it skips their fits), MINUIT
    at ``tolerance`` (``benchmarks/bench_cabinetry.py`` runs it too)."""
    keep = np.isin(model.config.par_names, labels)
    prefit = cabinetry.model_utils.prefit_uncertainties(model)
    monkeypatch.setattr(
        cabinetry.model_utils, "prefit_uncertainties", lambda _: np.where(keep, prefit, 0.0)
    )
    restricted = nominal._replace(uncertainty=np.where(keep, nominal.uncertainty, 0.0))
    return cabinetry.fit.ranking(model, data, fit_results=restricted, tolerance=tolerance)


@pytest.mark.slow
def test_ranking_matches_cabinetry_and_feeds_its_figure(
    published, their_fit, our_fit, client, monkeypatch, tmp_path
):
    model, data = published
    ours = gpu_cabinetry.ranking(model, data, fit_results=our_fit, client=client)
    assert isinstance(ours, cabinetry.fit.RankingResults)
    poi = model.config.poi_name
    assert ours.labels == [label for label in model.config.par_names if label != poi]
    impact = np.maximum(np.abs(ours.postfit_up), np.abs(ours.postfit_down))
    largest = [ours.labels[k] for k in np.argsort(-impact)[:RANKED]]
    theirs = cabinetry_ranking(model, data, their_fit, largest, monkeypatch)
    for label in largest:
        a, b = ours.labels.index(label), theirs.labels.index(label)
        for field in ("prefit_up", "prefit_down", "postfit_up", "postfit_down"):
            mine, minuit = getattr(ours, field)[a], getattr(theirs, field)[b]
            assert mine == pytest.approx(minuit, rel=IMPACT_RTOL, abs=1e-3), (label, field)
    cabinetry.visualize.ranking(ours, figure_folder=tmp_path, max_pars=10)
    assert_figure(tmp_path / "ranking.pdf")


# ---------------------------------------------------------------------------------- scan


def test_scan_matches_cabinetry_and_feeds_its_figure(published, client, tmp_path):
    model, data = published
    grid = (0.0, 4.0)
    ours = gpu_cabinetry.scan(model, data, "mu_SIG", par_range=grid, n_steps=3, client=client)
    theirs = cabinetry.fit.scan(
        model, data, "mu_SIG", par_range=grid, n_steps=3, tolerance=MINUIT_TOLERANCE
    )
    assert isinstance(ours, cabinetry.fit.ScanResults) and ours.name == theirs.name
    np.testing.assert_allclose(ours.parameter_values, theirs.parameter_values, atol=1e-12)
    np.testing.assert_allclose(ours.delta_nlls, theirs.delta_nlls, rtol=LIMIT_RTOL, atol=1e-4)
    assert_within_sigma(ours.bestfit, theirs.bestfit, ours.uncertainty)
    cabinetry.visualize.scan(ours, figure_folder=tmp_path)
    assert_figure(tmp_path / "scan_mu_SIG.pdf")


def test_scan_default_range_is_cabinetrys_within_the_bounds(small, client):
    """No ``par_range``: the best fit +- 2 uncertainties (cabinetry's), within the bounds."""
    model, data = small
    label = "uncorr_bkguncrt[1]"
    ours = gpu_cabinetry.scan(model, data, label, n_steps=3, client=client)
    centre, sigma = ours.bestfit, ours.uncertainty
    low, high = model.config.suggested_bounds()[model.config.par_names.index(label)]
    expected = [max(centre - 2 * sigma, low), centre, min(centre + 2 * sigma, high)]
    np.testing.assert_allclose(ours.parameter_values, expected, rtol=1e-9)
    theirs = cabinetry.fit.scan(model, data, label, n_steps=3, tolerance=MINUIT_TOLERANCE)
    np.testing.assert_allclose(ours.delta_nlls, theirs.delta_nlls, rtol=IMPACT_RTOL, atol=1e-3)


# ------------------------------------------------------------------ limit and significance


def test_limit_matches_cabinetry(small, client, tmp_path):
    model, data = small
    ours = gpu_cabinetry.limit(model, data, client=client)
    theirs = cabinetry.fit.limit(model, data, poi_tolerance=1e-6)
    assert isinstance(ours, cabinetry.fit.LimitResults)
    assert ours.observed_limit == pytest.approx(theirs.observed_limit, rel=LIMIT_RTOL)
    np.testing.assert_allclose(ours.expected_limit, theirs.expected_limit, rtol=LIMIT_RTOL)
    assert ours.confidence_level == theirs.confidence_level == 0.95
    # the CLs curve: at the observed limit 1 - CL, and cabinetry's CLs at cabinetry's points
    at_limit = list(ours.poi_values).index(ours.observed_limit)
    assert ours.observed_CLs[at_limit] == pytest.approx(0.05, rel=LIMIT_RTOL)
    assert ours.expected_CLs.shape == (len(ours.poi_values), 5)
    assert np.all(np.diff(ours.poi_values) > 0)
    cabinetry.visualize.limit(ours, figure_folder=tmp_path)
    assert_figure(tmp_path / "limit.pdf")


def test_limits_past_the_bound_are_flagged_and_the_curve_stops_there(small, client, tmp_path):
    """``par_bounds`` (the measurement's bounds) with the POI's upper bound 3 below the +2 sigma
    expected limit: the service answers it and says so (cabinetry's brentq raises there), and
    the CLs curve stops at the bound."""
    model, data = small
    bounds = model.config.suggested_bounds()
    bounds[model.config.poi_index] = (0.0, 3.0)
    with pytest.warns(BeyondBoundsWarning, match="past the upper bound 3"):
        ours = gpu_cabinetry.limit(model, data, par_bounds=bounds, client=client)
    assert 0 < ours.observed_limit < 3 < ours.expected_limit[-1]
    assert ours.poi_values[0] == 0.1 and ours.poi_values[-1] == 3.0
    assert np.all(np.diff(ours.observed_CLs) < 0)  # CLs falls with the POI
    cabinetry.visualize.limit(ours, figure_folder=tmp_path)
    assert_figure(tmp_path / "limit.pdf")


def test_significance_matches_cabinetry(small, client):
    """From the workspace dict (its observations as data) against cabinetry's model and data."""
    ours = gpu_cabinetry.significance(simple_workspace(), client=client)
    theirs = cabinetry.fit.significance(*small, tolerance=MINUIT_TOLERANCE)
    assert isinstance(ours, cabinetry.fit.SignificanceResults)
    np.testing.assert_allclose(ours, theirs, rtol=LIMIT_RTOL)


# ------------------------------------------------------------------- settings and refusals


def test_fix_pars_and_asimov_data_as_cabinetry(small, client, server, monkeypatch):
    """``fix_pars``/``init_pars`` become the measurement's settings; Asimov data (cabinetry's
    ``model_and_data(asimov=True)``); no ``client``: the one of ``$PYHF_GPU_SERVER``."""
    model, _ = small
    _, asimov = cabinetry.model_utils.model_and_data(simple_workspace(), asimov=True)
    init, fixed = model.config.suggested_init(), model.config.suggested_fixed()
    for k, label in enumerate(model.config.par_names):
        if label.startswith("uncorr_bkguncrt"):
            init[k], fixed[k] = 1.05, True
    monkeypatch.setenv("PYHF_GPU_SERVER", server.url)
    ours = gpu_cabinetry.fit(model, asimov, init_pars=init, fix_pars=fixed)
    theirs = cabinetry.fit.fit(
        model, asimov, init_pars=init, fix_pars=fixed, tolerance=MINUIT_TOLERANCE
    )
    np.testing.assert_allclose(ours.bestfit, theirs.bestfit, rtol=1e-4)
    assert ours.best_twice_nll == pytest.approx(theirs.best_twice_nll, abs=1e-6)
    assert np.all(ours.uncertainty[np.asarray(fixed)] == 0)


def test_what_the_service_cannot_do_is_refused(small, client):
    model, data = small
    with pytest.raises(NotImplementedError, match="minos"):
        gpu_cabinetry.fit(model, data, minos="mu", client=client)
    for option in ({"tolerance": 1e-3}, {"strategy": 2}, {"custom_fit": True}):
        with pytest.raises(NotImplementedError, match=next(iter(option))):
            gpu_cabinetry.fit(model, data, client=client, **option)
    with pytest.raises(NotImplementedError, match="maxsteps"):
        gpu_cabinetry.limit(model, data, maxsteps=20, client=client)
    fixed = model.config.suggested_fixed()
    fixed[model.config.par_names.index("uncorr_bkguncrt[0]")] = True
    with pytest.raises(ValueError, match="part of the parameter set 'uncorr_bkguncrt'"):
        gpu_cabinetry.fit(model, data, fix_pars=fixed, client=client)
    shifted = [*data[: model.config.nmaindata], *(np.asarray(model.config.auxdata) * 1.1)]
    with pytest.raises(ValueError, match="auxdata"):
        gpu_cabinetry.fit(model, shifted, client=client)
    with pytest.raises(ValueError, match="data is needed"):
        gpu_cabinetry.fit(model, client=client)
    with pytest.raises(ValueError, match="not found in model"):
        gpu_cabinetry.scan(model, data, "nope", client=client)
    with pytest.raises(ValueError, match="must not be the same"):
        gpu_cabinetry.limit(model, data, bracket=(1.0, 1.0), client=client)
    with pytest.raises(ValueError, match="outside the bracket"):
        gpu_cabinetry.limit(model, data, bracket=(0.1, 0.2), client=client)
    nominal = gpu_cabinetry.fit(model, data, client=client)
    elsewhere = nominal._replace(bestfit=nominal.bestfit + nominal.uncertainty)
    with pytest.raises(ValueError, match="not the service's best fit"):
        gpu_cabinetry.ranking(model, data, fit_results=elsewhere, client=client)
