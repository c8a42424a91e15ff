"""Nuisance-parameter ranking against cabinetry's ``fit.ranking``, computed in the test.

cabinetry fits with MINUIT (pyhf's numpy backend, ``minuit`` optimiser, here at
``tolerance=1e-6``) one parameter value at a time; ours runs every conditional fit of every
row in one batched call. Two things differ by construction, and the tests account for them:

- post-fit uncertainties: ours come from the exact Hessian, cabinetry's from MINUIT's HESSE
  within the parameters' limits, i.e. in MINUIT's sin-transformed internal coordinates,
  which shrinks them: by 0.7% for most bounded parameters of sbottom-A and by 14% for its
  POI, near its bound (a central-difference Hessian of pyhf's own ``logpdf`` agrees with
  ours to 1e-5). So cabinetry's ranking loop is handed OUR
  nominal fit (``fit_results``), and both compute impacts at the very same fixed values; the
  nominal fits are compared on their own (:func:`test_nominal_fit_matches_cabinetry`).
- MINUIT's precision on a flat POI (``sigma_POI`` of 2.5 to 67 here) is ~1e-4 absolute, and it
  leaves a POI at its bound ~1e-6 off it. Where an impact differs from cabinetry's by more
  than 1e-3 relative (plus 1e-5 absolute: MINUIT's bound), that conditional fit is run again
  with cabinetry's own fitter and ours, and our minimum must be the lower one.

cabinetry's ``ranking`` ranks every parameter; on the published workspaces it is restricted to
a named subset by zeroing the other parameters' uncertainties (its loop skips the fits of a
parameter whose uncertainties are 0, so it runs its own code on the subset only).
"""

from __future__ import annotations

import doctest
import importlib
import json
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
from pyhf_gpu_server.inference import FitOptions, MinimizeOptions, fit, ranking
from pyhf_gpu_server.inference.constraints import prefit_uncertainties
from pyhf_gpu_server.inference.ranking import IMPACTS
from pyhf_gpu_server.service.operations.ranking import ranking_answer

pytestmark = pytest.mark.usefixtures("one_thread")

MINUIT_TOLERANCE = 1e-6
REL, ABS = 1e-3, 1e-5
WORST: dict[str, float] = {}  # worst relative difference per case (printed with -s)


@pytest.fixture(autouse=True)
def numpy_backend():
    backend = pyhf.get_backend()
    pyhf.set_backend("numpy")
    yield
    pyhf.set_backend(*backend)


def published(name: str, patch: str | None = None):
    """(our model, pyhf model, data) of a shared workspace and one of its patches (the first
    by default)."""
    workspace, patchset, _ = shared_workspace(name)
    entry = (
        patchset["patches"][0]
        if patch is None
        else next(p for p in patchset["patches"] if p["metadata"]["name"] == patch)
    )
    ours = HistFactoryModel.from_workspace(workspace, patches=[entry["patch"]], device=DEVICE)
    ws = pyhf.PatchSet(patchset).apply(pyhf.Workspace(workspace), entry["metadata"]["name"])
    model = ws.model()
    return ours, model, ws.data(model)


def cabinetry_impacts(model, data, ours, labels: list[str]) -> dict:
    """cabinetry's ranking loop over ``labels`` only, from our nominal fit (row 0 of
    ``ours``): ``{label: [prefit_up, prefit_down, postfit_up, postfit_down]}``."""
    keep = np.isin(model.config.par_names, labels)
    prefit = cabinetry.model_utils.prefit_uncertainties
    cabinetry.model_utils.prefit_uncertainties = lambda m: np.where(keep, prefit(m), 0.0)
    nominal = cabinetry.fit.FitResults(
        ours.bestfit[0].cpu().numpy(),
        np.where(keep, ours.uncertainty[0].cpu().numpy(), 0.0),
        model.config.par_names,
        np.eye(model.config.npars),
        0.0,
    )
    try:
        res = cabinetry.fit.ranking(model, data, fit_results=nominal, tolerance=MINUIT_TOLERANCE)
    finally:
        cabinetry.model_utils.prefit_uncertainties = prefit
    return {
        label: [float(getattr(res, f)[res.labels.index(label)]) for f in IMPACTS]
        for label in labels
    }


def conditional_minima(model, data, ours, ours_model, label: str, kind: int) -> tuple:
    """``-2 log L`` of one conditional fit of the ranking (``label`` fixed at the value of
    impact ``kind``), by cabinetry's fitter and by ours."""
    i = model.config.par_names.index(label)
    best = ours.bestfit[0].cpu().numpy()
    sigma = (ours.prefit_uncertainty if kind < 2 else ours.uncertainty)[0, i].item()
    lo, hi = model.config.suggested_bounds()[i]
    value = min(max(best[i] + (1 - 2 * (kind % 2)) * sigma, lo), hi)
    init = model.config.suggested_init()
    init[i] = value
    fixed = model.config.suggested_fixed()
    fixed[i] = True
    theirs = cabinetry.fit._fit_model(
        model, data, init_pars=init, fix_pars=fixed, tolerance=MINUIT_TOLERANCE
    ).best_twice_nll
    start = torch.as_tensor(best, dtype=ours_model.dtype, device=ours_model.device).clone()
    start[i] = value
    mask = ours_model.fixed[0].clone()
    mask[i] = True
    mine = fit(ours_model, init=start, fixed=mask, uncertainties=False).best_twice_nll.item()
    return mine, theirs


def compare(case, model, data, ours, ours_model, theirs: dict) -> None:
    """Every impact of ``theirs`` within REL (+ ABS) of ours, or our minimum the lower one."""
    worst, rechecked = 0.0, []
    for label, impacts in theirs.items():
        c = ours.labels.index(label)
        for kind, (name, expected) in enumerate(zip(IMPACTS, impacts, strict=True)):
            got = getattr(ours, name)[0, c].item()
            diff = abs(got - expected)
            if abs(expected) > 100 * ABS:
                worst = max(worst, diff / abs(expected))
            if diff <= REL * abs(expected) + ABS:
                continue
            mine, minuit = conditional_minima(model, data, ours, ours_model, label, kind)
            assert mine <= minuit + 1e-9, (label, name, got, expected, mine, minuit)
            rechecked.append(
                f"{label} {name}: {got:.6g} vs {expected:.6g}, -2 log L lower by "
                f"{minuit - mine:.1e}"
            )
    WORST[case] = worst
    print(
        f"{case}: worst relative difference of the impacts above {100 * ABS:g}: {worst:.2e};"
        f" rechecked {rechecked}"
    )


# --------------------------------------------------------------------------- hand-built
def every_modifier() -> tuple[HistFactoryModel, pyhf.Model, list[float]]:
    """The hand-built workspace with every modifier type and a fixed parameter, its
    shapefactor fixed too: free, its three bins and the POI share the SR's three bins, and
    the Hessian is singular (the ranking then reports NaN post-fit impacts and a failed fit;
    cabinetry's MINUIT reports numbers)."""
    workspace = all_modifiers_workspace()
    parameters = workspace["measurements"][0]["config"]["parameters"]
    parameters.append({"name": "shape_free", "fixed": True})
    ws = pyhf.Workspace(workspace)
    model = ws.model()
    return HistFactoryModel.from_workspace(workspace, device=DEVICE), model, ws.data(model)


def test_ranking_matches_cabinetry_on_every_modifier_type():
    """Every free parameter of the hand-built workspace (normsys, histosys, lumi, staterror,
    shapesys, normfactor): cabinetry's ranking loop, from our nominal fit."""
    ours_model, model, data = every_modifier()
    ours = ranking(ours_model)
    assert ours.converged.all() and ours.fits_converged.all()
    poi, fixed = model.config.poi_index, model.config.suggested_fixed()
    free = [lab for i, lab in enumerate(model.config.par_names) if i != poi and not fixed[i]]
    assert [ours.labels[c] for c in ours.columns[0]] == free  # pyhf's order, fixed ones out
    res = ours.labels.index("res")  # fixed in the measurement: not ranked
    assert np.isnan(ours.postfit_up[0, res].item())
    theirs = cabinetry_impacts(model, data, ours, free)
    compare("every-modifier", model, data, ours, ours_model, theirs)


def test_uncertainties_are_the_exact_hessians():
    """Post-fit uncertainties: a central-difference Hessian of pyhf's own ``logpdf`` at our
    minimum agrees with ours to 1e-5 (cabinetry's, from MINUIT's HESSE within parameter
    limits, differ by up to 2.3% here: see :func:`test_nominal_fit_matches_cabinetry`)."""
    ours_model, model, data = every_modifier()
    ours = ranking(ours_model, parameters=["jes"])
    x = ours.bestfit[0].cpu().numpy()
    free = np.flatnonzero(~np.asarray(model.config.suggested_fixed()))
    h = 1e-4

    def twice_nll(i, j, si, sj):
        p = x.copy()
        p[i] += si * h
        p[j] += sj * h
        return -2 * model.logpdf(p, data)[0]

    hessian = np.array(
        [
            [
                (
                    twice_nll(i, j, 1, 1)
                    - twice_nll(i, j, 1, -1)
                    - twice_nll(i, j, -1, 1)
                    + twice_nll(i, j, -1, -1)
                )
                / (4 * h * h)
                for j in free
            ]
            for i in free
        ]
    )
    numeric = np.sqrt(np.diag(np.linalg.inv(hessian / 2)))
    got = ours.uncertainty[0].cpu().numpy()[free]
    np.testing.assert_allclose(got, numeric, rtol=1e-5)
    WORST["uncertainties vs central differences"] = float(np.max(np.abs(got / numeric - 1)))
    print("uncertainties vs central differences:", WORST["uncertainties vs central differences"])


def test_prefit_uncertainties_match_cabinetry():
    """Normal widths (normsys/histosys 1, lumi sigma, staterror relative), 1/sqrt(tau) for
    shapesys, 0 for normfactor/shapefactor and fixed parameters, as cabinetry."""
    cases = [(HistFactoryModel.from_workspace(all_modifiers_workspace()), None)]
    cases.append((published("atlas-susy-2018-31-sbottom-B")[0], "atlas-susy-2018-31-sbottom-B"))
    for ours, name in cases:
        if name is None:
            model = pyhf.Workspace(all_modifiers_workspace()).model()
        else:
            model = published(name)[1]
        expected = cabinetry.model_utils.prefit_uncertainties(model)
        got = prefit_uncertainties(ours)[0].cpu().numpy()
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=0)


# --------------------------------------------------------------------------- published
#: (workspace, patch (None: the first), the parameters ranked): the POI at its bound 0 with a
#: ttbar_Gen shift pushing it to its bound 10 (sbottom-B); a POI inside its bounds (sbottom-A,
#: 0.77 +- 2.5); the 119-parameter stau workspace's largest post-fit impact
CASES = [
    ("atlas-susy-2018-31-sbottom-B", None, ["ttbar_Gen", "staterror_SR_cuts[0]", "mu_ttbar"]),
    (
        "atlas-susy-2018-31-sbottom-A",
        "sig_s1_x1",
        ["ttbar_FSR", "staterror_SR_meff[0]", "ttbar_PS"],
    ),
    ("atlas-susy-2018-04-stau", "sig_s1_x1", ["TopSystHardCodeSR1"]),
]
#: cabinetry's impacts of CASES from our nominal fit (~20 s of MINUIT fits a workspace),
#: written by tests/data/cabinetry_ranking_published.py
REFERENCE = Path(__file__).parent / "data" / "cabinetry_ranking_published.json"


def reference_impacts(name: str) -> dict[str, list[float]]:
    cases = json.loads(REFERENCE.read_text())["cases"]
    return next(c["impacts"] for c in cases if c["workspace"] == name)


@pytest.mark.parametrize(
    ("name", "patch", "labels"), CASES, ids=[c[0].split("-", 3)[-1] for c in CASES]
)
def test_ranking_matches_cabinetry(name, patch, labels):
    """Our ranking of every parameter (one batched call), its named subset equal to the same
    entries of the whole, and each impact as cabinetry's (the reference file; a conditional
    fit that differs is run again by cabinetry's fitter here)."""
    theirs = reference_impacts(name)
    assert list(theirs) == labels
    ours_model, model, data = published(name, patch)
    ours = ranking(ours_model)  # every parameter, in one batched call
    assert ours.converged.all() and ours.fits_converged.all()
    assert (
        len(ours.columns[0]) == sum(1 for f in model.config.suggested_fixed() if not f) - 1
    )  # every free parameter but the POI
    subset = ranking(ours_model, parameters=labels)
    for field in IMPACTS:
        full, sub = getattr(ours, field), getattr(subset, field)
        for c in subset.columns[0]:
            assert sub[0, c].item() == pytest.approx(full[0, c].item(), abs=1e-9)
    if name == "atlas-susy-2018-04-stau":
        assert ranking_answer(ours).labels[0] == labels[0]  # the largest post-fit impact
    compare(name, model, data, ours, ours_model, theirs)


@pytest.mark.slow
def test_reference_impacts_are_cabinetrys_own():
    """The reference file's generator is cabinetry's ranking loop as the tests run it: on the
    smallest case (sbottom-B's first patch, one parameter), computed here, the same numbers."""
    name, patch, labels = CASES[0]
    ours_model, model, data = published(name, patch)
    ours = ranking(ours_model, parameters=labels[:1])
    theirs = cabinetry_impacts(model, data, ours, labels[:1])[labels[0]]
    assert theirs == pytest.approx(reference_impacts(name)[labels[0]], rel=REL, abs=ABS)


def test_nominal_fit_matches_cabinetry():
    """The free fit behind the ranking: our minimum is at least as low as cabinetry's, the best
    fits agree to MINUIT's precision. cabinetry's uncertainties come from MINUIT's HESSE
    within the parameter limits, in MINUIT's internal (sin-transformed) coordinates: here 0.7%
    smaller than ours for most bounded parameters (up to 1.1%), 14% for the POI, 0.77 from
    its bound 0 with an uncertainty of 2.5 (the exact Hessian is checked against central
    differences in :func:`test_uncertainties_are_the_exact_hessians`)."""
    ours_model, model, data = published("atlas-susy-2018-31-sbottom-A", "sig_s1_x1")
    ours = ranking(ours_model, parameters=["ttbar_PS"])
    theirs = cabinetry.fit.fit(model, data, tolerance=MINUIT_TOLERANCE)
    x = ours.bestfit[0].cpu().numpy()
    assert -2 * model.logpdf(x, data)[0] <= theirs.best_twice_nll + 1e-9
    np.testing.assert_allclose(x, theirs.bestfit, atol=2e-3)
    poi = model.config.poi_index
    unc = np.delete(ours.uncertainty[0].cpu().numpy(), poi)
    np.testing.assert_allclose(unc, np.delete(theirs.uncertainty, poi), rtol=2e-2)
    assert theirs.uncertainty[poi] < 0.9 * ours.uncertainty[0, poi].item()


# --------------------------------------------------------------------------- batching
def test_stacked_elements_equal_each_alone():
    """Two patches stacked in one model, ranked in one call (each row its own element's
    parameters), equal each ranked alone."""
    workspace, patchset, _ = shared_workspace("atlas-susy-2018-31-sbottom-B")
    names = [p["metadata"]["name"] for p in patchset["patches"]][:2]
    stacked = HistFactoryModel.from_patchset(workspace, patchset, patch_names=names, device=DEVICE)
    both = ranking(stacked)
    assert both.converged.all()
    for e, name in enumerate(names):
        patch = next(p for p in patchset["patches"] if p["metadata"]["name"] == name)
        alone_model = HistFactoryModel.from_workspace(
            workspace, patches=[patch["patch"]], device=DEVICE
        )
        alone = ranking(alone_model)
        one, other = ranking_answer(both, e).model_dump(), ranking_answer(alone).model_dump()
        assert one["labels"] == other["labels"]
        for field in (*IMPACTS, "bestfit", "uncertainty", "pull", "constraint"):
            np.testing.assert_allclose(one[field], other[field], rtol=0, atol=1e-8)


def test_sorted_output_and_bad_parameters():
    ours_model = every_modifier()[0]
    res = ranking(ours_model, parameters=["xsec", "stat_shared", "bkg1_norm"])
    row = ranking_answer(res).model_dump()
    impact = [
        max(abs(u), abs(d)) for u, d in zip(row["postfit_up"], row["postfit_down"], strict=True)
    ]
    assert impact == sorted(impact, reverse=True)
    assert set(row["labels"]) == {"xsec", "bkg1_norm"} | {
        lab for lab in res.labels if lab.startswith("stat_shared[")
    } - {lab for c, lab in enumerate(res.labels) if ours_model.fixed[0, c]}
    # no constraint term: pre-fit impacts 0, pull and constraint undefined
    k = row["labels"].index("bkg1_norm")
    assert row["prefit_up"][k] == row["prefit_down"][k] == 0.0 and np.isnan(row["pull"][k])
    assert len(ranking_answer(res, top=2).labels) == 2
    with pytest.raises(ValueError, match="'nope' is not in the model"):
        ranking(ours_model, parameters=["nope"])
    with pytest.raises(ValueError, match="POI 'mu'"):
        ranking(ours_model, parameters=["mu"])


# --------------------------------------------------------------------------- chord steps
def post_fit_conditional_fits(model):
    """The free fit of ``model``'s observations and the post-fit conditional fits of its
    ranking (every free non-POI parameter pinned at ``bestfit +/- uncertainty``, within
    its bounds): ``(free fit, pinned columns [F, 1], their values [F, 1])``."""
    free = fit(model)
    best, sigma = free.bestfit[0].tolist(), free.uncertainty[0].tolist()
    lo, hi = model.bounds[0, :, 0].tolist(), model.bounds[0, :, 1].tolist()
    pinned, values = [], []
    for c in range(model.n_pars):
        if c == model.poi_index or bool(model.fixed[0, c]):
            continue
        for sign in (1.0, -1.0):
            pinned.append([c])
            values.append([min(max(best[c] + sign * sigma[c], lo[c]), hi[c])])
    return (
        free,
        torch.tensor(pinned, device=model.device),
        torch.tensor(values, dtype=model.dtype, device=model.device),
    )


@pytest.mark.parametrize(
    ("name", "patch"),
    [("atlas-susy-2018-31-sbottom-A", "sig_s1_x1"), ("atlas-susy-2018-31-sbottom-B", None)],
    ids=["POI inside its bounds", "POI held at its bound 0"],
)
def test_chord_steps_reach_the_minimisers_minima(name, patch):
    """Most conditional fits of a ranking converge in the chord steps alone, at the minima
    the minimiser finds from the same start points, also where the free fit holds the POI at
    its bound; a fit whose minimum lies beyond a bound is not reported converged (the
    ranking gives it to the minimiser)."""
    from pyhf_gpu_server.inference.chord import chord_conditional_fits, held_at_bounds
    from pyhf_gpu_server.inference.mle import fit_rows
    from pyhf_gpu_server.inference.objective import TwiceNLL

    model, _, _ = published(name, patch)
    free, pinned, values = post_fit_conditional_fits(model)
    F, k = pinned.shape[0], model.poi_index
    element = torch.zeros(F, dtype=torch.long, device=model.device)
    data = model.observed.expand(F, -1)
    start = free.bestfit.expand(F, -1).scatter(1, pinned, values)
    bounds = model.bounds.expand(F, -1, -1).clone()
    fixed = model.fixed.expand(F, -1).scatter(1, pinned, True)
    reference = fit_rows(model, data, element, init=start, bounds=bounds, fixed=fixed)
    assert reference.converged.all()
    held = held_at_bounds(free.bestfit, model.bounds, model.fixed, 1e-12)
    assert bool(held[0, k]) == (patch is None)  # sbottom-B's first patch: POI at 0
    # a fit whose POI moves: its bound set halfway there, short of that fit's minimum
    moved = (reference.bestfit[:, k] - free.bestfit[0, k]).abs()
    blocked = int(moved.argmax())
    shift = reference.bestfit[blocked, k] - free.bestfit[0, k]
    assert abs(shift) > 1e-3
    bounds[blocked, k, 1 if shift > 0 else 0] = free.bestfit[0, k] + 0.5 * shift
    inverse = 0.5 * free.corr_mat * free.uncertainty.unsqueeze(2) * free.uncertainty.unsqueeze(1)
    objective = TwiceNLL(model, data, element)
    x, converged = chord_conditional_fits(
        objective, free.bestfit.expand(F, -1), values, inverse, held, [F], pinned, bounds, 1e-10
    )
    assert not converged[blocked]
    assert bounds[blocked, k, 0] <= x[blocked, k] <= bounds[blocked, k, 1]
    assert converged.float().mean() >= 0.9, converged.tolist()
    ours = objective.value(x, torch.arange(F))
    theirs = objective.value(reference.bestfit, torch.arange(F))
    ok = converged.nonzero().squeeze(1)
    assert torch.all(ours[ok] <= theirs[ok] + 1e-8)
    assert torch.allclose(x[ok, k], reference.bestfit[ok, k], rtol=0, atol=1e-5)
    assert torch.equal(x.gather(1, pinned), values)  # pinned stay pinned


# --------------------------------------------------------------------------- devices
def test_ranking_runs_on_fake_cuda(monkeypatch):
    """The free fit, the Hessian, every conditional fit and the scatter of the impacts on a
    simulated cuda device (a cpu tensor anywhere would raise). torch.func's autograd aborts the
    process under FakeTensorMode on a cuda device, so the exact Hessian is replaced by the
    closed-form Fisher matrix here (on a real device it is the autograd one)."""
    from test_engine_device import small_patchset_model
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    monkeypatch.setattr("pyhf_gpu_server.inference.objective.TwiceNLL.hessian", fisher_hessian)
    options = FitOptions(minimize=MinimizeOptions(max_iter=3, check_every=0))
    with FakeTensorMode():
        model = small_patchset_model("cuda:0")
        res = ranking(model, options=options, parameters=["ttbar_Gen", "staterror_SR_cuts"])
        for name in ("bestfit", "uncertainty", *IMPACTS, "pull", "converged", "starts"):
            tensor = getattr(res, name)
            assert isinstance(tensor, FakeTensor), name
            assert tensor.device == torch.device("cuda:0"), name
        assert res.postfit_up.shape == (model.n_elements, model.n_pars)


def fisher_hessian(self, x, rows):
    """A FakeTensorMode-safe stand-in for ``TwiceNLL.hessian``: ``J^T W J + diag``."""
    from pyhf_gpu_server.inference.objective import TwiceNLL

    d = TwiceNLL(self.model, self.data, self.element, "fisher").derivatives(x, rows)
    return torch.einsum("rnp,rn,rnq->rpq", d.J, d.weight, d.J) + torch.diag_embed(d.diagonal)


def test_docstring_examples():
    failures, attempted = doctest.testmod(
        importlib.import_module("pyhf_gpu_server.inference.ranking"), optionflags=doctest.ELLIPSIS
    )
    assert attempted > 0 and failures == 0
