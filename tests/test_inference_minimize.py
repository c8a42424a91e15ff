"""The batched bounded damped-Newton minimiser on objectives with known minima."""

from __future__ import annotations

import doctest
import importlib
import json
from pathlib import Path

import pyhf
import pytest
import torch
from pyhf_global import global_pyhf
from test_inference_support import DEVICE as DEVICE_NAME
from test_inference_support import (
    one_thread,  # noqa: F401 (fixture)
    step_inputs,
)

from pyhf_gpu_server.inference.curvature import DenseCurvature, LowRankCurvature
from pyhf_gpu_server.inference.minimize import (
    Derivatives,
    MinimizeOptions,
    decrement_tolerance,
    minimize,
)

DEVICE = torch.device(DEVICE_NAME)
pytestmark = pytest.mark.usefixtures("one_thread")


#: every inference module with a docstring example (found, so that none is left out)
INFERENCE_MODULES = sorted(
    path.stem
    for path in (Path(__file__).parents[1] / "server" / "inference").glob("*.py")
    if ">>>" in path.read_text()
)


class Poisson:
    """``-2 log L`` of Poisson counts ``n`` with rates ``exp(A x)``: smooth, convex."""

    def __init__(self, A: torch.Tensor, n: torch.Tensor, value_fails_above: float | None = None):
        self.A, self.n, self.fails_above = A, n, value_fails_above

    def _rates(self, x):
        return torch.exp(x @ self.A.T)

    def value(self, x, rows):
        lam = self._rates(x)
        f = 2 * (lam - self.n[rows] * torch.log(lam)).sum(-1)
        if self.fails_above is not None:
            f = torch.where(x.abs().amax(-1) > self.fails_above, torch.full_like(f, torch.nan), f)
        return f

    def derivatives(self, x, rows):
        lam = self._rates(x)
        J = lam.unsqueeze(-1) * self.A  # [R, N, P]
        r = 2 * (1 - self.n[rows] / lam)
        g = torch.einsum("rn,rnp->rp", r, J)
        H = torch.einsum("rn,rnp,rnq->rpq", 2 * self.n[rows] / lam**2, J, J)
        return Derivatives(self.value(x, rows), g, H, J, r)


def make_problem(B: int = 64, P: int = 6, N: int = 12, seed: int = 0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    A = (torch.randn(N, P, generator=gen, dtype=dtype) * 0.4).to(DEVICE)
    truth = torch.randn(B, P, generator=gen, dtype=dtype).to(DEVICE) * 0.5
    n = torch.poisson(torch.exp(truth @ A.T) * 20).to(DEVICE) / 20 + 0.05
    return A, n


@pytest.mark.parametrize("name", INFERENCE_MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(f"pyhf_gpu_server.inference.{name}")
    failures, _ = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert failures == 0


def test_reaches_the_exact_minimum_of_a_batch_with_bounds_and_fixed_parameters():
    A, n = make_problem()
    B, P = n.shape[0], A.shape[1]
    objective = Poisson(A, n)
    init = torch.zeros(B, P, dtype=A.dtype, device=DEVICE)
    bounds = torch.tensor([-0.2, 0.2], dtype=A.dtype, device=DEVICE).expand(B, P, 2)
    fixed = torch.zeros(B, P, dtype=torch.bool, device=DEVICE)
    fixed[::2, 0] = True
    init[::2, 0] = 0.1
    res = minimize(objective, init, bounds, fixed)
    assert res.converged.all()
    assert res.x.device == DEVICE
    assert torch.all(res.x[::2, 0] == 0.1)
    assert torch.all((res.x >= -0.2) & (res.x <= 0.2))
    # KKT: zero gradient on free interior parameters, outward gradient on active bounds
    g = objective.derivatives(res.x, torch.arange(B, device=DEVICE)).g
    interior = (res.x.abs() < 0.2 - 1e-9) & ~fixed
    assert g[interior].abs().max() < 1e-4
    at_upper = (res.x >= 0.2 - 1e-12) & ~fixed
    assert torch.all(g[at_upper] <= 1e-8)
    # a row fitted alone gives the same minimum
    alone = minimize(Poisson(A, n[1:2]), init[1:2], bounds[1:2], fixed[1:2])
    assert abs(alone.fun.item() - res.fun[1].item()) < 1e-9


@pytest.mark.parametrize("secant", [True, False])
def test_unbounded_minimum_matches_the_analytic_one(secant):
    A, n = make_problem(B=8, P=3, N=3, seed=1)  # square A: rates can match the counts
    objective = Poisson(A, n)
    init = torch.zeros(8, 3, dtype=A.dtype, device=DEVICE)
    wide = torch.tensor([-50.0, 50.0], dtype=A.dtype, device=DEVICE).expand(8, 3, 2)
    res = minimize(objective, init, wide, options=MinimizeOptions(secant=secant))
    exact = torch.linalg.solve(A, torch.log(n).T).T
    rows = torch.arange(8, device=DEVICE)
    assert res.converged.all()
    assert torch.all(res.fun - objective.value(exact, rows) < 1e-9)
    assert torch.allclose(res.x, exact, atol=1e-3)


def test_a_failing_row_is_reported_failed_and_does_not_spoil_the_others():
    A, n = make_problem(B=4)
    objective = Poisson(A, n, value_fails_above=1e-3)  # NaN everywhere but near 0
    init = torch.zeros(4, A.shape[1], dtype=A.dtype, device=DEVICE)
    bounds = torch.tensor([-5.0, 5.0], dtype=A.dtype, device=DEVICE).expand(4, A.shape[1], 2)
    res = minimize(objective, init, bounds)
    assert not res.converged.any()
    healthy = minimize(Poisson(A, n), init, bounds)
    mixed_init = torch.stack([init[0], init[1] + 10.0])  # second row starts outside -> clipped
    mixed = minimize(Poisson(A, n), mixed_init, bounds[:2])
    assert healthy.converged.all() and mixed.converged.all()


def test_running_out_of_iterations_is_not_convergence():
    A, n = make_problem(B=4)
    init = torch.full((4, A.shape[1]), 2.0, dtype=A.dtype, device=DEVICE)
    bounds = torch.tensor([-5.0, 5.0], dtype=A.dtype, device=DEVICE).expand(4, A.shape[1], 2)
    res = minimize(Poisson(A, n), init, bounds, options=MinimizeOptions(max_iter=1))
    assert not res.converged.any()
    assert torch.all(res.iterations == 1)


def test_float32_converges_close_to_the_float64_minimum():
    A, n = make_problem(B=16)
    init = torch.zeros(16, A.shape[1], dtype=A.dtype, device=DEVICE)
    bounds = torch.tensor([-2.0, 2.0], dtype=A.dtype, device=DEVICE).expand(16, A.shape[1], 2)
    ref = minimize(Poisson(A, n), init, bounds)
    single = minimize(Poisson(A.float(), n.float()), init.float(), bounds.float())
    assert single.x.dtype == torch.float32
    assert single.converged.all()
    assert torch.allclose(single.fun.double(), ref.fun, atol=1e-3)


def _random_low_rank(R=6, P=9, N=3, m=2, seed=3):
    """A low-rank curvature with secant pairs, a flat (unconstrained) parameter, and its
    dense twin."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(DEVICE)

    d = rand(R, P).abs() + 0.5
    d[:, 0] = 0.0  # parameter 0 has no constraint term
    J, w = rand(R, N, P), rand(R, N).abs()
    low = LowRankCurvature(d, J, w, rand(R, N), torch.tensor([0], device=DEVICE), memory=m)
    low.pairs_a, low.pairs_y, low.c = 0.3 * rand(R, m, P), 0.3 * rand(R, m, P), rand(R, m).abs()
    S = torch.einsum("rk,rkp,rkq->rpq", low.c, low.pairs_a, low.pairs_y)
    dense = DenseCurvature(
        torch.diag_embed(d) + torch.einsum("rn,rnp,rnq->rpq", w, J, J) + S + S.mT
    )
    return low, dense


def test_low_rank_steps_equal_dense_cholesky_steps_and_definiteness():
    """Woodbury + Schur complement give the dense Cholesky's steps, and flag the same rows as
    not positive definite (the secant term makes some matrices indefinite)."""
    for seed in range(4):
        low, dense = _random_low_rank(seed=seed)
        g, movable, lams = step_inputs(*low.d.shape, seed)
        movable[1, 3] = movable[2, 0] = False  # a fixed parameter, and the flat one held
        p_low, ok_low = low.steps(g, movable, lams)
        p_dense, ok_dense = dense.steps(g, movable, lams)
        assert torch.equal(ok_low, ok_dense)
        assert torch.allclose(p_low, p_dense, rtol=1e-8, atol=1e-10)
        assert torch.all(p_low[:, 1, 3] == 0) and torch.all(p_low[:, 2, 0] == 0)
    assert not ok_dense.all(), "the cases should include an indefinite matrix"


def test_solvers_and_trial_rules_find_the_same_histfactory_minima():
    """Fits of toys of a model with every modifier type (normfactor and shapefactor without
    constraint, Poisson shapesys) land on the same minima with either solver and either trial
    rule, and converge. (Some toys of this deliberately awkward model have a singular
    curvature at the minimum, a parameter without effect: the convergence test there is the
    damped step's decrement.)"""
    from hand_built import all_modifiers_workspace

    from pyhf_gpu_server.engine import HistFactoryModel
    from pyhf_gpu_server.inference.objective import TwiceNLL
    from pyhf_gpu_server.inference.toys import sample_toys

    model = HistFactoryModel.from_workspace(all_modifiers_workspace(), device=DEVICE)
    element = torch.zeros(1, dtype=torch.long, device=DEVICE)
    toys = sample_toys(model, model.init, element, 32, torch.Generator(DEVICE).manual_seed(5))[0]
    rows = torch.zeros(toys.shape[0], dtype=torch.long, device=DEVICE)
    init = model.init.expand(toys.shape[0], -1)
    found = {}
    for solver in ("dense", "low-rank"):
        for trials in ("damped", "grid"):
            objective = TwiceNLL(model, toys, rows, "gauss-newton")
            options = MinimizeOptions(solver=solver, secant_memory=3, trials=trials)
            found[solver, trials] = minimize(
                objective, init, model.bounds[0], model.fixed[0], options
            )
    reference = found["dense", "grid"]
    for result in found.values():
        assert result.converged.sum() >= 0.9 * toys.shape[0]
        both = result.converged & reference.converged
        assert torch.allclose(result.fun[both], reference.fun[both], rtol=0, atol=1e-7)


@pytest.mark.parametrize("solver", ["dense", "low-rank"])
def test_the_last_rows_of_a_call_iterate_on_a_grid_to_the_same_minima(monkeypatch, solver):
    """Once at most ``tail_rows`` rows run after ``tail_after`` iterations, the iterations try
    the tail's grid of damped and stretched steps (an iteration of a few rows costs its
    dispatch, not its arithmetic); the minima are those of the plain damped steps, and as many
    rows converge."""
    from hand_built import all_modifiers_workspace

    from pyhf_gpu_server.engine import HistFactoryModel
    from pyhf_gpu_server.inference.objective import TwiceNLL
    from pyhf_gpu_server.inference.toys import sample_toys

    module = importlib.import_module("pyhf_gpu_server.inference.minimize")
    model = HistFactoryModel.from_workspace(all_modifiers_workspace(), device=DEVICE)
    element = torch.zeros(1, dtype=torch.long, device=DEVICE)
    toys = sample_toys(model, model.init, element, 64, torch.Generator(DEVICE).manual_seed(7))[0]
    rows = torch.zeros(toys.shape[0], dtype=torch.long, device=DEVICE)
    init = model.init.expand(toys.shape[0], -1)
    calls: list[tuple[str, int]] = []
    iterate = module._iterate

    def recorded(objective, s, bounds, options, constants, exact):
        calls.append((options.trials, s.rows.numel()))
        return iterate(objective, s, bounds, options, constants, exact)

    monkeypatch.setattr(module, "_iterate", recorded)
    found = {}
    for tail_rows in (0, 16):
        calls.clear()
        options = MinimizeOptions(solver=solver, secant_memory=3, tail_rows=tail_rows)
        objective = TwiceNLL(model, toys, rows, "gauss-newton")
        found[tail_rows] = minimize(objective, init, model.bounds[0], model.fixed[0], options)
        grid = [(i, n) for i, (trials, n) in enumerate(calls, 1) if trials == "grid"]
        assert (len(grid) > 0) is (tail_rows > 0)
        assert all(n <= tail_rows and i > module.TAIL_AFTER for i, n in grid)
    plain, tail = found[0], found[16]
    assert tail.converged.sum() >= plain.converged.sum() >= 0.9 * toys.shape[0]
    both = plain.converged & tail.converged
    assert torch.allclose(tail.fun[both], plain.fun[both], rtol=0, atol=1e-7)


class _PoissonConstraint:
    """``2 (tau gamma - n log gamma) + 10 (y - 10)^2`` per row, ``x = (gamma, y)``: a Poisson
    constraint term with its exact curvature ``2 n / gamma^2``, its minimum at ``gamma = n /
    tau``, beside a parameter whose first step lowers the sum far more than the constraint
    term's rise could."""

    def __init__(self, tau: float, n: float):
        self.tau, self.n = tau, n

    def value(self, x, rows):
        gamma, y = x.unbind(-1)
        return 2 * (self.tau * gamma - self.n * torch.log(gamma)) + 10 * (y - 10) ** 2

    def derivatives(self, x, rows):
        gamma, y = x.unbind(-1)
        g = torch.stack([2 * (self.tau - self.n / gamma), 20 * (y - 10)], -1)
        H = torch.diag_embed(torch.stack([2 * self.n / gamma**2, torch.full_like(y, 20.0)], -1))
        return self.value(x, rows), g, H


@pytest.mark.parametrize("trials", ["damped", "grid"])
def test_a_barrier_keeps_a_poisson_constrained_parameter_off_its_lower_bound(trials):
    """From ``gamma = 1, y = 0`` with ``tau = 20, n = 5``, Newton's step takes ``gamma`` to -2,
    and the other parameter's decrease pays for the constraint term's rise: without the barrier
    the fit lands on the lower bound 1e-10 and regains a factor of 2 an iteration, more than
    30 iterations; with it the step stops at 0.1 and the fit ends in a few. Both find the
    minimum ``(0.25, 10)``."""
    x0 = torch.tensor([[1.0, 0.0]], dtype=torch.float64, device=DEVICE)
    box = torch.tensor([[1e-10, 10.0], [-20.0, 20.0]], dtype=torch.float64, device=DEVICE)
    options = MinimizeOptions(trials=trials)
    iterations = {}
    for barrier in (None, torch.tensor([True, False], device=DEVICE)):
        res = minimize(_PoissonConstraint(20.0, 5.0), x0, box, options=options, barrier=barrier)
        assert res.converged.all()
        assert res.x[0].tolist() == pytest.approx([0.25, 10.0], abs=1e-6)
        iterations[barrier is not None] = res.iterations.item()
    assert iterations[False] > 30 and iterations[True] <= 10, iterations


def test_the_barrier_marks_poisson_constrained_parameters_with_a_positive_count():
    """``TwiceNLL.barrier``: a row's parameters with a Poisson constraint term (shapesys) whose
    auxiliary count is positive; with that count 0 (the minimum may then sit on the bound) and
    on Normal-constrained or free parameters, none."""
    from hand_built import all_modifiers_workspace

    from pyhf_gpu_server.engine import HistFactoryModel
    from pyhf_gpu_server.inference.objective import TwiceNLL

    model = HistFactoryModel.from_workspace(all_modifiers_workspace(), device=DEVICE)
    poisson = model.constraint.is_poisson
    data = model.observed.index_select(0, torch.zeros(2, dtype=torch.long, device=DEVICE))
    first = int(poisson.nonzero()[0])
    data[1, model.n_main + first] = 0.0  # row 1: the first Poisson term's count is 0
    nll = TwiceNLL(model, data, torch.zeros(2, dtype=torch.long, device=DEVICE), "gauss-newton")
    marked = model.constraint.param[poisson]
    expected = torch.zeros(2, model.n_pars, dtype=torch.bool, device=DEVICE)
    expected[:, marked] = True
    expected[1, model.constraint.param[first]] = False
    assert marked.numel() > 0 and torch.equal(nll.barrier, expected)


def published_sbottom_b(name: str):
    """The model of one published point of sbottom region B (``patchset.hepdata.json.gz``)."""
    from conftest import WORKSPACES_DIR, load_json, load_patchset

    from pyhf_gpu_server.engine import HistFactoryModel
    from pyhf_gpu_server.engine.translate import WorkspaceTranslator

    folder = WORKSPACES_DIR / "atlas-susy-2018-31-sbottom-B"
    patches = load_patchset(folder / "patchset.hepdata.json.gz")["patches"]
    patch = next(p for p in patches if p["metadata"]["name"] == name)
    element = WorkspaceTranslator(load_json(folder / "BkgOnly.json")).element(patch["patch"])
    return HistFactoryModel([element], device=DEVICE)


def test_a_converged_fit_has_no_gradient_left_even_from_far_off_starts():
    """Conditional fits (mu = 1) of a published sbottom point from 33 start points, the init
    and 32 seeded random moves of every free parameter (N(0, 0.5), clipped to the bounds):
    every fit flagged converged ends with a gradient of ~0 on the parameters off their bounds.
    Some of these starts put a staterror gamma on its lower bound, where a bin's rate is ~0:
    the curvature's solve there lost its digits and gave an uphill step, whose negative
    Newton decrement was taken for convergence at twice NLL 2064 (BENCHMARKS.md)."""
    from pyhf_gpu_server.inference.mle import fixed_poi_fit
    from pyhf_gpu_server.inference.objective import TwiceNLL

    model = published_sbottom_b("sbottom_400_370_240")
    rows = 33
    init, bounds = model.init[0], model.bounds[0]
    fixed = model.fixed[0].clone()
    fixed[model.poi_index] = True
    moved = 0.5 * torch.randn(
        rows, init.shape[0], generator=torch.Generator().manual_seed(1), dtype=model.dtype
    ).to(DEVICE)
    moved[0] = 0.0
    lo, hi = bounds.select(-1, 0), bounds.select(-1, 1)
    start = torch.where(fixed, init, torch.minimum(torch.maximum(init + moved, lo), hi))
    at_lower_bound = ((start <= lo) & ~fixed).any(1)
    assert at_lower_bound.any()  # the case this test is about is among the starts
    each = torch.zeros(rows, dtype=torch.long, device=DEVICE)
    fit = fixed_poi_fit(model, 1.0, element=each, init=start, uncertainties=False)
    objective = TwiceNLL(model, model.observed.expand(rows, -1), each, "gauss-newton")
    gradient = objective.derivatives(fit.bestfit, torch.arange(rows, device=DEVICE)).g
    inside = ~fixed & (fit.bestfit > lo + 1e-8) & (fit.bestfit < hi - 1e-8)
    left = (gradient.abs() * inside).amax(1)
    assert fit.converged[0]
    assert (left[fit.converged] < 1e-3).all(), left[fit.converged].max()
    assert fit.converged.sum() >= rows - 2


def test_the_exact_newton_trial_ends_a_slow_fit_at_the_same_minimum():
    """The conditional fit (mu = 1) of a strongly excluded published sbottom point creeps for
    ~60 iterations on the Gauss-Newton model once the likelihood is convex around it
    (``benchmarks/bench_tail.py``). With the exact curvature's Newton step among the tail's
    trials it reaches the same minimum, to the minimiser's tolerance, in far fewer."""
    from dataclasses import replace

    from pyhf_gpu_server.inference.mle import FitOptions, fixed_poi_fit

    model = published_sbottom_b("sbottom_400_300_60")
    fits = {}
    for exact in (False, True):
        options = replace(MinimizeOptions(), exact_newton_after=30 if exact else None)
        fits[exact] = fixed_poi_fit(
            model, 1.0, options=FitOptions(minimize=options), uncertainties=False
        )
    gauss_newton, exact = fits[False], fits[True]
    assert gauss_newton.converged.all() and exact.converged.all()
    assert gauss_newton.iterations.item() >= 90
    assert exact.iterations.item() <= 0.7 * gauss_newton.iterations.item()
    torch.testing.assert_close(exact.best_twice_nll, gauss_newton.best_twice_nll, rtol=0, atol=1e-9)
    torch.testing.assert_close(exact.bestfit, gauss_newton.bestfit, rtol=0, atol=1e-4)


def _scaled_signal(operations: list, scale: float) -> list:
    """A patch's operations with every sample it adds scaled by ``scale`` (nominal, histosys
    variations, staterror widths): the same systematics on a larger signal."""
    scaled = []
    for operation in operations:
        value = operation.get("value")
        if isinstance(value, dict) and "data" in value:
            value = {**value, "data": [scale * x for x in value["data"]], "modifiers": []}
            for modifier in operation["value"]["modifiers"]:
                data = modifier["data"]
                if modifier["type"] == "histosys":
                    data = {k: [scale * x for x in data[k]] for k in ("hi_data", "lo_data")}
                elif modifier["type"] == "staterror":
                    data = [scale * x for x in data]
                value["modifiers"].append({**modifier, "data": data})
            operation = {**operation, "value": value}
        scaled.append(operation)
    return scaled


@pytest.mark.slow
def test_the_hard_fits_of_strongly_excluded_signals_converge():
    """The published sbottom signals, five times larger: their conditional fits at mu = 1
    are strongly excluded and hard (nuisance parameters on their bounds, a Gauss-Newton model
    that is not positive definite for tens of iterations). In one hypotest of all 217
    sbottom-B points every fit converges. On sbottom-A all but one do, because the rows
    still running after ``tail_after_all`` iterations move to the tail's grid and exact
    Newton trials, and a row at its minimum whose model gives no certificate gets the exact
    curvature's: with the tail left to the last 16 rows, many run out of iterations. The CLs
    stay as they are (these points are excluded)."""
    from dataclasses import replace

    from conftest import WORKSPACES_DIR, load_json, load_patchset

    from pyhf_gpu_server.engine import HistFactoryModel
    from pyhf_gpu_server.engine.translate import WorkspaceTranslator
    from pyhf_gpu_server.inference import hypotest
    from pyhf_gpu_server.inference.mle import FitOptions

    def not_converged(region: str, tail_after_all: int) -> tuple[int, torch.Tensor]:
        folder = WORKSPACES_DIR / f"atlas-susy-2018-31-sbottom-{region}"
        translator = WorkspaceTranslator(load_json(folder / "BkgOnly.json"))
        elements = [
            translator.element(_scaled_signal(p["patch"], 5.0), p["metadata"]["name"])
            for p in load_patchset(folder / "patchset.hepdata.json.gz")["patches"]
            if any(op["op"] == "add" for op in p["patch"])  # the one point without a signal
        ]
        model = HistFactoryModel(elements, device=DEVICE)
        poi = torch.ones(model.n_elements, dtype=model.dtype, device=DEVICE)
        options = FitOptions(minimize=replace(MinimizeOptions(), tail_after_all=tail_after_all))
        found = hypotest(model, poi, torch.arange(model.n_elements, device=DEVICE), options=options)
        return sum(int((~status.converged).sum()) for status in found.fits.values()), found.cls_obs

    default = MinimizeOptions().tail_after_all
    assert not_converged("B", default)[0] == 0
    (left, cls), (left_by_last_rows_only, cls_last_rows_only) = (
        not_converged("A", late) for late in (default, 10**6)
    )
    assert left <= 1 and left_by_last_rows_only >= 10
    torch.testing.assert_close(cls, cls_last_rows_only, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_fits_converge_where_the_deviance_is_summed_from_huge_counts():
    """shapesys with Poisson scales of 10^4-10^6 (counts of ~10^7 behind a deviance of ~10^3):
    the Newton decrement cannot fall below 1e-10 there, as every value carries rounding errors
    of ~10^-8, and such fits were reported not converged although at their minimum. The
    tolerance relative to the terms' size (decrement_tolerance's scale) reports them converged,
    at a minimum no higher than pyhf's with scipy at a tight tolerance (and the free fit of a
    hypotest as well as its conditional ones)."""
    import numpy as np
    import pyhf
    from hand_built import large_scale_shapesys_workspace
    from pyhf_global import global_pyhf

    from pyhf_gpu_server.engine import HistFactoryModel
    from pyhf_gpu_server.inference.hypotest import hypotest
    from pyhf_gpu_server.inference.mle import fit
    from pyhf_gpu_server.inference.objective import TwiceNLL

    spec = large_scale_shapesys_workspace(seed=2, bins=12)
    model = HistFactoryModel.from_workspace(spec, device=DEVICE)
    ours = fit(model, uncertainties=False)
    assert ours.converged.all()

    element = torch.zeros(1, dtype=torch.long, device=DEVICE)
    nll = TwiceNLL(model, model.observed, element, "gauss-newton")
    result = minimize(nll, model.init, model.bounds[0], model.fixed[0])
    assert result.converged.all()
    # the tolerance the rounding leaves is above the absolute 1e-10 that such fits missed
    # (whether a fit meets 1e-10 anyway depends on the machine's rounding)
    floor = decrement_tolerance(result.fun, 1e-10, nll.rounding_scale(element))
    assert floor.item() > 1e-10
    lo, hi = model.bounds[0].unbind(-1)
    at_bound = ((ours.bestfit[0] - lo).abs() < 1e-9) | ((hi - ours.bestfit[0]).abs() < 1e-9)
    assert at_bound.any()  # the projected steps hold some parameter on its bound
    assert hypotest(model, [1.0]).status.converged.all()

    workspace = pyhf.Workspace(spec)
    reference = workspace.model()
    data = workspace.data(reference)
    with global_pyhf(tolerance=1e-12):  # pyhf's own fit (one start), scipy at 1e-12
        _, twice_nll = pyhf.infer.mle.fit(data, reference, return_fitted_val=True)
    ours_at_pyhf = -2 * reference.logpdf(ours.bestfit[0].cpu().numpy(), data)[0]
    assert ours.best_twice_nll[0].item() == pytest.approx(ours_at_pyhf, abs=1e-6)
    assert ours_at_pyhf <= float(np.asarray(twice_nll)) + 1e-6


class _Wells:
    """Rows before ``half``: ``(x + 1)^2``, one minimum at -1; the others: ``(x^2 - 1)^2``,
    minima at -1 and +1 (which one a fit finds depends on where it starts)."""

    def __init__(self, half: int):
        self.half = half

    def derivatives(self, x, rows):
        well = (rows >= self.half).unsqueeze(-1)
        f = torch.where(well, (x**2 - 1) ** 2, (x + 1) ** 2).sum(-1)
        g = torch.where(well, 4 * x * (x**2 - 1), 2 * (x + 1))
        H = torch.where(well, 12 * x**2 - 4, torch.full_like(x, 2.0)).unsqueeze(-1)
        return f, g, H

    def value(self, x, rows):
        return self.derivatives(x, rows)[0]


def test_a_row_that_follows_another_starts_where_that_one_ended():
    """A follower starts at its row's end point, not at its own ``init``: in a double well,
    from the other row's minimum at -1 it stays there; from its ``init`` (0.5) it finds +1."""
    from pyhf_gpu_server.inference.minimize import Follow

    init = torch.tensor([[3.0], [2.0], [0.5], [0.5]], dtype=torch.float64, device=DEVICE)
    bounds = torch.tensor([[-5.0, 5.0]], dtype=torch.float64, device=DEVICE)
    followed = minimize(_Wells(2), init, bounds, follows=[Follow(2, 0, 2)])
    alone = minimize(_Wells(2), init, bounds)
    assert followed.converged.all() and alone.converged.all()
    assert followed.x.squeeze(1).round(decimals=4).tolist() == [-1.0, -1.0, -1.0, -1.0]
    assert alone.x.squeeze(1).round(decimals=4).tolist() == [-1.0, -1.0, 1.0, 1.0]
    # rows that run out of iterations end too: their followers start there, with a budget
    # of their own
    short = MinimizeOptions(max_iter=1)
    stopped = minimize(_Wells(2), init, bounds, None, short, follows=[Follow(2, 0, 2)])
    assert stopped.iterations.tolist() == [1, 1, 1, 1] and not stopped.converged.any()
    assert torch.all(stopped.x[2:] < -0.9), stopped.x


def _toy_problem(solver: str, n: int):
    """``n`` toys of a model whose fits use ``solver`` (block: a generated analysis with a
    gamma per bin; else every modifier type), with their objective's pieces."""
    import sys

    from conftest import REPO_ROOT
    from hand_built import all_modifiers_workspace

    from pyhf_gpu_server.engine import HistFactoryModel
    from pyhf_gpu_server.inference.toys import sample_toys

    if solver == "block":
        sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
        import generate_large

        spec = generate_large.workspace(channels=2, bins=5, systematics=4, per_sample=3)
    else:
        spec = all_modifiers_workspace()
    model = HistFactoryModel.from_workspace(spec, device=DEVICE)
    element = torch.zeros(1, dtype=torch.long, device=DEVICE)
    toys = sample_toys(model, model.init, element, n, torch.Generator(DEVICE).manual_seed(3))[0]
    return model, toys


@pytest.mark.parametrize("solver", ["dense", "low-rank", "block"])
def test_rows_that_follow_others_end_where_a_call_after_them_ends(solver):
    """Rows that start from other rows' end points in the same call (``follows``: a fit of
    each minimum to other data) reach the minima that a second call started at those points
    reaches, with every solver (their curvature joins the running rows'), and keep their own
    fixed values; without host looks they cannot start, which is said."""
    from pyhf_gpu_server.inference.minimize import Follow
    from pyhf_gpu_server.inference.objective import TwiceNLL

    model, toys = _toy_problem(solver, 48)
    half = 24
    element = torch.zeros(toys.shape[0], dtype=torch.long, device=DEVICE)
    k = model.poi_index
    init = model.init.expand(toys.shape[0], -1).clone()
    fixed = model.fixed.expand(toys.shape[0], -1).clone()
    init[half:, k], fixed[half:, k] = 0.5, True  # the followers: the POI fixed at 0.5
    bounds = model.bounds[0]
    options = MinimizeOptions(solver=solver, secant_memory=3)

    def objective(rows: slice):
        return TwiceNLL(model, toys[rows], element[rows], "gauss-newton", solver=solver)

    together = minimize(
        objective(slice(None)), init, bounds, fixed, options, follows=[Follow(half, 0, half)]
    )
    first = minimize(objective(slice(0, half)), init[:half], bounds, fixed[:half], options)
    start = torch.where(fixed[half:], init[half:], first.x)
    second = minimize(objective(slice(half, None)), start, bounds, fixed[half:], options)
    for part, alone in ((slice(0, half), first), (slice(half, None), second)):
        assert torch.equal(together.converged[part], alone.converged)
        assert alone.converged.sum() >= 0.9 * half
        assert torch.allclose(together.fun[part], alone.fun, rtol=0, atol=1e-7)
    assert torch.all(together.x[half:, k] == 0.5)
    assert torch.all(together.iterations[half:] > 0)
    with pytest.raises(ValueError, match="check_every"):
        minimize(
            objective(slice(None)),
            init,
            bounds,
            fixed,
            MinimizeOptions(check_every=0),
            follows=[Follow(half, 0, half)],
        )


def test_a_following_block_of_fit_requests_runs_in_the_call_or_after_it_alike():
    """``FitRequest.also_from`` gives the lower of the fits from the request's own start and
    the fits a call after the other block would give (its minima as warm starts), whether
    the rows run in one minimiser call, in chunks (``max_rows``) or without host looks
    (``check_every=0``: then one call after the other)."""
    from pyhf_gpu_server.inference.mle import FitOptions, FitRequest, FitSpec, fit_requests

    model, toys = _toy_problem("dense", 24)
    element = torch.zeros(12, dtype=torch.long, device=DEVICE)
    nan = torch.full((12,), torch.nan, dtype=model.dtype, device=DEVICE)
    one = torch.ones(12, dtype=model.dtype, device=DEVICE)
    lead, rest = toys[:12], toys[12:]
    free = fit_requests(model, [FitRequest(lead, element, nan)])[0]
    (after,) = fit_requests(model, [FitRequest(rest, element, one, free.bestfit)])
    (own,) = fit_requests(model, [FitRequest(rest, element, one)])
    after = after.lower_of(own)
    for options in (
        FitOptions(),
        FitOptions(max_rows=5),
        FitOptions(minimize=MinimizeOptions(check_every=0, max_iter=60)),
    ):
        got = fit_requests(
            model,
            [FitRequest(lead, element, nan), FitRequest(rest, element, one, also_from=0)],
            FitSpec(options=options),
        )
        for fits, reference in zip(got, (free, after), strict=True):
            assert fits.converged.all() and reference.converged.all()
            assert torch.allclose(fits.best_twice_nll, reference.best_twice_nll, atol=1e-7)
        assert torch.all(got[1].bestfit[:, model.poi_index] == 1.0)


def test_a_fit_along_a_flat_direction_converges_at_the_minimum():
    """``tests/data/degenerate_normfactors.json`` (a random workspace): two normfactors on
    one sample, and a shapefactor on it and another, leave a direction the likelihood does not
    see, so the curvature is singular. The fit reached pyhf's minimum with a decrement just
    above ``tol``; the next solve at small damping failed, the damping rose past 1e-3, where
    the step used to certify nothing, and the fit was reported failed at the minimum. The
    damped step's decrement, scaled to damping 1e-3, certifies it (pyhf's minimum: scipy at
    tolerance 1e-12)."""
    from pyhf_gpu_server.engine import HistFactoryModel
    from pyhf_gpu_server.inference import fit, hypotest

    spec = json.loads((Path(__file__).parent / "data/degenerate_normfactors.json").read_text())
    model = HistFactoryModel.from_workspace(spec, device=DEVICE_NAME)
    found = fit(model, uncertainties=False)
    assert found.converged.all()
    _, twice_nll = _pyhf_minimum(spec)
    assert found.best_twice_nll.item() <= float(twice_nll) + 1e-9
    assert hypotest(model, 1.0).converged.all()


def test_a_small_model_far_from_its_data_converges_to_pyhfs_minimum():
    """``tests/data/tension_staterror.json`` (a random workspace, 10 parameters): at mu = 0
    the data are far above the background, so the residuals are large and Gauss-Newton's
    curvature alone is poor. The block solver, which keeps no secant pairs on a model this
    small, crawled for 200 iterations and stopped 9e-4 above pyhf's minimum, not converged;
    the dense solver with its secant term, which ``"auto"`` now picks here, converges to it
    (pyhf's minimum: the lowest of its multi-start fits at tolerance 1e-12)."""
    from pyhf_gpu_server.engine import HistFactoryModel
    from pyhf_gpu_server.inference import fixed_poi_fit

    spec = json.loads((Path(__file__).parent / "data/tension_staterror.json").read_text())
    model = HistFactoryModel.from_workspace(spec, device=DEVICE_NAME)
    found = fixed_poi_fit(model, 0.0, uncertainties=False)
    assert found.converged.all()
    _, twice_nll = _pyhf_minimum(spec, fixed_poi=0.0)
    assert found.best_twice_nll.item() <= float(twice_nll) + 1e-9


@pytest.mark.parametrize("solver", ["dense", "low-rank", "block"])
def test_a_rejected_trial_at_an_infinite_likelihood_does_not_end_the_fit(solver):
    """A signal-only bin with events seen: the first Newton step from mu = 2 overshoots to the
    POI's bound 0, where that bin's rate is 0 and ``-2 log L`` infinite. The trial is
    rejected, but its gradient change (NaN) entered the dense solver's secant term, which
    made every later step fail: the fit stayed at its init, not converged (0.69 is pyhf's
    best fit). Each solver, with its secant term, must reach pyhf's minimum (the lowest of
    its multi-start fits at tolerance 1e-12)."""
    from pyhf_gpu_server.engine import HistFactoryModel
    from pyhf_gpu_server.inference import FitOptions, fit

    mu = {"name": "mu", "bounds": [[0.0, 20.0]], "inits": [2.0]}
    spec = {
        **pyhf.simplemodels.uncorrelated_background([3.0, 7.0], [0.0, 49.0], [0.0, 10.0]).spec,
        "observations": [{"name": "singlechannel", "data": [2.0, 56.0]}],
        "measurements": [{"name": "m", "config": {"poi": "mu", "parameters": [mu]}}],
        "version": "1.0.0",
    }
    model = HistFactoryModel.from_workspace(spec, device=DEVICE_NAME)
    options = FitOptions(minimize=MinimizeOptions(solver=solver, secant=True))
    found = fit(model, options=options, uncertainties=False)
    assert found.converged.all()
    bestfit, twice_nll = _pyhf_minimum(spec)
    assert found.best_twice_nll.item() == pytest.approx(float(twice_nll), abs=1e-7)
    assert found.bestfit[0, model.poi_index].item() == pytest.approx(bestfit[0], abs=1e-4)


def test_a_high_statistics_control_region_fit_with_the_poi_on_its_bound_converges():
    """A precision analysis' control region: 3e5 events on a background with a free
    normfactor, a normsys and a histosys (one narrow curved valley), and the signal in it too,
    so that the POI, on its bound 0 at the minimum, is strongly correlated with them. Its
    gradient points inside or outside the bound as the fit crosses the valley; where it
    points inside, the POI was released, its step (the others' moves included) pointed out,
    the projected trial bent and failed and the damping rose: the free fit crawled for 200
    iterations and stopped 0.013 above the minimum, not converged. A parameter whose step
    points out of its bound is now held there for the next solve. The minimum has the POI
    on its bound, so the free fit equals the fit at mu = 0; pyhf's fit from its init stops
    there (-2 log L 4e5), and its multi-start fit from our minimum (tolerance 1e-12) finds
    nothing lower."""
    from pyhf_gpu_server.engine import HistFactoryModel
    from pyhf_gpu_server.inference import fit, fixed_poi_fit

    background = {
        "name": "background",
        "data": [293757.0],
        "modifiers": [
            {"name": "k_bkg", "type": "normfactor", "data": None},
            {"name": "bkg_norm", "type": "normsys", "data": {"hi": 1.2, "lo": 0.84}},
            {
                "name": "bkg_shape",
                "type": "histosys",
                "data": {"hi_data": [341078.0], "lo_data": [245069.0]},
            },
        ],
    }
    mu = [{"name": "mu", "type": "normfactor", "data": None}]
    spec = {
        "channels": [
            {
                "name": "cr",
                "samples": [{"name": "signal", "data": [65770.0], "modifiers": mu}, background],
            },
            {
                "name": "sr",
                "samples": [
                    {"name": "signal", "data": [1.05], "modifiers": mu},
                    {"name": "background", "data": [11.15], "modifiers": []},
                ],
            },
        ],
        "observations": [{"name": "cr", "data": [304507.0]}, {"name": "sr", "data": [9.0]}],
        "measurements": [
            {
                "name": "m",
                "config": {
                    "poi": "mu",
                    "parameters": [{"name": "k_bkg", "bounds": [[0.0, 50.0]], "inits": [2.5]}],
                },
            }
        ],
        "version": "1.0.0",
    }
    model = HistFactoryModel.from_workspace(spec, device=DEVICE_NAME)
    free = fit(model, uncertainties=False)
    at_zero = fixed_poi_fit(model, 0.0, uncertainties=False)
    assert free.converged.all() and at_zero.converged.all()
    assert free.best_twice_nll.item() == pytest.approx(at_zero.best_twice_nll.item(), abs=1e-7)
    _, twice_nll = _pyhf_minimum(spec, init_pars=free.bestfit[0].tolist())
    assert free.best_twice_nll.item() <= float(twice_nll) + 1e-7


def _pyhf_minimum(spec: dict, fixed_poi: float | None = None, **kwargs):
    """pyhf's ``(bestfit, -2 log L)`` on ``spec``'s observations, free or at ``fixed_poi``:
    the lowest of its multi-start fits, scipy at tolerance 1e-12 (:func:`global_pyhf`)."""
    workspace = pyhf.Workspace(spec)
    model = workspace.model()
    data = workspace.data(model)
    with global_pyhf():
        if fixed_poi is None:
            return pyhf.infer.mle.fit(data, model, return_fitted_val=True, **kwargs)
        return pyhf.infer.mle.fixed_poi_fit(
            fixed_poi, data, model, return_fitted_val=True, **kwargs
        )
