"""``yields``: stacked pre- or post-fit sample yields per channel, their uncertainty, the data
and a data / model ratio panel; several channels as a grid."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from matplotlib.artist import Artist
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import AutoMinorLocator, MaxNLocator
from scipy.special import gammaincinv

from . import _style
from ._base import count_option, fail, need, numbers, register, strings

DEFAULT_MAX_CHANNELS = 12
_ONE_SIGMA = 0.6826894921370859
STAGES = ("postfit", "prefit")


@dataclass
class Channel:
    """One channel's yields."""

    name: str
    edges: np.ndarray  # [N + 1]
    bin_labels: list[str] | None
    samples: list[tuple[str, np.ndarray]]
    total: np.ndarray
    total_stdev: np.ndarray | None
    data: np.ndarray | None
    axis: str = "bin"  # the x axis' label


def poisson_interval(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Garwood's central 68.3% interval of Poisson counts: (lower, upper) error lengths."""
    counts = np.asarray(counts, float)
    alpha = 1.0 - _ONE_SIGMA
    low = np.where(counts > 0, gammaincinv(np.maximum(counts, 1e-300), alpha / 2), 0.0)
    high = gammaincinv(counts + 1.0, 1.0 - alpha / 2)
    return counts - low, high - counts


def _channels(kind: str, result: Any, stage: str | None) -> tuple[str | None, dict[str, Any]]:
    """The stage drawn and its ``{channel: yields}``."""
    if not isinstance(result, Mapping) or not result:
        raise fail(kind, "the result must be a yields object {prefit/postfit: {channel: ...}}")
    present = [s for s in STAGES if s in result]
    if stage is not None and stage not in STAGES:
        raise fail(kind, f"stage must be one of {', '.join(STAGES)}, not {stage!r}")
    if present:
        stage = stage or present[0]
        channels = need(kind, result, stage)
    else:
        if stage is not None:
            raise fail(kind, f"the result has no {stage!r} field")
        channels = result
    if isinstance(channels, Mapping) and "channels" in channels:
        channels = channels["channels"]
    if not isinstance(channels, Mapping) or not channels:
        raise fail(
            kind, f"the {stage or 'result'}'s channels must be an object {{channel: yields}}"
        )
    return stage, {k: v for k, v in channels.items() if k != "meta"}


def _channel(kind: str, name: str, entry: Any) -> Channel:
    where = f"channel {name!r}"
    samples_json = need(kind, entry, "samples", where)
    if isinstance(samples_json, Mapping):
        items = list(samples_json.items())
    elif isinstance(samples_json, Sequence):
        items = [(need(kind, s, "name", f"{where} sample"), s) for s in samples_json]
    else:
        raise fail(kind, f"{where}: samples must be an object {{sample: {{yields, stdev}}}}")
    samples = []
    for sample, body in items:
        values = body.get("yields") if isinstance(body, Mapping) else body
        if values is None:
            raise fail(kind, f"{where}: sample {sample!r} has no 'yields' field")
        samples.append((str(sample), np.asarray(numbers(kind, f"{where}.{sample}.yields", values))))
    if not samples:
        raise fail(kind, f"{where} has no samples")
    n = len(samples[0][1])
    if any(len(v) != n for _, v in samples):
        raise fail(kind, f"{where}: the samples' yields differ in length")
    total_json = entry.get("total")
    stdev = None
    if isinstance(total_json, Mapping):
        values = need(kind, total_json, "yields", f"{where}.total")
        total = np.asarray(numbers(kind, f"{where}.total.yields", values, n))
        if total_json.get("stdev") is not None:
            stdev = np.asarray(numbers(kind, f"{where}.total.stdev", total_json["stdev"], n))
    else:
        total = np.sum([v for _, v in samples], axis=0)
    data = None
    if entry.get("data") is not None:
        data = np.asarray(numbers(kind, f"{where}.data", entry["data"], n))
    bins = entry.get("bins")
    bin_labels = None
    edges = np.arange(n + 1, dtype=float)
    if isinstance(bins, Sequence) and not isinstance(bins, str):
        if len(bins) == n + 1 and all(isinstance(b, (int, float)) for b in bins):
            edges = np.asarray(bins, float)
            if np.any(np.diff(edges) <= 0):
                raise fail(kind, f"{where}: bins (edges) must increase")
        elif len(bins) == n:
            bin_labels = [str(b) for b in bins]
        else:
            raise fail(kind, f"{where}: bins must be {n + 1} edges or {n} labels, not {len(bins)}")
    return Channel(str(name), edges, bin_labels, samples, total, stdev, data)


@register("yields")
def yields(
    result: Any,
    *,
    stage: str | None = None,
    channels: Sequence[str] | None = None,
    max_channels: int | None = DEFAULT_MAX_CHANNELS,
    log_y: bool | None = None,
    columns: int | None = None,
) -> Figure:
    """Yields JSON ``{"prefit"|"postfit": {channel: {bins, samples: {name: {yields, stdev}},
    total: {yields, stdev}, data}}}`` (or the channels object itself).

    ``stage``: ``postfit`` (default when present) or ``prefit``; ``channels``: which, in that
    order (default all, at most ``max_channels``, default 12); ``log_y``: default when a
    channel's yields span more than two orders of magnitude; ``columns``: of the grid.
    Channels of one bin each are drawn side by side in one panel (a summary of the regions)
    unless ``columns`` asks for a grid.
    """
    kind = "yields"
    stage, all_channels = _channels(kind, result, stage)
    names = list(all_channels)
    if channels is not None:
        wanted = strings(kind, "channels", channels)
        unknown = [c for c in wanted if c not in all_channels]
        if unknown:
            raise fail(kind, f"channels not in the result: {', '.join(unknown[:10])}")
        names = wanted
    cap = count_option(kind, "max_channels", max_channels, None)
    notes = []
    if cap is not None and len(names) > cap:
        notes.append(f"{cap} of {len(names)} channels shown (options channels, max_channels)")
        names = names[:cap]
    parsed = [_channel(kind, name, all_channels[name]) for name in names]
    if len(parsed) > 1 and columns is None and all(_one_bin(c) for c in parsed):
        parsed = [_side_by_side(parsed)]
    sample_names = _sample_names(parsed)
    palette = _style.palette(len(sample_names))
    colors = dict(zip(sample_names, palette, strict=True))
    n = len(parsed)
    ncols = count_option(kind, "columns", columns, None) or (
        1 if n == 1 else min(4, math.ceil(math.sqrt(n)))
    )
    stage_text = {"postfit": "Post-fit", "prefit": "Pre-fit"}.get(stage or "")
    fig = _grid(parsed, ncols, colors, log_y, stage_text if n == 1 else None)
    if n > 1:
        handles: list[Artist] = [
            *(Patch(facecolor=colors[s], edgecolor="black", lw=0.5, label=s) for s in sample_names),
            Patch(facecolor="none", edgecolor="0.3", hatch="////", lw=0, label="Uncertainty"),
            Line2D([], [], color="black", marker="o", ls="none", label="Data"),
        ]
        fig.legend(
            handles=handles,
            loc="upper center",
            bbox_to_anchor=(0.5, 1.0),
            ncols=_legend_columns(len(handles), ncols),
            frameon=False,
            prop=_style.font(_style.LEGEND_SIZE),
        )
    if stage_text and n > 1:  # one panel has it under its name
        kw = _style.text_kw(_style.LABEL_SIZE - 2, fontstyle="italic", ha="right", va="top")
        fig.text(0.995, 0.995, stage_text, **kw)
    _style.note(fig, notes)
    return fig


def _sample_names(channels: list[Channel]) -> list[str]:
    """The channels' sample names, in the order they first appear."""
    names: list[str] = []
    for channel in channels:
        names += [s for s, _ in channel.samples if s not in names]
    return names


def _one_bin(channel: Channel) -> bool:
    return len(channel.total) == 1 and channel.bin_labels is None


def _side_by_side(channels: list[Channel]) -> Channel:
    """Channels of one bin each as the bins of one panel, named by their channels (a summary
    of the regions, as published), a sample missing from a channel counted 0 there."""
    samples = []
    for name in _sample_names(channels):
        values = [dict(c.samples).get(name) for c in channels]
        samples.append((name, np.array([0.0 if v is None else float(v[0]) for v in values])))
    stdevs = [c.total_stdev for c in channels if c.total_stdev is not None]
    data = [c.data for c in channels]
    return Channel(
        "",
        np.arange(len(channels) + 1, dtype=float),
        [c.name for c in channels],
        samples,
        np.concatenate([c.total for c in channels]),
        np.concatenate(stdevs) if len(stdevs) == len(channels) else None,
        None
        if all(d is None for d in data)
        else np.array([np.nan if d is None else d[0] for d in data]),
        axis="channel",
    )


_CELL = {True: (6.5, 6.0), False: (4.2, 4.3)}  # one channel / a grid: inches per channel
_MARGINS = (0.95, 0.3, 0.2, 0.6)  # left, right, top, bottom of a channel's axes, inches


def _legend_columns(entries: int, ncols: int) -> int:
    return max(1, min(entries, 2 * ncols + 1))


def _grid(
    parsed: list[Channel], ncols: int, colors: dict[str, str], log_y: bool | None, stage: str | None
) -> Figure:
    """Channels on a grid of fixed-size cells, each a main panel over a ratio panel that
    touch (placed by hand: a layout engine would pad between them)."""
    single = len(parsed) == 1
    cell_w, cell_h = _CELL[single]
    entries = len({s for c in parsed for s, _ in c.samples}) + 2  # the samples, uncertainty, data
    legend_rows = 0 if single else math.ceil(entries / _legend_columns(99, ncols))
    head = 0.15 + 0.3 * legend_rows
    left, right, top, bottom = _MARGINS
    scale = 1.0 if single else 0.8
    labels = [label for c in parsed for label in c.bin_labels or ()]
    if labels:  # room for the bin labels, turned 45 degrees when many
        longest = max(len(label) for label in labels) * _style.TICK_SIZE * scale / 72 * 0.6
        turned = any(len(c.bin_labels or ()) > 3 for c in parsed)
        bottom += max(0.0, (longest * 0.75 if turned else 0.0) - 0.1)
    cell_h += bottom - _MARGINS[3]
    width, height = cell_w * ncols, cell_h * math.ceil(len(parsed) / ncols) + head + 0.2
    fig = _style.new_figure(width, height, layout=None)
    panels = []
    for k, channel in enumerate(parsed):
        row, col = divmod(k, ncols)
        x0 = col * cell_w + left
        y_top = height - head - row * cell_h - top
        y_bottom = height - head - (row + 1) * cell_h + bottom
        span = y_top - y_bottom
        w = cell_w - left - right
        ratio = fig.add_axes((x0 / width, y_bottom / height, w / width, 0.25 * span / height))
        ax = fig.add_axes(
            (x0 / width, (y_bottom + 0.25 * span) / height, w / width, 0.75 * span / height),
            sharex=ratio,
        )
        drawn = _draw_channel(ax, ratio, channel, colors, log_y, scale, single)
        if stage:
            _, boxes = drawn
            below = boxes[0] if channel.name else None
            size = _style.LABEL_SIZE * scale - 2
            kw = _style.text_kw(size, fontstyle="italic", ha="left", va="top")
            xy = (0.0, -0.3) if below else (0.04, 0.95)
            boxes.append(ax.annotate(stage, xy=xy, xycoords=below or ax.transAxes, **kw))
        panels.append((ax, drawn))
    renderer = _style.renderer_of(fig)
    for ax, (data_top, boxes) in panels:  # the name and legend above the bars and points
        _style.room_above(ax, boxes, renderer, data_top)
    return fig


def ratio_range(
    value: np.ndarray, low: np.ndarray, high: np.ndarray, band: np.ndarray | None
) -> tuple[float, float]:
    """The ratio panel's y range: the data / model points with their error bars and the
    model's uncertainty band, 1 always inside, a margin of 8% each side; error bars count up
    to 2 (a longer one is cut at the edge), the points themselves up to 3.

    >>> ratio_range(np.array([1.02, 0.97]), np.array([0.05, 0.05]), np.array([0.05, 0.06]), None)
    (0.884, 1.116)
    """
    parts_low = [np.asarray(value - low, float), np.array([0.9])]
    parts_high = [np.asarray(value + high, float), np.array([1.1])]
    if band is not None:
        parts_low.append(1 - np.asarray(band, float))
        parts_high.append(1 + np.asarray(band, float))
    lows, highs = np.concatenate(parts_low), np.concatenate(parts_high)
    points = np.asarray(value, float)
    points = points[np.isfinite(points)]
    lo = max(float(np.min(lows[np.isfinite(lows)])), 0.0)
    hi = min(float(np.max(highs[np.isfinite(highs)])), 2.0)
    if len(points):
        lo, hi = min(lo, float(points.min())), max(hi, min(float(points.max()), 3.0))
    margin = 0.08 * (hi - lo)
    return round(max(lo - margin, 0.0), 4), round(hi + margin, 4)


def ratio_ticks(lo: float, hi: float) -> list[float]:
    """The ratio panel's y ticks: round steps, none in the top 12% of the panel (where the
    main panel's lowest label is) nor at its bottom edge (the x labels' corner).

    >>> ratio_ticks(0.0, 2.16), ratio_ticks(0.88, 1.12)
    ([0.5, 1.0, 1.5], [0.9, 0.95, 1.0, 1.05])
    """
    span = hi - lo
    ticks = MaxNLocator(nbins=5, steps=[1, 2, 2.5, 5, 10]).tick_values(lo, hi)
    return [round(float(t), 6) for t in ticks if lo + 0.04 * span <= t <= hi - 0.12 * span]


def _draw_channel(
    ax,
    ratio,
    channel: Channel,
    colors: dict[str, str],
    log_y: bool | None,
    scale: float,
    legend: bool,
) -> tuple[float, list[Any]]:
    """One channel's panels; returns the top of its data and the boxes to keep them under
    (its name, its legend)."""
    edges = channel.edges
    centers = 0.5 * (edges[1:] + edges[:-1])
    widths = np.diff(edges)
    bottom = np.zeros(len(centers))
    stack = {"width": widths, "edgecolor": "black", "lw": 0.4}
    for sample, values in channel.samples:
        ax.bar(centers, values, bottom=bottom, color=colors[sample], label=sample, **stack)
        bottom = bottom + values
    total, stdev, data = channel.total, channel.total_stdev, channel.data
    # the model's uncertainty band and the data points, in both panels
    band: dict[str, Any] = {"width": widths, "fill": False, "hatch": "////", "edgecolor": "0.3"}
    points: dict[str, Any] = {"fmt": "o", "color": "black", "ms": 5 * scale, "lw": 1.2}
    if stdev is not None:
        ax.bar(centers, 2 * stdev, bottom=total - stdev, lw=0, label="Uncertainty", **band)
    top_parts = [total + (stdev if stdev is not None else 0.0)]
    positive_parts = [total[total > 0]]
    if data is not None:
        low, high = poisson_interval(data)
        ax.errorbar(centers, data, yerr=[low, high], label="Data", **points)
        top_parts.append(data + high)
        positive_parts.append(data[data > 0])
    tops = np.concatenate(top_parts)
    tops = tops[np.isfinite(tops)]
    positive = np.concatenate(positive_parts)
    data_top = max(float(tops.max()) if len(tops) else 1.0, 1e-9)
    if log_y is None:
        log_y = len(positive) > 0 and positive.max() / positive.min() > 100
    if log_y and len(positive):
        ax.set_yscale("log")
        ax.set_ylim(positive.min() / 5, data_top * 30)
    else:
        ax.set_ylim(0, data_top * 1.35)
    # data / model
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = None
        if stdev is not None:
            rel = np.where(total > 0, stdev / total, np.nan)
            ratio.bar(centers, 2 * rel, bottom=1 - rel, lw=0, **band)
        ratio.axhline(1.0, color="black", lw=1, ls="--")
        value = err_low = err_high = np.array([np.nan])
        if data is not None:
            model = np.where(total > 0, total, np.nan)
            value, err_low, err_high = data / model, low / model, high / model
            ratio.errorbar(centers, value, yerr=[err_low, err_high], **points)
    ratio.set_ylim(*ratio_range(value, err_low, err_high, rel))
    ratio.set_xlim(edges[0], edges[-1])
    size = _style.LABEL_SIZE * scale
    tick = _style.TICK_SIZE * scale
    minor_x = channel.bin_labels is None and len(centers) > 1
    for axes in (ax, ratio):
        _style.style_axes(axes, tick_size=tick, minor_x=minor_x)
    ratio.set_yticks(ratio_ticks(*ratio.get_ylim()))
    ratio.yaxis.set_minor_locator(AutoMinorLocator())
    ax.tick_params(labelbottom=False)
    _style.set_ylabel(ax, "Events", size)
    _style.set_ylabel(ratio, "Data / Model", size * 0.8)
    if channel.bin_labels is not None or len(centers) == 1:  # one tick a bin, no minor ones
        turned = len(centers) > 3
        ratio.set_xticks(
            centers,
            channel.bin_labels or ["1"],
            rotation=45 if turned else 0,
            ha="right" if turned else "center",
            rotation_mode="anchor" if turned else "default",
        )
        for axes in (ax, ratio):
            axes.tick_params(axis="x", which="minor", bottom=False, top=False)
    elif len(centers) <= 12:
        ratio.set_xticks(edges)
    else:
        ratio.xaxis.set_major_locator(MaxNLocator(nbins=6, integer=True))
    _style.set_xlabel(ratio, channel.axis, size)
    boxes: list[Any] = []
    if channel.name:
        kw = _style.text_kw(size, fontweight="bold", ha="left", va="top")
        boxes.append(ax.text(0.04, 0.95, channel.name, transform=ax.transAxes, **kw))
    if legend:
        handles, labels = ax.get_legend_handles_labels()
        ncols = 1 if len(labels) <= 6 else 2  # two beyond six entries: it stays short
        boxes.append(_style.legend(ax, handles[::-1], labels[::-1], loc="upper right", ncols=ncols))
    return data_top, boxes
