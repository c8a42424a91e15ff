"""Shared pieces of the inference tests (no tests here).

``PYHF_GPU_TEST_DEVICE`` (default ``cpu``) selects the device the inference tests build
their models on, e.g. ``PYHF_GPU_TEST_DEVICE=cuda`` in ``benchmarks/gpu_check.sh``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import pyhf
import pytest
import torch

DEVICE = os.environ.get("PYHF_GPU_TEST_DEVICE", "cpu")


def as_workspace(model: pyhf.Model, observations: list[float]) -> dict:
    """A pyhf workspace around a simplemodel and its observed main data."""
    return {
        **model.spec,
        "observations": [{"name": model.config.channels[0], "data": observations}],
        "measurements": [{"name": "meas", "config": {"poi": "mu", "parameters": []}}],
        "version": "1.0.0",
    }


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for the module (restored afterwards): small batched fits are
    latency-bound, and more threads oversubscribe a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def fake_cuda_fit(model, element: torch.Tensor, uncertainty: float, corr_mat: torch.Tensor):
    """A converged ``FitResults`` at the model's init for rows ``element`` (inside
    FakeTensorMode on a simulated ``cuda`` device: what a fit would hand over, without one)."""
    from pyhf_gpu_server.inference import FitResults

    x = model.init.index_select(0, element)
    zero = torch.zeros(element.shape[0], dtype=model.dtype, device=element.device)
    true = torch.ones(element.shape[0], dtype=torch.bool, device=element.device)
    return FitResults(
        bestfit=x,
        uncertainty=torch.full_like(x, uncertainty),
        corr_mat=corr_mat,
        best_twice_nll=zero,
        deviance=zero,
        converged=true,
        iterations=element,
        labels=list(model.par_names),
        element=element,
        starts=element,
        starts_agreed=true,
    )


def step_inputs(rows: int, pars: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Inputs of a curvature's ``steps``: a random gradient (``rows x pars``, float64 on
    ``DEVICE``), every parameter movable, and the damping ``0, 1e-2, 10`` for every row."""
    generator = torch.Generator().manual_seed(seed)
    g = torch.randn(rows, pars, generator=generator, dtype=torch.float64).to(DEVICE)
    movable = torch.ones(rows, pars, dtype=torch.bool, device=DEVICE)
    lams = torch.tensor([[0.0], [1e-2], [10.0]], dtype=torch.float64, device=DEVICE)
    return g, movable, lams.expand(3, rows)


def assert_on_fake_cuda(tensors: Iterable[torch.Tensor]) -> None:
    """Every tensor a FakeTensor on the simulated ``cuda:0`` (inside FakeTensorMode)."""
    from torch._subclasses.fake_tensor import FakeTensor

    for tensor in tensors:
        assert isinstance(tensor, FakeTensor)
        assert tensor.device == torch.device("cuda:0")
