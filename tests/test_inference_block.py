"""The block solver: per-bin parameters eliminated bin by bin, the shared block dense.

Its steps must equal the dense Cholesky's (with secant pairs, held parameters, dampings from 0
up, and bins with two per-bin parameters), its Jacobian in block form the whole one, and its
fits the other solvers' minima, on generated analysis-like models and on every shared
published workspace (the solver forced: ``"auto"`` keeps the low-rank one there).
"""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import REPO_ROOT, WORKSPACE_NAMES, load_patchset, shared_workspace
from test_inference_support import DEVICE as DEVICE_NAME
from test_inference_support import (
    one_thread,  # noqa: F401 (fixture)
    step_inputs,
)
from workspaces import WORKSPACES_DIR, workspace_file

from pyhf_gpu_server.engine import HistFactoryModel
from pyhf_gpu_server.inference.covariance import covariance
from pyhf_gpu_server.inference.curvature import (
    BlockCurvature,
    DenseCurvature,
    choose_solver,
)
from pyhf_gpu_server.inference.hypotest import hypotest
from pyhf_gpu_server.inference.minimize import MinimizeOptions, minimize
from pyhf_gpu_server.inference.mle import FitOptions
from pyhf_gpu_server.inference.objective import TwiceNLL

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
import generate_large

DEVICE = torch.device(DEVICE_NAME)
pytestmark = pytest.mark.usefixtures("one_thread")


def _analysis(channels=3, bins=6, systematics=8, **kwargs) -> HistFactoryModel:
    """A small generated analysis: a staterror gamma per bin, shared shape systematics."""
    spec = generate_large.workspace(
        channels=channels, bins=bins, systematics=systematics, per_sample=4, **kwargs
    )
    return HistFactoryModel.from_workspace(spec, device=DEVICE)


def _heterogeneous(name: str) -> HistFactoryModel:
    background, _, _ = shared_workspace(name)
    folder = WORKSPACES_DIR / name
    heterogeneous = workspace_file(folder, "patchset.heterogeneous.json")
    patchset = load_patchset(heterogeneous if heterogeneous.exists() else folder / "patchset.json")
    return HistFactoryModel.from_patchset(background, patchset, device=DEVICE)


def _whole_jacobian(model, J_shared, J_bins):
    structure = model.bin_parameters
    J = J_shared.new_zeros(J_shared.shape[0], model.n_main, model.n_pars)
    J[:, :, torch.as_tensor(structure.shared, device=DEVICE)] = J_shared
    params = torch.as_tensor(structure.params, device=DEVICE)
    J[:, torch.as_tensor(structure.bins, device=DEVICE), params] = J_bins
    return J


@pytest.mark.parametrize("name", WORKSPACE_NAMES)
def test_the_block_jacobian_is_the_whole_one_without_its_zeros(name):
    """Per-bin parameters found from the layout (staterror gammas, one-bin normfactors; two
    in one bin of sbottom-B), and the two-part Jacobian equal to the dense one entry by entry,
    for rows of different elements of a heterogeneous stack."""
    model = _heterogeneous(name)
    structure = model.bin_parameters
    assert structure.n_per_bin > 0
    assert structure.n_per_bin + structure.n_shared == model.n_pars
    element = torch.tensor([0, 3, 7], device=DEVICE)
    gen = torch.Generator().manual_seed(1)
    x = model.init.index_select(0, element) + 0.05 * torch.randn(
        3, model.n_pars, generator=gen, dtype=torch.float64
    ).to(DEVICE)
    rates, J = model.expected_main_jacobian(x, element)
    rates_block, J_shared, J_bins = model.expected_main_block_jacobian(x, element)
    assert J_shared.shape == (3, model.n_main, structure.n_shared)
    assert torch.equal(rates, rates_block)
    assert torch.equal(_whole_jacobian(model, J_shared, J_bins), J)


def _points(name: str, seed: int) -> tuple[HistFactoryModel, torch.Tensor, torch.Tensor]:
    """A model (a shared workspace's heterogeneous stack, or a generated analysis), rows of
    several of its elements, and random points near their starts, inside the bounds."""
    if name == "analysis":
        model, element = _analysis(channels=3, bins=5), torch.tensor([0, 0], device=DEVICE)
    else:
        model, element = _heterogeneous(name), torch.tensor([0, 3, 7], device=DEVICE)
    gen = torch.Generator().manual_seed(seed)
    x = model.init.index_select(0, element) + 0.05 * torch.randn(
        element.shape[0], model.n_pars, generator=gen, dtype=torch.float64
    ).to(DEVICE)
    x = torch.minimum(
        torch.maximum(x, model.bounds[..., 0].index_select(0, element) + 1e-3),
        model.bounds[..., 1].index_select(0, element),
    )
    return model, element, x


@pytest.mark.parametrize("name", [*WORKSPACE_NAMES, "analysis"])
def test_the_block_hessian_and_covariance_equal_the_dense_ones(name):
    """The exact Hessian in block form (the second-order term's per-bin border and bin blocks
    included) equals the dense one, and the covariance by block elimination equals the dense
    inverse, with a shared and a per-bin parameter fixed, for rows of different elements of a
    heterogeneous stack (own per-row blocks; two per-bin parameters in one bin of sbottom-B)
    and of a generated analysis with shape systematics."""
    model, element, x = _points(name, seed=2)
    R = element.shape[0]
    data = model.observed.index_select(0, element)
    rows = torch.arange(R, device=DEVICE)
    objective = TwiceNLL(model, data, element, "hessian")
    dense = objective.hessian(x, rows)
    block = objective.block_hessian(x, rows)
    torch.testing.assert_close(
        block.dense(), dense, rtol=1e-11, atol=1e-11 * dense.abs().amax().item()
    )
    # the rows computed a block of one at a time join into the same blocks (this raised a
    # TypeError while a split's per-bin blocks were joined as tensors)
    split = TwiceNLL(model, data, element, "hessian", block_rows=1).block_hessian(x, rows)
    for part in ("shared", "cross", "per_bin"):
        whole = getattr(block, part)
        torch.testing.assert_close(
            getattr(split, part), whole, rtol=1e-12, atol=1e-12 * whole.abs().amax().item()
        )
    fixed = model.fixed.index_select(0, element).clone()
    structure = model.bin_parameters
    fixed[0, int(structure.shared[-1])] = True
    fixed[-1, int(structure.params[0])] = True
    # (an inverse exists away from the minimum too: the variances there may be negative)
    unc, corr, cov = covariance(dense, fixed)
    unc_b, corr_b, cov_b = block.covariance(fixed)
    assert torch.isfinite(cov).all()
    torch.testing.assert_close(cov_b, cov, rtol=1e-8, atol=1e-10 * cov.abs().amax().item())
    torch.testing.assert_close(unc_b, unc, rtol=1e-8, atol=1e-12, equal_nan=True)
    torch.testing.assert_close(corr_b, corr, rtol=1e-8, atol=1e-10, equal_nan=True)
    assert (unc_b[fixed] == 0).all()


@pytest.mark.parametrize("name", [*WORKSPACE_NAMES, "analysis"])
def test_the_gradient_without_a_jacobian_equals_the_jacobians(name):
    """The vector-Jacobian product (value and gradient, for chord steps) equals ``J^T r`` plus
    the constraint terms of the Jacobian-based derivatives, for rows of several elements."""
    model, element, x = _points(name, seed=3)
    R = element.shape[0]
    objective = TwiceNLL(model, model.observed.index_select(0, element), element, "gauss-newton")
    rows = torch.arange(R, device=DEVICE)
    whole = objective.derivatives(x, rows)
    f, g = objective.gradient(x, rows)
    assert torch.equal(f, whole.f)
    torch.testing.assert_close(g, whole.g, rtol=1e-12, atol=1e-12 * whole.g.abs().amax().item())


def _random_block(model, R=5, m=3, seed=0):
    """A block curvature with secant pairs at random points of ``model``, and its dense twin."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(DEVICE)

    element = torch.zeros(R, dtype=torch.long, device=DEVICE)
    x = model.init.index_select(0, element) + 0.1 * rand(R, model.n_pars)
    _, J_shared, J_bins = model.expected_main_block_jacobian(x, element)
    d = rand(R, model.n_pars).abs() + 0.1
    d[:, :2] = 0.0  # flat parameters
    d[:, model.bin_parameters.params[0]] = 0.0  # and a flat per-bin one
    w = rand(R, model.n_main).abs()
    block = BlockCurvature(
        d, J_shared, J_bins, w, rand(R, model.n_main), model.bin_blocks(), memory=m
    )
    P = model.n_pars
    block.pairs_a, block.pairs_y = 0.3 * rand(R, m, P), 0.3 * rand(R, m, P)
    block.c = rand(R, m).abs()
    S = torch.einsum("rk,rkp,rkq->rpq", block.c, block.pairs_a, block.pairs_y)
    J = _whole_jacobian(model, J_shared, J_bins)
    dense = DenseCurvature(
        torch.diag_embed(d) + torch.einsum("rn,rnp,rnq->rpq", w, J, J) + S + S.mT
    )
    return block, dense


@pytest.mark.parametrize("which", ["analysis", "atlas-susy-2018-31-sbottom-B"])
def test_block_steps_equal_dense_cholesky_steps_and_definiteness(which):
    """Elimination + Schur complement + Woodbury give the dense Cholesky's steps, and flag the
    same matrices as not positive definite (the secant term makes some indefinite); held
    parameters (a per-bin one among them) do not move."""
    model = _analysis() if which == "analysis" else _heterogeneous(which)
    if which != "analysis":
        assert model.bin_parameters.slots.shape[1] == 2  # a bin with two per-bin parameters
    flagged = 0
    for seed in range(4):
        block, dense = _random_block(model, seed=seed)
        g, movable, lams = step_inputs(*block.d.shape, seed)
        held = int(model.bin_parameters.params[-1])
        movable[1, 3] = movable[2, 0] = movable[3, held] = False
        p_block, ok_block = block.steps(g, movable, lams)
        p_dense, ok_dense = dense.steps(g, movable, lams)
        assert torch.equal(ok_block, ok_dense)
        assert torch.allclose(p_block, p_dense, rtol=1e-7, atol=1e-9)
        assert torch.all(p_block[:, 1, 3] == 0) and torch.all(p_block[:, 3, held] == 0)
        flagged += int((~ok_dense).sum())
        assert torch.allclose(block.diagonal(), dense.H.diagonal(dim1=-2, dim2=-1))
    assert flagged, "the cases should include an indefinite matrix"


def test_auto_picks_block_for_analyses_and_keeps_low_rank_for_published_susy():
    """The rule in one place: a gamma per bin over many bins is the block solver's; the
    published SUSY likelihoods (few bins) keep the low-rank one, so their answers stay as
    they were."""
    assert choose_solver(1600, 2107, 1600, 5, 8) == "block"
    assert choose_solver(300, 547, 300, 5, 8) == "block"
    for name in WORKSPACE_NAMES:
        model = _heterogeneous(name)
        nll = TwiceNLL(model, model.observed, torch.zeros(1, dtype=torch.long), "gauss-newton")
        assert nll.blocks is None, name


@pytest.mark.parametrize("name", WORKSPACE_NAMES)
def test_block_fits_find_the_low_rank_minima_on_published_likelihoods(name):
    """Every patch's free fit on each shared workspace's heterogeneous stack: with the block
    solver forced, the same minima as the solver ``"auto"`` picks there (low-rank), to 1e-9 in
    -2 log L and 1e-4 in parameters, all converged. (Forced on these few bins, the block solver
    keeps no secant pairs, :func:`~pyhf_gpu_server.inference.curvature.block_memory`, and so
    stops elsewhere on the weakest directions: stau's flattest parameter moves by 1e-5 at a
    Newton decrement of 2e-13. Distinct minima of these likelihoods differ by far more.)"""
    model = _heterogeneous(name)
    element = torch.arange(model.n_elements, device=DEVICE)
    data = model.observed.index_select(0, element)
    init = model.init.index_select(0, element)
    bounds = model.bounds.index_select(0, element)
    fixed = model.fixed.index_select(0, element)
    found = {}
    for solver in ("auto", "block"):
        objective = TwiceNLL(model, data, element, "gauss-newton", solver=solver)
        assert (objective.blocks is not None) is (solver == "block")
        options = MinimizeOptions(solver=solver, tol=1e-12)
        found[solver] = minimize(objective, init, bounds, fixed, options)
    auto, block = found["auto"], found["block"]
    assert block.converged.all() and auto.converged.all()
    assert torch.allclose(block.fun, auto.fun, rtol=0, atol=1e-9)
    assert torch.allclose(block.x, auto.x, rtol=0, atol=1e-4)


def test_block_hypotests_equal_dense_ones_on_a_generated_analysis():
    """CLs (observed and expected band) with the block solver, as ``"auto"`` picks it on a
    generated analysis of 5 channels x 12 bins, equal the dense solver's to 1e-8; both fits
    converged. Both stop at a Newton decrement of 1e-12: at the default 1e-10 the block
    solver's stopping error alone is 1e-8 in CLs (on this model it keeps no secant pairs,
    :func:`~pyhf_gpu_server.inference.curvature.block_memory`; the dense one's is 2e-12)."""
    model = _analysis(channels=5, bins=12, systematics=16, seed=3)
    objective = TwiceNLL(model, model.observed, torch.zeros(1, dtype=torch.long), "gauss-newton")
    assert objective.blocks is not None  # auto: block
    results = {
        solver: hypotest(
            model,
            [0.5, 1.0, 2.0],
            options=FitOptions(minimize=MinimizeOptions(solver=solver, tol=1e-12)),
        )
        for solver in ("auto", "dense")
    }
    auto, dense = results["auto"], results["dense"]
    assert torch.allclose(auto.cls_obs, dense.cls_obs, rtol=0, atol=1e-8)
    assert torch.allclose(auto.cls_exp, dense.cls_exp, rtol=0, atol=1e-8)
    assert auto.status.converged.all() and dense.status.converged.all()


def test_the_generator_makes_what_it_says():
    """``generate_large``'s examples: its workspaces are pyhf's, of the size :func:`size` says."""
    import doctest

    assert doctest.testmod(generate_large).failed == 0
    spec = generate_large.workspace(channels=3, bins=6, systematics=8, per_sample=8)
    model = HistFactoryModel.from_workspace(spec)
    assert (model.n_pars, model.n_main) == tuple(generate_large.size(3, 6, 8).values())
