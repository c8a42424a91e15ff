"""The service's tables, declared once: the operation names, the plot kinds each operation's
answer offers, what each kind needs of the request and is given from it, and each kind's
options with their types and defaults; the image formats and their media types.

Plain data (dicts, tuples, strings: what ``GET /tables`` answers as JSON) and the few rules
that read it. The client owns them (the lower layer: no dependencies); the server imports
them (``pyhf_gpu_server.service.plotting``, ``pyhf_gpu_server.plots``) and the web page reads
them from ``GET /tables``, so none of them can differ. ``tests/test_tables_once.py`` checks
that no other module restates them and that the renderers' signatures are these.

Example:
    >>> PLOT_KINDS[FIT], PLOT_MEDIA_TYPES["svg"]
    (('pulls', 'correlation'), 'image/svg+xml')
    >>> PLOTS["ranking"]["options"]["top"], option_type("test_poi", EXCLUSION)
    (('int', 20), 'float')
    >>> plot_kinds_for(CLS, {"test_poi": [0.5, 1.0]}), plot_kinds_for(CLS, {"test_poi": 1.0})
    (('brazil',), ())
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

__all__ = [
    "CLS",
    "FIT",
    "LIKELIHOOD",
    "OPERATION_NAMES",
    "PLOTS",
    "PLOT_COMMON_OPTIONS",
    "PLOT_FORMATS",
    "PLOT_KINDS",
    "PLOT_MEDIA_TYPES",
    "PLOT_NEEDS",
    "PLOT_PATCH_OPTION",
    "QUERY_OPTIONS",
    "RANKING",
    "SCAN",
    "SIGNIFICANCE",
    "UPPER_LIMIT",
    "YIELDS",
    "as_json",
    "default_plot_kind",
    "option_type",
    "plot_kinds_for",
    "read_option",
]

# ------------------------------------------------------------------------------ operations
CLS = "cls"
FIT = "fit"
UPPER_LIMIT = "upper-limit"
SIGNIFICANCE = "significance"
RANKING = "ranking"
SCAN = "scan"
YIELDS = "yields"
LIKELIHOOD = "likelihood"
#: every operation: ``POST /<name>``, a job's ``operation`` (the web page's order)
OPERATION_NAMES: tuple[str, ...] = (
    CLS,
    UPPER_LIMIT,
    FIT,
    RANKING,
    SCAN,
    YIELDS,
    SIGNIFICANCE,
    LIKELIHOOD,
)

# ----------------------------------------------------------------------------- plot kinds
BRAZIL = "brazil"
EXCLUSION = "exclusion"
PULLS = "pulls"
CORRELATION = "correlation"
# the ranking, scan and yields plots are named after their operations

#: the plot kinds that suit each operation's answer (:data:`PLOT_NEEDS` narrows them by the
#: request; the server's ``GET /jobs/{id}/plots`` has the final word)
PLOT_KINDS: dict[str, tuple[str, ...]] = {
    CLS: (BRAZIL, EXCLUSION),
    UPPER_LIMIT: (BRAZIL,),
    FIT: (PULLS, CORRELATION),
    RANKING: (RANKING,),
    SCAN: (SCAN,),
    YIELDS: (YIELDS,),
    SIGNIFICANCE: (),
    LIKELIHOOD: (),
}


class Need(TypedDict):
    """What a plot kind needs of the request: ``field`` given (``list``: as a JSON list)."""

    field: str
    list: bool
    says: str  # the server's words: "a ... plot needs <says>"
    flag: str  # the command line's: "a ... plot needs <flag>"


#: operation -> kind -> what the kind needs of that operation's request to fit its answer
PLOT_NEEDS: dict[str, dict[str, Need]] = {
    CLS: {
        BRAZIL: {
            "field": "test_poi",
            "list": True,
            "says": "a list of test_poi",
            "flag": "several --test-poi values",
        },
        EXCLUSION: {"field": "patchset", "list": False, "says": "a patchset", "flag": "--patchset"},
    },
}

#: An option: ``(type, default)``. Types: ``int``, ``float``, ``bool``, ``str``; ``strs``,
#: ``ints``, ``floats`` (repeated query parameters or one comma-separated value); ``json``:
#: only a JSON plot spec carries it (an object), or the service fills it in.
Option = tuple[str, Any]


class PlotKind(TypedDict):
    """A plot kind: what it shows, what it draws of a patchset's answer (``patch``: one
    patch, the ``patch`` option; ``patchset``: all of them), what the service gives it
    (renderer option -> its source, see ``pyhf_gpu_server.service.plotting``), how the
    service reads the answer for it (``adapt``: none, ``pull_centres`` or ``scan_axes``) and the
    renderer's options (besides :data:`PLOT_COMMON_OPTIONS`)."""

    description: str
    draws: str
    inputs: dict[str, str]
    adapt: str | None
    options: dict[str, Option]


PLOTS: dict[str, PlotKind] = {
    BRAZIL: {
        "description": "observed and expected CLs with 1σ/2σ bands versus the POI, the CLs "
        "level and the upper limits (from a CLs list answer, or an upper-limit answer)",
        "draws": "patch",
        "inputs": {"test_poi": "request:test_poi", "xlabel": "poi_name"},
        "adapt": None,
        "options": {
            "test_poi": ("floats", None),
            "level": ("float", None),
            "upper_limit": ("json", None),
            "xlabel": ("str", "μ"),
            "log_y": ("bool", False),
            "patch": ("str", None),
        },
    },
    EXCLUSION: {
        "description": "observed and expected CLs = level contours (1σ band) over a plane of "
        "the signal parameters from a patchset CLs answer (one slice of the others), or CLs "
        "versus one",
        "draws": "patchset",
        "inputs": {"patchset": "request:patchset", "test_poi": "tested_value"},
        "adapt": None,
        "options": {
            "values": ("json", None),
            "patchset": ("json", None),
            "labels": ("strs", None),
            "axes": ("ints", None),
            "slice": ("floats", None),
            "level": ("float", 0.05),
            "test_poi": ("float", 1.0),
            "show_points": ("bool", True),
        },
    },
    PULLS: {
        "description": "pulls (θ̂ − θ₀)/Δθ of the constrained parameters of a fit answer, with "
        "±1σ/±2σ bands",
        "draws": "patch",
        "inputs": {"workspace": "fitted_workspace", "measurement": "request:measurement"},
        "adapt": None,
        "options": {
            "parameters": ("strs", None),
            "top": ("int", None),
            "workspace": ("json", None),
            "measurement": ("str", None),
            "poi": ("str", None),
            "prefit": ("json", None),
            "patch": ("str", None),
        },
    },
    CORRELATION: {
        "description": "the correlation matrix of a fit answer, without parameters correlated "
        "less than a threshold",
        "draws": "patch",
        "inputs": {},
        "adapt": None,
        "options": {
            "threshold": ("float", None),
            "parameters": ("strs", None),
            "top": ("int", None),
            "annotate": ("bool", None),
            "patch": ("str", None),
        },
    },
    RANKING: {
        "description": "the parameters with the largest impacts on the POI (pre-fit hatched, "
        "post-fit filled) with their pulls, as cabinetry's ranking plot",
        "draws": "patch",
        "inputs": {"poi_label": "result_poi_name"},
        "adapt": "pull_centres",
        "options": {"top": ("int", 20), "poi_label": ("str", "μ")},
    },
    SCAN: {
        "description": "a likelihood scan: -2ΔlnL versus a parameter with 1σ/2σ lines, or "
        "over two parameters with 68%/95% CL contours",
        "draws": "patch",
        "inputs": {},
        "adapt": "scan_axes",
        "options": {"xlabel": ("str", None), "ylabel": ("str", None), "ymax": ("float", None)},
    },
    YIELDS: {
        "description": "stacked sample yields per channel with their uncertainty, the data and "
        "a data / model ratio (pre- or post-fit), several channels as a grid",
        "draws": "patch",
        "inputs": {},
        "adapt": None,
        "options": {
            "stage": ("str", None),
            "channels": ("strs", None),
            "max_channels": ("int", 12),
            "log_y": ("bool", None),
            "columns": ("int", None),
        },
    },
}

#: the options every kind takes: ``(type, default, what it does)``
PLOT_COMMON_OPTIONS: dict[str, tuple[str, Any, str]] = {
    "dpi": (
        "float",
        150.0,
        "PNG resolution in dots per inch (default 150; SVG is resolution-free)",
    ),
    "figsize": ("floats", None, "[width, height] in inches, replacing the kind's own size"),
    "title": ("str", None, "a title above the figure"),
    "label": (
        "str",
        None,
        'experiment label above the main axes on the left, e.g. "ATLAS Internal"',
    ),
    "rlabel": ("str", None, 'label above the main axes on the right, e.g. "13 TeV, 139 fb⁻¹"'),
}
#: the service's own option: the patch of a patchset's answer drawn (default the first that
#: answered a result; not of a kind that draws the whole patchset)
PLOT_PATCH_OPTION = "patch"

#: the image formats, and the media type each is served as
PLOT_MEDIA_TYPES: dict[str, str] = {"svg": "image/svg+xml", "png": "image/png"}
PLOT_FORMATS: tuple[str, ...] = tuple(PLOT_MEDIA_TYPES)


# ------------------------------------------------------------------------- derived, rules
def _declared() -> dict[str, set[str]]:
    """Each option's types, over the common options and every kind's."""
    types: dict[str, set[str]] = {}
    for name, (kind, *_) in PLOT_COMMON_OPTIONS.items():
        types.setdefault(name, set()).add(kind)
    types.setdefault(PLOT_PATCH_OPTION, set()).add("str")
    for plot in PLOTS.values():
        for name, (kind, _) in plot["options"].items():
            types.setdefault(name, set()).add(kind)
    return types


_TYPES = _declared()
#: the options a query string (or ``KEY=VALUE``) carries: all but the ``json`` ones
QUERY_OPTIONS: tuple[str, ...] = tuple(n for n, t in _TYPES.items() if t != {"json"})
#: what a malformed value of each type should have been
TYPE_WORDS: dict[str, str] = {
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "ints": "integers",
    "floats": "numbers",
}
_SCALARS: dict[str, type] = {"int": int, "float": float, "str": str}
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def option_type(name: str, kind: str | None = None) -> str | None:
    """The type of option ``name`` (of plot ``kind`` when the kinds differ: ``test_poi`` is
    a list of a brazil plot, one value of an exclusion plot); None for an option no kind
    has, or of several types where ``kind`` does not say which."""
    if kind in PLOTS and name in PLOTS[kind]["options"]:
        return PLOTS[kind]["options"][name][0]
    types = _TYPES.get(name, set())
    return next(iter(types)) if len(types) == 1 else None


def read_option(kind: str, values: Sequence[str]) -> Any:
    """The typed value of a query option of type ``kind`` given as ``values`` (the last one
    counts; a list is repeated values or one comma-separated value); ``ValueError`` when
    malformed."""
    last = values[-1]
    if kind == "bool":
        if last.lower() not in _TRUE | _FALSE:
            raise ValueError(last)
        return last.lower() in _TRUE
    convert = _SCALARS.get(kind.removesuffix("s"), str)  # a list type: its items' type + "s"
    if not kind.endswith("s"):
        return convert(last)
    listed = list(values) if len(values) > 1 else [v.strip() for v in last.split(",") if v.strip()]
    return [convert(v) for v in listed]


def plot_kinds_for(operation: str, request: Mapping[str, Any]) -> tuple[str, ...]:
    """The plot kinds that fit ``operation``'s answer to ``request`` (its envelope fields or
    the client's keywords): those of :data:`PLOT_KINDS` whose :data:`PLOT_NEEDS` it meets."""
    needs = PLOT_NEEDS.get(operation, {})
    return tuple(k for k in PLOT_KINDS.get(operation, ()) if _meets(request, needs.get(k)))


def _meets(request: Mapping[str, Any], need: Need | None) -> bool:
    if need is None:
        return True
    value = request.get(need["field"])
    return isinstance(value, (list, tuple)) if need["list"] else value is not None


def default_plot_kind(operation: str, request: Mapping[str, Any]) -> str | None:
    """The plot a request implies: a kind that draws the whole patchset when one fits
    (``exclusion``), else the first that fits; None when none does."""
    kinds = plot_kinds_for(operation, request)
    whole = [k for k in kinds if PLOTS[k]["draws"] == "patchset"]
    return next(iter(whole or kinds), None)


def as_json() -> dict[str, Any]:
    """The tables as ``GET /tables`` answers them."""
    return {
        "operations": list(OPERATION_NAMES),
        "plot_kinds": {op: list(kinds) for op, kinds in PLOT_KINDS.items()},
        "plot_needs": PLOT_NEEDS,
        "plots": PLOTS,
        "plot_common_options": PLOT_COMMON_OPTIONS,
        "plot_patch_option": PLOT_PATCH_OPTION,
        "plot_formats": PLOT_MEDIA_TYPES,
    }
