"""Device hygiene: every tensor of a model lives on the model's device.

Under torch's FakeTensorMode a ``cuda`` tensor exists on a CPU-only machine, and any op that
mixes it with a cpu tensor raises the error of the bug this project was born from.
"""

from __future__ import annotations

import pyhf
import pytest
import torch
from conftest import shared_workspace
from hand_built import all_modifiers_workspace
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from pyhf_gpu_server.engine import HistFactoryModel

MIXED_DEVICES = "Expected all tensors to be on the same device"


def assert_all_on(model: HistFactoryModel, device: str) -> None:
    tensors = model.tensors()
    assert len(tensors) >= 15
    for name, tensor in tensors.items():
        assert tensor.device == torch.device(device), name
        if tensor.is_floating_point():
            assert tensor.dtype == model.dtype, name


def small_patchset_model(device: str, modifier_settings=None) -> HistFactoryModel:
    workspace, patchset, _ = shared_workspace("atlas-susy-2018-31-sbottom-B")
    names = [p["metadata"]["name"] for p in patchset["patches"]][:3]
    return HistFactoryModel.from_patchset(
        workspace, patchset, patch_names=names, device=device, modifier_settings=modifier_settings
    )


def test_fake_cuda_really_catches_mixed_devices():
    """The check is only worth something if FakeTensorMode raises the original error here."""
    with FakeTensorMode():
        on_cuda = torch.ones(3, device="cuda")
        with pytest.raises(RuntimeError, match=MIXED_DEVICES):
            torch.einsum("i,i->", on_cuda, torch.ones(3))
        with pytest.raises(RuntimeError, match=MIXED_DEVICES):
            on_cuda + torch.ones(3)


@pytest.mark.parametrize(
    "build",
    [
        lambda device: HistFactoryModel.from_workspace(all_modifiers_workspace(), device=device),
        small_patchset_model,
    ],
    ids=["all-modifiers", "sbottom-B-patchset"],
)
def test_model_evaluates_on_fake_cuda(build):
    with FakeTensorMode():
        model = build("cuda")
        assert_all_on(model, "cuda:0")
        element = torch.arange(model.n_elements, device="cuda").repeat(4)
        pars = model.init.index_select(0, element)
        data = model.observed.index_select(0, element)
        outputs = [
            model.expected_data(pars, element),
            model.logpdf(pars, data, element),
            *model.expected_main_jacobian(pars, element),
            model.main_rates_curvature(pars, element, data.narrow(1, 0, model.n_main)),
        ]
        for output in outputs:
            assert isinstance(output, FakeTensor)
            assert output.device == torch.device("cuda:0")
        # a cpu tensor sneaking in is caught
        with pytest.raises(RuntimeError, match=MIXED_DEVICES):
            model.logpdf(pars, torch.zeros(data.shape, dtype=model.dtype), element)


def test_every_tensor_on_the_model_device_and_dtype():
    for dtype in (torch.float64, torch.float32):
        model = HistFactoryModel.from_workspace(all_modifiers_workspace(), dtype=dtype)
        assert_all_on(model, "cpu")
        assert model.logpdf(model.init, model.observed).dtype == dtype


def test_float32_is_close_to_float64():
    model64 = small_patchset_model("cpu")
    model32 = model64.to(dtype=torch.float32)
    element = torch.arange(model64.n_elements)
    value64 = model64.logpdf(model64.init, model64.observed, element)
    value32 = model32.logpdf(model32.init, model32.observed, element)
    torch.testing.assert_close(value32.double(), value64, rtol=1e-5, atol=1e-3)


def test_no_process_wide_backend_state():
    """Models of different dtypes coexist; pyhf's global backend is never touched."""
    before = pyhf.get_backend()[0]
    model64 = HistFactoryModel.from_workspace(all_modifiers_workspace())
    model32 = model64.to(dtype=torch.float32)
    assert model64.logpdf(model64.init, model64.observed).dtype == torch.float64
    assert model32.logpdf(model32.init, model32.observed).dtype == torch.float32
    assert pyhf.get_backend()[0] is before
    assert before.name == "numpy"


@pytest.mark.parametrize(
    ("solver", "trials"),
    [("dense", "damped"), ("low-rank", "damped"), ("low-rank", "grid"), ("block", "damped")],
)
def test_fit_runs_on_fake_cuda(solver, trials):
    """A batched fit (Gauss-Newton with secant updates, fixed budget, no host synchronisation)
    on a simulated cuda device, with each step solver (the block one: the Jacobian in block
    form, per-bin parameters eliminated), and with the grid's trials (the exact curvature's
    Newton step among them), Poisson-constrained parameters kept off their lower bound (the
    objective's ``barrier``): any cpu tensor created inside the fit loop would raise."""
    from pyhf_gpu_server.inference.minimize import MinimizeOptions, minimize
    from pyhf_gpu_server.inference.objective import TwiceNLL

    with FakeTensorMode():
        model = small_patchset_model("cuda")
        element = torch.arange(model.n_elements, device="cuda").repeat(2)
        data = model.observed.index_select(0, element)
        objective = TwiceNLL(model, data, element, "gauss-newton", solver=solver)
        assert (objective.blocks is not None) is (solver == "block")
        result = minimize(
            objective,
            model.init.index_select(0, element),
            model.bounds.index_select(0, element),
            model.fixed.index_select(0, element),
            MinimizeOptions(
                max_iter=3, check_every=0, solver=solver, trials=trials, exact_newton_after=0
            ),
            barrier=objective.barrier,
        )
        for tensor in (result.x, result.fun, result.converged, result.iterations):
            assert isinstance(tensor, FakeTensor)
            assert tensor.device == torch.device("cuda:0")


def test_uncertainties_and_gradients_run_on_fake_cuda():
    """The exact Hessian's covariance on a simulated cuda device, in block form (per-bin
    parameters eliminated) and dense, and the Jacobian-free gradient of the ranking's chord
    steps: any cpu tensor created on the way would raise."""
    from pyhf_gpu_server.inference.covariance import covariance
    from pyhf_gpu_server.inference.objective import TwiceNLL

    with FakeTensorMode():
        model = small_patchset_model("cuda")
        assert model.bin_parameters.n_per_bin
        element = torch.arange(model.n_elements, device="cuda")
        data = model.observed.index_select(0, element)
        objective = TwiceNLL(model, data, element, "hessian")
        rows = torch.arange(model.n_elements, device="cuda")
        fixed = model.fixed.index_select(0, element)
        x = model.init.index_select(0, element)
        block = objective.covariance(x, rows, fixed)
        dense = covariance(objective.hessian(x, rows), fixed)
        gradient = objective.gradient(x, rows)
        for tensor in (*block, *dense, *gradient):
            assert isinstance(tensor, FakeTensor)
            assert tensor.device == torch.device("cuda:0")


def test_fits_that_follow_others_run_on_fake_cuda():
    """A block of fits started a second time from another block's minima
    (``FitRequest.also_from``, the asymptotic calculator's Asimov fits): without host looks
    (``check_every=0``) it runs in a call after the block it follows, on the device, with no
    data-dependent shapes."""
    from pyhf_gpu_server.inference.minimize import MinimizeOptions
    from pyhf_gpu_server.inference.mle import FitOptions, FitRequest, FitSpec, fit_requests

    with FakeTensorMode():
        model = small_patchset_model("cuda")
        element = torch.arange(model.n_elements, device="cuda")
        nan = torch.full((model.n_elements,), torch.nan, dtype=model.dtype, device="cuda")
        one = torch.ones_like(nan)
        options = FitOptions(minimize=MinimizeOptions(max_iter=3, check_every=0))
        free, followed = fit_requests(
            model,
            [
                FitRequest(model.observed, element, nan),
                FitRequest(model.observed, element, one, also_from=0),
            ],
            FitSpec(options=options),
        )
        for tensor in (free.bestfit, followed.bestfit, followed.deviance, followed.converged):
            assert isinstance(tensor, FakeTensor)
            assert tensor.device == torch.device("cuda:0")


def test_kinked_fit_with_extra_starts_runs_on_fake_cuda():
    """code0/code1 make every fit run extra starts, a kink-pinned refit and one-sided slope
    checks: all of it on the model's device, with no data-dependent shapes."""
    from pyhf_gpu_server.inference.minimize import MinimizeOptions
    from pyhf_gpu_server.inference.mle import FitOptions, fit_rows

    kinked = {"histosys": {"interpcode": "code0"}, "normsys": {"interpcode": "code1"}}
    with FakeTensorMode():
        model = small_patchset_model("cuda", kinked)
        assert model.kinked_params.numel() > 0
        element = torch.arange(model.n_elements, device="cuda")
        options = FitOptions(minimize=MinimizeOptions(max_iter=3, check_every=0))
        result = fit_rows(model, model.observed, element, options=options)
        for tensor in (result.bestfit, result.deviance, result.starts, result.starts_agreed):
            assert isinstance(tensor, FakeTensor)
            assert tensor.device == torch.device("cuda:0")
