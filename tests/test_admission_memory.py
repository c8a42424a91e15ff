"""Admission's bytes per fit row against what the kernel really allocates.

The live tensor bytes are counted by a dispatch mode that sees every tensor an ATen operator
returns and the moment its storage is freed: exact, and independent of the allocator and of
the machine's load (unlike resident memory).
"""

from __future__ import annotations

import sys
import weakref
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pyhf_gpu_server.engine import HistFactoryModel
from pyhf_gpu_server.inference import FitOptions, MinimizeOptions, hypotest
from pyhf_gpu_server.service.admission import BYTES_PER_NUMBER, block_bytes_per_row, toy_bytes
from pyhf_gpu_server.service.dispatch import model_shape

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from generate_large import workspace as analysis_workspace


class PeakTensorBytes(TorchDispatchMode):
    """The most bytes held at once by storages that operators allocated inside the mode."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def _forget(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, tuple | list) else (out,):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key in self.live or storage.nbytes() == 0:
                continue  # a view, or an in-place result: no new memory
            self.live[key] = storage.nbytes()
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._forget, key)
        return out


@pytest.fixture(scope="module")
def analysis_model() -> HistFactoryModel:
    """A generated analysis: 12 regions x 25 bins, 8 samples each, 120 shared systematics,
    a staterror gamma per bin (427 parameters, block solver)."""
    ws = analysis_workspace(channels=12, bins=25, systematics=120, injected=1.0)
    return HistFactoryModel.from_workspace(ws, dtype=torch.float64)


@pytest.fixture(scope="module")
def small_analysis_model() -> HistFactoryModel:
    """A smaller generated analysis: 4 regions x 10 bins, 10 shared systematics (57
    parameters)."""
    ws = analysis_workspace(channels=4, bins=10, systematics=10, injected=1.0)
    return HistFactoryModel.from_workspace(ws, dtype=torch.float64)


def test_a_block_row_is_admitted_with_what_its_jacobian_assembly_allocates(analysis_model):
    model, rows = analysis_model, 64
    shape = model_shape(model)
    assert shape.solver == "block"
    pars = model.init.expand(rows, -1).clone() + 0.01
    with PeakTensorBytes() as counter:
        _expected, shared, _per_bin = model.expected_main_block_jacobian(pars)
    held = counter.peak / rows
    # the Jacobian (3 N K: current, trial, weighted) and its assembly, as admission counts them
    K = model.n_pars - shape.n_per_bin
    counted = BYTES_PER_NUMBER * (3 * model.n_main * K + shape.n_assembly)
    assert 0.6 * counted <= held <= counted, (held, counted)
    assert shared.shape == (rows, model.n_main, model.n_pars - shape.n_per_bin)


@pytest.mark.slow
def test_toy_fits_hold_at_most_their_admitted_bytes_per_row(analysis_model):
    """Every fit of a toy hypothesis test (free and conditional, signal and background toys)
    in minimiser calls of 32 rows, each at most 3 iterations (the memory of an iteration does
    not grow with their number): the most tensor bytes held at once, per row, within what
    admission counts for a block-solver row."""
    model, rows = analysis_model, 32
    admitted = block_bytes_per_row(model_shape(model))
    options = FitOptions(max_rows=rows, minimize=MinimizeOptions(max_iter=3))
    with PeakTensorBytes() as counter:
        hypotest(model, 1.0, calctype="toybased", ntoys=rows, seed=1, options=options)
    held = counter.peak / rows
    assert 0.6 * admitted <= held <= admitted, (held, admitted)


def test_drawn_toys_hold_at_most_their_admitted_bytes(small_analysis_model):
    """What a toy-based call holds per toy outside its minimiser calls (the growth of the
    peak from 20 to 60 toys, fit rows fixed at 16 a call), within what admission counts
    (``toy_bytes``), so that a call's toys and fits together keep to the fit-memory bound."""
    model = small_analysis_model
    options = FitOptions(max_rows=16, minimize=MinimizeOptions(max_iter=1))
    peaks = []
    for ntoys in (20, 60):
        with PeakTensorBytes() as counter:
            hypotest(model, 1.0, calctype="toybased", ntoys=ntoys, seed=1, options=options)
        peaks.append(counter.peak)
    per_toy = (peaks[1] - peaks[0]) / (2 * 40)  # signal and background toys
    admitted = toy_bytes(model_shape(model))
    assert 0.6 * admitted <= per_toy <= admitted, (per_toy, admitted)
