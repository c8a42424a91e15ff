"""The HEP look, applied per figure and per artist: no ``pyplot``, no rcParams, no style sheet.

The values follow mplhep's ATLAS style (TeX Gyre Heros text, ticks inside on all four sides
with minor ticks, axis labels at the axes' ends, frameless legends, the ATLAS colour
sequence), but they are passed as arguments to each figure, axes and text, so rendering never
changes what another figure in the process looks like. The only process-wide step is making
mplhep's fonts known to matplotlib's font manager once, at import (additive: it changes no
setting and no other figure's fonts).
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np
from matplotlib import font_manager
from matplotlib.axes import Axes
from matplotlib.axis import Axis
from matplotlib.backends.backend_agg import FigureCanvasAgg, RendererAgg
from matplotlib.collections import Collection, PathCollection
from matplotlib.colorbar import Colorbar
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.layout_engine import ConstrainedLayoutEngine
from matplotlib.legend import Legend
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.spines import Spine
from matplotlib.text import Text
from matplotlib.ticker import AutoMinorLocator, LogLocator
from matplotlib.transforms import Bbox

#: text font, with fallbacks for glyphs it lacks (and for installs without mplhep's fonts)
FONT_FAMILY: list[str] = ["TeX Gyre Heros", "DejaVu Sans"]
#: the mathtext font set of every text (a per-text property; rcParams are not read for it)
MATH_FONT = "stixsans"

LABEL_SIZE = 14.0
TICK_SIZE = 12.0
LEGEND_SIZE = 11.0
NOTE_SIZE = 9.0
TITLE_SIZE = 15.0

#: ATLAS colour sequence (arXiv:2107.02270, table 1), as mplhep's ``ATLAS1`` style
COLORS: list[str] = [
    "#3f90da",
    "#ffa90e",
    "#bd1f01",
    "#94a4a2",
    "#832db6",
    "#a96b59",
    "#e76300",
    "#b9ac70",
    "#717581",
    "#92dadd",
]
#: further colours after :data:`COLORS` (mplhep's ATLAS2 sequence, then Tableau's)
MORE_COLORS: list[str] = [
    "#56b4e9",
    "#009e73",
    "#f0e442",
    "#cc79a7",
    "#0072b2",
    "#d55e00",
    "#e69f00",
    "#17becf",
    "#bcbd22",
    "#7f7f7f",
]


def palette(n: int) -> list[str]:
    """``n`` colours: the ATLAS ones first, then more; repeated beyond 20."""
    colors = COLORS + MORE_COLORS
    return [colors[i % len(colors)] for i in range(n)]


#: the expected bands of limit plots ("Brazil" green and yellow) and pull plots
BAND_1SIGMA = "#00e000"
BAND_2SIGMA = "#ffee00"
OBSERVED = "black"
EXPECTED = "black"
LEVEL_LINE = "#d00000"

_FONTS_LOCK = threading.Lock()
_fonts_registered = False


def _font_files() -> list[Path]:
    """mplhep's TeX Gyre Heros files (in ``mplhep_data`` or, for older mplhep, in mplhep)."""
    for package in ("mplhep_data", "mplhep"):  # found without importing them
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            continue
        if spec is not None and spec.origin is not None:
            fonts = Path(spec.origin).parent / "fonts"
            files = sorted(fonts.glob("texgyreheros/texgyreheros-*.otf"))
            if files:
                return files
    return []


def register_fonts() -> None:
    """Make mplhep's TeX Gyre Heros known to matplotlib's font manager (once per process).

    Without the files, text falls back to DejaVu Sans (matplotlib's own font)."""
    global _fonts_registered
    with _FONTS_LOCK:
        if _fonts_registered:
            return
        known = {f.name for f in font_manager.fontManager.ttflist}
        if "TeX Gyre Heros" not in known:
            for path in _font_files():
                if "heroscn" not in path.name:  # the condensed cut is another family
                    font_manager.fontManager.addfont(str(path))
            cached = getattr(font_manager.fontManager, "_findfont_cached", None)
            clear = getattr(cached, "cache_clear", None)
            if clear is not None:  # fonts looked up before now were cached without these
                clear()
        _fonts_registered = True


def text_kw(size: float = LABEL_SIZE, **extra: Any) -> dict[str, Any]:
    """Keyword arguments that give a text the HEP look."""
    return {"fontfamily": FONT_FAMILY, "fontsize": size, "math_fontfamily": MATH_FONT, **extra}


def font(size: float = LEGEND_SIZE, **extra: Any) -> FontProperties:
    """A FontProperties of the HEP look (for legends)."""
    return FontProperties(family=FONT_FAMILY, size=size, math_fontfamily=MATH_FONT, **extra)


@dataclass(frozen=True)
class Pending:
    """What :func:`pyhf_gpu_server.plots.figure` adds to a figure once a kind has drawn it:
    its size (``figsize``), a title, labels above the axes. Kinds that place things by the
    layout (:func:`place_legend`) read it, to place them as they will be."""

    figsize: tuple[float, float] | None = None
    title: bool = False
    labels: bool = False


#: the :class:`Pending` of the figure being drawn (set by ``figure`` around a kind's draw)
NOTHING_PENDING = Pending()
PENDING: ContextVar[Pending] = ContextVar("PENDING", default=NOTHING_PENDING)


def renderer_of(fig: Figure) -> RendererAgg:
    """The renderer of a figure on its own Agg canvas (:func:`new_figure`'s)."""
    return cast(FigureCanvasAgg, fig.canvas).get_renderer()


Layout = Literal["constrained", "compressed", "tight"]


def new_figure(width: float, height: float, *, layout: Layout | None = "constrained") -> Figure:
    """A white figure with its own Agg canvas (``pyplot`` keeps no reference to it), of the
    size asked for (``figsize``, :data:`PENDING`) or else ``width`` x ``height`` inches."""
    size = PENDING.get().figsize or (width, height)
    fig = Figure(figsize=size, dpi=100, facecolor="white", layout=layout)
    FigureCanvasAgg(fig)
    return fig


def style_axes(
    ax: Axes,
    *,
    minor_x: bool = True,
    minor_y: bool = True,
    tick_size: float = TICK_SIZE,
    top: bool = True,
    right: bool = True,
) -> None:
    """Ticks inside on all four sides, with minor ticks; tick labels in the HEP font."""
    ax.tick_params(which="both", direction="in", top=top, right=right, bottom=True, left=True)
    ax.tick_params(which="both", labelsize=tick_size, labelfontfamily=FONT_FAMILY)
    ax.tick_params(which="major", length=7, width=1.0)
    ax.tick_params(which="minor", length=3.5, width=0.8)
    for axis, minor in ((ax.xaxis, minor_x), (ax.yaxis, minor_y)):
        if minor and axis.get_scale() == "log":
            axis.set_minor_locator(LogLocator(base=10.0, subs=tuple(range(2, 10)), numticks=12))
        elif minor:
            axis.set_minor_locator(AutoMinorLocator())
        axis.get_offset_text().set(fontfamily=FONT_FAMILY, fontsize=tick_size * 0.9)
    for spine in ax.spines.values():
        spine.set_linewidth(1.0)


def set_xlabel(ax: Axes, text: str, size: float = LABEL_SIZE) -> None:
    """The x label, right-aligned at the axis end (HEP convention)."""
    ax.set_xlabel(text, loc="right", **text_kw(size))


def set_ylabel(ax: Axes, text: str, size: float = LABEL_SIZE) -> None:
    """The y label, at the top of the axis (HEP convention)."""
    ax.set_ylabel(text, loc="top", **text_kw(size))


def legend(
    ax: Axes, *args: Any, size: float = LEGEND_SIZE, box: float | None = None, **kwargs: Any
):
    """A legend in the HEP font: frameless, or in a white box of opacity ``box``."""
    if box is not None:
        kwargs.update(frameon=True, facecolor="white", edgecolor="none", framealpha=box)
    kwargs.setdefault("frameon", False)
    kwargs.setdefault("loc", "best")
    return ax.legend(*args, prop=font(size), **kwargs)


#: where :func:`place_legend` tries a legend inside the axes, in this order
INSIDE = (
    "upper right",
    "upper left",
    "lower left",
    "lower right",
    "center right",
    "center left",
    "upper center",
    "lower center",
)


def hides_data(ax: Axes, box: Bbox, renderer: Any, ignore: Sequence[Any] = ()) -> bool:
    """Whether the display-space ``box`` hides any of ``ax``'s data: a line (or a curve's
    outline) through it, a filled area (a band, a contour region, a bar) under it, a marker
    or an error bar in it, or a text."""
    for artist in ax.get_children():
        if artist in ignore or not artist.get_visible() or artist is ax.patch:
            continue
        if isinstance(artist, (Legend, Spine, Axis)):
            continue
        if isinstance(artist, Line2D):
            path = artist.get_transform().transform_path(artist.get_path())
            drawn = artist.get_linestyle() not in ("None", "none", "", " ")
            if (drawn and path.intersects_bbox(box, filled=False)) or (
                artist.get_marker() not in (None, "None", "none", "", " ")
                and box.count_contains(path.vertices)
            ):
                return True
        elif isinstance(artist, Patch):
            path = artist.get_transform().transform_path(artist.get_path())
            if path.intersects_bbox(box, filled=bool(artist.get_fill())):
                return True
        elif isinstance(artist, Collection):
            offsets = artist.get_offsets()
            if isinstance(artist, PathCollection) and np.shape(offsets)[0]:  # markers (scatter)
                points = artist.get_offset_transform().transform(offsets)
                radius = np.sqrt(np.max(artist.get_sizes(), initial=36.0)) / 2 * renderer.dpi / 72
                if box.padded(radius).count_contains(points):
                    return True
                continue
            faces = artist.get_facecolor()
            filled = len(faces) > 0 and bool(np.any(np.asarray(faces)[:, 3] > 0))
            transform = artist.get_transform()
            if any(
                transform.transform_path(path).intersects_bbox(box, filled=filled)
                for path in artist.get_paths()
            ):
                return True
        elif (
            isinstance(artist, Text)
            and artist.get_text()
            and artist.get_window_extent(renderer).overlaps(box)
        ):
            return True
    return False


def place_legend(
    ax: Axes,
    *args: Any,
    candidates: Sequence[str] = INSIDE,
    outside: str = "right",
    ignore: Sequence[Any] = (),
    data_top: float | None = None,
    **kwargs: Any,
) -> Legend:
    """A legend where it hides no data: the first of ``candidates`` inside the axes that is
    clear of them (:func:`hides_data`, a few points of margin), else outside the axes:
    ``outside="right"`` beside them (the layout makes room), ``"top"`` at the first
    candidate, in headroom made above the data up to ``data_top`` (:func:`room_above`)."""
    leg = legend(ax, *args, loc=candidates[0], **kwargs)
    fig = cast(Figure, ax.figure)
    with as_finished(ax):
        fig.draw_without_rendering()  # the layout: where the axes are
        renderer = renderer_of(fig)
        margin = 4 * renderer.dpi / 72
        for loc in candidates:
            leg.set_loc(loc)
            box = leg.get_window_extent(renderer).padded(margin)
            if not hides_data(ax, box, renderer, ignore):
                return leg
        if outside == "top" and data_top is not None:
            leg.set_loc(candidates[0])
            room_above(ax, [leg], renderer, data_top)
            return leg
    leg.set_loc("upper left")
    leg.set_bbox_to_anchor((1.02, 1.0), transform=ax.transAxes)
    # the figure grows by the legend's width: the axes keep theirs (and room for the labels
    # above them), unless the size was asked for
    if PENDING.get().figsize is None:
        width, height = fig.get_size_inches()
        extra = leg.get_window_extent(renderer).width / renderer.dpi + 0.15
        fig.set_size_inches(width + extra, height)
    return leg


@contextmanager
def as_finished(ax: Axes) -> Iterator[None]:
    """The figure laid out as it will be once finished (:data:`PENDING`): with stand-ins for
    the title and the labels above ``ax`` (the axes as small as they will be: a legend
    placed clear of the data then stays clear)."""
    pending = PENDING.get()
    fig = ax.figure
    stand_ins = []
    if pending.labels and not ax.get_title(loc="left"):
        stand_ins.append(ax.set_title("Ag", loc="left", pad=5, **text_kw(LABEL_SIZE)))
    if pending.title and not fig.get_suptitle():
        stand_ins.append(fig.suptitle("Ag", **text_kw(TITLE_SIZE)))
    try:
        yield
    finally:
        for text in stand_ins:  # the title and labels to come replace them
            text.set_text("")


def room_above(
    ax: Axes, boxes: Sequence[Any], renderer: Any, data_top: float, gap: float = 0.03
) -> None:
    """Raise the top of ``ax``'s y range so that its data, up to ``data_top`` (data
    coordinates), end ``gap`` (axes fraction) below the lowest of ``boxes`` (a legend, a text
    at the top of the axes); on a log axis in decades."""
    axes_box = ax.get_window_extent(renderer)
    if not boxes or axes_box.height <= 0:
        return
    lowest = min(b.get_window_extent(renderer).y0 for b in boxes)
    free = clamp((lowest - axes_box.y0) / axes_box.height - gap, 0.3, 0.97)
    bottom = ax.get_ylim()[0]
    if ax.get_yscale() == "log":
        low, high = np.log10(bottom), np.log10(max(data_top, bottom * 1.0001))
        ax.set_ylim(bottom, 10 ** (low + (high - low) / free))
    else:
        ax.set_ylim(bottom, bottom + (data_top - bottom) / free)


def note(fig: Figure, lines: Sequence[str]) -> None:
    """Small grey notes (what was skipped or capped) in the figure's lower left corner; in a
    figure laid out by constrained layout they have a strip of their own at the bottom, under
    everything else (tick labels, axis labels)."""
    lines = [line for line in lines if line]
    if not lines:
        return
    engine = fig.get_layout_engine()
    if isinstance(engine, ConstrainedLayoutEngine):
        strip = (len(lines) * NOTE_SIZE * 1.3 + 4) / 72  # inches
        fraction = min(strip / fig.get_size_inches()[1], 0.3)
        engine.set(rect=(0.0, fraction, 1.0, 1.0 - fraction))
    kw = text_kw(NOTE_SIZE, ha="left", va="bottom", color="0.35", gid="plot-notes")
    fig.text(0.005, 0.005, "\n".join(lines), **kw)


def experiment_label(ax: Axes, label: str | None, rlabel: str | None) -> None:
    """mplhep-like labels on the line above ``ax``'s frame: ``label`` on the left (its first
    word bold italic, as "ATLAS Internal"), ``rlabel`` on the right (e.g. "13 TeV, 139 fb⁻¹").

    Both are the axes' left and right titles, so they stay clear of the legends inside the
    frame and of a twin's top axis (matplotlib places titles above it), and the layout
    engine makes room for them."""
    if label:
        head, _, tail = label.partition(" ")
        title = ax.set_title(
            head, loc="left", pad=5, fontweight="bold", fontstyle="italic", **text_kw(LABEL_SIZE)
        )
        if tail:
            kw = text_kw(LABEL_SIZE, ha="left", va="bottom", annotation_clip=False)
            ax.annotate(" " + tail, xy=(1.0, 0.0), xycoords=title, **kw)
    if rlabel:
        ax.set_title(rlabel, loc="right", pad=5, **text_kw(LABEL_SIZE - 1))


def colorbar(fig: Figure, mappable: Any, ax: Axes, label: str, **kwargs: Any) -> Colorbar:
    """A colorbar beside ``ax`` (``kwargs``: ``fig.colorbar``'s), labelled at its top, its
    ticks outside on the right."""
    bar = fig.colorbar(mappable, ax=ax, **kwargs)
    bar.set_label(label, loc="top", **text_kw())
    style_axes(bar.ax, minor_x=False, minor_y=False, top=False)
    bar.ax.tick_params(which="both", direction="out", left=False, right=True)
    return bar


def clamp(value: float, low: float, high: float) -> float:
    """``value`` limited to ``[low, high]``."""
    return max(low, min(high, value))


register_fonts()
