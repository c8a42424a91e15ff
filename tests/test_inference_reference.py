"""Parity with pyhf 0.7.6 on the shared ATLAS workspaces (reference.json of each folder).

For the three reference patches of every workspace, batched as one stacked model:
CLs_obs and each CLs_exp within 1e-4 of pyhf's, and our unconditional twice-NLL minimum at
most pyhf's + 1e-6.
"""

from __future__ import annotations

from functools import cache

import pytest
import torch
from conftest import reference_patches, shared_workspace
from test_inference_support import DEVICE, one_thread  # noqa: F401 (fixture)

from pyhf_gpu_server.engine import HistFactoryModel
from pyhf_gpu_server.inference import fit, hypotest

pytestmark = pytest.mark.usefixtures("one_thread")


@cache
def reference_model(name: str) -> HistFactoryModel:
    workspace, patchset, _ = shared_workspace(name)
    return HistFactoryModel.from_patchset(
        workspace, patchset, patch_names=reference_patches(name), device=DEVICE
    )


def references(name: str) -> list[dict]:
    return shared_workspace(name)[2]["reference"]["results"]


@pytest.mark.slow
def test_cls_matches_pyhf_on_every_reference_patch(shared_name):
    model = reference_model(shared_name)
    result = hypotest(model, 1.0)  # every element (patch) in one batched call
    assert result.converged.all(), result.non_converged()
    observed, expected = result.observed().tolist(), result.expected().tolist()
    for i, ref in enumerate(references(shared_name)):
        assert abs(observed[i] - ref["CLs_obs"]) <= 1e-4, ref["patch"]
        for mine, theirs in zip(expected[i], ref["CLs_exp"], strict=True):
            assert abs(mine - theirs) <= 1e-4, ref["patch"]


@pytest.mark.slow
def test_unconditional_minimum_is_never_worse_than_pyhf(shared_name):
    model = reference_model(shared_name)
    result = fit(model, uncertainties=False)
    assert result.converged.all()
    for i, ref in enumerate(references(shared_name)):
        assert result.best_twice_nll[i].item() <= ref["twice_nll_at_bestfit"] + 1e-6, ref["patch"]
        poi = result.bestfit[i, model.poi_index].item()
        assert abs(poi - ref["bestfit_poi"]) < 5e-3 * max(1.0, abs(ref["bestfit_poi"]))


def test_results_stay_on_the_model_device():
    model = reference_model("atlas-susy-2018-31-sbottom-B")
    result = hypotest(
        model, torch.tensor([0.5, 1.5], dtype=model.dtype, device=model.device), element=[0, 2]
    )
    for tensor in (result.cls_obs, result.cls_exp, result.teststat, result.converged):
        assert tensor.device == model.device
    assert result.cls_obs.dtype == model.dtype


def test_float32_cls_stay_close_to_pyhf(shared_name):
    """In float32 the fits compare deviances (values of order 1, not a -2 log L of order 100),
    so CLs on the reference patches stay within 1e-3 of pyhf's (measured: 3.5e-4 at most;
    subtracting -2 log L values gave 1.2e-3 on stau), with no 0/0."""
    model = reference_model(shared_name).to(dtype=torch.float32)
    result = hypotest(model, 1.0)
    observed, expected = result.observed().tolist(), result.expected().tolist()
    for i, ref in enumerate(references(shared_name)):
        assert abs(observed[i] - ref["CLs_obs"]) <= 1e-3, ref["patch"]
        for mine, theirs in zip(expected[i], ref["CLs_exp"], strict=True):
            assert abs(mine - theirs) <= 1e-3, ref["patch"]
