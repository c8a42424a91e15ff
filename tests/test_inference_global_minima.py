"""Likelihoods with two basins: our minima are the global ones, in every row.

Kinks: a family of generated two-channel models after pyhf's ``2bin_2channel_coupledhistosys``
validation case: one histosys parameter shared by every background, with code0 (kinked at 0)
and up/down variations that often both go the same way (a concave kink, two basins), half of
them with the POI starting on its lower bound. All run as ONE stacked model. For each:

- the unconditional minimum is at or below pyhf's own fit (scipy, from the init) and below
  every point of a dense (alpha, mu) grid evaluated by pyhf;
- the conditional minimum at mu = 1 is at or below pyhf's and the grid's at mu = 1, and never
  below the unconditional one.

Saddles: a family of smooth (pyhf's default codes) models whose background shifts are even
in their parameter (``hi == lo``, a histosys and a normsys), with data above the nominal rates:
``alpha = 0``, pyhf's init, is then a saddle of ``-2 log L`` (zero gradient, curving down), and
a fit started on it reports it as a minimum. Ours start off it and reach the minima of the
grid, at or below pyhf's; started as pyhf does, they stay on the saddle.

A POI started far from its best fit: a free fit from the init alone can end in a minimum of
the nuisance parameters' own, far above the global one; ours also start from the
background-only POI, keep the lower minimum and flag the disagreement.
"""

from __future__ import annotations

import numpy as np
import pyhf
import pytest
import torch
from hand_built import symmetric_workspace
from test_inference_support import DEVICE, one_thread  # noqa: F401 (fixture)

from pyhf_gpu_server.engine import HistFactoryModel
from pyhf_gpu_server.inference import fit, fixed_poi_fit
from pyhf_gpu_server.inference.mle import FitOptions
from pyhf_gpu_server.inference.objective import TwiceNLL

pytestmark = pytest.mark.usefixtures("one_thread")

SETTINGS = {"histosys": {"interpcode": "code0"}, "normsys": {"interpcode": "code1"}}
SMOOTH = {"histosys": {"interpcode": "code4p"}, "normsys": {"interpcode": "code4"}}  # pyhf's
FAMILY = 16
ALPHA = np.linspace(-3.0, 3.0, 241)
MU = np.linspace(0.0, 4.0, 161)


def _sample(name, nominal, rng, modifiers=True):
    nominal = np.round(nominal, 1)
    up = np.round(nominal * (1 + rng.uniform(-0.6, 0.6, nominal.shape)), 1)
    same_way = rng.random(nominal.shape) < 0.5
    down_shift = rng.uniform(-0.6, 0.6, nominal.shape)
    down_shift = np.where(same_way, np.sign(up - nominal) * np.abs(down_shift), down_shift)
    down = np.round(np.maximum(nominal * (1 + down_shift), 0.5), 1)
    histosys = {"lo_data": down.tolist(), "hi_data": up.tolist()}
    return {
        "name": name,
        "data": nominal.tolist(),
        "modifiers": (
            [{"name": "coupled_histosys", "type": "histosys", "data": histosys}]
            if modifiers
            else []
        ),
    }


def two_basin_workspace(seed: int) -> dict:
    """A coupledhistosys-like workspace from ``seed`` (odd seeds: POI init on its bound)."""
    rng = np.random.default_rng(seed)
    signal = {
        "name": "signal",
        "data": np.round(rng.uniform(10, 40, 2), 1).tolist(),
        "modifiers": [{"name": "mu", "type": "normfactor", "data": None}],
    }
    channels = [
        {
            "name": "signal",
            "samples": [
                signal,
                _sample("bkg1", rng.uniform(60, 140, 2), rng),
                _sample("bkg2", rng.uniform(40, 140, 2), rng),
            ],
        },
        {"name": "control", "samples": [_sample("background", rng.uniform(80, 130, 2), rng)]},
    ]
    expected = [
        sum(np.asarray(s["data"]) for s in c["samples"] if s["name"] != "signal") for c in channels
    ]
    observations = [
        {"name": c["name"], "data": rng.poisson(e * rng.uniform(0.9, 1.3)).astype(float).tolist()}
        for c, e in zip(channels, expected, strict=True)
    ]
    parameters = [{"name": "mu", "inits": [0.0], "bounds": [[0.0, 10.0]]}] if seed % 2 else []
    return {
        "channels": channels,
        "observations": observations,
        "measurements": [{"name": "m", "config": {"poi": "mu", "parameters": parameters}}],
        "version": "1.0.0",
    }


def _pyhf_model(workspace, batch_size=None, settings=SETTINGS):
    ws = pyhf.Workspace(workspace)
    model = ws.model(modifier_settings=settings, batch_size=batch_size)
    return model, np.asarray(ws.data(model))


def grid_minima(workspace, settings=SETTINGS) -> tuple[float, float]:
    """pyhf's -2 log L minimised over the (alpha, mu) grid, and over alpha at mu = 1."""
    model, data = _pyhf_model(workspace, len(ALPHA) * len(MU), settings)
    alpha, mu = np.meshgrid(ALPHA, MU, indexing="ij")
    pars = np.zeros((alpha.size, 2))
    pars[:, model.config.par_slice("coupled_histosys")] = alpha.reshape(-1, 1)
    pars[:, model.config.poi_index] = mu.reshape(-1)
    twice_nll = -2 * np.asarray(model.logpdf(pars, np.tile(data, (alpha.size, 1))))
    twice_nll = np.where(np.isfinite(twice_nll), twice_nll, np.inf).reshape(alpha.shape)
    at_one = np.argmin(np.abs(MU - 1.0))
    return float(twice_nll.min()), float(twice_nll[:, at_one].min())


def pyhf_minima(workspace, settings=SETTINGS) -> tuple[float, float]:
    """pyhf's unconditional and mu = 1 fits, from the init (its default optimiser)."""
    model, data = _pyhf_model(workspace, settings=settings)
    pyhf.set_backend("numpy", "scipy")
    _, free = pyhf.infer.mle.fit(data, model, return_fitted_val=True)
    _, fixed = pyhf.infer.mle.fixed_poi_fit(1.0, data, model, return_fitted_val=True)
    return float(free), float(fixed)


@pytest.fixture(scope="module")
def family():
    workspaces = [two_basin_workspace(seed) for seed in range(FAMILY)]
    models = [
        HistFactoryModel.from_workspace(w, modifier_settings=SETTINGS, device=DEVICE)
        for w in workspaces
    ]
    return workspaces, HistFactoryModel.stack(models)


def test_every_row_finds_the_global_minimum(family):
    workspaces, model = family
    free = fit(model, uncertainties=False)
    fixed = fixed_poi_fit(model, 1.0, uncertainties=False)
    assert free.converged.all() and fixed.converged.all()
    assert bool((free.starts > 1).all())  # the kinked parameter gave every row extra starts
    several_basins = 0
    for i, workspace in enumerate(workspaces):
        grid_free, grid_fixed = grid_minima(workspace)
        pyhf_free, pyhf_fixed = pyhf_minima(workspace)
        ours_free = free.best_twice_nll[i].item()
        ours_fixed = fixed.best_twice_nll[i].item()
        assert ours_free <= min(grid_free, pyhf_free) + 1e-6, (i, ours_free, grid_free, pyhf_free)
        assert ours_fixed <= min(grid_fixed, pyhf_fixed) + 1e-6, (i, ours_fixed, grid_fixed)
        assert ours_fixed >= ours_free - 1e-9
        several_basins += not bool(free.starts_agreed[i] and fixed.starts_agreed[i])
    # the family is what it claims: many of its likelihoods have more than one minimum
    assert several_basins >= FAMILY // 4


def test_a_smooth_likelihood_is_fitted_once(family):
    workspaces, _ = family
    model = HistFactoryModel.from_workspace(
        workspaces[0], modifier_settings={"histosys": {"interpcode": "code4p"}}, device=DEVICE
    )
    free = fit(model, uncertainties=False)  # from init, and from the background-only POI
    assert free.starts.tolist() == [2] and free.starts_agreed.tolist() == [True]
    pinned = fixed_poi_fit(model, 1.0, uncertainties=False)
    assert pinned.starts.tolist() == [1] and pinned.starts_agreed.tolist() == [True]


def test_extra_starts_never_move_fixed_parameters(family):
    workspaces, _ = family
    model = HistFactoryModel.from_workspace(workspaces[2], modifier_settings=SETTINGS)
    alpha = model.par_names.index("coupled_histosys")
    fixed = model.fixed.clone()
    fixed[:, alpha] = True
    init = model.init[0].clone()
    init[alpha] = 0.3
    result = fit(model, init=init, fixed=fixed[0], uncertainties=False)
    assert result.bestfit[0, alpha].item() == pytest.approx(0.3, abs=0)
    assert torch.isfinite(result.best_twice_nll).all()


def test_fits_leave_the_saddle_of_an_even_shift():
    workspaces = [symmetric_workspace(seed) for seed in range(6)]
    model = HistFactoryModel.stack(
        [HistFactoryModel.from_workspace(w, device=DEVICE) for w in workspaces]
    )
    symmetric = [model.par_names[i] for i in model.symmetric_params[0].nonzero().flatten()]
    assert sorted(symmetric) == ["norm", "shape"] and model.symmetric_params.all(0).sum() == 2
    free = fit(model, uncertainties=False)
    fixed = fixed_poi_fit(model, 1.0, uncertainties=False)
    assert free.converged.all() and fixed.converged.all()
    rows = torch.arange(len(workspaces), device=model.device)
    pinned = model.fixed.clone()
    pinned[:, model.poi_index] = True
    for result, held in ((free, model.fixed), (fixed, pinned)):
        # a minimum: the exact Hessian of -2 log L is positive definite on the free parameters
        hessian = TwiceNLL(model, model.observed, rows).hessian(result.bestfit, rows)
        for i in range(len(workspaces)):
            free_columns = held[i].logical_not()
            block = hessian[i][free_columns][:, free_columns]
            assert torch.linalg.eigvalsh(block)[0].item() > 0, i
    for i, workspace in enumerate(workspaces):
        ours_free, ours_fixed = free.best_twice_nll[i].item(), fixed.best_twice_nll[i].item()
        pyhf_free, pyhf_fixed = pyhf_minima(workspace, settings=SMOOTH)
        assert ours_free <= pyhf_free + 1e-6 and ours_fixed <= pyhf_fixed + 1e-6, i
    # started as pyhf starts, on alpha = 0: the saddle, higher, and reported as converged
    stuck = fixed_poi_fit(model, 1.0, uncertainties=False, options=FitOptions(starts=None))
    shape = model.par_names.index("shape")
    assert bool((stuck.bestfit[:, shape] == 0).all()) and bool(stuck.converged.all())
    assert bool((stuck.best_twice_nll > fixed.best_twice_nll + 1e-3).all())


def far_poi_init_workspace() -> dict:
    """One channel of the generated scale family (workspace 24, reduced; its yields rounded):
    a signal whose POI starts at 50 in [0, 100], over a background with two histosys and a
    shapesys of 70-80 % per bin. Its best fit is mu = 0.25; started at 50, the fit pulls both
    histosys to -5 and the shapesys to its bounds, a minimum of its own 188 above."""
    signal = [219, 215, 157, 153, 141, 394]
    background = [284, 1283, 533, 839, 831, 613]
    shifts = [
        ("hs0", [332, 1454, 674, 958, 1035, 651], [247, 969, 464, 689, 768, 493]),
        ("hs3", [342, 1607, 589, 892, 940, 752], [250, 1174, 414, 621, 625, 491]),
    ]
    modifiers = [
        {"name": name, "type": "histosys", "data": {"hi_data": hi, "lo_data": lo}}
        for name, hi, lo in shifts
    ]
    modifiers.append({"name": "ss", "type": "shapesys", "data": [226, 1021, 424, 668, 662, 487]})
    samples = [
        {"name": "signal", "data": signal, "modifiers": [mu_modifier()]},
        {"name": "background", "data": background, "modifiers": modifiers},
    ]
    config = {"poi": "mu", "parameters": [{"name": "mu", "bounds": [[0, 100]], "inits": [50]}]}
    return {
        "channels": [{"name": "sr", "samples": samples}],
        "observations": [{"name": "sr", "data": [344, 1334, 518, 816, 880, 729]}],
        "measurements": [{"name": "m", "config": config}],
        "version": "1.0.0",
    }


def mu_modifier() -> dict:
    return {"name": "mu", "type": "normfactor", "data": None}


def test_a_free_fit_from_a_far_poi_init_also_starts_from_the_background():
    spec = far_poi_init_workspace()
    model = HistFactoryModel.from_workspace(spec, device=DEVICE)
    ours = fit(model, uncertainties=False)
    # pyhf's scipy fails from the init (50); started at mu = 0 (tolerance 1e-12), it finds:
    pyhf.set_backend("numpy", "scipy")
    workspace = pyhf.Workspace(spec)
    pyhf_model = workspace.model()
    init = pyhf_model.config.suggested_init()
    poi = pyhf_model.config.poi_index
    init[poi] = 0.0
    data = workspace.data(pyhf_model)
    bestfit, twice_nll = pyhf.infer.mle.fit(
        data, pyhf_model, init_pars=init, return_fitted_val=True, tolerance=1e-12
    )
    assert ours.converged.item()
    assert ours.best_twice_nll.item() == pytest.approx(float(twice_nll), abs=1e-7)
    mu = model.par_names.index("mu")
    assert ours.bestfit[0, mu].item() == pytest.approx(float(bestfit[poi]), abs=1e-4)
    # the init's own minimum is far above: the two starts disagree, and the answer says so
    assert ours.starts.item() == 2 and not ours.starts_agreed.item()
