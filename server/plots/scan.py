"""``scan``: profile-likelihood scans, -2ΔlnL versus one parameter (1σ and 2σ lines) or over
two (68% and 95% CL contours)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from . import _style
from ._base import fail, matrix, need, number, numbers, register, strings

#: -2ΔlnL of the 68.27% and 95.45% (1σ, 2σ) intervals of one parameter
ONE_D_LEVELS = ((1.0, "1σ"), (4.0, "2σ"))
#: -2ΔlnL of the 68% and 95% CL regions of two parameters (χ² with 2 degrees of freedom)
TWO_D_LEVELS = ((2.30, "68% CL"), (5.99, "95% CL"))
Y_LABEL = r"$-2\,\Delta\ln L$"


@register("scan")
def scan(
    result: Any, *, xlabel: str | None = None, ylabel: str | None = None, ymax: float | None = None
) -> Figure:
    """cabinetry-like scan JSON: 1D ``{name, bestfit, uncertainty, parameter_values,
    delta_nlls}`` (``delta_nlls`` are -2ΔlnL, as cabinetry's), or 2D ``{parameters: [x, y],
    values_x, values_y, delta_nlls: [[...] per x]}``. ``xlabel``/``ylabel`` replace the
    parameter names; ``ymax``: the top of the 1D plot (default: the scan's, at least 5)."""
    kind = "scan"
    if not isinstance(result, Mapping):
        raise fail(kind, f"the result must be a scan object, not {type(result).__name__}")
    if "parameters" in result or "values_x" in result:
        return _scan_2d(kind, result, xlabel, ylabel)
    name = str(need(kind, result, "name"))
    x = np.asarray(numbers(kind, "parameter_values", need(kind, result, "parameter_values")))
    y = np.asarray(numbers(kind, "delta_nlls", need(kind, result, "delta_nlls"), len(x)))
    if len(x) < 2:
        raise fail(kind, "parameter_values needs at least 2 values")
    order = np.argsort(x, kind="stable")
    x, y = x[order], y[order]
    bestfit = number(kind, "bestfit", result.get("bestfit"))  # absent: NaN, as null
    unc = number(kind, "uncertainty", result.get("uncertainty"))
    fig = _style.new_figure(7.5, 5.5)
    ax = fig.add_subplot()
    finite = np.isfinite(y)
    top = max(5.0, float(np.max(y[finite])) * 1.25) if finite.any() else 5.0
    if ymax is not None:
        top = number(kind, "ymax", ymax)
    shading: list[Any] = []
    if math.isfinite(bestfit) and math.isfinite(unc):
        label = f"Best fit: {bestfit:.3g} ± {unc:.2g}"
        span = (bestfit - unc, bestfit + unc)
        shading.append(ax.axvspan(*span, color="0.8", alpha=0.6, lw=0, zorder=0, label=label))
    ax.plot(x, y, color=_style.COLORS[0], lw=2, marker="o", ms=4, zorder=3, label="Profile scan")
    ends = y[finite][[0, -1]] if finite.any() else np.array([np.inf, np.inf])
    for level, text in ONE_D_LEVELS:
        if level < top:
            ax.axhline(level, color="0.3", ls="--", lw=1, zorder=1)
            # at the end where the curve is farther from the line (its label clear of it)
            right = abs(ends[1] - level) >= 0.5 * abs(ends[0] - level)
            ha = "right" if right else "left"
            kw = _style.text_kw(_style.LEGEND_SIZE, color="0.3", ha=ha, va="bottom")
            ax.text(0.99 if right else 0.01, level, text, transform=ax.get_yaxis_transform(), **kw)
    if math.isfinite(bestfit):
        ax.axvline(bestfit, color="black", lw=1, ls=":", zorder=2)
    ax.set_xlim(float(x[0]), float(x[-1]))
    ax.set_ylim(0.0, top)
    _style.style_axes(ax)
    _style.set_xlabel(ax, xlabel or name)
    _style.set_ylabel(ax, ylabel or Y_LABEL)
    _style.place_legend(  # the best fit's band is a background: the legend may go over it
        ax, candidates=("upper center", *_style.INSIDE), ignore=shading
    )
    return fig


def _scan_2d(
    kind: str, result: Mapping[str, Any], xlabel: str | None, ylabel: str | None
) -> Figure:
    names = strings(kind, "parameters", need(kind, result, "parameters"))
    if len(names) != 2:
        raise fail(kind, f"parameters must name 2 parameters, not {len(names)}")
    vx = np.asarray(numbers(kind, "values_x", need(kind, result, "values_x")))
    vy = np.asarray(numbers(kind, "values_y", need(kind, result, "values_y")))
    if len(vx) < 2 or len(vy) < 2:
        raise fail(kind, "values_x and values_y need at least 2 values each")
    z = np.asarray(matrix(kind, "delta_nlls", need(kind, result, "delta_nlls"), len(vx), len(vy)))
    if not np.isfinite(z).any():
        raise fail(kind, "delta_nlls has no finite value")
    z = z - np.nanmin(z)  # -2ΔlnL from the grid's minimum when the fit's is not on it
    fig = _style.new_figure(7.5, 6.0)
    ax = fig.add_subplot()
    cap = max(TWO_D_LEVELS[-1][0] * 2.0, 1.0)
    grid = np.clip(z.T, 0, cap)  # [y, x] for contourf
    masked = np.ma.masked_invalid(grid)
    filled = ax.contourf(
        vx, vy, masked, levels=np.linspace(0, cap, 25), cmap="viridis_r", extend="max"
    )
    filled.set_gid("scan-filled")
    colorbar = _style.colorbar(fig, filled, ax, Y_LABEL, pad=0.02)
    colorbar.set_ticks(np.arange(0, cap + 0.1, 2).tolist())
    handles = []
    for (level, text), style in zip(TWO_D_LEVELS, ("-", "--"), strict=True):
        if np.nanmin(grid) < level < np.nanmax(grid):
            lines = ax.contour(
                vx, vy, masked, levels=[level], colors="white", linestyles=style, linewidths=2.2
            )
            lines.set_gid(f"contour-{text.split('%')[0]}")
        handles.append(
            Line2D([], [], color="black", ls=style, lw=2, label=f"{text} (-2ΔlnL = {level:g})")
        )
    best = result.get("bestfit")
    if isinstance(best, Sequence) and len(best) == 2:
        bx, by = numbers(kind, "bestfit", best, 2)
    else:
        iy, ix = np.unravel_index(np.nanargmin(grid), grid.shape)
        bx, by = vx[ix], vy[iy]
    handles.append(
        ax.plot(
            [bx], [by], marker="X", ms=11, color="white", mec="black", ls="none", label="Best fit"
        )[0]
    )
    _style.style_axes(ax)
    _style.set_xlabel(ax, xlabel or names[0])
    _style.set_ylabel(ax, ylabel or names[1])
    _style.legend(ax, handles=handles, loc="upper right", box=0.8)
    return fig
