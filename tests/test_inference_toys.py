"""The toy-based calculator: pyhf's sampling and test statistics, batched and seedable."""

from __future__ import annotations

import math

import numpy as np
import pyhf
import pytest
import torch
from test_inference_support import DEVICE, one_thread  # noqa: F401 (fixture)

from pyhf_gpu_server.engine import HistFactoryModel
from pyhf_gpu_server.inference import hypotest
from pyhf_gpu_server.inference.hypotest import CalculatorSpec, join_toy_parts, make_calculator
from pyhf_gpu_server.inference.mle import FitRequest, fit_requests
from pyhf_gpu_server.inference.toys import ToySlice, sample_toys

OBSERVED = [12.0, 10.0]

pytestmark = pytest.mark.usefixtures("one_thread")


def both_fits_statistic(test_stat: str, model, mu, data, element) -> torch.Tensor:
    """The statistic with both fits run for every row (what pyhf does), from the same spec
    the calculator uses."""
    spec = CalculatorSpec.of(test_stat)
    stat, tested = spec.stat, spec.stat.tested(mu)
    fixed, free = fit_requests(
        model,
        [FitRequest(data, element, tested), FitRequest(data, element, mu * float("nan"))],
        spec.fit,
    )
    return stat.of_fits(tested, fixed, free, model.poi_index)


@pytest.fixture(scope="module")
def models() -> tuple[pyhf.Model, list[float], HistFactoryModel]:
    pyhf_model = pyhf.simplemodels.uncorrelated_background([5.0, 4.0], [10.0, 9.0], [2.0, 1.5])
    workspace = {
        **pyhf_model.spec,
        "observations": [{"name": "singlechannel", "data": OBSERVED}],
        "measurements": [{"name": "meas", "config": {"poi": "mu", "parameters": []}}],
        "version": "1.0.0",
    }
    ours = HistFactoryModel.from_workspace(workspace, device=DEVICE)
    return pyhf_model, OBSERVED + pyhf_model.config.auxdata, ours


@pytest.fixture
def numpy2_percentile(monkeypatch):
    """pyhf 0.7.6 calls np.percentile(..., interpolation=...), gone in NumPy 2."""
    from pyhf.tensor.numpy_backend import numpy_backend

    def percentile(self, tensor_in, q, axis=None, interpolation="linear"):
        return np.percentile(tensor_in, q, axis=axis, method=interpolation)

    monkeypatch.setattr(numpy_backend, "percentile", percentile)
    pyhf.set_backend("numpy")


def binomial_se(p: float, n: int) -> float:
    return math.sqrt(max(p * (1 - p), 1e-4) / n)


def cls_se(clsb: float, clb: float, n: int) -> float:
    """Monte-Carlo standard error of CLsb / CLb (delta method)."""
    cls = clsb / clb
    return cls * math.hypot(
        binomial_se(clsb, n) / max(clsb, 1e-3), binomial_se(clb, n) / max(clb, 1e-3)
    )


def test_same_seed_same_result_other_seed_other_result(models):
    _, _, model = models
    first = hypotest(model, 1.0, calctype="toybased", ntoys=200, seed=7)
    again = hypotest(model, 1.0, calctype="toybased", ntoys=200, seed=7)
    other = hypotest(model, 1.0, calctype="toybased", ntoys=200, seed=8)
    assert torch.equal(first.cls_obs, again.cls_obs) and torch.equal(first.cls_exp, again.cls_exp)
    assert not torch.equal(first.cls_exp, other.cls_exp)
    assert first.converged.all()


def test_toy_test_statistics_equal_pyhf_on_the_same_toys(models):
    pyhf_model, data, model = models
    pyhf.set_backend("numpy")
    generator = torch.Generator(device=model.device).manual_seed(3)
    element = torch.zeros(1, dtype=torch.long, device=model.device)
    toys = sample_toys(model, model.init, element, 12, generator)[0]
    assert toys.shape == (12, len(data))
    assert torch.all(toys[:, : model.n_main] == toys[:, : model.n_main].round())  # Poisson counts
    mu = torch.ones(12, dtype=model.dtype, device=model.device)
    ours = both_fits_statistic("qtilde", model, mu, toys, element.expand(12))
    for i, toy in enumerate(toys.tolist()):
        theirs = pyhf.infer.test_statistics.qmu_tilde(
            1.0,
            np.asarray(toy),
            pyhf_model,
            pyhf_model.config.suggested_init(),
            pyhf_model.config.suggested_bounds(),
            pyhf_model.config.suggested_fixed(),
        )
        assert ours[i].item() == pytest.approx(float(theirs), abs=2e-4)


@pytest.mark.slow
def test_toy_cls_within_three_standard_errors_of_pyhf(models, numpy2_percentile):
    pyhf_model, data, model = models
    n_pyhf, n_ours = 200, 4000
    np.random.seed(11)
    cls, (clsb, clb), _ = pyhf.infer.hypotest(
        1.0,
        data,
        pyhf_model,
        calctype="toybased",
        ntoys=n_pyhf,
        return_tail_probs=True,
        return_expected_set=True,
        track_progress=False,
    )
    ours = hypotest(model, 1.0, calctype="toybased", ntoys=n_ours, seed=5)
    assert ours.converged.all(), ours.non_converged()
    se = math.hypot(
        cls_se(float(clsb), float(clb), n_pyhf),
        cls_se(ours.clsb_obs.item(), ours.clb_obs.item(), n_ours),
    )
    assert abs(ours.cls_obs.item() - float(cls)) <= 3 * se
    assert abs(ours.clb_obs.item() - float(clb)) <= 3 * math.hypot(
        binomial_se(float(clb), n_pyhf), binomial_se(ours.clb_obs.item(), n_ours)
    )
    # the asymptotic CLs is a sanity anchor for the median of the toys
    asymptotic = hypotest(model, 1.0)
    assert abs(ours.cls_exp[0, 2].item() - asymptotic.cls_exp[0, 2].item()) < 0.05


def test_toys_sample_normal_and_poisson_constraints_as_pyhf():
    pyhf_model = pyhf.simplemodels.correlated_background(
        [5.0, 4.0], [10.0, 9.0], [8.0, 7.0], [12.0, 11.0]
    )
    spec = {
        **pyhf_model.spec,
        "observations": [{"name": pyhf_model.config.channels[0], "data": [12.0, 10.0]}],
        "measurements": [{"name": "meas", "config": {"poi": "mu", "parameters": []}}],
        "version": "1.0.0",
    }
    model = HistFactoryModel.from_workspace(spec, device=DEVICE)
    pars = model.init.clone()
    pars[0, 1 - model.poi_index] = -0.5  # the Normal-constrained nuisance parameter, below 0
    generator = torch.Generator(device=model.device).manual_seed(0)
    toys = sample_toys(
        model, pars, torch.zeros(1, dtype=torch.long, device=model.device), 20000, generator
    )[0]
    aux = toys[:, model.n_main :]
    assert aux.mean().item() == pytest.approx(-0.5, abs=0.03)  # Normal(theta, 1) around theta
    assert aux.std().item() == pytest.approx(1.0, abs=0.03)
    expected = model.expected_data(pars, include_auxdata=False)[0]
    assert toys[:, : model.n_main].mean(0).tolist() == pytest.approx(expected.tolist(), rel=0.03)


@pytest.mark.parametrize("test_stat", ["qtilde", "q", "q0"])
def test_toy_statistics_skip_only_conditional_fits_the_clip_makes_irrelevant(models, test_stat):
    """The calculator fits a toy at ``mu`` only where ``muhat`` does not clip its statistic to
    0, starting at the unconditional minimum; on this convex model that gives exactly the
    statistics of both fits run for every toy."""
    _, _, model = models
    element = torch.zeros(1, dtype=torch.long, device=DEVICE)
    toys = sample_toys(model, model.init, element, 400, torch.Generator(DEVICE).manual_seed(3))[0]
    rows = torch.zeros(toys.shape[0], dtype=torch.long, device=DEVICE)
    mu = torch.full((toys.shape[0],), 1.0, dtype=model.dtype, device=DEVICE)
    spec = CalculatorSpec.of(test_stat, "toybased")
    calc = make_calculator(model, model.observed, element, spec)
    found, status = calc._toy_statistics(toys, rows, spec.stat.tested(mu))
    expected = both_fits_statistic(test_stat, model, mu, toys, rows)
    assert status.converged.all()
    assert 0 < int((found == 0).sum()) < toys.shape[0]  # both regimes are present
    assert torch.allclose(found, expected, rtol=0, atol=1e-6)


def test_a_row_s_toys_do_not_depend_on_its_slices_nor_its_company(models):
    """A row's toys follow (seed, key, block): its slices, run in one call with another
    hypothesis' slices or each alone, join into exactly the whole row's answer."""
    _, _, model = models
    whole = hypotest(model, 1.0, calctype="toybased", ntoys=120, seed=3)  # key 0: its row
    mine, other = ToySlice.cut(0, 120), ToySlice.cut(9, 70)
    mixed = [mine[0], other[0], mine[1], other[1], mine[2]]
    mu = torch.tensor([1.0, 2.0, 1.0, 2.0, 1.0], dtype=model.dtype, device=model.device)
    element = torch.zeros(5, dtype=torch.long, device=model.device)
    together = hypotest(model, mu, element, calctype="toybased", ntoys=120, seed=3, toys=mixed)
    joined = join_toy_parts([together.row(i) for i in (0, 2, 4)])
    alone = join_toy_parts(
        [hypotest(model, 1.0, calctype="toybased", ntoys=120, seed=3, toys=[s]) for s in mine]
    )
    # parts finer than a block, and across blocks (as a large model's): each draws its blocks
    sevens = ToySlice.cut(0, 120, 7)
    assert (sevens[7].first, sevens[7].stop, sevens[-1].ntoys) == (49, 56, 1)
    mu = torch.ones(len(sevens), dtype=model.dtype, device=model.device)
    element = torch.zeros(len(sevens), dtype=torch.long, device=model.device)
    fine = hypotest(model, mu, element, calctype="toybased", ntoys=120, seed=3, toys=sevens)
    finer = join_toy_parts([fine.row(i) for i in range(len(sevens))])
    for result in (joined, alone, finer):
        assert torch.equal(result.cls_obs.cpu(), whole.cls_obs.cpu())
        assert torch.equal(result.cls_exp.cpu(), whole.cls_exp.cpu())
        assert torch.equal(result.toys.signal[0].cpu(), whole.toys.signal[0].cpu())
        assert result.converged.all()
    with pytest.raises(ValueError, match="holds toys of its row"):
        ToySlice(0, 60, 60, 120)
