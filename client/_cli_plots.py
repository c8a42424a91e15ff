"""Plots on the command line: the operation a ``plot KIND`` command runs and its options, the
``KEY=VALUE`` renderer options, and ``--plot FILE`` of an operation (checked before it runs)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click

from . import _cli_options as opts
from . import tables
from ._cli_output import CommandFailed
from ._plot_options import plot_format, plot_option

#: plot kind -> the operation it draws, the first that offers it (``brazil`` without
#: --test-poi: ``upper-limit``)
PLOT_OPERATIONS: dict[str, str] = {}
for _operation, _kinds in tables.PLOT_KINDS.items():
    for _kind in _kinds:
        PLOT_OPERATIONS.setdefault(_kind, _operation)

PLOT_HELP = {
    tables.BRAZIL: "CLs observed and expected (±1σ, ±2σ bands) versus the POI: `cls` over "
    "several --test-poi values, or without --test-poi the upper limit's scan (--level, --scan).",
    tables.EXCLUSION: "CLs = 0.05 contours over the signal points of --patchset (their "
    "metadata values): `cls` of every patch (or the --patch-name ones).",
    tables.PULLS: "Pulls (θ̂ − θ₀)/Δθ of the constrained parameters: a `fit`.",
    tables.CORRELATION: "The correlation matrix of a `fit` (weakly correlated parameters left "
    "out).",
    tables.RANKING: "Impacts on the POI, pre- and post-fit, and pulls: `ranking`.",
    tables.SCAN: "-2Δln L of a `scan` with 1σ/2σ lines, or 68%/95% CL contours of a 2D scan.",
    tables.YIELDS: "Stacked post-fit yields per channel, the data and data / model: `yields` "
    "(--option stage=prefit for the pre-fit ones).",
}


def plot_operation(kind: str, kwargs: dict[str, Any]) -> str:
    """The operation a ``plot KIND`` command runs (usage errors for options that do not fit)."""
    if kind == tables.EXCLUSION and not kwargs.get("patchset"):
        raise click.UsageError("an exclusion plot needs --patchset")
    if kind != tables.BRAZIL:
        return PLOT_OPERATIONS[kind]
    if kwargs.get("test_poi"):
        if kwargs.get("scan"):
            raise click.UsageError(
                "--scan is the upper limit's; with --test-poi give the values there"
            )
        if not isinstance(opts.parse_test_poi(kwargs["test_poi"]), list):
            raise click.UsageError(
                "a brazil plot needs several --test-poi values (e.g. 0:2:11), or none: the "
                "upper limit's scan"
            )
        return tables.CLS
    toys = kwargs.get("ntoys") is not None or kwargs.get("seed") is not None
    if toys or kwargs.get("calctype") != "asymptotics" or kwargs.get("test_stat") != "qtilde":
        raise click.UsageError(
            "--test-stat, --calctype, --ntoys and --seed apply to a CLs scan: give --test-poi"
        )
    return tables.UPPER_LIMIT


def parse_plot_options(
    values: Sequence[str], option: str = "--option", kind: str | None = None
) -> dict[str, Any]:
    """``KEY=VALUE`` options of the renderer (of plot ``kind``), typed (``top=5`` an int,
    ``channels=SR,CR`` a list; see :func:`pyhf_gpu_client.protocol.plot_option`)."""
    out: dict[str, Any] = {}
    for text in values:
        try:
            key, value = plot_option(text, kind)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint=f"'{option}'") from None
        out[key] = value
    return out


def file_format(path: str, option: str) -> str:
    """``png`` or ``svg`` from the suffix of ``path`` (a usage error otherwise)."""
    try:
        return plot_format(path)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint=f"'{option}'") from None


def job_plot(
    operation: str, kwargs: dict[str, Any], call_kwargs: dict[str, Any]
) -> tuple[str, str, dict[str, Any]] | None:
    """``(kind, format, options)`` of ``--plot FILE``, checked to fit before anything runs."""
    path = kwargs.get("plot_file")
    if path is None:
        if kwargs.get("plot_kind") or kwargs.get("plot_option"):
            raise click.UsageError("--plot-kind and --plot-option need --plot FILE")
        return None
    fmt = file_format(path, "--plot")
    fitting = tables.plot_kinds_for(operation, call_kwargs)
    kind = kwargs.get("plot_kind") or tables.default_plot_kind(operation, call_kwargs)
    if kind is None:
        raise click.UsageError(
            "--plot: a cls plot needs several --test-poi values (a brazil plot, e.g. "
            "--test-poi 0:2:11) or --patchset (an exclusion plot)"
        )
    if kind not in fitting:
        need = tables.PLOT_NEEDS.get(operation, {}).get(kind)
        why = f" ({_article(kind)} {kind} plot needs {need['flag']})" if need else ""
        raise click.UsageError(
            f"--plot-kind {kind} does not fit {operation}{why}; the kinds that do: "
            f"{', '.join(fitting) or 'none'}"
        )
    options = parse_plot_options(kwargs.get("plot_option") or (), "--plot-option", kind)
    return kind, fmt, options


def _article(word: str) -> str:
    return "an" if word[:1] in tuple("aeiou") else "a"


def write_plot(path: str, data: bytes) -> None:
    """Write an image (an unwritable path: exit 1)."""
    try:
        Path(path).write_bytes(data)
    except OSError as exc:
        raise CommandFailed(f"cannot write the plot to {path!r}: {exc}") from None


def plot_command_options(f: Callable[..., Any], kind: str) -> Callable[..., Any]:
    """The options of the ``plot KIND`` command: those of the operation it runs, the image's."""
    if kind == tables.BRAZIL:
        f = opts.upper_limit_options(
            f,
            "CLs level: of the upper limit, or the line drawn with --test-poi [default 0.05].",
        )
        f = opts.cls_options(
            f,
            test_poi=(),
            test_poi_help="POI values of a CLs scan: repeat it, a comma list or start:stop:num "
            "[default: the upper limit's scan].",
        )
    elif kind == tables.EXCLUSION:
        f = opts.cls_options(f)
    elif kind == tables.RANKING:
        f = opts.ranking_options(f)
    elif kind == tables.SCAN:
        f = opts.scan_axis_options(opts.scan_axis_options(f, "-y"))
    decorators = [
        click.option(
            "-o",
            "--output",
            required=True,
            metavar="FILE",
            help="The image file; its suffix is the format: .png or .svg.",
        ),
        click.option("--title", help="A title above the plot."),
        click.option(
            "--label",
            help="An experiment label at the top left, e.g. 'ATLAS Internal' (first word bold).",
        ),
        click.option("--rlabel", help="A label at the top right, e.g. '13 TeV, 139 fb⁻¹'."),
        click.option(
            "--dpi", type=click.FloatRange(min=1), help="PNG resolution [server default 150]."
        ),
        click.option(
            "--option",
            multiple=True,
            metavar="KEY=VALUE",
            help="A renderer option (repeatable): top=10, threshold=0.3, channels=SR,CR, "
            "stage=prefit, log_y=true, figsize=8,6, patch=NAME, ... (docs/SERVICE.md).",
        ),
    ]
    return opts.connection_options(opts.workspace_options(opts.apply(f, decorators), outputs=False))
