"""Fit plots: ``pulls`` and ``correlation`` (from a ``POST /fit`` answer) and ``ranking``
(impacts on the POI, from cabinetry-like ranking JSON)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure

from . import _style
from ._base import count_option, fail, matrix, need, number, numbers, one_patch, register, strings

_INDEXED = re.compile(r"^(.*)\[(\d+)\]$")


# ------------------------------------------------------------------------------ fit JSON
@dataclass
class FitParameters:
    """A fit answer's parameters, flattened in pyhf's order (``name`` or ``name[i]``)."""

    labels: list[str]
    sets: list[tuple[str, int, int]]  # per label: (parameter set, index in it, set size)
    bestfit: np.ndarray
    uncertainty: np.ndarray
    corr: np.ndarray | None


def fit_parameters(kind: str, result: Any, *, with_corr: bool = False) -> FitParameters:
    """The parameters of a ``POST /fit`` answer (``mle_parameters``, ``uncertainties``,
    ``corr_mat``), or of cabinetry-like JSON (``labels``, ``bestfit``, ``uncertainty``,
    ``corr_mat``)."""
    if not isinstance(result, Mapping):
        raise fail(
            kind, f"the result must be a fit answer (a JSON object), not {type(result).__name__}"
        )
    if "mle_parameters" in result:
        mle = result["mle_parameters"]
        if not isinstance(mle, Mapping):
            raise fail(kind, "mle_parameters must be an object {parameter: [values]}")
        unc = result.get("uncertainties")
        if unc is not None and not isinstance(unc, Mapping):
            raise fail(kind, "uncertainties must be an object {parameter: [values]}")
        labels, sets, best, err = [], [], [], []
        for name, values in mle.items():
            vals = numbers(kind, f"mle_parameters[{name!r}]", values)
            errs = (
                [math.nan] * len(vals)
                if unc is None or name not in unc
                else numbers(kind, f"uncertainties[{name!r}]", unc[name], len(vals))
            )
            for i, (v, e) in enumerate(zip(vals, errs, strict=True)):
                labels.append(name if len(vals) == 1 else f"{name}[{i}]")
                sets.append((name, i, len(vals)))
                best.append(v)
                err.append(e)
    elif "bestfit" in result:
        labels = strings(kind, "labels", need(kind, result, "labels"))
        best = numbers(kind, "bestfit", result["bestfit"], len(labels))
        err = numbers(kind, "uncertainty", need(kind, result, "uncertainty"), len(labels))
        sets = []
        for label in labels:
            match = _INDEXED.match(label)
            sets.append((match.group(1), int(match.group(2)), 2) if match else (label, 0, 1))
    else:
        raise fail(kind, "the result has no 'mle_parameters' field (nor 'labels' and 'bestfit')")
    corr = None
    if with_corr:
        n = len(labels)
        corr = np.asarray(matrix(kind, "corr_mat", need(kind, result, "corr_mat"), n, n))
    return FitParameters(labels, sets, np.asarray(best, float), np.asarray(err, float), corr)


def _selection(kind: str, fit: FitParameters, parameters: Any) -> np.ndarray:
    """Mask of the labels named by ``parameters`` (labels or whole parameter sets)."""
    labels, sets = fit.labels, fit.sets
    if parameters is None:
        return np.ones(len(labels), bool)
    wanted = set(strings(kind, "parameters", parameters))
    mask = np.array([lab in wanted or s[0] in wanted for lab, s in zip(labels, sets, strict=True)])
    unknown = wanted - set(labels) - {s[0] for s in sets}
    if unknown:
        raise fail(kind, f"parameters not in the result: {', '.join(sorted(unknown)[:10])}")
    return mask


# -------------------------------------------------------------------------- constraints
@dataclass
class Constraints:
    """Per parameter set: its constraint per index, ``(centre, pre-fit width)`` or None when
    unconstrained; the POI; parameters the measurement fixes."""

    sets: dict[str, list[tuple[float, float] | None]]
    poi: str | None
    fixed: set[str]


def workspace_constraints(kind: str, workspace: Any, measurement: str | None = None) -> Constraints:
    """The constraints of a workspace's parameters, read from its JSON as pyhf builds them:
    normsys/histosys N(0, 1); lumi N(auxdata, sigmas) of the measurement; staterror
    N(1, sqrt(sum unc²)/sum nominal) per bin; shapesys Poisson around 1 of relative width
    unc/nominal; normfactor and shapefactor unconstrained."""
    where = "the workspace option"
    channels = need(kind, workspace, "channels", where)
    measurements = need(kind, workspace, "measurements", where)
    chosen = next(
        (m for m in measurements if measurement is None or m.get("name") == measurement), None
    )
    if chosen is None:
        raise fail(kind, f"the workspace has no measurement {measurement!r}")
    config = chosen.get("config", {})
    params = {p.get("name"): p for p in config.get("parameters", [])}
    types: dict[str, str] = {}
    stat: dict[str, dict[str, list[np.ndarray]]] = {}
    shapesys: dict[str, list[tuple[float, float] | None]] = {}
    for channel in channels:
        for sample in channel.get("samples", []):
            nominal = np.asarray(sample.get("data", []), float)
            for modifier in sample.get("modifiers", []):
                name, mtype = modifier.get("name"), modifier.get("type")
                types.setdefault(name, mtype)
                if mtype == "staterror":
                    parts = stat.setdefault(name, {}).setdefault(
                        channel.get("name"), [np.zeros_like(nominal), np.zeros_like(nominal)]
                    )
                    parts[0] += np.asarray(modifier.get("data", []), float) ** 2
                    parts[1] += nominal
                elif mtype == "shapesys":
                    unc = np.asarray(modifier.get("data", []), float)
                    shapesys[name] = [
                        (1.0, float(u / n)) if n > 0 and u > 0 else None
                        for u, n in zip(unc, nominal, strict=False)
                    ]
    sets: dict[str, list[tuple[float, float] | None]] = {}
    for name, mtype in types.items():
        if mtype in ("normsys", "histosys"):
            sets[name] = [(0.0, 1.0)]
        elif mtype == "lumi":
            p = params.get(name, {})
            sigmas, aux = p.get("sigmas"), p.get("auxdata") or [1.0]
            sets[name] = [(float(aux[0]), float(sigmas[0]))] if sigmas else [None]
        elif mtype == "staterror":
            widths = []
            for unc2, nominal in stat[name].values():
                widths += [
                    (1.0, float(math.sqrt(u) / n)) if n > 0 else None
                    for u, n in zip(unc2, nominal, strict=True)
                ]
            sets[name] = widths
        elif mtype == "shapesys":
            sets[name] = shapesys[name]
        else:  # normfactor, shapefactor: free
            sets[name] = []
    fixed = {name for name, p in params.items() if p.get("fixed")}
    return Constraints(sets, config.get("poi"), fixed)


_FREE_NAME = re.compile(r"^(mu|norm|k|sf|SF|POI|poi)([_A-Z0-9]|$)|SigXsecOverSM|^r$")
_GAMMA_NAME = re.compile(r"(staterror|shapesys|^gamma|^stat_|^lumi)", re.IGNORECASE)


def guessed_constraint(name: str, size: int) -> tuple[float, float] | str | None:
    """Without a workspace, from the name: normfactor-like (``mu_*``, ``norm*``, ...) is free
    (None); vector sets, staterror/shapesys/gamma and lumi have a width only the workspace
    knows (``"unknown"``); anything else is taken as normsys/histosys, N(0, 1)."""
    if _FREE_NAME.search(name):
        return None
    if size > 1 or _GAMMA_NAME.search(name):
        return "unknown"
    return (0.0, 1.0)


# -------------------------------------------------------------------------------- pulls
DEFAULT_PULLS_TOP = 120
PULL_LABEL = r"$(\hat{\theta} - \theta_0)\,/\,\Delta\theta$"
MAX_HEIGHT = 24.0


def _rows_figure(
    labels: list[str], base_width: float, per_row: float = 0.3, extra: float = 1.5
) -> tuple[Figure, float]:
    """A figure for labelled rows: its height grows with their number up to MAX_HEIGHT (rows
    then get thinner) and its width with the longest label; returns it and the label size."""
    n = len(labels)
    row = _style.clamp((MAX_HEIGHT - extra) / max(n, 1), 0.11, per_row)
    height = _style.clamp(extra + n * row, 3.5, MAX_HEIGHT)
    size = _style.clamp(row * 72 * 0.62, 5.0, _style.TICK_SIZE)
    longest = max((len(label) for label in labels), default=10)
    width = _style.clamp(base_width + longest * size / 72 * 0.55, 6.0, 14.0)
    return _style.new_figure(width, height), size


@register("pulls")
def pulls(
    result: Any,
    *,
    parameters: Sequence[str] | None = None,
    top: int | None = None,
    workspace: Mapping[str, Any] | None = None,
    measurement: str | None = None,
    poi: str | None = None,
    prefit: Mapping[str, Sequence[float]] | None = None,
    patch: str | None = None,
) -> Figure:
    """Pulls of the constrained nuisance parameters of a ``POST /fit`` answer.

    Which parameters are constrained, and their pre-fit centre and width, come from
    ``workspace`` (the fitted workspace, with ``measurement``) when given, else are guessed
    from the names (``mu_*``/``norm*`` free; gammas and lumi skipped; others N(0, 1)), and
    ``prefit`` ``{label: [centre, width]}`` overrides both. The POI (``poi``, or the
    workspace's), free and fixed parameters (zero uncertainty) are skipped. ``parameters``:
    only these labels (or parameter sets). ``top``: at most this many rows (default 120), the
    largest pulls and strongest constraints, in fit order. ``patch``: the patch of a
    patchset answer ``{patch_name: fit}``.
    """
    kind = "pulls"
    fit = fit_parameters(kind, one_patch(kind, result, patch, "mle_parameters"))
    top = count_option(kind, "top", top, DEFAULT_PULLS_TOP)
    constraints = None
    if workspace is not None:
        constraints = workspace_constraints(kind, workspace, measurement)
        poi = constraints.poi if poi is None else poi
    overrides = {}
    if prefit is not None:
        if not isinstance(prefit, Mapping):
            raise fail(kind, "prefit must be an object {label: [centre, width]}")
        overrides = {str(k): numbers(kind, f"prefit[{k!r}]", v, 2) for k, v in prefit.items()}
    selected = _selection(kind, fit, parameters)
    rows: list[tuple[str, float, float]] = []
    unknown = 0
    for i, label in enumerate(fit.labels):
        name, index, set_size = fit.sets[i]
        if not selected[i] or name == poi or label == poi:
            continue
        if fit.uncertainty[i] == 0.0 or (constraints is not None and name in constraints.fixed):
            continue  # fixed
        if label in overrides:
            constraint: Any = tuple(overrides[label])
        elif constraints is None:
            constraint = guessed_constraint(name, set_size)
        elif name not in constraints.sets:
            constraint = "unknown"
        elif not constraints.sets[name]:  # normfactor, shapefactor
            constraint = None
        else:
            widths = constraints.sets[name]
            constraint = widths[index] if index < len(widths) else "unknown"
        if constraint is None:  # free
            continue
        if constraint == "unknown" or not constraint[1] > 0:
            unknown += 1
            continue
        centre, width = constraint
        rows.append((label, (fit.bestfit[i] - centre) / width, fit.uncertainty[i] / width))
    if not rows:
        raise fail(kind, "no constrained parameter to draw (all free, fixed, or of unknown width)")
    notes = []
    total = len(rows)
    if top is not None and total > top:
        score = [max(abs(p), 1 - e if math.isfinite(e) else 0) for _, p, e in rows]
        keep = set(np.argsort(score, kind="stable")[::-1][:top].tolist())
        rows = [r for i, r in enumerate(rows) if i in keep]
        notes.append(f"{top} of {total} constrained parameters: largest pulls and constraints")
    if constraints is None and prefit is None:
        notes.append("constraints guessed from the names (give the workspace for exact ones)")
    if unknown:
        notes.append(f"{unknown} parameters of unknown pre-fit width skipped (gammas, lumi)")
    labels = [r[0] for r in rows]
    fig, size = _rows_figure(labels, 4.5, extra=1.6 + 0.18 * len(notes))
    ax = fig.add_subplot()
    n = len(rows)
    y = np.arange(n)[::-1]
    value = np.array([r[1] for r in rows])
    error = np.array([r[2] for r in rows])
    xerr = np.where(np.isfinite(error), error, 0)
    ax.axvspan(-2, 2, color=_style.BAND_2SIGMA, lw=0, zorder=0)
    ax.axvspan(-1, 1, color=_style.BAND_1SIGMA, lw=0, zorder=0)
    ax.axvline(0, color="black", ls="--", lw=1, zorder=1)
    ms = max(2.5, min(5.0, size * 0.45))
    ax.errorbar(value, y, xerr=xerr, fmt="o", color="black", ms=ms, lw=1.2, capsize=0, zorder=2)
    reach = np.nanmax(np.abs(value) + xerr)
    limit = max(3.0, math.ceil(float(reach) + 0.25)) if np.isfinite(reach) else 3.0
    ax.set_xlim(-limit, limit)
    ax.set_ylim(-0.75, n - 0.25)
    ax.set_yticks(y, labels)
    _style.style_axes(ax, minor_y=False)
    ax.tick_params(axis="y", which="both", labelsize=size, left=False, right=False)
    _style.set_xlabel(ax, PULL_LABEL)
    _style.note(fig, notes)
    return fig


# ------------------------------------------------------------------------------ ranking
_RANKING_FIELDS = ("prefit_up", "prefit_down", "postfit_up", "postfit_down")


@register("ranking")
def ranking(result: Any, *, top: int | None = 20, poi_label: str = "μ") -> Figure:
    """Impacts of cabinetry-like ranking JSON ``{labels, bestfit, uncertainty, prefit_up,
    prefit_down, postfit_up, postfit_down}`` (optional ``init`` and ``prefit_uncertainty``
    turn the pulls into (θ̂ − θ₀)/Δθ), ranked by the larger post-fit impact; ``top``: how
    many (default 20)."""
    kind = "ranking"
    labels = strings(kind, "labels", need(kind, result, "labels"))
    n_all = len(labels)
    if n_all == 0:
        raise fail(kind, "labels is empty")
    bestfit = np.asarray(numbers(kind, "bestfit", need(kind, result, "bestfit"), n_all))
    unc = np.asarray(numbers(kind, "uncertainty", need(kind, result, "uncertainty"), n_all))
    impacts = {
        f: np.asarray(numbers(kind, f, need(kind, result, f), n_all)) for f in _RANKING_FIELDS
    }
    normalised = "init" in result and "prefit_uncertainty" in result
    if normalised:
        init = np.asarray(numbers(kind, "init", result["init"], n_all))
        width = np.asarray(numbers(kind, "prefit_uncertainty", result["prefit_uncertainty"], n_all))
        width = np.where(width > 0, width, np.nan)
        bestfit, unc = (bestfit - init) / width, unc / width
    top = count_option(kind, "top", top, None) or n_all
    post = np.maximum(np.abs(impacts["postfit_up"]), np.abs(impacts["postfit_down"]))
    score = np.nan_to_num(post)
    order = np.argsort(-score, kind="stable")[:top]
    n = len(order)
    shown = [labels[i] for i in order]
    fig, size = _rows_figure(shown, 5.0, per_row=0.38, extra=2.2)
    ax_pulls = fig.add_subplot()
    ax_impact = ax_pulls.twiny()
    ax_pulls.set_zorder(1)  # the pulls above the bars
    ax_pulls.patch.set_visible(False)
    y = np.arange(n)[::-1]
    up, down = _style.COLORS[0], _style.COLORS[6]
    hatches = {"prefit_up": "////", "prefit_down": "\\\\\\\\"}
    for field in _RANKING_FIELDS:  # pre-fit: hatched outlines; post-fit: filled bars
        color, sign = (up, "+") if field.endswith("_up") else (down, "-")
        if field in hatches:
            style: dict[str, Any] = dict(fill=False, edgecolor=color, hatch=hatches[field], lw=1)
            delta = r"\Delta\theta$ (pre-fit)"
        else:
            style, delta = {"color": color}, r"\Delta\hat{\theta}$ (post-fit)"
        label = rf"$\theta = \hat{{\theta}} {sign} {delta}"
        ax_impact.barh(y, impacts[field][order], height=0.75, label=label, **style)
    xerr = np.nan_to_num(unc[order])
    ax_pulls.errorbar(
        bestfit[order], y, xerr=xerr, fmt="o", color="black", ms=5, lw=1.4, label="Pull"
    )
    ax_pulls.axvline(0, color="black", ls=":", lw=1)
    for v in (-1, 1):
        ax_pulls.axvline(v, color="black", ls="-.", lw=0.75)
    span = np.nanmax(np.abs(np.stack([impacts[f][order] for f in _RANKING_FIELDS])))
    span_zero = not (np.isfinite(span) and span > 0)
    span = 1.0 if span_zero else float(span) * 1.1
    ax_impact.set_xlim(-span, span)
    ax_pulls.set_xlim(-2, 2)
    ax_pulls.set_ylim(-0.5, n - 0.5)
    ax_pulls.set_yticks(y, shown)
    _style.style_axes(ax_pulls, minor_y=False, top=False)
    _style.style_axes(ax_impact, minor_y=False, top=True, right=False)
    ax_pulls.tick_params(axis="x", which="both", top=False)
    ax_impact.tick_params(axis="x", which="both", bottom=False, top=True, labeltop=True)
    ax_pulls.tick_params(axis="y", which="both", labelsize=size, left=False, right=False)
    ax_impact.xaxis.set_label_position("top")
    ax_impact.set_xlabel(f"Δ{poi_label}", loc="right", **_style.text_kw())
    _style.set_xlabel(
        ax_pulls, PULL_LABEL if normalised else r"$\hat{\theta} \pm \Delta\hat{\theta}$"
    )
    bars = ax_impact.get_legend_handles_labels()[0]  # pre up, pre down, post up, post down
    handles = [bars[0], bars[1], *ax_pulls.get_legend_handles_labels()[0], bars[2], bars[3]]
    leg = _style.legend(
        ax_pulls,
        handles=handles,
        loc="upper center",
        ncols=2,
        size=_style.clamp(size, 7, _style.LEGEND_SIZE - 1),
        handlelength=1.5,
        columnspacing=1.0,
        borderaxespad=0.2,
        box=1.0,
    )
    # room for the legend above the first bar, however thin the rows
    notes = []
    if n < n_all:
        notes.append(f"{n} of {n_all} parameters, by post-fit impact")
    if span_zero:
        notes.append(f"every impact on {poi_label} is 0 (its best fit at a bound?)")
    _style.note(fig, notes)
    with _style.as_finished(ax_pulls):
        fig.draw_without_rendering()
        _style.room_above(ax_pulls, [leg], _style.renderer_of(fig), n - 0.5, gap=0.01)
    return fig


# -------------------------------------------------------------------------- correlation
DEFAULT_CORRELATION_TOP = 80
MAX_CORRELATION_TOP = 200  # n^2 cells
MAX_ANNOTATED = 60  # n^2 texts


@register("correlation")
def correlation(
    result: Any,
    *,
    threshold: float | None = None,
    parameters: Sequence[str] | None = None,
    top: int | None = None,
    annotate: bool | None = None,
    patch: str | None = None,
) -> Figure:
    """The ``corr_mat`` of a ``POST /fit`` answer (labels from ``mle_parameters``).

    Fixed parameters (zero rows) are dropped, and then those whose largest off-diagonal
    |correlation| is below ``threshold`` (default 0 under 50 parameters, else 0.2); ``top``
    caps what remains (default 80, the most correlated); values are written in the cells
    when few (``annotate``, default: up to 20 parameters). ``patch``: the patch of a
    patchset answer ``{patch_name: fit}``.
    """
    kind = "correlation"
    fit = fit_parameters(kind, one_patch(kind, result, patch, "mle_parameters"), with_corr=True)
    corr = fit.corr
    assert corr is not None
    diag = np.diag(corr)
    keep = np.isfinite(diag) & (np.abs(diag) > 0) & _selection(kind, fit, parameters)
    index = np.flatnonzero(keep)
    if len(index) == 0:
        raise fail(kind, "corr_mat has no parameter with a non-zero diagonal")
    sub = corr[np.ix_(index, index)]
    off = np.abs(np.where(np.eye(len(index), dtype=bool), np.nan, sub))
    strongest = np.nan_to_num(np.nanmax(off, axis=1) if len(index) > 1 else np.zeros(1))
    cut = 0.0 if len(index) < 50 else 0.2
    if threshold is not None:
        cut = number(kind, "threshold", threshold)
    chosen = strongest >= cut
    notes = []
    if not chosen.any():
        raise fail(
            kind, f"no parameter is correlated by |ρ| >= {cut:g} with another (lower threshold)"
        )
    if cut > 0:
        notes.append(f"{int(chosen.sum())} of {len(index)} parameters with max |ρ| ≥ {cut:g}")
    top = count_option(kind, "top", top, DEFAULT_CORRELATION_TOP, MAX_CORRELATION_TOP)
    if top is not None and chosen.sum() > top:
        ranked = np.argsort(-np.where(chosen, strongest, -1), kind="stable")[:top]
        chosen = np.zeros_like(chosen)
        chosen[ranked] = True
        notes.append(f"the {top} most correlated shown")
    pick = np.flatnonzero(chosen)
    labels = [fit.labels[index[i]] for i in pick]
    values = sub[np.ix_(pick, pick)]
    n = len(labels)
    cell = _style.clamp(14.0 / max(n, 1), 0.16, 0.6)
    size = _style.clamp(cell * 72 * 0.55, 5.0, _style.TICK_SIZE)
    longest = max(len(label) for label in labels) * size / 72 * 0.6
    side = _style.clamp(n * cell + longest + 1.0, 5.0, 22.0)
    fig = _style.new_figure(side + 1.2, side + 0.3 * bool(notes))
    ax = fig.add_subplot()
    cmap = colormaps["RdBu_r"].with_extremes(bad="0.8")
    shown = np.ma.masked_invalid(values)
    image = ax.imshow(shown, cmap=cmap, vmin=-1, vmax=1, interpolation="nearest", aspect="equal")
    ax.set_xticks(range(n), labels, rotation=90)
    ax.set_yticks(range(n), labels)
    _style.style_axes(ax, minor_x=False, minor_y=False, tick_size=size)
    ax.tick_params(which="both", top=False, right=False, bottom=False, left=False)
    if annotate is None:
        annotate = n <= 20
    if annotate and n > MAX_ANNOTATED:
        raise fail(
            kind,
            f"annotate writes each of the {n} x {n} cells: at most {MAX_ANNOTATED} rows "
            "(lower top, or raise threshold)",
        )
    if annotate:
        text = _style.text_kw(_style.clamp(size * 0.85, 5, 10), ha="center", va="center")
        for (i, j), v in np.ndenumerate(values):
            if np.isfinite(v):
                color = "white" if abs(v) > 0.6 else "black"
                ax.text(j, i, f"{v:.2f}".replace("-0.00", "0.00"), color=color, **text)
    _style.colorbar(fig, image, ax, "correlation", fraction=0.046, pad=0.02, shrink=0.8)
    _style.note(fig, notes)
    return fig
