"""Shared pieces of the inference tests (no tests here).

``PYHF_GPU_TEST_DEVICE`` (default ``cpu``) selects the device the inference tests build
their models on, e.g. ``PYHF_GPU_TEST_DEVICE=cuda`` in ``benchmarks/gpu_check.sh``.
"""

from __future__ import annotations

import os

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
    """Small batched fits are latency-bound: on a shared 2-core machine one intra-op thread
    avoids oversubscription (2 threads were 10x slower here). Restored afterwards."""
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
