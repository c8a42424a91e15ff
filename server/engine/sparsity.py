"""Which parameters touch one bin: the structure the minimiser's block solver follows.

A HistFactory likelihood's per-bin parameters (staterror and shapesys gammas, a shapefactor,
a normfactor of a one-bin region) each multiply the rates of ONE main bin: their columns of
the rate Jacobian have one entry, and the Gauss-Newton curvature ``J^T W J`` is a dense block
over the *shared* parameters bordered by a block-diagonal one (per bin) over the per-bin
parameters. A large analysis (a gamma per bin) is mostly per-bin parameters, so this
structure decides what a fit iteration costs: ``O(N K^2 + K^3)`` with ``K`` shared
parameters, not ``O(N P^2 + P^3)``
(:class:`~pyhf_gpu_server.inference.curvature.BlockCurvature`).

A parameter is per-bin here when, in every element of the stack, it is only a multiplier
(never a histosys or normsys parameter) and every column it multiplies lies in one and the
same main bin. Found once per model, on the host, from the stacked layout.

Example:
    >>> import pyhf
    >>> from pyhf_gpu_server.engine.layout import read_model
    >>> model = pyhf.simplemodels.uncorrelated_background([5.0, 6.0], [10.0, 9.0], [2.5, 2.0])
    >>> layout = read_model(model, [12.0, 10.0, *model.config.auxdata])
    >>> found = bin_parameters(StackLayout([layout]))
    >>> layout.par_names, found.params.tolist(), found.bins.tolist()
    (['mu', 'uncorr_bkguncrt[0]', 'uncorr_bkguncrt[1]'], [1, 2], [0, 1])
    >>> found.slots.tolist()  # per bin, its per-bin parameters (2: none)
    [[0], [1]]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from .layout import ElementLayout
from .stacking import StackLayout

__all__ = [
    "BinBlocks",
    "BinParameters",
    "bin_parameters",
    "layout_per_bin_count",
    "slot_positions",
]


@dataclass(frozen=True)
class BinParameters:
    """The per-bin parameters of a model, on the host.

    Attributes:
        params: ``[M]`` their parameter indices, ascending.
        bins: ``[M]`` the main bin each one multiplies.
        shared: ``[K]`` every other parameter index, ascending (``K + M = P``).
        slots: ``[N, G]`` per main bin, the positions in ``params`` of its per-bin parameters
            (``G``: the most any bin has; ``M`` pads).
    """

    params: np.ndarray
    bins: np.ndarray
    shared: np.ndarray
    slots: np.ndarray

    @property
    def n_per_bin(self) -> int:
        return int(self.params.shape[0])

    @property
    def n_shared(self) -> int:
        return int(self.shared.shape[0])


def _multiplied(stack: StackLayout) -> tuple[np.ndarray, np.ndarray]:
    """Every (parameter, main bin) pair of a multiplier, over the common and own blocks."""
    n_main, n_pars = stack.n_main, stack.n_pars
    params, bins = [], []
    for block in (stack.common, stack.own):
        multiplier = np.asarray(block.multiplier_params)
        if multiplier.size == 0:
            continue
        columns = multiplier.shape[-1]
        column_bin = np.broadcast_to(np.arange(columns) % n_main, multiplier.shape)
        used = multiplier < n_pars  # n_pars: "times 1" padding
        params.append(multiplier[used])
        bins.append(column_bin[used])
    if not params:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(params).astype(np.int64), np.concatenate(bins).astype(np.int64)


def bin_parameters(stack: StackLayout) -> BinParameters:
    """The per-bin parameters of a stacked layout (see the module doc)."""
    n_pars, n_main = stack.n_pars, stack.n_main
    params, bins = _multiplied(stack)
    lowest = np.full(n_pars, n_main, dtype=np.int64)
    highest = np.full(n_pars, -1, dtype=np.int64)
    np.minimum.at(lowest, params, bins)
    np.maximum.at(highest, params, bins)
    one_bin = lowest == highest
    for block in (stack.common, stack.own):  # interpolated modifiers are shared parameters
        for index in (block.histosys_params, block.normsys_param):
            index = np.asarray(index).reshape(-1)
            one_bin[index[index < n_pars]] = False
    per_bin = np.flatnonzero(one_bin)
    bin_of = lowest[per_bin]
    counts = np.bincount(bin_of, minlength=n_main)
    width = max(int(counts.max(initial=0)), 1)
    slots = np.full((n_main, width), per_bin.shape[0], dtype=np.int64)
    filled = np.zeros(n_main, dtype=np.int64)
    for position, b in enumerate(bin_of):
        slots[b, filled[b]] = position
        filled[b] += 1
    return BinParameters(
        params=per_bin,
        bins=bin_of,
        shared=np.flatnonzero(~one_bin),
        slots=slots,
    )


class BinBlocks(NamedTuple):
    """:class:`BinParameters` as index tensors on a model's device, for the block solver."""

    shared: torch.Tensor  # [K] parameter indices
    params: torch.Tensor  # [M] parameter indices
    bins: torch.Tensor  # [M] the main bin of each
    slots: torch.Tensor  # [N, G] per bin, positions in params (M pads)
    position: torch.Tensor  # [M] each per-bin parameter's place in slots.flatten()


def slot_positions(structure: BinParameters) -> np.ndarray:
    """``[M]``: where each per-bin parameter sits in ``slots.flatten()``."""
    flat = structure.slots.reshape(-1)
    position = np.zeros(structure.n_per_bin, dtype=np.int64)
    used = flat < structure.n_per_bin
    position[flat[used]] = np.flatnonzero(used)
    return position


def _bin_ranges(layout: ElementLayout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per parameter of one element: the lowest and highest main bin it multiplies, and
    whether it is interpolated (histosys or normsys: shared)."""
    n_main, n_pars = layout.n_main, layout.n_pars
    lowest = np.full(n_pars, n_main, dtype=np.int64)
    highest = np.full(n_pars, -1, dtype=np.int64)
    for sample in layout.samples:
        for b, params in enumerate(sample.multipliers):
            for p in params:
                lowest[p] = min(lowest[p], b)
                highest[p] = max(highest[p], b)
    interpolated = np.zeros(n_pars, dtype=bool)
    for index in (layout.histosys_params, layout.normsys_params):
        interpolated[np.asarray(index, dtype=np.int64)] = True
    return lowest, highest, interpolated


def layout_per_bin_count(layouts: ElementLayout | list[ElementLayout]) -> int:
    """How many per-bin parameters the model stacking ``layouts`` (or of one layout) has, as
    :func:`bin_parameters` finds them, from the layouts alone (parameters united by name):
    what admission estimates a fit's memory by before any model is built."""
    if isinstance(layouts, ElementLayout):
        layouts = [layouts]
    seen: dict[tuple[str, int], tuple[int, int, bool]] = {}
    for layout in layouts:
        labels = [(p.name, i) for p in layout.parameters for i in range(p.n_parameters)]
        for label, lo, hi, interpolated in zip(labels, *_bin_ranges(layout), strict=True):
            before = seen.get(label, (layout.n_main, -1, False))
            seen[label] = (min(before[0], lo), max(before[1], hi), before[2] or interpolated)
    return sum(1 for lo, hi, interpolated in seen.values() if lo == hi and not interpolated)
