"""torch.compile of the main-model kernel gives the eager results (tested on the CPU)."""

from __future__ import annotations

import pytest
import torch
from conftest import shared_workspace

from pyhf_gpu_server.engine import HistFactoryModel, KernelCache, batch_bucket


def test_batch_buckets_are_powers_of_two():
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 64, 65)] == [2, 2, 4, 8, 64, 128]


@pytest.mark.slow
def test_compiled_equals_eager():
    workspace, patchset, _ = shared_workspace("atlas-susy-2018-31-sbottom-B")
    names = [p["metadata"]["name"] for p in patchset["patches"]][:2]
    eager = HistFactoryModel.from_patchset(workspace, patchset, patch_names=names)
    compiled = HistFactoryModel.from_patchset(workspace, patchset, patch_names=names)
    kernels = KernelCache()
    compiled.enable_compile(kernels)
    generator = torch.Generator().manual_seed(3)
    for rows in (3, 5, 37):  # three buckets: 4, 8, 64
        element = torch.arange(rows) % 2
        pars = eager.init[element] + 0.05 * torch.randn(
            rows, eager.n_pars, generator=generator, dtype=torch.float64
        )
        data = eager.observed[element]
        torch.testing.assert_close(
            compiled.expected_data(pars, element),
            eager.expected_data(pars, element),
            rtol=1e-12,
            atol=1e-12,
        )
        torch.testing.assert_close(
            compiled.logpdf(pars, data, element),
            eager.logpdf(pars, data, element),
            rtol=1e-12,
            atol=1e-12,
        )
        assert kernels.is_warm(compiled, rows)
    assert not kernels.is_warm(compiled, 1000)
