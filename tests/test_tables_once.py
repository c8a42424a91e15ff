"""One table per fact: the operation names, the plot kinds per operation, what each kind
needs and is given, and the plot options with their types and defaults are declared once, in
``pyhf_gpu_client.tables`` (the lower layer). The server uses those very objects, the
renderers' signatures are what the tables say, the web page reads them from ``GET /tables``,
and no other module under ``server/`` or ``client/`` restates them (checked on the syntax
trees: a literal table of operation names, plot kinds or plot options, or the spelled-out
name ``"upper-limit"``)."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from pyhf_gpu_client import cli, protocol, tables
from pyhf_gpu_server import plots
from pyhf_gpu_server.service import plotting
from pyhf_gpu_server.service.operations import OPERATIONS
from pyhf_gpu_server.service.routers import pages

ROOT = Path(tables.__file__).resolve().parents[1]
TABLES = Path(tables.__file__).resolve()
OPERATION_NAMES = frozenset(tables.OPERATION_NAMES)
KIND_NAMES = frozenset(tables.PLOTS)
OPTION_NAMES = frozenset(tables.QUERY_OPTIONS) | frozenset(plotting.JSON_OPTIONS)
#: Modules, not yet moved to the constants, that still spell operation names (each with
#: its offences; the list may only shrink: ``test_the_pending_modules_still_offend``).


# ------------------------------------------------------------------------- the one source
def test_the_server_and_the_client_use_the_tables() -> None:
    assert plotting.PLOTS is tables.PLOT_KINDS is protocol.PLOT_KINDS
    assert plotting.MEDIA_TYPES is tables.PLOT_MEDIA_TYPES
    assert plots.FORMATS is tables.PLOT_FORMATS is protocol.PLOT_FORMATS
    assert plotting.QUERY_OPTIONS is tables.QUERY_OPTIONS
    assert set(OPERATIONS) == OPERATION_NAMES
    assert set(tables.PLOT_KINDS) == OPERATION_NAMES
    assert set(plots.KINDS) == KIND_NAMES == {k for ks in tables.PLOT_KINDS.values() for k in ks}
    assert {k: kind.description for k, kind in plots.KINDS.items()} == {
        k: plot["description"] for k, plot in tables.PLOTS.items()
    }
    assert set(plots.COMMON_OPTIONS) == set(tables.PLOT_COMMON_OPTIONS)
    assert set(cli.PLOT_OPERATIONS) == KIND_NAMES
    for operation, needs in tables.PLOT_NEEDS.items():
        assert set(needs) <= set(tables.PLOT_KINDS[operation])
    # every source and adapter a kind names is one the service has
    for plot in tables.PLOTS.values():
        for source in plot["inputs"].values():
            assert source.startswith("request:") or source in plotting._SOURCES, source
        assert plot["adapt"] is None or plot["adapt"] in plotting._ADAPTERS
        assert plot["draws"] in ("patch", "patchset")


#: the annotation each option type is drawn with (``| None`` aside)
ANNOTATIONS = {
    "int": "int",
    "float": "float",
    "bool": "bool",
    "str": "str",
    "strs": "Sequence[str]",
    "ints": "Sequence[int]",
    "floats": "Sequence[float]",
}


def _annotation_fits(kind: str, annotation: Any) -> bool:
    text = str(annotation).removesuffix(" | None")
    if kind == "json":
        return text.startswith("Mapping[")
    return text == ANNOTATIONS[kind]


@pytest.mark.parametrize("kind", sorted(tables.PLOTS))
def test_each_renderer_signature_is_its_table(kind: str) -> None:
    """The renderer's keyword options are the table's, in order, with its defaults and types
    (the renderers keep their signatures; the table is what the client can read)."""
    parameters = list(inspect.signature(plots.KINDS[kind].draw).parameters.values())[1:]
    declared = tables.PLOTS[kind]["options"]
    assert [p.name for p in parameters] == list(declared)
    for p in parameters:
        of, default = declared[p.name]
        assert p.kind is inspect.Parameter.KEYWORD_ONLY, p.name
        assert p.default == default, (kind, p.name, p.default, default)
        assert _annotation_fits(of, p.annotation), (kind, p.name, p.annotation, of)


def test_the_common_options_are_figure_and_render_options() -> None:
    signature = (
        inspect.signature(plots.figure).parameters | inspect.signature(plots.render).parameters
    )
    for name, (of, default, _) in tables.PLOT_COMMON_OPTIONS.items():
        assert _annotation_fits(of, signature[name].annotation), name
        if name == "dpi":  # render's None is the table's default
            assert default == plots._base.DEFAULT_DPI
        else:
            assert signature[name].default == default, name


def test_options_are_typed_alike_on_both_sides() -> None:
    """The client's ``KEY=VALUE`` and the server's query read an option the same way, by
    the kind where kinds differ (``test_poi``)."""
    assert protocol.plot_option("slice=60") == ("slice", [60.0])
    assert plotting.query_options({"slice": ["60"]}) == {"slice": [60.0]}
    assert protocol.plot_option("test_poi=1", tables.EXCLUSION) == ("test_poi", 1.0)
    assert protocol.plot_option("test_poi=1,2", tables.BRAZIL) == ("test_poi", [1.0, 2.0])
    assert plotting.query_options({"test_poi": ["1"]}, kind=tables.EXCLUSION) == {"test_poi": 1.0}
    assert plotting.query_options({"test_poi": ["1,2"]}, kind=tables.BRAZIL) == {
        "test_poi": [1.0, 2.0]
    }
    for name in tables.QUERY_OPTIONS:
        assert tables.option_type(name) in (*ANNOTATIONS, None), name


def test_get_tables_answers_the_tables() -> None:
    app = FastAPI()
    pages.add_pages(app)
    answer = TestClient(app).get("/tables")
    assert answer.status_code == 200
    got = answer.json()
    assert got["operations"] == list(tables.OPERATION_NAMES)
    assert got["plot_kinds"]["cls"] == ["brazil", "exclusion"]
    assert got["plots"]["exclusion"]["draws"] == "patchset"
    assert got["plots"]["ranking"]["options"]["top"] == ["int", 20]
    assert got["plot_formats"] == tables.PLOT_MEDIA_TYPES


# ------------------------------------------------------------------- no copies elsewhere
def _strings(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Dict):
        items: list[Any] = list(node.keys)
    elif isinstance(node, (ast.Set, ast.Tuple, ast.List)):
        items = list(node.elts)
    else:
        return []
    return [i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)]


def _exports(tree: ast.AST) -> set[int]:
    """The ids of ``__all__``'s literals (function names such as ``fit`` and ``scan``)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            out.add(id(node.value))
    return out


def restatements(source: str) -> list[str]:
    """What in ``source`` restates the tables: a dict, set, tuple or list literal naming two
    operations, two plot kinds or three plot options as strings, or the literal
    ``"upper-limit"`` (use ``tables.UPPER_LIMIT``)."""
    tree = ast.parse(source)
    exported = _exports(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and node.value == tables.UPPER_LIMIT:
            found.append(f"line {node.lineno}: {tables.UPPER_LIMIT!r}")
        if id(node) in exported:
            continue
        named = set(_strings(node))
        for what, names, least in (
            ("operations", OPERATION_NAMES, 2),
            ("plot kinds", KIND_NAMES, 2),
            ("plot options", OPTION_NAMES, 3),
        ):
            if len(named & names) >= least:
                found.append(f"line {node.lineno}: a literal of {what} {sorted(named & names)}")
    return found


def _sources() -> dict[str, list[str]]:
    out = {}
    for path in sorted([*ROOT.glob("server/**/*.py"), *ROOT.glob("client/**/*.py")]):
        if path.resolve() == TABLES:
            continue
        found = restatements(path.read_text(encoding="utf-8"))
        if found:
            out[path.relative_to(ROOT).as_posix()] = found
    return out


def test_no_module_restates_the_tables() -> None:
    offending = _sources()
    assert offending == {}, "use pyhf_gpu_client.tables (its constants and tables)"


@pytest.mark.parametrize(
    "source",
    [
        'PLOTS = {"cls": ("brazil",), "fit": ("pulls", "correlation")}',
        'NEEDS = {"brazil": "a list of test_poi", "exclusion": "a patchset"}',
        'INTS = ("top", "max_channels", "columns")',
        'if operation in ("cls", "significance"):\n    pass',
        'path = "/" + "upper-limit"',
    ],
)
def test_a_restated_table_is_found(source: str) -> None:
    assert restatements(source)


def test_what_is_not_a_table_passes() -> None:
    source = (
        '__all__ = ["fit", "ranking", "scan"]\n'
        "KINDS = {tables.CLS: (tables.BRAZIL,), tables.FIT: (tables.PULLS,)}\n"
        'if kind == "exclusion":\n    pass\n'
    )
    assert restatements(source) == []


# ---------------------------------------------------------------------------- the page
def test_the_page_reads_the_tables_not_a_copy() -> None:
    """``app.js`` names no plot kind (it asks ``GET /tables`` what a kind draws) and holds no
    list of operation names (one object keys its results tables by operation)."""
    script = (pages.static_dir() / "app.js").read_text(encoding="utf-8")
    assert 'json("/tables")' in script
    quoted = set(re.findall(r"[\"'`]([a-z-]+)[\"'`]", script))
    assert not quoted & (KIND_NAMES - OPERATION_NAMES)
    for listed in re.findall(r"\[([^\[\]]*)\]", script):
        names = set(re.findall(r"[\"']([a-z-]+)[\"']", listed))
        assert len(names & OPERATION_NAMES) < 2, listed
