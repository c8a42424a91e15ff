"""``pyhf-gpu-client``: pyhf's ``cls``/``fit`` commands, computed by a pyhf-gpu server.

``pyhf-gpu-client cls WORKSPACE`` takes the options of ``pyhf cls`` and prints the same JSON
(``indent=4, sort_keys=True``); ``--backend``, ``--optimizer`` and ``--optconf`` are accepted
and ignored so that existing scripts run unchanged. Beyond pyhf: ``--patchset``, several
``--test-poi`` values, ``upper-limit``, ``significance``, cabinetry's ``ranking``, ``scan`` and
``yields`` (``--format table|json|csv``), ``fit --goodness-of-fit``, plots drawn by the server
(``plot KIND WORKSPACE -o FILE.png``, or ``--plot FILE`` on an operation), ``jobs``,
``health`` and ``info``.

Exit codes: 0 success; 1 the server rejected or failed the request, a job failed, or the
input could not be read; 2 usage error; 3 the server could not be reached or timed out.
"""

from __future__ import annotations

import csv
import io
import json
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import click

from . import tables
from ._base import ClientBase
from ._stdlib import StdlibClient
from .exceptions import (
    DoubtfulResultWarning,
    JobError,
    PyhfGpuError,
    ServerError,
    TransportError,
    WorkspaceError,
    format_detail,
)
from .protocol import (
    DEFAULT_SERVER,
    ENV_SERVER,
    ENV_TOKEN,
    MAX_SEED,
    PLOT_KINDS,
    ClientConfig,
    default_plot_kind,
    plot_format,
    plot_kinds_for,
    plot_option,
)
from .results import Job, YieldsResult, doubtful, patch_errors, result_to_json
from .tables import (
    BRAZIL,
    CLS,
    CORRELATION,
    EXCLUSION,
    FIT,
    PULLS,
    RANKING,
    SCAN,
    SIGNIFICANCE,
    UPPER_LIMIT,
    YIELDS,
)
from .workspace import observation_notices

if TYPE_CHECKING:
    from ._client import Client

__all__ = [
    "format_yields_csv",
    "format_yields_table",
    "main",
    "parse_plot_options",
    "parse_test_poi",
    "run",
]

EXIT_FAILED = 1
EXIT_UNREACHABLE = 3
_META = "pyhf_gpu_client"


class CommandFailed(click.ClickException):
    """A failure reported as ``Error: <message>`` on stderr, exit 1."""

    exit_code = EXIT_FAILED


class Unreachable(CommandFailed):
    """The server could not be reached or timed out: exit 3."""

    exit_code = EXIT_UNREACHABLE


@contextmanager
def _errors() -> Iterator[None]:
    """Turn the client's exceptions into one-line messages and exit codes (no traceback)."""
    try:
        yield
    except WorkspaceError as exc:
        raise CommandFailed(str(exc)) from None
    except ServerError as exc:
        raise CommandFailed(
            f"the server answered {exc.status}: {format_detail(exc.detail)}"
        ) from None
    except TransportError as exc:
        raise Unreachable(str(exc)) from None
    except JobError as exc:
        raise CommandFailed(str(exc)) from None
    except PyhfGpuError as exc:
        raise CommandFailed(str(exc)) from None
    except ValueError as exc:
        raise CommandFailed(str(exc)) from None


# ------------------------------------------------------------------- connection options


def _store(ctx: click.Context, param: click.Parameter, value: Any) -> None:
    """Remember a connection option given at group or command level (the command's wins)."""
    if value is not None:
        ctx.meta.setdefault(_META, {})[param.name] = value


def connection_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """``--server``, ``--token``, ``--timeout``, ``--retries``, accepted before or after the command."""
    options = [
        click.option(
            "--server",
            metavar="URL",
            expose_value=False,
            callback=_store,
            help=f"Service URL [env {ENV_SERVER}; default {DEFAULT_SERVER}].",
        ),
        click.option(
            "--token",
            metavar="TOKEN",
            expose_value=False,
            callback=_store,
            help=f"API token, sent as 'Authorization: Bearer' [env {ENV_TOKEN}].",
        ),
        click.option(
            "--timeout",
            type=click.FloatRange(min=0, min_open=True),
            metavar="SECONDS",
            expose_value=False,
            callback=_store,
            help="Seconds to wait for one answer [default 600].",
        ),
        click.option(
            "--retries",
            type=click.IntRange(min=0),
            expose_value=False,
            callback=_store,
            help="Retries on connection errors, 429 and 503 [default 4].",
        ),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _client(ctx: click.Context) -> StdlibClient | Client:
    """A client from the connection options (environment variables fill the rest): over
    ``http.client`` for a plain ``http://`` server (:class:`~._stdlib.StdlibClient`: no httpx
    to import), else httpx's :class:`~pyhf_gpu_client.Client` (TLS, proxies)."""
    opts = ctx.meta.get(_META, {})
    kwargs: dict[str, Any] = {}
    if "timeout" in opts:
        kwargs["timeout"] = opts["timeout"]
    if "retries" in opts:
        kwargs["retries"] = opts["retries"]
    server = opts.get("server") or os.environ.get(ENV_SERVER) or DEFAULT_SERVER
    if ClientConfig(server=server).plain_http():
        return StdlibClient(server, token=opts.get("token"), **kwargs)
    from ._client import Client

    return Client(server, token=opts.get("token"), **kwargs)


# -------------------------------------------------------------------------- helpers


def parse_test_poi(values: Sequence[str], option: str = "--test-poi") -> float | list[float]:
    """``--test-poi`` values -> one float (as pyhf) or a list (several, comma lists, ranges).

    ``start:stop:num`` is ``num`` evenly spaced values from ``start`` to ``stop`` inclusive.
    """
    points: list[float] = []
    single = len(values) == 1
    for value in values:
        for piece in str(value).split(","):
            piece = piece.strip()
            if not piece:
                continue
            if ":" in piece:
                single = False
                points.extend(_linspace(piece, option))
            else:
                try:
                    points.append(float(piece))
                except ValueError:
                    raise click.BadParameter(
                        f"{piece!r} is not a number", param_hint=f"'{option}'"
                    ) from None
        if "," in str(value):
            single = False
    if not points:
        raise click.BadParameter("no value given", param_hint=f"'{option}'")
    return points[0] if single and len(points) == 1 else points


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


def emit(obj: Any, output_file: str | None) -> None:
    """Print ``obj`` as pyhf does (``indent=4, sort_keys=True``), or write it to a file."""
    if output_file is None:
        click.echo(json.dumps(obj, indent=4, sort_keys=True))
    else:
        with open(output_file, "w+", encoding="utf-8") as out:
            json.dump(obj, out, indent=4, sort_keys=True)


def emit_text(text: str, output_file: str | None) -> None:
    """Print ``text`` as it is (a table, CSV), or write it to a file."""
    if output_file is None:
        click.echo(text, nl=False)
    else:
        with open(output_file, "w", encoding="utf-8", newline="") as out:
            out.write(text)


def _by_patch(result: Any) -> list[tuple[str | None, YieldsResult]]:
    """``[(None, result)]`` for one result, ``[(patch, result), ...]`` for a patchset's."""
    if isinstance(result, YieldsResult):
        return [(None, result)]
    return list(result.items())


def text_table(rows: Sequence[dict[str, str]]) -> str:
    """Aligned columns under a header line (the first column left, the others right)."""
    headers = list(rows[0])
    cells = [headers, *([row[h] for h in headers] for row in rows)]
    widths = [max(len(line[c]) for line in cells) for c in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        first, *rest = (
            v.ljust(w) if c == 0 else v.rjust(w)
            for c, (v, w) in enumerate(zip(values, widths, strict=True))
        )
        return "  ".join([first, *rest]).rstrip()

    rule = ["-" * w for w in widths]
    return "\n".join([line(headers), line(rule), *(line(c) for c in cells[1:])])


def format_yields_table(result: Any, precision: int = 2) -> str:
    """Yields as text tables, cabinetry's ``tabulate.yields`` layout: per fit (pre-, then
    post-fit) and channel, one row per sample, ``total`` and ``data``, one column per bin and
    the channel sum, ``value ± stdev``; a patchset's results one patch after the other."""
    blocks = []
    for patch, yields in _by_patch(result):
        if patch is not None:
            blocks.append(f"=== patch {patch} ===")
        for fit in YieldsResult.FITS:
            for channel, rows in yields.table(fit, precision).items():
                blocks.append(f"{fit} yields, channel {channel}:\n{text_table(rows)}")
    return "\n\n".join(blocks) + "\n"


def format_yields_csv(result: Any) -> str:
    """Yields as CSV: a header, then one row per (fit, channel, sample, bin) of
    :meth:`YieldsResult.rows` (a first ``patch`` column for a patchset's results)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    parts = _by_patch(result)
    patched = not isinstance(result, YieldsResult)
    writer.writerow((("patch",) if patched else ()) + YieldsResult.COLUMNS)
    for patch, yields in parts:
        for row in yields.rows():
            values = ["" if v is None else v for v in row.values()]
            writer.writerow(([patch] if patched else []) + values)
    return out.getvalue()


#: ``--format`` of yields: text formatters (``json`` is :func:`emit`'s)
_FORMATS: dict[str, Callable[[Any], str]] = {
    "table": format_yields_table,
    "csv": format_yields_csv,
}


class Progress:
    """Job progress on stderr: a redrawn bar on a terminal, plain lines otherwise."""

    WIDTH = 30

    def __init__(self, stream: IO[str] | None = None, tty: bool | None = None) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self._last: tuple[str, int] | None = None
        self._drawn = False

    def __call__(self, job: Job) -> None:
        """Report one polled state of ``job``."""
        percent = -1 if job.progress is None else round(100 * min(max(job.progress, 0.0), 1.0))
        state = (job.status, percent)
        if self.tty:
            filled = 0 if percent < 0 else percent * self.WIDTH // 100
            bar = "#" * filled + "-" * (self.WIDTH - filled)
            shown = "" if percent < 0 else f"{percent:3d}%"
            self.stream.write(f"\r{job.id[:12]} [{bar}] {shown} {job.status:<10}")
            self.stream.flush()
            self._drawn = True
        elif state != self._last:
            shown = "" if percent < 0 else f" {percent}%"
            self.stream.write(f"job {job.id}: {job.status}{shown}\n")
            self.stream.flush()
        self._last = state

    def close(self) -> None:
        """End the bar's line."""
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False


# ------------------------------------------------------------------------- commands


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="pyhf-gpu", prog_name="pyhf-gpu-client")
@connection_options
def main() -> None:
    """pyhf's cls and fit, and cabinetry's ranking, scan and yields, computed by a pyhf-gpu
    service.

    A drop-in for `pyhf cls` / `pyhf fit`: same options, same JSON output. The server is
    --server or $PYHF_GPU_SERVER (default http://127.0.0.1:8000), the token --token or
    $PYHF_GPU_API_TOKEN. Results the server flagged (fits that did not converge, extra starts
    that disagree, a limit past the POI's bounds, the POI's best fit on its bound) are printed
    with a warning on stderr (with --strict: exit 1).
    """
    # the commands say it in their own words, once per result (_output)
    warnings.simplefilter("ignore", DoubtfulResultWarning)


def _workspace_options(f: Callable[..., Any], outputs: bool = True) -> Callable[..., Any]:
    """WORKSPACE, --measurement, -p/--patch, --patchset, --patch-name (and with ``outputs``
    --output-file and --strict)."""
    output_file = click.option(
        "--output-file",
        help="The location of the output json file. If not specified, prints to screen.",
        default=None,
    )
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
        *([output_file] if outputs else []),
        click.option("--measurement", default=None),
        click.option(
            "-p", "--patch", multiple=True, help="A jsonpatch file applied first (repeatable)."
        ),
        click.option(
            "--patchset",
            default=None,
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
    for decorator in reversed(decorators):
        f = decorator(f)
    return f


def _compat_options(f: Callable[..., Any]) -> Callable[..., Any]:
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
    for decorator in reversed(decorators):
        f = decorator(f)
    return f


def _cls_options(
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
    for decorator in reversed(decorators):
        f = decorator(f)
    return _calculator_options(f)


def _calculator_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """--calctype, --ntoys, --seed: asymptotic or toy-based p-values (cls, significance)."""
    decorators = [
        click.option(
            "--calctype", type=click.Choice(["asymptotics", "toybased"]), default="asymptotics"
        ),
        click.option(
            "--ntoys",
            type=click.IntRange(min=1),
            default=None,
            help="Toys per hypothesis with --calctype toybased [server default 2000].",
        ),
        click.option(
            "--seed",
            type=click.IntRange(min=0, max=MAX_SEED),
            default=None,
            help="Random seed of the toys with --calctype toybased (an unsigned 64-bit integer).",
        ),
    ]
    for decorator in reversed(decorators):
        f = decorator(f)
    return f


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
        grid = parse_test_poi(values, flag("values"))
        out["values" + suffix] = grid if isinstance(grid, list) else [grid]
    elif bounds:
        out["range" + suffix] = list(bounds)
    return out


def _operation_kwargs(operation: str, kwargs: dict[str, Any]) -> dict[str, Any]:
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
            scan = parse_test_poi(kwargs["scan"], "--scan")
            out["scan"] = scan if isinstance(scan, list) else [scan]
    elif operation == RANKING:
        out.update(parameters=list(kwargs["parameter"]) or None, top=kwargs.get("top"))
    elif operation == SCAN:
        out.update(_scan_axis(kwargs), **_scan_axis(kwargs, "_y"))
    return out


def _output(result: Any, kwargs: dict[str, Any]) -> None:
    """Print the results as pyhf would; patches that could not be tested are left out of it
    and reported on stderr (an error exit only with ``--strict``)."""
    failed = patch_errors(result)
    if failed:
        result = {name: r for name, r in result.items() if name not in failed}
    text_format = _FORMATS.get(kwargs.get("format") or "json")
    if text_format is not None:
        emit_text(text_format(result), kwargs.get("output_file"))
    else:
        emit(
            result_to_json(
                result,
                value=bool(kwargs.get("value", True)),
                uncertainties=bool(kwargs.get("uncertainties", False)),
            ),
            kwargs.get("output_file"),
        )
    for notice in observation_notices(result):
        click.echo(f"Notice: {notice}", err=True)
    for name, error in failed.items():
        click.echo(
            f"Warning: patch {name!r} was not tested ({error.status}): {error.detail}", err=True
        )
    flagged = doubtful(result)
    for line in flagged:
        click.echo(f"Warning: {line}", err=True)
    if failed and kwargs.get("strict"):
        raise CommandFailed(f"{len(failed)} of {len(failed) + len(result)} patches were not tested")
    if flagged and kwargs.get("strict"):
        count = f"{len(flagged)} flag{'s' if len(flagged) != 1 else ''}"
        raise CommandFailed(f"{count} on the results (the warnings above)")


#: the operations run by a command of the same name (and ``jobs submit``): the client's
#: method of each is named as it is, ``_`` for ``-``
_COMMANDS = (CLS, FIT, UPPER_LIMIT, SIGNIFICANCE, RANKING, SCAN, YIELDS)


def _method(operation: str) -> str:
    return operation.replace("-", "_")


def _run_blocking(operation: str) -> Callable[..., None]:
    def command(**kwargs: Any) -> None:
        ctx = click.get_current_context()
        with _errors():
            call_kwargs = _operation_kwargs(operation, kwargs)
            plot = _job_plot(operation, kwargs, call_kwargs)
            if plot is not None:
                _run_with_plot(ctx, operation, kwargs, call_kwargs, plot)
                return
            with _client(ctx) as client:
                result = getattr(client, _method(operation))(kwargs["workspace"], **call_kwargs)
            _output(result, kwargs)

    return command


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


def _file_format(path: str, option: str) -> str:
    """``png`` or ``svg`` from the suffix of ``path`` (a usage error otherwise)."""
    try:
        return plot_format(path)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint=f"'{option}'") from None


def _job_plot(
    operation: str, kwargs: dict[str, Any], call_kwargs: dict[str, Any]
) -> tuple[str, str, dict[str, Any]] | None:
    """``(kind, format, options)`` of ``--plot FILE``, checked to fit before anything runs."""
    path = kwargs.get("plot_file")
    if path is None:
        if kwargs.get("plot_kind") or kwargs.get("plot_option"):
            raise click.UsageError("--plot-kind and --plot-option need --plot FILE")
        return None
    fmt = _file_format(path, "--plot")
    fitting = plot_kinds_for(operation, call_kwargs)
    kind = kwargs.get("plot_kind") or default_plot_kind(operation, call_kwargs)
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


def _write_plot(path: str, data: bytes) -> None:
    """Write an image (an unwritable path: exit 1)."""
    try:
        Path(path).write_bytes(data)
    except OSError as exc:
        raise CommandFailed(f"cannot write the plot to {path!r}: {exc}") from None


def _run_with_plot(
    ctx: click.Context,
    operation: str,
    kwargs: dict[str, Any],
    call_kwargs: dict[str, Any],
    plot: tuple[str, str, dict[str, Any]],
) -> None:
    """``--plot FILE``: submit as a job, wait (progress on stderr), print the result as the
    blocking command does, then fetch the job's plot into FILE (the fit runs once)."""
    kind, fmt, options = plot
    with _client(ctx) as client:
        job = client.submit(operation, kwargs["workspace"], **call_kwargs)
        click.echo(f"submitted job {job.id}", err=True)
        job = _wait(client, job.id, None)
        failure: CommandFailed | None = None
        try:
            _output(job.result, kwargs)
        except CommandFailed as exc:  # --strict: still draw the patches that were tested
            failure = exc
        _write_plot(kwargs["plot_file"], client.plot(job, kind, fmt, **options))
    if failure is not None:
        raise failure


def _run_submit(operation: str) -> Callable[..., None]:
    def command(**kwargs: Any) -> None:
        ctx = click.get_current_context()
        with _errors():
            call_kwargs = _operation_kwargs(operation, kwargs)
            with _client(ctx) as client:
                job = client.submit(operation, kwargs["workspace"], **call_kwargs)
                if not kwargs.get("wait"):
                    click.echo(job.id)
                    return
                click.echo(f"submitted job {job.id}", err=True)
                job = _wait(client, job.id, kwargs.get("wait_timeout"))
            _output(job.result, kwargs)

    return command


def _wait(client: ClientBase, job_id: str, timeout: float | None) -> Job:
    progress = Progress()
    try:
        return client.wait(job_id, timeout=timeout, on_update=progress)
    finally:
        progress.close()


_HELP = {
    CLS: "Compute CLs value(s) for a given pyhf workspace (as `pyhf cls`).",
    FIT: "Perform a maximum likelihood fit for a given pyhf workspace (as `pyhf fit`).",
    UPPER_LIMIT: "Observed and expected upper limits on the POI (upper_limit_obs, upper_limit_exp, level).",
    SIGNIFICANCE: "Discovery p-value and significance (p0, Z), observed and expected.",
    RANKING: "Impacts of the nuisance parameters on the POI, pre- and post-fit, with pulls "
    "and constraints (as cabinetry's ranking); largest impact first.",
    SCAN: "Profile-likelihood scan (-2 delta ln L) of a parameter over a grid, or of two "
    "(--parameter-y ...) over a 2D grid (as cabinetry's scan; without --values or --range, "
    "its default grid: each patch's best fit +- 3 uncertainties).",
    YIELDS: "Pre- and post-fit yields per channel, sample and bin with uncertainties, and "
    "the data (as cabinetry's yield tables).",
}


def _scan_axis_options(f: Callable[..., Any], suffix: str = "") -> Callable[..., Any]:
    """--parameter, --values, --range, --steps (``suffix`` "-y": the second axis)."""
    axis = "the second axis (a 2D scan)" if suffix else "the scanned parameter"
    decorators = [
        click.option(
            f"--parameter{suffix}",
            default=None,
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
            default=None,
            metavar="LO HI",
            help=f"An evenly spaced grid from LO to HI (with --steps{suffix}).",
        ),
        click.option(
            f"--steps{suffix}",
            type=click.IntRange(min=2),
            default=None,
            help=f"Grid points over --range{suffix}, or without a grid over each patch's "
            "best fit +- 3 uncertainties (cabinetry's default) [server default 11].",
        ),
    ]
    for decorator in reversed(decorators):
        f = decorator(f)
    return f


def _upper_limit_options(
    f: Callable[..., Any],
    level_help: str = "CLs level of the limit [server default 0.05, i.e. 95% CL].",
) -> Callable[..., Any]:
    """--level, --scan."""
    f = click.option(
        "--level",
        type=click.FloatRange(0, 1, min_open=True, max_open=True),
        default=None,
        help=level_help,
    )(f)
    return click.option(
        "--scan",
        multiple=True,
        metavar="VALUES",
        help="POI values to scan: start:stop:num or a comma list [server: automatic].",
    )(f)


def _ranking_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """--parameter (repeatable), --top."""
    f = click.option(
        "--parameter",
        multiple=True,
        metavar="NAME",
        help="Rank only this parameter (repeatable; a label such as lumi or "
        "staterror_SR[0]) [default: every free parameter but the POI].",
    )(f)
    return click.option(
        "--top",
        type=click.IntRange(min=1),
        default=None,
        metavar="N",
        help="Only the N largest impacts.",
    )(f)


def _job_plot_options(f: Callable[..., Any], operation: str) -> Callable[..., Any]:
    """--plot FILE, --plot-kind, --plot-option: run as a job, then write its plot."""
    kinds = sorted(PLOT_KINDS[operation], key=lambda k: tables.PLOTS[k]["draws"] != "patchset")
    needs = tables.PLOT_NEEDS.get(operation, {})
    implied = ", ".join(f"{k} with {needs[k]['flag']}" for k in kinds) if needs else kinds[0]
    decorators = [
        click.option(
            "--plot",
            "plot_file",
            default=None,
            metavar="FILE",
            help="Also draw the result into FILE (.png or .svg): the command then runs as a "
            f"job (progress on stderr) and its plot is fetched [kind: {implied}].",
        ),
        click.option(
            "--plot-kind",
            type=click.Choice(sorted(tables.PLOTS)),
            default=None,
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
    for decorator in reversed(decorators):
        f = decorator(f)
    return f


def make_command(operation: str, submit: bool = False) -> click.Command:
    """Build the ``operation`` command: blocking (top level) or queued (``jobs submit``)."""
    callback = _run_submit(operation) if submit else _run_blocking(operation)
    if operation == FIT:
        callback = click.option(
            "--uncertainties",
            is_flag=True,
            help="Also print the server's uncertainties and corr_mat (not in pyhf's output).",
        )(callback)
        callback = click.option(
            "--value",
            help="Flag for returning the fitted value of the objective function.",
            default=False,
            is_flag=True,
        )(callback)
    if operation == CLS:
        callback = _cls_options(callback)
    if operation == SIGNIFICANCE:
        callback = _calculator_options(callback)
    if operation == UPPER_LIMIT:
        callback = _upper_limit_options(callback)
    if operation == FIT:
        callback = click.option(
            "--goodness-of-fit",
            is_flag=True,
            help="Add the saturated-model goodness of fit: goodness_of_fit {p_value, "
            "delta_twice_nll, ndof} (as cabinetry's).",
        )(callback)
    if operation == RANKING:
        callback = _ranking_options(callback)
    if operation == SCAN:
        callback = _scan_axis_options(_scan_axis_options(callback, "-y"))
    if operation == YIELDS:
        callback = click.option(
            "--format",
            type=click.Choice(["json", "table", "csv"]),
            default="json",
            show_default=True,
            help="json: the server's JSON; table: aligned tables per fit and channel "
            "(value ± stdev); csv: one row per fit, channel, sample and bin.",
        )(callback)
    if operation in (CLS, FIT):
        callback = _compat_options(callback)
    if not submit and PLOT_KINDS.get(operation):
        callback = _job_plot_options(callback, operation)
    if submit:
        callback = click.option(
            "--wait-timeout",
            type=float,
            default=None,
            metavar="SECONDS",
            help="With --wait: give up waiting after this long (the job keeps running).",
        )(callback)
        callback = click.option(
            "--wait",
            is_flag=True,
            help="Wait for the result and print it (progress on stderr); else print the job id.",
        )(callback)
    callback = _workspace_options(callback)
    callback = connection_options(callback)
    help_text = _HELP[operation] + (
        "\n\nQueued as an asynchronous job; prints its id (or, with --wait, the result)."
        if submit
        else "\n\nWORKSPACE is a path or - for stdin (the default)."
    )
    return click.command(name=operation, help=help_text)(callback)


for _operation in _COMMANDS:
    main.add_command(make_command(_operation))


@main.group()
def jobs() -> None:
    """Asynchronous jobs: submit, status, wait, cancel, list."""


@jobs.group()
def submit() -> None:
    """Queue an operation: `jobs submit cls WORKSPACE [options]`; prints the job id."""


for _operation in _COMMANDS:
    submit.add_command(make_command(_operation, submit=True))


def _job_json(job: Job) -> dict[str, Any]:
    data = {k: v for k, v in job.raw.items() if k != "result"}
    if job.result is not None:
        data["result"] = result_to_json(job.result)
    return data or {"id": job.id, "status": job.status}


@jobs.command("status")
@click.argument("job_id")
@connection_options
def jobs_status(job_id: str) -> None:
    """Print the job's state (status, progress, result once done) as JSON."""
    with _errors(), _client(click.get_current_context()) as client:
        emit(_job_json(client.job(job_id)), None)


@jobs.command("wait")
@click.argument("job_id")
@click.option(
    "--wait-timeout", type=float, default=None, metavar="SECONDS", help="Give up after this long."
)
@click.option(
    "--output-file",
    default=None,
    help="The location of the output json file. If not specified, prints to screen.",
)
@click.option("--value/--no-value", default=True, help="For fit jobs: print twice_nll.")
@connection_options
def jobs_wait(
    job_id: str, wait_timeout: float | None, output_file: str | None, value: bool
) -> None:
    """Wait for a job (progress on stderr), then print its result as pyhf JSON."""
    with _errors(), _client(click.get_current_context()) as client:
        job = _wait(client, job_id, wait_timeout)
        emit(result_to_json(job.result, value=value), output_file)


@jobs.command("cancel")
@click.argument("job_id")
@connection_options
def jobs_cancel(job_id: str) -> None:
    """Cancel a queued or running job; prints its state."""
    with _errors(), _client(click.get_current_context()) as client:
        emit(_job_json(client.cancel(job_id)), None)


@jobs.command("list")
@click.option("--status", default=None, help="Only jobs with this status.")
@connection_options
def jobs_list(status: str | None) -> None:
    """List the server's jobs as JSON (id, operation, status, progress)."""
    with _errors(), _client(click.get_current_context()) as client:
        listed = client.jobs(status)
        emit(
            [
                {"id": j.id, "operation": j.operation, "status": j.status, "progress": j.progress}
                for j in listed
            ],
            None,
        )


# ---------------------------------------------------------------------------------- plot

#: plot kind -> the operation it draws, the first that offers it (``brazil`` without
#: --test-poi: ``upper-limit``)
PLOT_OPERATIONS: dict[str, str] = {}
for _operation, _kinds in PLOT_KINDS.items():
    for _kind in _kinds:
        PLOT_OPERATIONS.setdefault(_kind, _operation)

_PLOT_HELP = {
    BRAZIL: "CLs observed and expected (±1σ, ±2σ bands) versus the POI: `cls` over several "
    "--test-poi values, or without --test-poi the upper limit's scan (--level, --scan).",
    EXCLUSION: "CLs = 0.05 contours over the signal points of --patchset (their metadata "
    "values): `cls` of every patch (or the --patch-name ones).",
    PULLS: "Pulls (θ̂ − θ₀)/Δθ of the constrained parameters: a `fit`.",
    CORRELATION: "The correlation matrix of a `fit` (weakly correlated parameters left out).",
    RANKING: "Impacts on the POI, pre- and post-fit, and pulls: `ranking`.",
    SCAN: "-2Δln L of a `scan` with 1σ/2σ lines, or 68%/95% CL contours of a 2D scan.",
    YIELDS: "Stacked post-fit yields per channel, the data and data / model: `yields` "
    "(--option stage=prefit for the pre-fit ones).",
}


def _plot_operation(kind: str, kwargs: dict[str, Any]) -> str:
    """The operation a ``plot KIND`` command runs (usage errors for options that do not fit)."""
    if kind == EXCLUSION and not kwargs.get("patchset"):
        raise click.UsageError("an exclusion plot needs --patchset")
    if kind != BRAZIL:
        return PLOT_OPERATIONS[kind]
    if kwargs.get("test_poi"):
        if kwargs.get("scan"):
            raise click.UsageError(
                "--scan is the upper limit's; with --test-poi give the values there"
            )
        if not isinstance(parse_test_poi(kwargs["test_poi"]), list):
            raise click.UsageError(
                "a brazil plot needs several --test-poi values (e.g. 0:2:11), or none: the "
                "upper limit's scan"
            )
        return CLS
    toys = kwargs.get("ntoys") is not None or kwargs.get("seed") is not None
    if toys or kwargs.get("calctype") != "asymptotics" or kwargs.get("test_stat") != "qtilde":
        raise click.UsageError(
            "--test-stat, --calctype, --ntoys and --seed apply to a CLs scan: give --test-poi"
        )
    return UPPER_LIMIT


def make_plot_command(kind: str) -> click.Command:
    """``plot KIND WORKSPACE [operation options] -o FILE``: one synchronous request whose
    answer is the image (``Client.render``)."""

    def command(**kwargs: Any) -> None:
        ctx = click.get_current_context()
        output = kwargs["output"]
        fmt = _file_format(output, "--output")
        options = parse_plot_options(kwargs.get("option") or (), kind=kind)
        for name in tables.PLOT_COMMON_OPTIONS:  # those with a flag of their own
            if kwargs.get(name) is not None:
                options[name] = kwargs[name]
        operation = _plot_operation(kind, kwargs)
        with _errors():
            call_kwargs = _operation_kwargs(operation, kwargs)
            if operation == CLS and kwargs.get("level") is not None:
                options.setdefault("level", kwargs["level"])  # the brazil line, not a cls option
            with _client(ctx) as client:
                data = client.render(
                    operation, kwargs["workspace"], kind, fmt, options, **call_kwargs
                )
            _write_plot(output, data)

    callback: Callable[..., Any] = command
    if kind == BRAZIL:
        callback = _upper_limit_options(
            callback,
            "CLs level: of the upper limit, or the line drawn with --test-poi [default 0.05].",
        )
        callback = _cls_options(
            callback,
            test_poi=(),
            test_poi_help="POI values of a CLs scan: repeat it, a comma list or start:stop:num "
            "[default: the upper limit's scan].",
        )
    elif kind == EXCLUSION:
        callback = _cls_options(callback)
    elif kind == RANKING:
        callback = _ranking_options(callback)
    elif kind == SCAN:
        callback = _scan_axis_options(_scan_axis_options(callback, "-y"))
    decorators = [
        click.option(
            "-o",
            "--output",
            required=True,
            metavar="FILE",
            help="The image file; its suffix is the format: .png or .svg.",
        ),
        click.option("--title", default=None, help="A title above the plot."),
        click.option(
            "--label",
            default=None,
            help="An experiment label at the top left, e.g. 'ATLAS Internal' (first word bold).",
        ),
        click.option(
            "--rlabel", default=None, help="A label at the top right, e.g. '13 TeV, 139 fb⁻¹'."
        ),
        click.option(
            "--dpi",
            type=click.FloatRange(min=1),
            default=None,
            help="PNG resolution [server default 150].",
        ),
        click.option(
            "--option",
            multiple=True,
            metavar="KEY=VALUE",
            help="A renderer option (repeatable): top=10, threshold=0.3, channels=SR,CR, "
            "stage=prefit, log_y=true, figsize=8,6, patch=NAME, ... (docs/SERVICE.md).",
        ),
    ]
    for decorator in reversed(decorators):
        callback = decorator(callback)
    callback = _workspace_options(callback, outputs=False)
    callback = connection_options(callback)
    return click.command(
        name=kind,
        help=_PLOT_HELP[kind] + "\n\nWORKSPACE is a path or - for stdin (the default).",
    )(callback)


@main.group("plot")
def plot_group() -> None:
    """Draw a plot of an operation's answer on the server into -o FILE (.png or .svg).

    `plot KIND WORKSPACE [options of the operation KIND runs] -o FILE`: brazil (cls over
    several --test-poi, or the upper limit's scan), exclusion (cls of a --patchset), pulls and
    correlation (fit), ranking, scan, yields. To print a result and draw it from one run, give
    --plot FILE to cls, upper-limit, fit, ranking, scan or yields instead.
    """


for _kind in PLOT_OPERATIONS:
    plot_group.add_command(make_plot_command(_kind))


@main.command()
@connection_options
def health() -> None:
    """Check /healthz and /readyz; exit 0 only when the server is ready."""
    with _errors(), _client(click.get_current_context()) as client:
        out: dict[str, Any] = {"server": client.config.server, "healthz": client.health()}
        try:
            out["readyz"] = client.ready()
            ready = True
        except ServerError as exc:
            out["readyz"] = {"status": exc.status, "detail": exc.detail}
            ready = False
        emit(out, None)
        if not ready:
            raise CommandFailed("the server is not ready")


@main.command()
@connection_options
def info() -> None:
    """Print the server's /info (version, device, limits) as JSON."""
    with _errors(), _client(click.get_current_context()) as client:
        emit(client.info(), None)


if __name__ == "__main__":  # pragma: no cover
    main()


def run() -> None:
    """The console script: :func:`main`, then exit at once with its status.

    A command's answer is printed and flushed by then; tearing the interpreter down would
    only free the workspace and patchset objects one by one (30 ms on a 218-patch command).
    """
    try:
        main()
    except SystemExit as exc:
        status = exc.code
    else:  # pragma: no cover - click's standalone mode always exits
        status = 0
    if not isinstance(status, int):
        if status is not None:
            sys.stderr.write(f"{status}\n")
        status = 0 if status is None else EXIT_FAILED
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BrokenPipeError:  # a reader that stopped early (| head): as Python itself exits
        status = status or 120
    os._exit(status)
