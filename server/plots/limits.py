"""CLs limit plots: ``brazil`` (CLs versus the POI) and ``exclusion`` (CLs over a plane of
signal-model parameters, from a patchset's answer)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.tri import TriAnalyzer, Triangulation

from . import _style
from ._base import (
    fail,
    first_key,
    level_option,
    need,
    number,
    numbers,
    one_patch,
    register,
    strings,
)
from .slices import axis_label, describe, off_axes, ranked_slices, slice_key

CLS_LABEL = "CL$_s$"
_LOG_FLOOR = 1e-12


@dataclass
class ClsCurve:
    """CLs tests of one signal hypothesis at several POI values (sorted by POI)."""

    poi: np.ndarray  # [n]
    obs: np.ndarray  # [n]
    exp: np.ndarray  # [5, n]: -2, -1, 0, +1, +2 sigma (pyhf's order)


def crossing(x: np.ndarray, y: np.ndarray, level: float) -> float:
    """First ``x`` where ``y`` falls from above ``level`` to at or below it, interpolated
    linearly between the two points around it (NaN when it never does)."""
    finite = np.isfinite(x) & np.isfinite(y)
    x, y = x[finite], y[finite]
    for i in range(1, len(x)):
        if y[i - 1] > level >= y[i]:
            t = (y[i - 1] - level) / (y[i - 1] - y[i])
            return float(x[i - 1] + t * (x[i] - x[i - 1]))
    return math.nan


def crossings(x: np.ndarray, y: np.ndarray, level: float) -> list[float]:
    """Every ``x`` where ``y`` crosses ``level`` (either way), interpolated linearly."""
    out = []
    for i in range(1, len(x)):
        a, b = y[i - 1] - level, y[i] - level
        if np.isfinite(a) and np.isfinite(b) and a * b < 0:
            out.append(float(x[i - 1] + a / (a - b) * (x[i] - x[i - 1])))
    return out


def cls_entry(kind: str, entry: Any, where: str) -> tuple[float, list[float]]:
    """``(CLs_obs, CLs_exp)`` of one CLs answer."""
    obs = number(kind, f"{where}.CLs_obs", need(kind, entry, "CLs_obs", where))
    exp = numbers(kind, f"{where}.CLs_exp", need(kind, entry, "CLs_exp", where), 5)
    return obs, exp


def _entry_poi(entry: Mapping[str, Any]) -> Any:
    if "test_poi" in entry:
        return entry["test_poi"]
    meta = entry.get("meta")
    return meta.get("test_poi") if isinstance(meta, Mapping) else None


def _curve(kind: str, entries: Any, test_poi: Any, where: str) -> ClsCurve:
    """A :class:`ClsCurve` from a list of CLs answers and their POI values."""
    if not isinstance(entries, Sequence) or isinstance(entries, (str, bytes)) or not entries:
        raise fail(kind, f"{where} must be a non-empty list of CLs results")
    pairs = [cls_entry(kind, e, f"{where}[{i}]") for i, e in enumerate(entries)]
    if test_poi is None:
        found = [_entry_poi(e) for e in entries]
        if any(p is None for p in found):
            raise fail(
                kind,
                "the tested POI values are unknown: give the 'test_poi' option (the list "
                "sent to POST /cls), or results whose meta has 'test_poi'",
            )
        test_poi = found
    pois = numbers(kind, "test_poi", test_poi, len(pairs))
    order = np.argsort(pois, kind="stable")
    poi = np.asarray(pois)[order]
    obs = np.asarray([p[0] for p in pairs])[order]
    exp = np.asarray([p[1] for p in pairs]).T[:, order]
    return ClsCurve(poi, obs, exp)


_SCAN_KEYS = ("scan", "test_poi", "tested_pois", "poi_values")


def _upper_limit_parts(kind: str, result: Mapping[str, Any]) -> tuple[float, list[float], Any]:
    """(observed limit, expected limits, the scan's CLs curve or None) of an upper-limit
    answer; the scan's CLs values are read when the answer carries them (``scan`` with
    ``results``, or ``CLs_obs``/``CLs_exp`` lists)."""
    obs = number(kind, "upper_limit_obs", result["upper_limit_obs"])
    exp = numbers(kind, "upper_limit_exp", need(kind, result, "upper_limit_exp"), 5)
    scan = next((result[k] for k in _SCAN_KEYS if k in result), None)
    curve = None
    if scan is not None:
        if "results" in result:
            curve = _curve(kind, result["results"], scan, "results")
        else:
            cls_obs = first_key(kind, result, ("CLs_obs", "cls_obs"), "the upper-limit result")
            cls_exp = first_key(kind, result, ("CLs_exp", "cls_exp"), "the upper-limit result")
            lengths = {len(v) if isinstance(v, Sequence) else -1 for v in (scan, cls_obs, cls_exp)}
            if len(lengths) != 1:
                raise fail(kind, "the scan, CLs_obs and CLs_exp of the result differ in length")
            entries = [{"CLs_obs": o, "CLs_exp": e} for o, e in zip(cls_obs, cls_exp, strict=True)]
            curve = _curve(kind, entries, scan, "the scan")
    return obs, exp, curve


@register("brazil")
def brazil(
    result: Any,
    *,
    test_poi: Sequence[float] | None = None,
    level: float | None = None,
    upper_limit: Mapping[str, Any] | None = None,
    xlabel: str = "μ",
    log_y: bool = False,
    patch: str | None = None,
) -> Figure:
    """CLs versus the tested POI, as pyhf's ``brazil`` plot, with the upper limits marked.

    ``result``: a ``POST /cls`` answer for a list of ``test_poi`` (a list of
    ``{CLs_obs, CLs_exp, meta}``; the POI values from the ``test_poi`` option or each
    ``meta.test_poi``), or a ``POST /upper-limit`` answer (its limits drawn alone, or on its
    scan's CLs values when it carries them). ``upper_limit``: an upper-limit answer whose
    limits to mark on a CLs list (else they are interpolated from the curves). ``patch``:
    the patch of a patchset answer ``{patch_name: [...]}`` to draw.
    """
    kind = "brazil"
    if patch is not None or (isinstance(result, Mapping) and "results" not in result):
        result = one_patch(kind, result, patch, "upper_limit_obs")
    limits: tuple[float, list[float]] | None = None
    if isinstance(result, Mapping) and "upper_limit_obs" in result:
        obs_limit, exp_limits, curve = _upper_limit_parts(kind, result)
        limits = (obs_limit, exp_limits)
        if level is None and "level" in result:
            level = number(kind, "level", result["level"])
        if curve is None:
            return _limits_only(obs_limit, exp_limits, level_option(kind, level or 0.05), xlabel)
    else:
        entries = result
        if isinstance(result, Mapping):  # {"test_poi": [...], "results": [...]}
            entries = need(kind, result, "results")
            test_poi = result.get("test_poi", test_poi)
        curve = _curve(kind, entries, test_poi, "the result")
    level = level_option(kind, 0.05 if level is None else level)
    if upper_limit is not None:
        obs_limit, exp_limits, _ = _upper_limit_parts(kind, upper_limit)
        limits = (obs_limit, exp_limits)
    interpolated = limits is None
    if limits is None:
        found = [crossing(curve.poi, values, level) for values in (curve.obs, *curve.exp)]
        limits = (found[0], found[1:])
    return _brazil_figure(curve, level, limits, interpolated, xlabel, log_y)


def _brazil_figure(
    curve: ClsCurve,
    level: float,
    limits: tuple[float, list[float]],
    interpolated: bool,
    xlabel: str,
    log_y: bool,
) -> Figure:
    fig = _style.new_figure(7.5, 5.5)
    ax = fig.add_subplot()
    x, exp = curve.poi, curve.exp
    if log_y:
        ax.set_yscale("log")
    ax.fill_between(x, exp[0], exp[4], color=_style.BAND_2SIGMA, lw=0, label="Expected ±2σ")
    ax.fill_between(x, exp[1], exp[3], color=_style.BAND_1SIGMA, lw=0, label="Expected ±1σ")
    _cls_curves(ax, x, curve.obs, exp[2], level)
    obs_limit, exp_limits = limits
    cl = f"{100 * (1 - level):g}% CL"
    if math.isfinite(obs_limit):
        ax.axvline(obs_limit, color=_style.OBSERVED, lw=1.2, ls=":", zorder=1)
        _limit_marks(
            ax, [obs_limit], level, observed=True, label=f"Observed {cl} limit: {obs_limit:.3g}"
        )
    if len(exp_limits) == 5 and math.isfinite(exp_limits[2]):
        median, lo, hi = exp_limits[2], exp_limits[1], exp_limits[3]
        value = (
            f"${median:.3g}^{{+{hi - median:#.2g}}}_{{-{median - lo:#.2g}}}$"
            if math.isfinite(lo) and math.isfinite(hi)
            else f"{median:.3g}"
        )
        _limit_marks(ax, [median], level, observed=False, label=f"Expected {cl} limit: {value}")
    ax.set_xlim(float(x[0]), float(x[-1]))
    if not log_y:
        ax.set_ylim(0.0, 1.05 * max(1.0, float(np.nanmax(exp[4]))) if exp.size else 1.05)
    else:
        floor = float(np.nanmin(np.where(exp[0] > 0, exp[0], np.nan), initial=level))
        ax.set_ylim(max(min(floor, level) / 3, level * 1e-3), 1.5)
    _style.style_axes(ax)
    _style.set_xlabel(ax, xlabel)
    _style.set_ylabel(ax, CLS_LABEL)
    found = [v for v in (obs_limit, *exp_limits[2:3]) if math.isfinite(v)]
    if interpolated and found:
        _style.note(fig, ["limits interpolated linearly between the tested POI values"])
    elif not found:
        _style.note(fig, [f"{CLS_LABEL} does not fall to {level:g} in the tested range: no limit"])
    _legend_in_order(ax)  # once the layout is final
    return fig


def _cls_curves(
    ax, x: np.ndarray, obs: np.ndarray, median: np.ndarray, level: float, joined: bool = True
) -> None:
    """The expected (median) and observed CLs curves, points only unless ``joined``, and the
    line at ``level``."""
    dashed, solid, dash = ("--", "-", "none") if joined else ("none", "none", "_")
    expected, observed = f"Expected {CLS_LABEL}", f"Observed {CLS_LABEL}"
    ax.plot(x, median, color=_style.EXPECTED, ls=dashed, marker=dash, ms=10, lw=2, label=expected)
    ax.plot(x, obs, color=_style.OBSERVED, ls=solid, lw=2, marker="o", ms=4, label=observed)
    ax.axhline(level, color=_style.LEVEL_LINE, lw=1.5, label=f"{CLS_LABEL} = {level:g}")


def _limit_marks(
    ax, where: Sequence[float], level: float, *, observed: bool, label: str | None = None
) -> None:
    """Triangles on the ``level`` line where the observed (red) or expected (white) CLs
    falls to it."""
    face = _style.LEVEL_LINE if observed else "white"
    levels = [level] * len(where)
    ax.plot(where, levels, ls="none", marker="v", ms=9, color=face, mec="black", label=label)


def _legend_in_order(ax, **kwargs: Any) -> None:
    """Observed, expected, the bands, the level, then the limits: the usual order; where it
    hides no curve nor band, else beside the axes."""
    handles, labels = ax.get_legend_handles_labels()
    prefixes = (
        "Observed CL",
        "Expected CL",
        "Expected ±1",
        "Expected ±2",
        "CL",
        "Observed",
        "Expected",
    )
    rank = [next((k for k, p in enumerate(prefixes) if lab.startswith(p)), 99) for lab in labels]
    order = sorted(range(len(labels)), key=lambda i: rank[i])
    _style.place_legend(ax, [handles[i] for i in order], [labels[i] for i in order], **kwargs)


def _limits_only(obs: float, exp: list[float], level: float, xlabel: str) -> Figure:
    """An upper-limit answer without the scan: its limits on the POI axis, with bands."""
    fig = _style.new_figure(7.5, 3.0)
    ax = fig.add_subplot()
    observed, expected = f"Observed: {obs:.3g}", f"Expected: {exp[2]:.3g}"
    ax.plot([obs], [0.45], marker="o", ms=9, color=_style.OBSERVED, ls="none", label=observed)
    ax.plot([exp[2]] * 2, [0.2, 0.7], color=_style.EXPECTED, ls="--", lw=2, label=expected)
    for sigma, color, zorder in ((1, _style.BAND_1SIGMA, 0.6), (2, _style.BAND_2SIGMA, 0.5)):
        low, high = exp[2 - sigma], exp[2 + sigma]
        label = f"Expected ±{sigma}σ"
        ax.barh(0.45, high - low, left=low, height=0.5, color=color, label=label, zorder=zorder)
    values = [v for v in [obs, *exp] if math.isfinite(v)]
    if values:
        lo, hi = min(values), max(values)
        pad = 0.15 * (hi - lo or max(abs(hi), 1.0))
        ax.set_xlim(max(0.0, lo - pad) if lo >= 0 else lo - pad, hi + pad)
    ax.set_ylim(0, 1.15)
    ax.set_yticks([])
    _style.style_axes(ax, minor_y=False, right=False)
    ax.tick_params(axis="y", left=False, right=False)
    _style.set_xlabel(ax, f"{100 * (1 - level):g}% CL upper limit on {xlabel}")
    _style.legend(ax, loc="upper center", ncols=4, size=_style.LEGEND_SIZE - 1)
    return fig


# ---------------------------------------------------------------------------- exclusion
@dataclass
class _Points:
    coords: np.ndarray  # [n, d]
    obs: np.ndarray  # [n]
    exp: np.ndarray  # [n, 5]


def _patch_values(kind: str, values: Any, patchset: Any) -> tuple[dict[str, list[float]], Any]:
    """``{patch: [values]}`` and the patchset's axis labels (None without a patchset)."""
    if values is None and patchset is None:
        raise fail(
            kind,
            "give the patches' coordinates: the 'values' option ({patch_name: [v1, v2]}, the "
            "patchset's metadata values) or the 'patchset' option",
        )
    labels = None
    if values is None:
        patches = need(kind, patchset, "patches", "the patchset option")
        values = {}
        for i, patch in enumerate(patches):
            meta = need(kind, patch, "metadata", f"patchset.patches[{i}]")
            values[str(need(kind, meta, "name", f"patchset.patches[{i}].metadata"))] = need(
                kind, meta, "values", f"patchset.patches[{i}].metadata"
            )
        meta = patchset.get("metadata")
        if isinstance(meta, Mapping) and isinstance(meta.get("labels"), Sequence):
            labels = [str(v) for v in meta["labels"]]
    if not isinstance(values, Mapping):
        raise fail(kind, "the values option must be an object {patch_name: [v1, v2]}")
    out = {}
    for name, vals in values.items():
        vals = [vals] if isinstance(vals, (int, float)) else vals
        out[str(name)] = numbers(kind, f"values[{name!r}]", vals)
    return out, labels


def _pick_entry(kind: str, name: str, entry: Any, test_poi: float) -> Any:
    """A patch's CLs answer (for a list of test_poi, the one at ``test_poi``)."""
    if isinstance(entry, Sequence) and not isinstance(entry, (str, bytes)):
        for item in entry:
            if isinstance(item, Mapping) and _entry_poi(item) == test_poi:
                return item
        raise fail(
            kind,
            f"patch {name!r} answered a list of test_poi without one at {test_poi:g} "
            "(the test_poi option picks the tested value)",
        )
    return entry


def _slice(
    kind: str, coords: np.ndarray, axes: list[int], names: list[str], wanted: Any
) -> tuple[np.ndarray, str | None]:
    """The mask of the points whose coordinates off the plotted ``axes`` equal ``wanted`` (the
    ``slice`` option), default the most populated such values (the lowest of those tied);
    every point when the values have no other coordinate; and the caption that names the
    slice on the plot. A slice too small to draw is refused, naming the slices there are:
    slices are never mixed on one plane."""
    n, dim = coords.shape
    others = off_axes(dim, axes)
    if not others:
        if wanted is not None:
            raise fail(kind, "slice: the plotted axes are all of the patches' values")
        return np.ones(n, bool), None
    points = coords.tolist()
    ranked = ranked_slices(points, axes)
    counts = dict(ranked)
    listed = "; ".join(f"{describe(names, axes, k)} ({c})" for k, c in ranked[:8])
    more = f"; and {len(ranked) - 8} more" if len(ranked) > 8 else ""
    needed = 3 if len(axes) == 2 else 2
    if wanted is not None:
        values = [wanted] if isinstance(wanted, (int, float)) else wanted
        values = numbers(kind, "slice", values)
        if len(values) != len(others):
            raise fail(
                kind,
                f"slice gives the values of the coordinates off the axes, "
                f"{', '.join(names[a] for a in others)}: {len(others)} number(s), not "
                f"{len(values)}",
            )
        chosen = tuple(round(float(v), 9) for v in values)
        if chosen not in counts:
            raise fail(
                kind,
                f"no tested point at {describe(names, axes, chosen)}; the slices (points): "
                f"{listed}{more}",
            )
    else:
        chosen = ranked[0][0]
    count = counts[chosen]
    if count < needed:
        what = "the most populated slice" if wanted is None else "the slice"
        raise fail(
            kind,
            f"{what}, {describe(names, axes, chosen)}, has {count} of {n} points: too few for "
            f"{'a contour (3)' if needed == 3 else 'a curve (2)'}; the points are not on "
            f"common planes of {', '.join(names[a] for a in axes)}, so they cannot be drawn "
            f"as one without mixing slices (choose other axes, or a slice: {listed}{more})",
        )
    mask = np.array([slice_key(point, axes) == chosen for point in points])
    return mask, f"{describe(names, axes, chosen)} ({count} of {n} points)"


@register("exclusion")
def exclusion(
    result: Any,
    *,
    values: Mapping[str, Sequence[float]] | None = None,
    patchset: Mapping[str, Any] | None = None,
    labels: Sequence[str] | None = None,
    axes: Sequence[int] | None = None,
    slice: Sequence[float] | None = None,
    level: float = 0.05,
    test_poi: float = 1.0,
    show_points: bool = True,
) -> Figure:
    """CLs of each patch of a patchset answer over the patches' coordinates.

    ``values``: ``{patch_name: [v1, v2, ...]}`` (the patchset's metadata ``values``; or give
    ``patchset`` itself); ``axes``: which two of them span the plane (default the first two;
    one index: CLs versus that value); ``slice``: the values of the other coordinates (in
    their order) whose points are drawn, default the most populated (named on the plot, e.g.
    "m_neutralino1 = 60 GeV (131 of 218 points)"): points of different slices are never
    drawn on one plane, and a slice too small to draw is refused. ``labels``: the axis labels
    (default the patchset's metadata ``labels``, with their unit: given in brackets, else GeV
    for a mass, a label starting ``m_``). Patches answered with an error, without coordinates
    or with a non-finite CLs are skipped and counted in a note.
    """
    kind = "exclusion"
    if not isinstance(result, Mapping) or not result:
        raise fail(kind, "the result must be a patchset answer {patch_name: CLs result}")
    level = level_option(kind, level)
    coords, meta_labels = _patch_values(kind, values, patchset)
    errors = missing = nonfinite = 0
    points, obs, exp = [], [], []
    for name, entry in result.items():
        if name == "meta":
            continue
        if isinstance(entry, Mapping) and "error" in entry:
            errors += 1
            continue
        entry = _pick_entry(kind, name, entry, float(test_poi))
        o, e = cls_entry(kind, entry, f"result[{name!r}]")
        if name not in coords:
            missing += 1
            continue
        if not (math.isfinite(o) and all(math.isfinite(v) for v in e)):
            nonfinite += 1
            continue
        points.append(coords[name])
        obs.append(o)
        exp.append(e)
    if not points:
        raise fail(
            kind,
            f"no patch to draw: {errors} answered an error, {missing} have no values, "
            f"{nonfinite} a non-finite CLs",
        )
    dims = {len(p) for p in points}
    if len(dims) != 1:
        raise fail(kind, "the patches' values differ in length")
    (dim,) = dims
    if meta_labels is None or len(meta_labels) != dim:
        meta_labels = [f"value {a}" for a in range(dim)]
    if axes is None:
        axes = [0] if dim == 1 else [0, 1]
    axes = [int(a) for a in (axes if isinstance(axes, Sequence) else [axes])]
    if (
        not 1 <= len(axes) <= 2
        or len(set(axes)) != len(axes)
        or any(not 0 <= a < dim for a in axes)
    ):
        named = ", ".join(f"{a} {lab}" for a, lab in enumerate(meta_labels))
        raise fail(
            kind, f"axes must be one or two different indices into a patch's values ({named})"
        )
    coords_all = np.asarray(points, float)
    keep, caption = _slice(kind, coords_all, axes, meta_labels, slice)
    data = _Points(
        coords_all[keep][:, axes],
        np.clip(np.asarray(obs)[keep], _LOG_FLOOR, None),
        np.clip(np.asarray(exp)[keep], _LOG_FLOOR, None),
    )
    if labels is None:
        labels = [axis_label(meta_labels[a]) for a in axes]
    labels = strings(kind, "labels", labels)
    if len(labels) < len(axes):
        raise fail(kind, f"labels must name the {len(axes)} axes")
    skipped = {"answered an error": errors, "without values": missing}
    skipped["with non-finite CLs"] = nonfinite
    notes = [f"{n} patch{'es' if n > 1 else ''} {why} (skipped)" for why, n in skipped.items() if n]
    if len(axes) == 1:
        return _exclusion_1d(data, level, labels[0], notes, caption)
    return _exclusion_2d(data, level, labels, notes, show_points, caption)


def _exclusion_1d(
    data: _Points, level: float, xlabel: str, notes: list[str], caption: str | None
) -> Figure:
    order = np.argsort(data.coords[:, 0], kind="stable")
    x = data.coords[order, 0]
    obs, exp = data.obs[order], data.exp[order].T
    shared = len(x) - len(np.unique(x))
    if shared:  # points sharing a value: no curve through them
        notes.append(f"{shared} patches share a value with another: no curve through them")
    fig = _style.new_figure(7.5, 5.5)
    ax = fig.add_subplot()
    ax.set_yscale("log")
    band = "Expected ±1σ"
    if shared == 0:
        ax.fill_between(x, exp[1], exp[3], color=_style.BAND_1SIGMA, lw=0, label=band)
    else:
        yerr = [exp[2] - exp[1], exp[3] - exp[2]]
        ax.errorbar(x, exp[2], yerr=yerr, fmt="none", ecolor=_style.BAND_1SIGMA, lw=4, label=band)
    _cls_curves(ax, x, obs, exp[2], level, joined=shared == 0)
    if shared == 0:
        for values, observed in ((obs, True), (exp[2], False)):
            where = crossings(x, values, level)
            if where:
                _limit_marks(ax, where, level, observed=observed)
    low = float(min(np.min(exp[1]), np.min(obs), level))
    ax.set_ylim(max(low / 3, level * 1e-3), 2.0)
    if len(x) > 1 and x[-1] > x[0]:
        ax.set_xlim(float(x[0]), float(x[-1]))
    _style.style_axes(ax)
    _style.set_xlabel(ax, xlabel)
    _style.set_ylabel(ax, CLS_LABEL)
    _style.note(fig, notes)
    _legend_in_order(ax, **_caption(caption))
    return fig


def _caption(caption: str | None) -> dict[str, Any]:
    """The legend's title naming the slice drawn (none for a plane of all the values)."""
    if caption is None:
        return {}
    return {
        "title": caption,
        "title_fontproperties": _style.font(_style.LEGEND_SIZE),
        "alignment": "left",
    }


def _triangulation(x: np.ndarray, y: np.ndarray) -> Triangulation | None:
    """Delaunay triangles of the points in coordinates scaled to the unit square (masses of
    very different ranges would otherwise give slivers), less the flat ones at the border."""
    if len(x) < 3:
        return None
    span = [np.ptp(x) or 1.0, np.ptp(y) or 1.0]
    try:
        unit = Triangulation((x - x.min()) / span[0], (y - y.min()) / span[1])
    except (ValueError, RuntimeError):  # collinear or too few distinct points
        return None
    unit.set_mask(TriAnalyzer(unit).get_flat_tri_mask(min_circle_ratio=0.02))
    triangles = unit.get_masked_triangles()
    if len(triangles) == 0:
        return None
    return Triangulation(x, y, triangles)


def _exclusion_2d(
    data: _Points,
    level: float,
    labels: list[str],
    notes: list[str],
    show_points: bool,
    caption: str | None,
) -> Figure:
    x, y = data.coords[:, 0].astype(float), data.coords[:, 1].astype(float)
    fig = _style.new_figure(8.0, 6.5)
    ax = fig.add_subplot()
    log_level = math.log10(level)
    log_obs = np.log10(data.obs)
    log_exp = np.log10(data.exp).T  # [5, n]
    tri = _triangulation(x, y)
    handles: list[Any] = []
    if tri is None:
        notes.append("too few points (or all on a line) for contours")
    else:
        # inside the expected ±1σ band: CLs(-1σ) <= level <= CLs(+1σ)
        band = np.maximum(log_exp[1] - log_level, log_level - log_exp[3])
        if band.min() < 0:
            ax.tricontourf(
                tri, band, levels=[band.min() - 1.0, 0.0], colors=[_style.BAND_2SIGMA], zorder=1
            ).set_gid("expected-band")
            handles.append(Patch(color=_style.BAND_2SIGMA, label="Expected ±1σ"))
        contours = (  # the CLs, its name (and the contour's gid), colour, line style and width
            (log_exp[2], "Expected", "#1f3b99", "--", 2.5),
            (log_obs, "Observed", "#d00000", "-", 3),
        )
        for values, text, color, ls, lw in contours:
            if values.min() < log_level < values.max():
                line = {"colors": color, "linestyles": ls, "linewidths": lw}
                drawn = ax.tricontour(tri, values, levels=[log_level], zorder=3, **line)
                drawn.set_gid(f"{text.lower()}-contour")
            else:
                notes.append(f"{text} {CLS_LABEL} never crosses {level:g}: no contour")
            label = f"{text} limit ({CLS_LABEL} = {level:g})"
            handles.append(Line2D([], [], color=color, ls=ls, lw=lw, label=label))
    if show_points:
        low = max(float(data.obs.min()), 1e-6)
        points = ax.scatter(
            x,
            y,
            c=data.obs,
            cmap="viridis",
            norm=LogNorm(vmin=min(low, level / 10), vmax=1.0),
            s=36,
            edgecolors="black",
            linewidths=0.6,
            zorder=4,
            label="Tested points",
        )
        _style.colorbar(fig, points, ax, f"Observed {CLS_LABEL}", pad=0.02)
        handles.append(points)
    pad_x, pad_y = 0.04 * (np.ptp(x) or 1.0), 0.04 * (np.ptp(y) or 1.0)
    ax.set_xlim(x.min() - pad_x, x.max() + pad_x)
    ax.set_ylim(y.min() - pad_y, y.max() + pad_y)
    _style.note(fig, notes)
    _style.style_axes(ax)
    _style.set_xlabel(ax, labels[0])
    _style.set_ylabel(ax, labels[1])
    _style.place_legend(
        ax,
        handles=handles,
        candidates=("upper left", "lower right", "upper right", "lower left"),
        outside="top",
        data_top=float(y.max() + pad_y),
        **_caption(caption),
    )
    return fig
