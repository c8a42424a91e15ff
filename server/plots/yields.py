"""``yields``: stacked pre- or post-fit sample yields per channel, their uncertainty, the data
and a data / model ratio panel; several channels as a grid."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
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
        total = np.asarray(
            numbers(
                kind, f"{where}.total.yields", need(kind, total_json, "yields", f"{where}.total"), n
            )
        )
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


@register(
    "yields",
    "stacked sample yields per channel with their uncertainty, the data and a data / model "
    "ratio (pre- or post-fit), several channels as a grid",
)
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
    sample_names: list[str] = []
    for channel in parsed:
        sample_names += [s for s, _ in channel.samples if s not in sample_names]
    palette = _style.palette(len(sample_names))
    colors = dict(zip(sample_names, palette, strict=True))
    n = len(parsed)
    ncols = count_option(kind, "columns", columns, None) or (
        1 if n == 1 else min(4, math.ceil(math.sqrt(n)))
    )
    nrows = math.ceil(n / ncols)
    fig = _grid(parsed, nrows, ncols, colors, log_y)
    if n > 1:
        handles = [
            Patch(facecolor=colors[s], edgecolor="black", lw=0.5, label=s) for s in sample_names
        ]
        handles.append(
            Patch(facecolor="none", edgecolor="0.3", hatch="////", lw=0, label="Uncertainty")
        )
        handles.append(Line2D([], [], color="black", marker="o", ls="none", label="Data"))
        fig.legend(
            handles=handles,
            loc="upper center",
            bbox_to_anchor=(0.5, 1.0),
            ncols=_legend_columns(len(handles), ncols),
            frameon=False,
            prop=_style.font(_style.LEGEND_SIZE),
        )
    if stage:
        fig.text(
            0.995,
            0.995,
            "Post-fit" if stage == "postfit" else "Pre-fit",
            ha="right",
            va="top",
            **_style.text_kw(_style.LABEL_SIZE - 2, fontstyle="italic"),
        )
    _style.note(fig, notes)
    return fig


_CELL = {True: (6.5, 6.0), False: (4.2, 4.3)}  # one channel / a grid: inches per channel
_MARGINS = (0.95, 0.3, 0.2, 0.6)  # left, right, top, bottom of a channel's axes, inches


def _legend_columns(entries: int, ncols: int) -> int:
    return max(1, min(entries, 2 * ncols + 1))


def _grid(
    parsed: list[Channel], nrows: int, ncols: int, colors: dict[str, str], log_y: bool | None
) -> Figure:
    """Channels on a grid of fixed-size cells, each a main panel over a ratio panel that
    touch (placed by hand: a layout engine would pad between them)."""
    single = len(parsed) == 1
    cell_w, cell_h = _CELL[single]
    legend_rows = (
        0
        if single
        else math.ceil(
            (len({s for c in parsed for s, _ in c.samples}) + 2) / _legend_columns(99, ncols)
        )
    )
    head = 0.15 + 0.3 * legend_rows
    width, height = cell_w * ncols, cell_h * nrows + head + 0.2
    fig = _style.new_figure(width, height, layout=None)
    left, right, top, bottom = _MARGINS
    if all(c.bin_labels is None and len(c.total) == 1 for c in parsed):
        bottom = 0.3  # no x tick labels nor x label
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
        _draw_channel(ax, ratio, channel, colors, log_y, 1.0 if single else 0.8, single)
    return fig


def _draw_channel(
    ax,
    ratio,
    channel: Channel,
    colors: dict[str, str],
    log_y: bool | None,
    scale: float,
    legend: bool,
) -> None:
    edges = channel.edges
    centers = 0.5 * (edges[1:] + edges[:-1])
    widths = np.diff(edges)
    bottom = np.zeros(len(centers))
    for sample, values in channel.samples:
        ax.bar(
            centers,
            values,
            width=widths,
            bottom=bottom,
            color=colors[sample],
            edgecolor="black",
            lw=0.4,
            label=sample,
        )
        bottom = bottom + values
    total = channel.total
    if channel.total_stdev is not None:
        ax.bar(
            centers,
            2 * channel.total_stdev,
            width=widths,
            bottom=total - channel.total_stdev,
            fill=False,
            hatch="////",
            edgecolor="0.3",
            lw=0,
            label="Uncertainty",
        )
    if channel.data is not None:
        low, high = poisson_interval(channel.data)
        ax.errorbar(
            centers,
            channel.data,
            yerr=[low, high],
            fmt="o",
            color="black",
            ms=5 * scale,
            lw=1.2,
            label="Data",
        )
    band = channel.total_stdev if channel.total_stdev is not None else 0.0
    tops = [total + band]
    positive = [total[total > 0]]
    if channel.data is not None:
        tops.append(channel.data + poisson_interval(channel.data)[1])
        positive.append(channel.data[channel.data > 0])
    tops = np.concatenate(tops)
    positive = np.concatenate(positive)
    if log_y is None:
        log_y = len(positive) > 0 and positive.max() / positive.min() > 100
    if log_y and len(positive):
        ax.set_yscale("log")
        ax.set_ylim(positive.min() / 5, tops.max() * 30)
    else:
        ax.set_ylim(0, max(tops.max(), 1e-9) * 1.35)
    # data / model
    with np.errstate(divide="ignore", invalid="ignore"):
        if channel.total_stdev is not None:
            rel = np.where(total > 0, channel.total_stdev / total, np.nan)
            ratio.bar(
                centers,
                2 * rel,
                width=widths,
                bottom=1 - rel,
                fill=False,
                hatch="////",
                edgecolor="0.3",
                lw=0,
            )
        ratio.axhline(1.0, color="black", lw=1, ls="--")
        spread = 0.25
        if channel.data is not None:
            low, high = poisson_interval(channel.data)
            value = np.where(total > 0, channel.data / total, np.nan)
            ratio.errorbar(
                centers,
                value,
                yerr=[
                    low / np.where(total > 0, total, np.nan),
                    high / np.where(total > 0, total, np.nan),
                ],
                fmt="o",
                color="black",
                ms=5 * scale,
                lw=1.2,
            )
            finite = value[np.isfinite(value)]
            if len(finite):
                spread = max(spread, float(np.max(np.abs(finite - 1))) * 1.3)
    spread = next((v for v in (0.2, 0.5, 1.0) if spread <= v), 1.0)
    ratio.set_ylim(1 - spread, 1 + spread)
    ratio.set_yticks([1 - spread / 2, 1.0, 1 + spread / 2])  # none at the edges, where the
    # main panel's lowest label would overlap
    ratio.set_xlim(edges[0], edges[-1])
    size = _style.LABEL_SIZE * scale
    tick = _style.TICK_SIZE * scale
    _style.style_axes(ax, tick_size=tick, minor_x=channel.bin_labels is None and len(centers) > 1)
    _style.style_axes(
        ratio, tick_size=tick, minor_x=channel.bin_labels is None and len(centers) > 1
    )
    ax.tick_params(labelbottom=False)
    _style.set_ylabel(ax, "Events", size)
    _style.set_ylabel(ratio, "Data / Model", size * 0.8)
    if channel.bin_labels is not None:
        ratio.set_xticks(centers, channel.bin_labels, rotation=45 if len(centers) > 3 else 0)
        ratio.tick_params(axis="x", which="minor", bottom=False, top=False)
    elif len(centers) == 1:
        ratio.set_xticks([])
        ratio.tick_params(axis="x", which="minor", bottom=False, top=False)
        ax.tick_params(axis="x", which="minor", bottom=False, top=False)
    else:
        if len(centers) <= 12:
            ratio.set_xticks(edges)
        _style.set_xlabel(ratio, "bin", size)
    ax.text(
        0.04,
        0.95,
        channel.name,
        transform=ax.transAxes,
        ha="left",
        va="top",
        **_style.text_kw(size, fontweight="bold"),
    )
    if legend:
        handles, labels = ax.get_legend_handles_labels()
        _style.legend(ax, handles[::-1], labels[::-1], loc="upper right")
