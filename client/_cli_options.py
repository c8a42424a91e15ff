"""The options of the command line's commands, and what they become: the client's
connection (``--server`` ...), the workspace and patchset, each operation's own options
(pyhf's and cabinetry's names) and their values as the client's keyword arguments."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import click

from . import tables
from ._request import DEFAULT_SERVER, ENV_SERVER, ENV_TOKEN, MAX_SEED
from .tables import CLS, FIT, PLOT_KINDS, RANKING, SCAN, SIGNIFICANCE, UPPER_LIMIT, YIELDS

META = "pyhf_gpu_client"

#: ``--output-file`` of a command that prints a result
OUTPUT_FILE = click.option(
    "--output-file",
    help="The location of the output json file. If not specified, prints to screen.",
)


def apply(f: Callable[..., Any], decorators: Sequence[Callable[..., Any]]) -> Callable[..., Any]:
    """``f`` decorated by ``decorators``, the first outermost (as if stacked above it)."""
    for decorator in reversed(decorators):
        f = decorator(f)
    return f


def _store(ctx: click.Context, param: click.Parameter, value: Any) -> None:
    """Remember a connection option given at group or command level (the command's wins)."""
    if value is not None:
        ctx.meta.setdefault(META, {})[param.name] = value


def _connection(*decls: str, **attrs: Any) -> Callable[..., Any]:
    """A connection option: remembered (:func:`_store`), not passed to the command."""
    return click.option(*decls, expose_value=False, callback=_store, **attrs)


def connection_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """``--server``, ``--token``, ``--timeout``, ``--retries``, ``--job-after``, accepted before
    or after the command."""
    decorators = [
        _connection(
            "--server",
            metavar="URL",
            help=f"Service URL [env {ENV_SERVER}; default {DEFAULT_SERVER}].",
        ),
        _connection(
            "--token",
            metavar="TOKEN",
            help=f"API token, sent as 'Authorization: Bearer' [env {ENV_TOKEN}].",
        ),
        _connection(
            "--timeout",
            type=click.FloatRange(min=0, min_open=True),
            metavar="SECONDS",
            help="Seconds to wait for one answer [default 600].",
        ),
        _connection(
            "--retries",
            type=click.IntRange(min=0),
            help="Retries on connection errors, 429 and 503 [default 4].",
        ),
        _connection(
            "--job-after",
            type=click.FloatRange(min=0),
            metavar="SECONDS",
            help="A computation still running after SECONDS becomes a job on the server, "
            "followed to its end (at most --timeout) with its progress on stderr [default 10].",
        ),
    ]
    return apply(f, decorators)


def parse_test_poi(values: Sequence[str], option: str = "--test-poi") -> float | list[float]:
    """``--test-poi`` values -> one float (as pyhf) or a list (several, comma lists, ranges).

    ``start:stop:num`` is ``num`` evenly spaced values from ``start`` to ``stop`` inclusive.
    """
    points: list[float] = []
    for piece in (piece.strip() for value in values for piece in str(value).split(",")):
        if ":" in piece:
            points.extend(_linspace(piece, option))
        elif piece:
            try:
                points.append(float(piece))
            except ValueError:
                raise click.BadParameter(
                    f"{piece!r} is not a number", param_hint=f"'{option}'"
                ) from None
    if not points:
        raise click.BadParameter("no value given", param_hint=f"'{option}'")
    single = len(values) == 1 and not {",", ":"} & set(str(values[0]))
    return points[0] if single else points


def _grid(values: Sequence[str], option: str) -> list[float]:
    """:func:`parse_test_poi`'s values, always a list."""
    grid = parse_test_poi(values, option)
    return grid if isinstance(grid, list) else [grid]


def _linspace(text: str, option: str = "--test-poi") -> list[float]:
    parts = text.split(":")
    try:
        if len(parts) != 3:
            raise ValueError
        start, stop, num = float(parts[0]), float(parts[1]), int(parts[2])
        if num < 1:
            raise ValueError
    except ValueError:
        raise click.BadParameter(
            f"{text!r}: a range is start:stop:num, e.g. 0:2:21", param_hint=f"'{option}'"
        ) from None
    if num == 1:
        return [start]
    step = (stop - start) / (num - 1)
    return [start + i * step for i in range(num - 1)] + [stop]


def workspace_options(f: Callable[..., Any], outputs: bool = True) -> Callable[..., Any]:
    """WORKSPACE, --measurement, -p/--patch, --patchset, --patch-name (and with ``outputs``
    --output-file and --strict)."""
    strict = click.option(
        "--strict",
        is_flag=True,
        help="Exit 1 when some patch of --patchset could not be tested, or the server flagged "
        "some result: fits that did not converge, a limit past the POI's bounds (where pyhf "
        "raises), the POI's best fit on its bound (default: warn on stderr, print the "
        "results).",
    )
    decorators = [
        click.argument("workspace", default="-"),
        *([OUTPUT_FILE] if outputs else []),
        click.option("--measurement"),
        click.option(
            "-p", "--patch", multiple=True, help="A jsonpatch file applied first (repeatable)."
        ),
        click.option(
            "--patchset",
            metavar="PATCHSET",
            help="A pyhf PatchSet: run every patch on WORKSPACE in one batch; prints {patch: result}.",
        ),
        click.option(
            "--patch-name",
            multiple=True,
            metavar="NAME",
            help="Only these patches of --patchset (repeatable; default all).",
        ),
        *([strict] if outputs else []),
    ]
    return apply(f, decorators)


def compat_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """pyhf's --backend/--optimizer/--optconf: accepted, ignored (the server has one engine)."""
    decorators = [
        click.option(
            "--backend",
            type=click.Choice(["numpy", "pytorch", "tensorflow", "jax", "np", "torch", "tf"]),
            default="numpy",
            help="Accepted for compatibility with pyhf; ignored (the server computes).",
        ),
        click.option(
            "--optimizer",
            type=click.Choice(["scipy", "minuit"]),
            default="scipy",
            help="Accepted for compatibility with pyhf; ignored.",
        ),
        click.option(
            "--optconf", multiple=True, help="Accepted for compatibility with pyhf; ignored."
        ),
    ]
    return apply(f, decorators)


def cls_options(
    f: Callable[..., Any],
    test_poi: tuple[str, ...] = ("1.0",),
    test_poi_help: str = "POI value to test; repeat it, give a comma list or start:stop:num "
    "to scan.",
) -> Callable[..., Any]:
    decorators = [
        click.option(
            "--test-poi",
            multiple=True,
            default=test_poi,
            show_default=bool(test_poi),
            help=test_poi_help,
        ),
        click.option("--test-stat", type=click.Choice(["q", "qtilde"]), default="qtilde"),
    ]
    return calculator_options(apply(f, decorators))


def calculator_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """--calctype, --ntoys, --seed: asymptotic or toy-based p-values (cls, significance)."""
    decorators = [
        click.option(
            "--calctype", type=click.Choice(["asymptotics", "toybased"]), default="asymptotics"
        ),
        click.option(
            "--ntoys",
            type=click.IntRange(min=1),
            help="Toys per hypothesis with --calctype toybased [server default 2000].",
        ),
        click.option(
            "--seed",
            type=click.IntRange(min=0, max=MAX_SEED),
            help="Random seed of the toys with --calctype toybased (an unsigned 64-bit integer).",
        ),
    ]
    return apply(f, decorators)


def scan_axis_options(f: Callable[..., Any], suffix: str = "") -> Callable[..., Any]:
    """--parameter, --values, --range, --steps (``suffix`` "-y": the second axis)."""
    axis = "the second axis (a 2D scan)" if suffix else "the scanned parameter"
    decorators = [
        click.option(
            f"--parameter{suffix}",
            metavar="NAME",
            help=f"Label of {axis}, e.g. lumi or staterror_SR[0] [default: the POI].",
        ),
        click.option(
            f"--values{suffix}",
            multiple=True,
            metavar="VALUES",
            help="Grid values, increasing: a comma list or start:stop:num (repeatable).",
        ),
        click.option(
            f"--range{suffix}",
            nargs=2,
            type=float,
            metavar="LO HI",
            help=f"An evenly spaced grid from LO to HI (with --steps{suffix}).",
        ),
        click.option(
            f"--steps{suffix}",
            type=click.IntRange(min=2),
            help=f"Grid points over --range{suffix}, or without a grid over each patch's "
            "best fit +- 3 uncertainties (cabinetry's default) [server default 11].",
        ),
    ]
    return apply(f, decorators)


def upper_limit_options(
    f: Callable[..., Any],
    level_help: str = "CLs level of the limit [server default 0.05, i.e. 95% CL].",
) -> Callable[..., Any]:
    """--level, --scan."""
    f = click.option(
        "--level",
        type=click.FloatRange(0, 1, min_open=True, max_open=True),
        help=level_help,
    )(f)
    return click.option(
        "--scan",
        multiple=True,
        metavar="VALUES",
        help="POI values to scan: start:stop:num or a comma list [server: automatic].",
    )(f)


def ranking_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """--parameter (repeatable), --top."""
    f = click.option(
        "--parameter",
        multiple=True,
        metavar="NAME",
        help="Rank only this parameter (repeatable; a label such as lumi or "
        "staterror_SR[0]) [default: every free parameter but the POI].",
    )(f)
    return click.option(
        "--top", type=click.IntRange(min=1), metavar="N", help="Only the N largest impacts."
    )(f)


def job_plot_options(f: Callable[..., Any], operation: str) -> Callable[..., Any]:
    """--plot FILE, --plot-kind, --plot-option: run as a job, then write its plot."""
    kinds = sorted(PLOT_KINDS[operation], key=lambda k: tables.PLOTS[k]["draws"] != "patchset")
    needs = tables.PLOT_NEEDS.get(operation, {})
    implied = ", ".join(f"{k} with {needs[k]['flag']}" for k in kinds) if needs else kinds[0]
    decorators = [
        click.option(
            "--plot",
            "plot_file",
            metavar="FILE",
            help="Also draw the result into FILE (.png or .svg): the command then runs as a "
            f"job (progress on stderr) and its plot is fetched [kind: {implied}].",
        ),
        click.option(
            "--plot-kind",
            type=click.Choice(sorted(tables.PLOTS)),
            help="The plot kind of --plot, when not the one implied.",
        ),
        click.option(
            "--plot-option",
            multiple=True,
            metavar="KEY=VALUE",
            help="A renderer option of --plot, e.g. label='ATLAS Internal', dpi=100, top=10 "
            "(repeatable).",
        ),
    ]
    return apply(f, decorators)


def operation_options(f: Callable[..., Any], operation: str, submit: bool) -> Callable[..., Any]:
    """The options of the ``operation`` command: blocking (top level) or queued (``jobs
    submit``)."""
    if operation == FIT:
        f = click.option(
            "--uncertainties",
            is_flag=True,
            help="Also print the server's uncertainties and corr_mat (not in pyhf's output).",
        )(f)
        f = click.option(
            "--value",
            help="Flag for returning the fitted value of the objective function.",
            is_flag=True,
        )(f)
        f = click.option(
            "--goodness-of-fit",
            is_flag=True,
            help="Add the saturated-model goodness of fit: goodness_of_fit {p_value, "
            "delta_twice_nll, ndof} (as cabinetry's).",
        )(f)
    elif operation == CLS:
        f = cls_options(f)
    elif operation == SIGNIFICANCE:
        f = calculator_options(f)
    elif operation == UPPER_LIMIT:
        f = upper_limit_options(f)
    elif operation == RANKING:
        f = ranking_options(f)
    elif operation == SCAN:
        f = scan_axis_options(scan_axis_options(f, "-y"))
    elif operation == YIELDS:
        f = click.option(
            "--format",
            type=click.Choice(["json", "table", "csv"]),
            default="json",
            show_default=True,
            help="json: the server's JSON; table: aligned tables per fit and channel "
            "(value ± stdev); csv: one row per fit, channel, sample and bin.",
        )(f)
    if operation in (CLS, FIT):
        f = compat_options(f)
    if not submit and PLOT_KINDS.get(operation):
        f = job_plot_options(f, operation)
    if submit:
        f = click.option(
            "--wait-timeout",
            type=float,
            metavar="SECONDS",
            help="With --wait: give up waiting after this long (the job keeps running).",
        )(f)
        f = click.option(
            "--wait",
            is_flag=True,
            help="Wait for the result and print it (progress on stderr); else print the job id.",
        )(f)
    return connection_options(workspace_options(f))


def _common(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Client keyword arguments from the shared workspace options."""
    if kwargs.get("patch_name") and not kwargs.get("patchset"):
        raise click.UsageError("--patch-name needs --patchset")
    return {
        "measurement": kwargs.get("measurement"),
        "patches": list(kwargs.get("patch") or ()) or None,
        "patchset": kwargs.get("patchset"),
        "patch_names": list(kwargs.get("patch_name") or ()) or None,
    }


def _scan_axis(kwargs: dict[str, Any], suffix: str = "") -> dict[str, Any]:
    """The client keywords of one scan axis (``suffix`` ``""``: x, ``"_y"``: y)."""

    def flag(name: str) -> str:
        return f"--{name}{suffix.replace('_', '-')}"

    parameter, values = kwargs.get("parameter" + suffix), kwargs.get("values" + suffix)
    bounds, steps = kwargs.get("range" + suffix), kwargs.get("steps" + suffix)
    if values and bounds:
        raise click.UsageError(f"give {flag('values')} or {flag('range')}, not both")
    if steps is not None and values:
        raise click.UsageError(f"{flag('steps')} goes with {flag('range')} or no grid")
    if suffix and not (parameter or values or bounds):
        return {}  # a 1D scan
    out: dict[str, Any] = {"parameter" + suffix: parameter, "steps" + suffix: steps}
    if values:
        out["values" + suffix] = _grid(values, flag("values"))
    elif bounds:
        out["range" + suffix] = list(bounds)
    return out


def operation_kwargs(operation: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """All client keyword arguments for ``operation`` from the parsed CLI options."""
    out = _common(kwargs)
    if operation in (CLS, SIGNIFICANCE):
        out.update(calctype=kwargs["calctype"], ntoys=kwargs.get("ntoys"), seed=kwargs.get("seed"))
    if operation == CLS:
        out.update(test_poi=parse_test_poi(kwargs["test_poi"]), test_stat=kwargs["test_stat"])
    elif operation == FIT:
        out["goodness_of_fit"] = True if kwargs.get("goodness_of_fit") else None
    elif operation == UPPER_LIMIT:
        out["level"] = kwargs.get("level")
        if kwargs.get("scan"):
            out["scan"] = _grid(kwargs["scan"], "--scan")
    elif operation == RANKING:
        out.update(parameters=list(kwargs["parameter"]) or None, top=kwargs.get("top"))
    elif operation == SCAN:
        out.update(_scan_axis(kwargs), **_scan_axis(kwargs, "_y"))
    return out
