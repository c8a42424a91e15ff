"""The registry of plot kinds, the JSON checks they share, and rendering to SVG or PNG.

A kind is a function ``draw(result, **options) -> Figure`` registered under its name with
:func:`register`; :func:`render` looks it up (one registry, as pyhf's ``get_test_stat``),
checks the options against its signature, builds the figure and writes it out.

Thread safety: drawing mutates state matplotlib shares process-wide (the mathtext parser,
with which layout and contour labels measure text), so each figure is built and drawn under
one lock (the work is GIL-bound: it costs little parallelism). No figure is registered with
``pyplot`` and no rcParams are set, so nothing outlives a call.
"""

from __future__ import annotations

import inspect
import io
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.backends.backend_svg import FigureCanvasSVG
from matplotlib.figure import Figure

from pyhf_gpu_client import tables

from . import _style
from .errors import PlotAbandonedError, PlotBusyError, PlotInputError

Format = Literal["svg", "png"]
FORMATS: tuple[str, ...] = tables.PLOT_FORMATS  # the one table (pyhf_gpu_client.tables)
DEFAULT_DPI = float(tables.PLOT_COMMON_OPTIONS["dpi"][1])
MAX_PIXELS = 40_000_000  # a PNG larger than this (e.g. 20 x 20 in at 300 dpi is 36 M) is refused
#: options every kind takes (applied by :func:`figure` and :func:`render`): what each does
COMMON_OPTIONS: dict[str, str] = {
    name: what for name, (_, _, what) in tables.PLOT_COMMON_OPTIONS.items()
}

# matplotlib's state is process-wide: one figure is drawn at a time
_LOCK = threading.RLock()
#: How long a render waits for the ones before it, at most (then :class:`PlotBusyError`).
RENDER_WAIT_S = 30.0
#: How often a render waiting for the drawing lock asks whether it is still wanted.
ABANDON_POLL_S = 0.1


@contextmanager
def _drawing(kind: str, abandoned: Callable[[], bool] = lambda: False) -> Iterator[None]:
    """Hold the drawing lock, waiting for it at most :data:`RENDER_WAIT_S`, and not at all
    once ``abandoned()``."""
    deadline = time.monotonic() + RENDER_WAIT_S
    while not _LOCK.acquire(timeout=min(ABANDON_POLL_S, max(deadline - time.monotonic(), 0))):
        if abandoned():
            raise PlotAbandonedError(f"{kind} plot: its client went away before it was drawn")
        if time.monotonic() >= deadline:
            raise PlotBusyError(
                f"{kind} plot: other plots have been drawing for {RENDER_WAIT_S:g} s; retry shortly"
            )
    try:
        yield
    finally:
        _LOCK.release()


@dataclass(frozen=True)
class Kind:
    """A registered plot kind: its name, drawing function and one-line description."""

    name: str
    draw: Callable[..., Figure]
    description: str

    @property
    def options(self) -> list[str]:
        """The kind's own keyword options (besides :data:`COMMON_OPTIONS`)."""
        params = list(inspect.signature(self.draw).parameters.values())[1:]
        return [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]


#: kind name -> :class:`Kind`
KINDS: dict[str, Kind] = {}


def register(name: str) -> Callable[[Callable[..., Figure]], Callable[..., Figure]]:
    """Register ``draw(result, **options) -> Figure`` as the plot kind ``name``, one of
    ``pyhf_gpu_client.tables.PLOTS`` (its description is there)."""

    def decorate(draw: Callable[..., Figure]) -> Callable[..., Figure]:
        if name in KINDS:
            raise RuntimeError(f"plot kind {name!r} is registered twice")
        if name not in tables.PLOTS:
            raise RuntimeError(f"plot kind {name!r} is not in pyhf_gpu_client.tables.PLOTS")
        KINDS[name] = Kind(name, draw, tables.PLOTS[name]["description"])
        return draw

    return decorate


def kinds() -> dict[str, str]:
    """``{kind: description}`` of every registered kind."""
    return {name: kind.description for name, kind in sorted(KINDS.items())}


def figure(
    kind: str,
    result: Any,
    *,
    figsize: Sequence[float] | None = None,
    title: str | None = None,
    label: str | None = None,
    rlabel: str | None = None,
    **options: Any,
) -> Figure:
    """The figure of ``kind`` for ``result`` (a matplotlib Figure with an Agg canvas).

    Raises:
        PlotInputError (a ValueError): unknown kind or option, or a result that does not fit.
    """
    spec = KINDS.get(kind) if isinstance(kind, str) else None
    if spec is None:
        raise PlotInputError(f"unknown plot kind {kind!r}; one of {', '.join(sorted(KINDS))}")
    unknown = sorted(set(options) - set(spec.options))
    if unknown:
        accepted = ", ".join([*spec.options, *COMMON_OPTIONS])
        raise PlotInputError(
            f"{kind} plot: unknown option {', '.join(map(repr, unknown))}; accepted: {accepted}"
        )
    size = None if figsize is None else _figsize(kind, figsize)
    pending = _style.Pending(size, bool(title), bool(label or rlabel))
    with _drawing(kind):
        token = _style.PENDING.set(pending)
        try:
            fig = spec.draw(result, **options)
        finally:
            _style.PENDING.reset(token)
        if size is not None:
            fig.set_size_inches(size)
        if title:
            fig.suptitle(title, **_style.text_kw(_style.TITLE_SIZE))
        if (label or rlabel) and fig.axes:
            left, right = _label_axes(fig)
            _style.experiment_label(left, label, None)
            _style.experiment_label(right, None, rlabel)
    return fig


def render(
    kind: str,
    result: Any,
    fmt: Format = "png",
    *,
    dpi: float | None = None,
    abandoned: Callable[[], bool] = lambda: False,
    **options: Any,
) -> bytes:
    """The figure of ``kind`` for ``result`` as SVG or PNG bytes.

    Args:
        result: the service's result JSON for that kind (parsed: dicts, lists, numbers).
        dpi: PNG resolution (default 150); the PNG is ``figsize * dpi`` pixels.
        abandoned: asked while waiting for the drawing lock and before the figure is
            written: true gives up (:class:`PlotAbandonedError`), e.g. its client went away.
        options: the kind's options, and ``figsize``, ``title``, ``label``, ``rlabel``.

    Raises:
        PlotInputError (a ValueError): unknown kind, format or option, or a result that does
            not fit the kind (the message names the kind and the missing or wrong field).
        PlotBusyError: other figures were drawing for :data:`RENDER_WAIT_S`.
        PlotAbandonedError: ``abandoned()`` turned true.
    """
    if fmt not in FORMATS:
        raise PlotInputError(f"unknown format {fmt!r}; one of {', '.join(FORMATS)}")
    resolution = DEFAULT_DPI if dpi is None else number(kind, "dpi", dpi)
    if not 10 <= resolution <= 1200:
        raise PlotInputError(f"{kind} plot: dpi must be within 10..1200, not {dpi!r}")
    with _drawing(kind, abandoned):
        fig = figure(kind, result, **options)
        width, height = fig.get_size_inches()
        if fmt == "png" and width * height * resolution**2 > MAX_PIXELS:
            raise PlotInputError(
                f"{kind} plot: {width:g} x {height:g} in at {resolution:g} dpi is more than "
                f"{MAX_PIXELS} pixels; lower dpi or figsize"
            )
        if abandoned():  # writing the figure is most of the drawing
            raise PlotAbandonedError(f"{kind} plot: its client went away while it was drawn")
        return _save(fig, fmt, resolution, options.get("title") or f"{kind} plot")


def _label_axes(fig: Figure) -> tuple[Any, Any]:
    """The axes ``label`` and ``rlabel`` go above: the top row's leftmost and rightmost
    (the same for one plot; the first channel's main panel, not its ratio panel, and the
    last of the top row in a yields grid), never a colorbar."""
    axes = [ax for ax in fig.axes if getattr(ax, "_colorbar", None) is None] or fig.axes
    boxes = [(ax.get_position(), i, ax) for i, ax in enumerate(axes)]
    top = max(round(box.y1, 3) for box, _, _ in boxes)
    row = [b for b in boxes if round(b[0].y1, 3) == top]
    left = min(row, key=lambda b: (round(b[0].x0, 3), b[1]))[2]
    right = min(row, key=lambda b: (-round(b[0].x1, 3), b[1]))[2]
    return left, right


def _save(fig: Figure, fmt: str, dpi: float, title: str) -> bytes:
    buffer = io.BytesIO()
    if fmt == "png":
        fig.set_dpi(dpi)
        FigureCanvasAgg(fig).print_png(buffer)
    else:
        FigureCanvasSVG(fig).print_svg(buffer, metadata={"Date": None, "Title": title})
    return buffer.getvalue()


def _figsize(kind: str, figsize: Any) -> tuple[float, float]:
    if (
        not isinstance(figsize, Sequence)
        or isinstance(figsize, str)
        or len(figsize) != 2
        or not all(isinstance(v, (int, float)) and 0.5 <= v <= 100 for v in figsize)
    ):
        raise PlotInputError(
            f"{kind} plot: figsize must be [width, height] in inches (0.5..100), not {figsize!r}"
        )
    return float(figsize[0]), float(figsize[1])


# --------------------------------------------------------------------- JSON checks
def fail(kind: str, message: str) -> PlotInputError:
    """The error for a result that does not fit ``kind``."""
    return PlotInputError(f"{kind} plot: {message}")


def need(kind: str, data: Any, key: str, where: str = "the result") -> Any:
    """``data[key]``, or a PlotInputError naming the kind and the missing field."""
    if not isinstance(data, Mapping):
        raise fail(kind, f"{where} must be a JSON object with {key!r}, not {_type(data)}")
    if key not in data:
        raise fail(kind, f"{where} has no {key!r} field")
    return data[key]


def one_patch(kind: str, result: Any, patch: str | None, key: str) -> Any:
    """``result[patch]`` of a patchset answer ``{patch_name: result}`` when ``patch`` is given
    (an error entry is refused), else ``result``; a patchset answer without ``patch`` is
    refused with the patch names, unless it is a single result (it has ``key``)."""
    if patch is None:
        if isinstance(result, Mapping) and key not in result and result:
            entries = [v for k, v in result.items() if k != "meta"]
            if entries and all(_patch_like(v) for v in entries):
                names = ", ".join(sorted(k for k in result if k != "meta")[:5])
                raise fail(
                    kind,
                    f"the result has no {key!r} field; for a patchset answer name the patch "
                    f"with the 'patch' option (one of {names}, ...)",
                )
        return result
    entry = need(kind, result, patch, "the patchset answer")
    if isinstance(entry, Mapping) and "error" in entry:
        raise fail(kind, f"patch {patch!r} answered an error: {entry['error']!r:.200}")
    return entry


def _patch_like(value: Any) -> bool:
    """A patch's entry in a patchset answer: a result object, or a list of them."""
    if isinstance(value, list):
        return bool(value) and all(isinstance(v, Mapping) for v in value)
    return isinstance(value, Mapping)


def first_key(kind: str, data: Mapping[str, Any], keys: Sequence[str], where: str) -> Any:
    """The value of the first of ``keys`` present in ``data`` (error naming them all)."""
    for key in keys:
        if key in data:
            return data[key]
    raise fail(kind, f"{where} has no {' / '.join(map(repr, keys))} field")


def to_float(value: Any) -> float:
    """A JSON number (``null`` for a non-finite one: NaN) as a float."""
    if value is None:
        return math.nan
    if isinstance(value, bool):
        raise TypeError("a boolean is not a number")
    return float(value)


def number(kind: str, field: str, value: Any) -> float:
    """``value`` as a float (``null``: NaN), or an error naming ``field``."""
    try:
        return to_float(value)
    except (TypeError, ValueError):
        raise fail(kind, f"{field} must be a number, not {_type(value)}") from None


def numbers(kind: str, field: str, values: Any, length: int | None = None) -> list[float]:
    """A JSON list of numbers (``null``: NaN), of ``length`` when given."""
    if not isinstance(values, Sequence) or isinstance(values, (str, bytes)):
        raise fail(kind, f"{field} must be a list of numbers, not {_type(values)}")
    if length is not None and len(values) != length:
        raise fail(kind, f"{field} must have {length} values, not {len(values)}")
    try:
        return [to_float(v) for v in values]
    except (TypeError, ValueError):
        raise fail(kind, f"{field} must be a list of numbers") from None


def strings(kind: str, field: str, values: Any) -> list[str]:
    """A JSON list of strings."""
    if not isinstance(values, Sequence) or isinstance(values, (str, bytes)):
        raise fail(kind, f"{field} must be a list of strings, not {_type(values)}")
    return [str(v) for v in values]


def matrix(kind: str, field: str, values: Any, rows: int, columns: int) -> list[list[float]]:
    """A ``rows x columns`` JSON list of lists of numbers."""
    if not isinstance(values, Sequence) or len(values) != rows:
        size = len(values) if isinstance(values, Sequence) else _type(values)
        raise fail(kind, f"{field} must have {rows} rows, not {size}")
    return [numbers(kind, f"{field}[{i}]", row, columns) for i, row in enumerate(values)]


#: The most rows a plot draws (``top``): more are unreadable and only cost render time.
MAX_ROWS = 400


def count_option(
    kind: str, field: str, value: Any, default: int | None, maximum: int = MAX_ROWS
) -> int | None:
    """A positive integer option of at most ``maximum`` (``None``: no cap unless
    ``default``)."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise fail(kind, f"{field} must be a positive integer, not {value!r}")
    if value > maximum:
        raise fail(kind, f"{field} must be at most {maximum}, not {value}")
    return value


def level_option(kind: str, value: Any) -> float:
    """A CLs level in (0, 1)."""
    level = number(kind, "level", value)
    if not 0.0 < level < 1.0:
        raise fail(kind, f"level must be within (0, 1), not {value!r}")
    return level


def _type(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", type(None): "null"}.get(
        type(value), type(value).__name__
    )
