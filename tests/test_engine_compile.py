"""torch.compile of the kernels a fit calls gives the eager results (tested on the CPU).

The compiled kernels are ``expected_main`` (values) and ``expected_main_jacobian`` (the
minimiser's derivative call). Compiling on two CPU cores takes tens of seconds per kernel
and structure, so one module-scoped :class:`KernelCache` serves every test here.
"""

from __future__ import annotations

import pytest
import torch
from conftest import WORKSPACES_DIR, load_patchset, shared_workspace

from pyhf_gpu_server import inference
from pyhf_gpu_server.engine import HistFactoryModel, KernelCache, batch_bucket, kernel

TIGHT = {"rtol": 1e-12, "atol": 1e-12}


def test_batch_buckets_are_powers_of_two():
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 64, 65)] == [2, 2, 4, 8, 64, 128]


@pytest.fixture(scope="module")
def kernels() -> KernelCache:
    """One cache for the module: each kernel shape is compiled once."""
    return KernelCache()


def _patchset_models(count: int) -> tuple[HistFactoryModel, HistFactoryModel]:
    """An eager and a second (to compile) model of ``count`` sbottom-B patchset.json patches."""
    workspace, patchset, _ = shared_workspace("atlas-susy-2018-31-sbottom-B")
    names = [p["metadata"]["name"] for p in patchset["patches"]][:count]
    return tuple(
        HistFactoryModel.from_patchset(workspace, patchset, patch_names=names) for _ in range(2)
    )


def _heterogeneous_models(count: int) -> tuple[HistFactoryModel, HistFactoryModel]:
    """The same for ``count`` stau patches whose signals carry different modifier sets."""
    workspace = shared_workspace("atlas-susy-2018-04-stau")[0]
    patchset = load_patchset(WORKSPACES_DIR / "atlas-susy-2018-04-stau/patchset.heterogeneous.json")
    names = [p["metadata"]["name"] for p in patchset["patches"]][:count]
    return tuple(
        HistFactoryModel.from_patchset(workspace, patchset, patch_names=names) for _ in range(2)
    )


def _rows(model: HistFactoryModel, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Parameter points near the inits, rows cycling through the elements."""
    generator = torch.Generator().manual_seed(seed)
    element = torch.arange(rows) % model.n_elements
    noise = torch.randn(rows, model.n_pars, generator=generator, dtype=model.dtype)
    pars = model.init.index_select(0, element) + 0.05 * noise
    bounds = model.bounds.index_select(0, element)
    return torch.clamp(pars, bounds[..., 0], bounds[..., 1]), element


@pytest.mark.slow
def test_compiled_equals_eager(kernels):
    eager, compiled = _patchset_models(4)
    compiled.enable_compile(kernels)
    for rows in (3, 12):  # two buckets: 4 and 16 (the fit test's below)
        pars, element = _rows(eager, rows, rows)
        data = eager.observed.index_select(0, element)
        torch.testing.assert_close(
            compiled.expected_data(pars, element), eager.expected_data(pars, element), **TIGHT
        )
        torch.testing.assert_close(
            compiled.logpdf(pars, data, element), eager.logpdf(pars, data, element), **TIGHT
        )
        assert kernels.is_warm(compiled, rows, "expected_main")
    assert not kernels.is_warm(compiled, 1000)


@pytest.mark.slow
@pytest.mark.parametrize("build", [_patchset_models, _heterogeneous_models])
def test_compiled_jacobian_equals_eager(kernels, build):
    """Rows of all four elements in one batch (own signal variants gathered per row)."""
    eager, compiled = build(4)
    compiled.enable_compile(kernels)
    assert compiled.expected_main_jacobian.__doc__ == eager.expected_main_jacobian.__doc__
    for rows in (3, 12):
        pars, element = _rows(eager, rows, rows)
        rates, jacobian = compiled.expected_main_jacobian(pars, element)
        eager_rates, eager_jacobian = eager.expected_main_jacobian(pars, element)
        assert jacobian.shape == (rows, eager.n_main, eager.n_pars)
        torch.testing.assert_close(rates, eager_rates, **TIGHT)
        torch.testing.assert_close(jacobian, eager_jacobian, **TIGHT)
        assert kernels.is_warm(compiled, rows, "expected_main_jacobian")
    # under autograd (and torch.func: a fit's exact Hessian) the kernels run eagerly
    pars = pars.clone().requires_grad_(True)
    compiled.expected_data(pars, element).sum().backward()
    assert pars.grad is not None and torch.isfinite(pars.grad).all()


@pytest.mark.slow
def test_fit_and_hypotest_with_compile_equal_eager(kernels):
    eager, compiled = _patchset_models(4)
    kernels.warm(compiled)
    compiled.enable_compile(kernels)
    element = torch.arange(4).repeat(3)
    close = {"rtol": 1e-9, "atol": 1e-9}
    fits = [inference.fit(m, element=element) for m in (eager, compiled)]
    assert bool(fits[1].converged.all())
    torch.testing.assert_close(fits[1].bestfit, fits[0].bestfit, **close)
    torch.testing.assert_close(fits[1].best_twice_nll, fits[0].best_twice_nll, **close)
    torch.testing.assert_close(fits[1].uncertainty, fits[0].uncertainty, **close)
    assert fits[1].iterations.tolist() == fits[0].iterations.tolist()
    poi = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64).repeat_interleave(4)
    tests = [inference.hypotest(m, poi, element) for m in (eager, compiled)]
    torch.testing.assert_close(tests[1].cls_obs, tests[0].cls_obs, **close)
    torch.testing.assert_close(tests[1].cls_exp, tests[0].cls_exp, **close)
    assert kernels.is_warm(compiled, element.shape[0])


def test_a_kernel_that_fails_to_compile_runs_eagerly(caplog):
    """A compiler failure (here a stand-in for the kernel) leaves the results eager, not wrong."""
    eager, model = _patchset_models(2)
    kernels = KernelCache()
    name = "expected_main_jacobian"

    def broken(*args):
        raise torch._dynamo.exc.BackendCompilerFailed(broken, RuntimeError("codegen"), None)

    kernels._kernels[(name, *kernels._key(model))] = broken
    kernels._kernels[("expected_main", *kernels._key(model))] = kernel.expected_main  # no compile
    model.enable_compile(kernels)
    pars, element = _rows(eager, 3, 0)
    for _ in range(2):
        for got, want in zip(
            model.expected_main_jacobian(pars, element),
            eager.expected_main_jacobian(pars, element),
            strict=True,
        ):
            torch.testing.assert_close(got, want)
    assert "compiling expected_main_jacobian failed" in caplog.text
    assert not kernels.is_warm(model, 3, name)
    with pytest.raises(RuntimeError, match="runs eagerly"):
        kernels.warm(model)
