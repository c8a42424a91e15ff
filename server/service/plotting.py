"""Plots of the service's answers: which plot kinds fit a request, and the renderer's inputs
drawn from the request and its result (``pyhf_gpu_server.plots`` draws them).

Both plot routes use this module: ``GET /jobs/{id}/plots/{kind}.{svg,png}`` (the job's stored
request and result) and a synchronous ``POST /<operation>`` carrying a ``plot`` field in its
envelope or ``?plot=<kind>&plot_format=png`` in its query (the request just answered).

>>> kinds_for("cls", {"test_poi": [0.5, 1.0]}), kinds_for("cls", {"patchset": {}})
(('brazil',), ('exclusion',))
>>> kinds_for("fit", {}), kinds_for("significance", {})
(('pulls', 'correlation'), ())
>>> query_options({"top": ["5"], "channels": ["SR,CR"], "log_y": ["true"]})
{'top': 5, 'channels': ['SR', 'CR'], 'log_y': True}
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jsonpatch
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from pyhf_gpu_client import tables
from pyhf_gpu_server import plots
from pyhf_gpu_server.plots.errors import PlotBusyError, PlotInputError, PlotsNotInstalledError
from pyhf_gpu_server.plots.slices import describe, ranked_slices

from .errors import NotFound, NotImplementedHere, ServiceError, Unavailable, Unprocessable

log = logging.getLogger("pyhf_gpu_server.service.plots")

#: the plot kinds that suit each operation's answer (``kinds_for`` narrows them by request);
#: these and the rest are ``pyhf_gpu_client.tables``' (declared once)
PLOTS: dict[str, tuple[str, ...]] = tables.PLOT_KINDS
FORMATS: tuple[str, ...] = tables.PLOT_FORMATS
KIND_NAMES: tuple[str, ...] = tuple(sorted(tables.PLOTS))
MEDIA_TYPES: dict[str, str] = tables.PLOT_MEDIA_TYPES
#: the plot options a query string carries
QUERY_OPTIONS: tuple[str, ...] = tables.QUERY_OPTIONS
#: renderer options only a JSON plot spec carries (objects), or that the service fills in
JSON_OPTIONS: tuple[str, ...] = tuple(
    dict.fromkeys(
        name
        for plot in tables.PLOTS.values()
        for name, (kind, _) in plot["options"].items()
        if kind == "json"
    )
)
#: the options given as texts (checked to be texts when a JSON plot spec gives them)
_STRINGS = tuple(name for name in QUERY_OPTIONS if tables.option_type(name) == "str")


@dataclass(frozen=True)
class PlotRequest:
    """A plot asked for: its kind, format (``svg``/``png``) and the renderer's options."""

    kind: str
    fmt: str = "png"
    options: dict[str, Any] = field(default_factory=dict)


class PlotSlice(BaseModel):
    """One slice of a patchset's signal coordinates an exclusion plot can draw."""

    model_config = ConfigDict(extra="forbid")

    values: list[float] = Field(description="the ``slice`` option: the coordinates off the axes")
    points: int = Field(description="how many of the patchset's points it holds")
    label: str = Field(description="the values in words, with units: m_neutralino1 = 60 GeV")


class PlotLink(BaseModel):
    """One plot kind that fits a job, and where to get it."""

    model_config = ConfigDict(extra="forbid")

    kind: str
    description: str
    options: list[str] = Field(description="the kind's own options (besides dpi, figsize, ...)")
    png: str = Field(description="URL of the PNG")
    svg: str = Field(description="URL of the SVG")
    slices: list[PlotSlice] | None = Field(
        None,
        description="exclusion of a patchset with more than two coordinates: the slices of "
        "the default axes' plane, the most populated (drawn by default) first; add "
        "`?slice=<values>` to draw another",
    )


class JobPlots(BaseModel):
    """GET /jobs/{id}/plots: the plot kinds that fit a job (drawable once it succeeded)."""

    model_config = ConfigDict(extra="forbid")

    id: str
    operation: str
    status: str
    plots: list[PlotLink]


# ----------------------------------------------------------------------------- which kinds
#: the plot kinds that fit an ``operation``'s answer to ``request`` (its envelope)
kinds_for = tables.plot_kinds_for


def links(job_id: str, operation: str, request: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The :class:`PlotLink` entries of a job."""
    out = []
    for kind in kinds_for(operation, request):
        link = {
            "kind": kind,
            "description": tables.PLOTS[kind]["description"],
            "options": list(tables.PLOTS[kind]["options"]),
            **{fmt: f"/jobs/{job_id}/plots/{kind}.{fmt}" for fmt in FORMATS},
        }
        if kind == tables.EXCLUSION:
            found = patchset_slices(request.get("patchset"))
            if len(found) > 1:
                link["slices"] = found
        out.append(link)
    return out


def patchset_slices(patchset: Any) -> list[dict[str, Any]]:
    """The slices (:class:`PlotSlice`) of the default exclusion plane (the first two
    coordinates) of ``patchset``'s points, the most populated first; none where its points
    have at most two coordinates (or no patchset's shape).

    >>> patchset = {"metadata": {"labels": ["m_sbottom", "m_neutralino2", "m_neutralino1"]},
    ...             "patches": [{"metadata": {"values": v}} for v in
    ...                         ([500, 200, 60], [600, 200, 60], [700, 330, 200])]}
    >>> patchset_slices(patchset)[1]
    {'values': [200.0], 'points': 1, 'label': 'm_neutralino1 = 200 GeV'}
    """
    try:
        points = [[float(v) for v in p["metadata"]["values"]] for p in patchset["patches"]]
        labels = [str(label) for label in patchset["metadata"]["labels"]]
    except (KeyError, TypeError, ValueError):
        return []
    if not points or any(len(p) != len(labels) for p in points) or len(labels) <= 2:
        return []
    axes = [0, 1]
    return [
        {"values": list(key), "points": count, "label": describe(labels, axes, key)}
        for key, count in ranked_slices(points, axes)
    ]


def check_kind(kind: str, unknown: type[ServiceError] = NotFound) -> None:
    """``unknown`` (404 on the job route, 422 in a request) unless ``kind`` is a plot kind."""
    if kind not in tables.PLOTS:
        raise unknown(f"unknown plot kind {kind!r}; the kinds: {', '.join(KIND_NAMES)}")


def check_format(fmt: str, unknown: type[ServiceError] = NotFound) -> None:
    """``unknown`` unless ``fmt`` is ``svg`` or ``png``."""
    if fmt not in FORMATS:
        raise unknown(f"unknown plot format {fmt!r}; one of {', '.join(FORMATS)}")


def check_fits(kind: str, operation: str, request: Mapping[str, Any]) -> None:
    """422 naming the kinds that fit, unless ``kind`` fits ``operation``'s answer to ``request``."""
    fitting = kinds_for(operation, request)
    if kind in fitting:
        return
    if not PLOTS.get(operation):
        raise Unprocessable(f"no plot kind fits a {operation} answer")
    need = tables.PLOT_NEEDS.get(operation, {}).get(kind)
    why = "" if need is None else f" (a {kind} plot needs {need['says']})"
    these = ", ".join(fitting) if fitting else "none"
    raise Unprocessable(
        f"a {kind} plot does not fit this {operation} answer{why}; the kinds that do: {these}"
    )


# -------------------------------------------------------------------------------- options
def query_options(
    query: Mapping[str, list[str]], prefix: str = "", kind: str | None = None
) -> dict[str, Any]:
    """The renderer's options of plot ``kind`` from query parameters (named ``prefix +
    option``; ``-`` or ``_``); 422 for an unknown or malformed one, naming what it takes."""
    options = {}
    for raw, values in query.items():
        name = raw.replace("-", "_").removeprefix(prefix)
        if name not in QUERY_OPTIONS:
            accepted = ", ".join(prefix + o for o in QUERY_OPTIONS)
            raise Unprocessable(f"unknown plot option {raw!r}; accepted: {accepted}")
        of = tables.option_type(name, kind) or "str"
        try:
            options[name] = tables.read_option(of, values)
        except ValueError:
            words = tables.TYPE_WORDS[of]
            raise Unprocessable(
                f"plot option {name!r} must be {words}, not {values[-1][:40]!r}"
            ) from None
    return options


def from_envelope(document: Any) -> tuple[Any, PlotRequest | None]:
    """A request body without its ``plot`` field, and the plot it asks for: ``"brazil"`` or
    ``{"kind": "brazil", "format": "svg", ...renderer options}`` (JSON values, as the
    renderer takes them)."""
    if not isinstance(document, dict) or "plot" not in document:
        return document, None
    if "workspace" not in document and "workspace_id" not in document:
        return document, None  # a bare workspace: plot goes in the query
    document = dict(document)
    spec = document.pop("plot")
    if isinstance(spec, str):
        spec = {"kind": spec}
    if not isinstance(spec, dict) or not isinstance(spec.get("kind"), str):
        raise Unprocessable(
            '\'plot\' must be a kind name or an object {"kind": ..., "format": "svg" | '
            f'"png", ...options}}; the kinds: {", ".join(KIND_NAMES)}'
        )
    options = dict(spec)
    kind = options.pop("kind")
    fmt = options.pop("format", "png")
    check_kind(kind, Unprocessable)
    if not isinstance(fmt, str):
        raise Unprocessable(f"plot format must be one of {', '.join(FORMATS)}")
    check_format(fmt, Unprocessable)
    return document, PlotRequest(kind, fmt, options)


def from_query(query: Mapping[str, list[str]]) -> tuple[dict[str, list[str]], PlotRequest | None]:
    """The query without its ``plot``, ``plot_format`` and ``plot_<option>`` parameters, and
    the plot they ask for."""
    rest: dict[str, list[str]] = {}
    mine: dict[str, list[str]] = {}
    for key, values in query.items():
        name = key.replace("-", "_")
        (mine if name == "plot" or name.startswith("plot_") else rest)[key] = values
    if not mine:
        return rest, None
    spec = {key.replace("-", "_"): values for key, values in mine.items()}
    kind = spec.pop("plot", [None])[-1]
    fmt = spec.pop("plot_format", ["png"])[-1]
    if kind is None:
        raise Unprocessable(f"plot options {sorted(mine)} need 'plot' (the kind)")
    check_kind(kind, Unprocessable)
    check_format(fmt, Unprocessable)
    return rest, PlotRequest(kind, fmt, query_options(spec, "plot_", kind))


# ------------------------------------------------------------------------ renderer inputs
WorkspaceLookup = Callable[[str], "dict[str, Any] | None"]


def _is_error(entry: Any) -> bool:
    """Whether a patchset answer's entry is a patch's error."""
    return isinstance(entry, Mapping) and set(entry) == {"error"}


def _one_patch(result: Any, patch: str | None) -> tuple[str, Any]:
    """The patch drawn of a patchset answer (``patch``, default the first that answered a
    result) and its entry; 422 when there is none, or it answered an error."""
    if not isinstance(result, Mapping) or not result:
        raise Unprocessable("the patchset answer has no patches")
    if patch is None:
        patch = next((name for name, entry in result.items() if not _is_error(entry)), None)
        if patch is None:
            raise Unprocessable("no patch of this patchset answer has a result to plot")
    if patch not in result:
        names = ", ".join(list(result)[:10])
        raise Unprocessable(
            f"plot option patch {patch!r} is not in the answer; its patches: {names}"
        )
    entry = result[patch]
    if _is_error(entry):
        raise Unprocessable(f"patch {patch!r} answered an error, nothing to plot: {entry['error']}")
    return patch, entry


def _workspace(
    request: Mapping[str, Any], lookup: WorkspaceLookup, patch: str | None
) -> dict[str, Any] | None:
    """The fitted workspace: the background (inline or stored) with the patch applied (a
    patchset's ``patch``, or the envelope's ``patches``); None when it is not stored any more
    or the patch does not apply."""
    spec = request.get("workspace")
    if spec is None and isinstance(request.get("workspace_id"), str):
        spec = lookup(request["workspace_id"])
    if not isinstance(spec, dict):
        return None
    operations: list[Any] = []
    patchset = request.get("patchset")
    if patch is not None and isinstance(patchset, Mapping):
        for entry in patchset.get("patches", []):
            if entry.get("metadata", {}).get("name") == patch:
                operations = list(entry.get("patch", []))
    for given in request.get("patches") or []:
        operations += given.get("patch", []) if isinstance(given, Mapping) else given
    if not operations:
        return spec
    try:
        return jsonpatch.apply_patch(copy.deepcopy(spec), operations)
    except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException, TypeError, KeyError):
        return spec


def _ranking(result: Mapping[str, Any]) -> dict[str, Any]:
    """The service's ranking answer with ``init`` (the constraint centres, from ``pull``), so
    the renderer draws the pulls (θ̂ − θ₀)/Δθ; unconstrained parameters have none."""
    out = dict(result)
    widths = result.get("prefit_uncertainty") or []
    pulls = result.get("pull") or []
    out["init"] = [
        b - p * w if None not in (b, p, w) and w > 0 else None
        for b, p, w in zip(result.get("bestfit") or [], pulls, widths, strict=False)
    ]
    if len(out["init"]) != len(result.get("labels") or []):
        out.pop("init")
    return out


def _scan(result: Mapping[str, Any]) -> Mapping[str, Any]:
    """A 2D scan answer (``names``, ``parameter_values: [[x], [y]]``) as the renderer reads
    it; a 1D one as it is."""
    if "names" not in result:
        return result
    values = result.get("parameter_values") or [[], []]
    return {
        "parameters": result["names"],
        "values_x": values[0],
        "values_y": values[1] if len(values) > 1 else [],
        "delta_nlls": result.get("delta_nlls"),
        "bestfit": result.get("bestfit"),
    }


@dataclass(frozen=True)
class _Drawn:
    """What a plot's inputs are drawn from: the request, its (adapted) result, the patch
    drawn of a patchset's answer, the workspace store."""

    request: Mapping[str, Any]
    result: Any
    patch: str | None
    lookup: WorkspaceLookup


def _tested_value(drawn: _Drawn) -> float | None:
    """The POI value of an exclusion plot: 1.0 when it was tested, else the first tested."""
    tested = drawn.request.get("test_poi")
    if not isinstance(tested, list):
        return None
    return 1.0 if 1.0 in tested else tested[0]


def _poi_name(drawn: _Drawn) -> str | None:
    """The POI of the (unpatched) workspace's measurement (default the first)."""
    measurement = drawn.request.get("measurement")
    for entry in (_workspace(drawn.request, drawn.lookup, None) or {}).get("measurements", []):
        if measurement is None or entry.get("name") == measurement:
            return entry.get("config", {}).get("poi")
    return None


def _result_poi_name(drawn: _Drawn) -> str | None:
    poi = drawn.result.get("poi")
    return poi["name"] if isinstance(poi, Mapping) and poi.get("name") else None


#: the sources ``tables.PLOTS[kind]["inputs"]`` names (``request:<field>``: the request's field)
_SOURCES: dict[str, Callable[[_Drawn], Any]] = {
    "tested_value": _tested_value,
    "poi_name": _poi_name,
    "fitted_workspace": lambda d: _workspace(d.request, d.lookup, d.patch),
    "result_poi_name": _result_poi_name,
}
#: how the service reads an answer for a kind (``tables.PLOTS[kind]["adapt"]``)
_ADAPTERS: dict[str, Callable[[Any], Any]] = {"pull_centres": _ranking, "scan_axes": _scan}


def inputs(
    plot: PlotRequest,
    operation: str,
    request: Mapping[str, Any],
    result: Any,
    lookup: WorkspaceLookup,
) -> tuple[Any, dict[str, Any]]:
    """The renderer's ``(result, options)`` for ``plot`` of ``operation``'s ``result`` to
    ``request``, as ``tables.PLOTS[kind]`` says: one patch of a patchset answer (the
    ``patch`` option, default the first tested) unless the kind draws the whole patchset,
    the answer adapted, and the kind's ``inputs`` (the patchset for ``exclusion``, the
    ``test_poi`` list for ``brazil``, the (patched) workspace for ``pulls``, the POI's name
    as axis label, ...) where they have a value. The caller's options win over these."""
    options = dict(plot.options)
    table = tables.PLOTS[plot.kind]
    patch = None
    if request.get("patchset") is not None and table["draws"] == "patch":
        patch, result = _one_patch(result, options.pop(tables.PLOT_PATCH_OPTION, None))
    if table["adapt"] is not None:
        result = _ADAPTERS[table["adapt"]](result)
    drawn = _Drawn(request, result, patch, lookup)
    for key, source in table["inputs"].items():
        where, _, name = source.partition(":")
        value = drawn.request.get(name) if where == "request" else _SOURCES[source](drawn)
        if value is not None:
            options.setdefault(key, value)
    return result, options


def render(
    plot: PlotRequest,
    operation: str,
    request: Mapping[str, Any],
    result: Any,
    lookup: WorkspaceLookup,
    abandoned: Callable[[], bool] = lambda: False,
) -> bytes:
    """The image of ``plot`` (blocking: call it in a thread); 422 when the result or an
    option does not fit the kind (the renderer's message); not drawn once ``abandoned()``
    (its client went away: :class:`~pyhf_gpu_server.plots.PlotAbandonedError`)."""
    for name in _STRINGS:  # texts given as JSON values (an envelope's plot) must be texts
        value = plot.options.get(name)
        if value is not None and not isinstance(value, str):
            raise Unprocessable(f"plot option {name!r} must be a string, not {value!r:.40}")
    drawn, options = inputs(plot, operation, request, result, lookup)
    try:
        return plots.render(plot.kind, drawn, plot.fmt, abandoned=abandoned, **options)
    except PlotsNotInstalledError as exc:
        raise NotImplementedHere(str(exc)) from None
    except PlotInputError as exc:
        raise Unprocessable(str(exc)) from None
    except PlotBusyError as exc:
        raise Unavailable(str(exc), 5) from None
    except Exception as exc:  # an option value the renderer does not check; logged in full
        log.warning("plot not drawn", exc_info=True, extra={"kind": plot.kind})
        raise Unprocessable(
            f"{plot.kind} plot: cannot draw it with these options ({type(exc).__name__}: "
            f"{str(exc)[:200]})"
        ) from None


def image(plot: PlotRequest, data: bytes, name: str) -> Response:
    """The image answer, named ``name.<fmt>`` for a download."""
    return Response(
        content=data,
        media_type=MEDIA_TYPES[plot.fmt],
        headers={
            "Content-Disposition": f'inline; filename="{name}.{plot.fmt}"',
            "Cache-Control": "private, max-age=300",
        },
    )


def store_lookup(store: Any) -> WorkspaceLookup:
    """A :data:`WorkspaceLookup` over the workspace store (None for one not stored)."""

    def lookup(workspace_id: str) -> dict[str, Any] | None:
        try:
            return store.get(workspace_id)
        except NotFound:
            return None

    return lookup


def openapi_query_parameters(kinds: Sequence[str]) -> list[dict[str, Any]]:
    """The ``plot`` and ``plot_format`` query parameters of a synchronous route."""
    return [
        {
            "name": "plot",
            "in": "query",
            "required": False,
            "description": "answer this plot of the result (an image) instead of JSON; "
            "plot options as `plot_<option>` (e.g. `plot_title`, `plot_top`, `plot_dpi`), or "
            'an envelope field `"plot": {"kind", "format", ...options}`',
            "schema": {"type": "string", "enum": list(kinds)},
        },
        {
            "name": "plot_format",
            "in": "query",
            "required": False,
            "description": "the plot's format (default png)",
            "schema": {"type": "string", "enum": list(FORMATS)},
        },
    ]
