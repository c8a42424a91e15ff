"""pyhf itself, with every fit started from many points and a tight tolerance: the reference
for likelihoods with several minima.

pyhf starts each fit once, at the model's init, and its optimiser (scipy's SLSQP) stops at a
tolerance that leaves a relative 1e-5..1e-4 on CLs. :func:`global_pyhf` replaces the fits of
``pyhf.infer`` (``mle.fit`` and ``mle.fixed_poi_fit`` where the calculators and test statistics
call them) by the lowest of pyhf's own fits from a grid of start points, at ``tolerance``; all
the rest (Asimov data, test statistics, p-values) stays pyhf's code.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import pyhf
import pyhf.infer.calculators
import pyhf.infer.test_statistics

GRID = (-1.5, -0.75, -0.25, 0.25, 0.75, 1.5)


def kinked_parameters(model: pyhf.Model) -> list[str]:
    """The model's histosys and normsys parameters (where code0/code1 put kinks)."""
    return [
        name
        for name, modifier_type in model.config.modifiers
        if modifier_type in ("histosys", "normsys")
    ]


def start_points(model: pyhf.Model, init: Sequence[float], grid=GRID) -> list[list[float]]:
    """``init``, and ``init`` with the kinked parameters on every point of ``grid`` (all
    combinations for up to 3 such parameters, else each one alone)."""
    names = list(dict.fromkeys(kinked_parameters(model)))
    slots = [model.config.par_slice(n).start for n in names]
    points = [list(init)]
    if len(slots) <= 3:
        combos = list(itertools.product(grid, repeat=len(slots)))
    else:
        combos = [
            [v if j == i else init[s] for j, s in enumerate(slots)]
            for i in range(len(slots))
            for v in grid
        ]
    for values in combos:
        point = list(init)
        for slot, value in zip(slots, values, strict=True):
            point[slot] = value
        points.append(point)
    return points


@contextmanager
def global_pyhf(tolerance: float = 1e-12) -> Iterator[None]:
    """Inside: pyhf's fits are the lowest of many starts (numpy backend, scipy at ``tolerance``)."""
    original_fit = pyhf.infer.mle.fit
    original_fixed = pyhf.infer.mle.fixed_poi_fit

    def lowest(call, data, model, init_pars, par_bounds, fixed_params, **kwargs) -> Any:
        init = model.config.suggested_init() if init_pars is None else list(init_pars)
        bounds = model.config.suggested_bounds() if par_bounds is None else par_bounds
        best = None
        wants_value = kwargs.pop("return_fitted_val", False)
        for start in start_points(model, init):
            start = [min(max(v, lo), hi) for v, (lo, hi) in zip(start, bounds, strict=True)]
            pars, value = call(
                data, model, start, bounds, fixed_params, return_fitted_val=True, **kwargs
            )
            if np.isfinite(value) and (best is None or value < best[1]):
                best = (pars, value)
        return best if wants_value else best[0]

    def fit(data, model, init_pars=None, par_bounds=None, fixed_params=None, **kwargs):
        return lowest(original_fit, data, model, init_pars, par_bounds, fixed_params, **kwargs)

    def fixed_poi_fit(
        poi_val, data, model, init_pars=None, par_bounds=None, fixed_params=None, **kwargs
    ):
        def call(*args, **kw):
            return original_fixed(poi_val, *args, **kw)

        return lowest(call, data, model, init_pars, par_bounds, fixed_params, **kwargs)

    backend = pyhf.get_backend()
    pyhf.set_backend("numpy", pyhf.optimize.scipy_optimizer(tolerance=tolerance))
    patched = [
        (pyhf.infer.test_statistics, "fit", fit),
        (pyhf.infer.test_statistics, "fixed_poi_fit", fixed_poi_fit),
        (pyhf.infer.calculators, "fixed_poi_fit", fixed_poi_fit),
    ]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patched]
    try:
        for module, name, replacement in patched:
            setattr(module, name, replacement)
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
        pyhf.set_backend(*backend)


def hypotest(workspace: dict, modifier_settings: dict, poi: float, test_stat: str, **kwargs):
    """pyhf's ``hypotest`` (observed, expected set) on ``workspace``'s observations."""
    ws = pyhf.Workspace(workspace)
    model = ws.model(modifier_settings=modifier_settings)
    return pyhf.infer.hypotest(
        poi, ws.data(model), model, test_stat=test_stat, return_expected_set=True, **kwargs
    )


def pyhf_upper_limit(data: Sequence[float], model: pyhf.Model, level: float = 0.05) -> tuple:
    """pyhf's ``upper_limit(data, model, scan=None)`` without its probe at ``mu = 0``.

    pyhf brackets the root at the POI's bounds; at ``mu = 0`` the Asimov ``sqrt(q_mu,A)`` is 0
    or a rounding residue, so whether CLs there is 1 or NaN (and toms748 stops with "the
    function value at x=0 is NaN") depends on the BLAS build and its threads. The same
    ``toms748_scan`` started at a hundredth of the upper bound (pyhf halves that end until every
    curve's CLs is above ``level``) gives that answer without the 0/0.
    """
    low, high = model.config.suggested_bounds()[model.config.poi_index]
    return pyhf.infer.intervals.upper_limits.toms748_scan(
        data, model, max(low, high / 100), high, level=level
    )
