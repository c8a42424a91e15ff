"""The engine's expected_data and logpdf equal pyhf's numpy backend to relative 1e-10."""

from __future__ import annotations

import numpy as np
import pyhf
import pytest
import torch
from conftest import reference_patches, shared_workspace
from hand_built import all_modifiers_workspace

from pyhf_gpu_server.engine import HistFactoryModel
from pyhf_gpu_server.engine.interpolation import (
    HISTOSYS_CODES,
    histosys_basis_derivative,
    histosys_coefficients,
    histosys_slopes_at_nominal,
)

RTOL = 1e-10
N_RANDOM = 20


def parameter_points(model: pyhf.Model, seed: int) -> np.ndarray:
    """The suggested init, then random points inside the bounds: half anywhere in the box,
    half in its central fifth around the init (where every rate is surely positive)."""
    rng = np.random.default_rng(seed)
    init = np.asarray(model.config.suggested_init())
    bounds = np.asarray(model.config.suggested_bounds())
    anywhere = rng.uniform(bounds[:, 0], bounds[:, 1], size=(N_RANDOM // 2, len(init)))
    low = init + 0.1 * (bounds[:, 0] - init)
    high = init + 0.1 * (bounds[:, 1] - init)
    central = rng.uniform(low, high, size=(N_RANDOM - N_RANDOM // 2, len(init)))
    return np.vstack([init, anywhere, central])


def assert_matches_pyhf(engine: HistFactoryModel, reference: pyhf.Model, data, seed: int = 0):
    points = parameter_points(reference, seed)
    data = np.asarray(data, dtype=np.float64)
    expected_ref = np.stack([reference.expected_data(p) for p in points])
    logpdf_ref = np.array([reference.logpdf(p, data)[0] for p in points])

    pars = torch.tensor(points, dtype=torch.float64)
    batch_data = torch.tensor(data, dtype=torch.float64).expand(len(points), -1)
    expected = engine.expected_data(pars).numpy()
    logpdf = engine.logpdf(pars, batch_data).numpy()

    np.testing.assert_allclose(expected, expected_ref, rtol=RTOL, atol=1e-12)
    np.testing.assert_allclose(logpdf, logpdf_ref, rtol=RTOL, equal_nan=True)
    central = slice(1 + N_RANDOM // 2, None)
    assert np.isfinite(logpdf[0]) and np.all(np.isfinite(logpdf[central]))


@pytest.fixture(scope="module")
def shared_models(shared_name):
    workspace, patchset, _ = shared_workspace(shared_name)
    patchset = pyhf.PatchSet(patchset)
    models = []
    for name in reference_patches(shared_name):
        reference = patchset.apply(pyhf.Workspace(workspace), name).model()
        engine = HistFactoryModel.from_workspace(workspace, patches=[patchset[name]])
        models.append((engine, reference))
    return models


@pytest.mark.slow
def test_shared_workspaces_match_pyhf(shared_models):
    assert len(shared_models) >= 3
    for seed, (model, reference) in enumerate(shared_models):
        assert_matches_pyhf(model, reference, model.observed[0].numpy(), seed)


def test_observed_data_is_pyhfs(shared_name, shared_models):
    workspace, patchset, _ = shared_workspace(shared_name)
    name = reference_patches(shared_name)[0]
    patched = pyhf.PatchSet(patchset).apply(pyhf.Workspace(workspace), name)
    reference = patched.model()
    np.testing.assert_array_equal(shared_models[0][0].observed[0].numpy(), patched.data(reference))
    np.testing.assert_array_equal(
        shared_models[0][0].init[0].numpy(), reference.config.suggested_init()
    )
    np.testing.assert_array_equal(
        shared_models[0][0].bounds[0].numpy(), reference.config.suggested_bounds()
    )
    assert shared_models[0][0].fixed[0].tolist() == reference.config.suggested_fixed()
    assert shared_models[0][0].par_names == reference.config.par_names
    assert shared_models[0][0].poi_index == reference.config.poi_index


@pytest.mark.parametrize(
    "build",
    [
        lambda: pyhf.simplemodels.uncorrelated_background([5.0, 7.0], [50.0, 52.0], [3.0, 7.0]),
        lambda: pyhf.simplemodels.correlated_background(
            [5.0, 2.0], [50.0, 60.0], [55.0, 59.0], [44.0, 61.0]
        ),
    ],
    ids=["uncorrelated_background", "correlated_background"],
)
def test_simplemodels_match_pyhf(build):
    reference = build()
    data = [53.0, 61.0, *reference.config.auxdata]
    workspace = pyhf.Workspace.build(reference, data)
    engine = HistFactoryModel.from_workspace(workspace)
    assert_matches_pyhf(engine, reference, data)


SETTINGS = [
    None,
    {"normsys": {"interpcode": "code1"}, "histosys": {"interpcode": "code0"}},
    {"normsys": {"interpcode": "code4"}, "histosys": {"interpcode": "code2"}},
    {"normsys": {"interpcode": "code1"}, "histosys": {"interpcode": "code4p"}},
    {"normsys": {"interpcode": "code4"}, "histosys": {"interpcode": "code0"}},
    {"normsys": {"interpcode": "code1"}},  # histosys falls back to pyhf's applier default
]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: str(s))
@pytest.mark.parametrize("measurement", ["meas", "other_poi"])
def test_every_modifier_and_code_matches_pyhf(settings, measurement):
    workspace = pyhf.Workspace(all_modifiers_workspace())
    kwargs = {} if settings is None else {"modifier_settings": settings}
    reference = workspace.model(measurement_name=measurement, **kwargs)
    engine = HistFactoryModel.from_workspace(
        workspace, measurement=measurement, modifier_settings=settings
    )
    types = {t for _, t in reference.config.modifiers}
    assert types == {
        "normfactor",
        "lumi",
        "shapefactor",
        "staterror",
        "shapesys",
        "normsys",
        "histosys",
    }
    assert_matches_pyhf(engine, reference, workspace.data(reference))


def test_alpha_grid_crosses_every_interpolation_boundary():
    """Every nuisance parameter swept over [-3, 3] (both sides of |alpha| = 1 and 0)."""
    workspace = pyhf.Workspace(all_modifiers_workspace())
    for settings in SETTINGS[1:5]:
        reference = workspace.model(modifier_settings=settings)
        engine = HistFactoryModel.from_workspace(workspace, modifier_settings=settings)
        grid = np.linspace(-3.0, 3.0, 25)
        points = np.tile(reference.config.suggested_init(), (len(grid), 1))
        for name in ("jes", "res", "xsec", "sig_norm", "extreme"):
            points[:, reference.config.par_slice(name)] = grid[:, None]
        expected_ref = np.stack([reference.expected_data(p) for p in points])
        expected = engine.expected_data(torch.tensor(points)).numpy()
        np.testing.assert_allclose(expected, expected_ref, rtol=RTOL, atol=1e-12)


def assert_jacobian_is_autograds(engine: HistFactoryModel, pars: torch.Tensor, element=None):
    """The closed-form rate Jacobian (the fitter's) equals reverse-mode autograd's."""
    element = engine.element_index(element, pars.shape[0])
    rates, jacobian = engine.expected_main_jacobian(pars, element)

    def main_rates(row, e):
        return engine.expected_data(row[None], e[None], include_auxdata=False)[0]

    reference = torch.stack(
        [torch.func.jacrev(main_rates)(row, e) for row, e in zip(pars, element, strict=True)]
    )
    torch.testing.assert_close(rates, engine.expected_data(pars, element, include_auxdata=False))
    torch.testing.assert_close(jacobian, reference, rtol=1e-10, atol=1e-10)


def assert_rates_curvature_is_autograds(engine: HistFactoryModel, pars: torch.Tensor, element):
    """The closed-form second-order term (the minimiser's exact Newton step) equals
    ``sum_n w_n Hess(lambda_n)`` by ``torch.func`` for random bin weights ``w``."""
    gen = torch.Generator().manual_seed(5)
    weights = torch.randn(pars.shape[0], engine.n_main, generator=gen, dtype=torch.float64)
    curvature = engine.main_rates_curvature(pars, element, weights)

    def weighted_rates(row, e, w):
        return (w * engine.expected_data(row[None], e[None], include_auxdata=False)[0]).sum()

    reference = torch.stack(
        [
            torch.func.hessian(weighted_rates)(row, e, w)
            for row, e, w in zip(pars, element, weights, strict=True)
        ]
    )
    torch.testing.assert_close(curvature, reference, rtol=1e-10, atol=1e-9)


@pytest.mark.parametrize("settings", SETTINGS[:5], ids=lambda s: str(s))
def test_rate_derivatives_match_autograd_for_every_code(settings):
    """The rates' Jacobian and weighted second derivatives, away from the interpolation kinks
    (|alpha| = 0, 1), where one-sided derivatives differ."""
    engine = HistFactoryModel.from_workspace(all_modifiers_workspace(), modifier_settings=settings)
    gen = torch.Generator().manual_seed(7)
    init = engine.init[0]
    lo, hi = engine.bounds[0].unbind(-1)
    shift = (torch.rand(12, engine.n_pars, generator=gen, dtype=torch.float64) - 0.5) * 0.6
    pars = torch.minimum(torch.maximum(init + shift * (hi - lo).clamp(max=6.0), lo), hi)
    pars[6:, :2] = torch.tensor([1.7, -1.4], dtype=torch.float64)  # outside |alpha| < 1
    assert_jacobian_is_autograds(engine, pars)
    assert_rates_curvature_is_autograds(engine, pars, engine.element_index(None, 12))


def test_rate_derivatives_match_autograd_on_a_stacked_patchset(shared_name):
    workspace, patchset, _ = shared_workspace(shared_name)
    names = [p["metadata"]["name"] for p in patchset["patches"][:3]]
    engine = HistFactoryModel.from_patchset(workspace, patchset, patch_names=names)
    gen = torch.Generator().manual_seed(3)
    element = torch.arange(3).repeat(2)
    pars = engine.init.index_select(0, element)
    pars = pars + 0.2 * torch.randn(pars.shape, generator=gen, dtype=torch.float64)
    lo, hi = engine.bounds.index_select(0, element).unbind(-1)
    pars = torch.minimum(torch.maximum(pars, lo), hi)
    assert_jacobian_is_autograds(engine, pars, element)
    assert_rates_curvature_is_autograds(engine, pars, element)


def test_deviance_plus_saturated_constant_is_twice_nll(shared_models):
    """The fitter's objective (deviance, non-negative) differs from -2 log L by a function of
    the data alone."""
    model = shared_models[0][0]
    gen = torch.Generator().manual_seed(11)
    pars = model.init + 0.1 * torch.randn(8, model.n_pars, generator=gen, dtype=torch.float64)
    lo, hi = model.bounds[0].unbind(-1)
    pars = torch.minimum(torch.maximum(pars, lo), hi)
    data = model.expected_data(pars.flip(0)).round()  # integer counts, some zeros
    deviance = model.deviance(pars, data)
    assert torch.all(deviance >= 0)
    torch.testing.assert_close(
        deviance + model.saturated_twice_nll(data),
        model.twice_nll(pars, data),
        rtol=1e-12,
        atol=1e-9,
    )


@pytest.mark.parametrize("code", HISTOSYS_CODES)
def test_histosys_slopes_at_nominal_are_the_basis_derivatives(code):
    """The numpy slopes at alpha = 0 that find even shifts (``symmetric_params``) are the
    torch basis derivative's there, for every code; zero exactly where ``hi == lo``."""
    rng = np.random.default_rng(3)
    nominal = rng.uniform(5, 50, 6)
    hi = nominal * rng.uniform(0.6, 1.4, 6)
    lo = np.where(np.arange(6) % 2, hi, nominal * rng.uniform(0.6, 1.4, 6))
    coefficients = histosys_coefficients(code, lo, nominal, hi)
    basis = histosys_basis_derivative(code, torch.zeros(1, 1, dtype=torch.float64))[0, :, 0]
    expected = np.tensordot(basis.numpy(), coefficients, axes=1)
    slopes = histosys_slopes_at_nominal(code, coefficients)
    np.testing.assert_array_equal(slopes, expected)
    assert (slopes[1::2] == 0).all() == (code != "code0") and (slopes[::2] != 0).all()
