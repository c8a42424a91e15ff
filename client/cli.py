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

The commands are defined here; their options in ``_cli_options.py``, their output (JSON,
tables, warnings, exit codes) in ``_cli_output.py``, plots in ``_cli_plots.py`` (the names of
those that callers use as ``cli.<name>`` re-exported here, ``import X as X``).
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from typing import TYPE_CHECKING, Any

import click

from . import _cli_output as out
from . import _cli_plots as plots
from . import tables
from ._cli_options import META as _META
from ._cli_options import OUTPUT_FILE, connection_options, operation_kwargs, operation_options
from ._cli_options import parse_test_poi as parse_test_poi
from ._cli_output import EXIT_UNREACHABLE as EXIT_UNREACHABLE
from ._cli_output import Progress as Progress
from ._cli_output import format_yields_csv as format_yields_csv
from ._cli_output import format_yields_table as format_yields_table
from ._cli_plots import PLOT_OPERATIONS, parse_plot_options
from ._request import DEFAULT_SERVER, ENV_SERVER, ClientConfig
from ._stdlib import StdlibClient
from .exceptions import DoubtfulResultWarning, ServerError
from .results import result_to_json
from .tables import CLS, FIT, RANKING, SCAN, SIGNIFICANCE, UPPER_LIMIT, YIELDS

if TYPE_CHECKING:
    from ._client import Client


def _client(ctx: click.Context, progress: out.Progress | None = None) -> StdlibClient | Client:
    """A client from the connection options (environment variables fill the rest): over
    ``http.client`` for a plain ``http://`` server (:class:`~._stdlib.StdlibClient`: no httpx
    to import), else httpx's :class:`~pyhf_gpu_client.Client` (TLS, proxies). ``progress``
    reports a computation that the server made a job (after the client's ``job_after``)."""
    opts = ctx.meta.get(_META, {})
    kwargs: dict[str, Any] = {"on_job_update": progress}
    kwargs.update({k: opts[k] for k in ("timeout", "retries", "job_after") if k in opts})
    server = opts.get("server") or os.environ.get(ENV_SERVER) or DEFAULT_SERVER
    if ClientConfig(server=server).plain_http():
        return StdlibClient(server, token=opts.get("token"), **kwargs)
    from ._client import Client

    return Client(server, token=opts.get("token"), **kwargs)


@contextmanager
def _connected() -> Iterator[StdlibClient | Client]:
    """The client of the current command; its exceptions as messages and exit codes."""
    with out.errors(), _client(click.get_current_context()) as client:
        yield client


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="pyhf-gpu", prog_name="pyhf-gpu-client")
@connection_options
def main() -> None:
    """pyhf's cls and fit, and cabinetry's ranking, scan and yields, computed by a pyhf-gpu
    service.

    A drop-in for `pyhf cls` / `pyhf fit`: same options, same JSON output. The server is
    --server or $PYHF_GPU_SERVER (default http://127.0.0.1:8000), the token --token or
    $PYHF_GPU_API_TOKEN. Results the server flagged (fits that did not converge, extra starts
    that disagree, a limit past the POI's bounds, the POI's best fit on its bound, a p-value of
    0 that more toys would resolve) are printed with a warning on stderr (with --strict: exit
    1).
    """
    # the commands say it in their own words, once per result (_cli_output.output)
    warnings.simplefilter("ignore", DoubtfulResultWarning)


#: the operations run by a command of the same name (and ``jobs submit``): the client's
#: method of each is named as it is, ``_`` for ``-``
_COMMANDS = (CLS, FIT, UPPER_LIMIT, SIGNIFICANCE, RANKING, SCAN, YIELDS)


def _run(operation: str, submit: bool) -> Callable[..., None]:
    """The ``operation`` command: the client's call, or with ``submit`` a queued job (its id,
    or with --wait its result)."""

    def command(**kwargs: Any) -> None:
        ctx = click.get_current_context()
        with out.errors():
            call_kwargs = operation_kwargs(operation, kwargs)
            plot = plots.job_plot(operation, kwargs, call_kwargs)  # None for `jobs submit`
            if plot is not None:
                _run_with_plot(ctx, operation, kwargs, call_kwargs, plot)
                return
            progress = out.Progress()
            with _client(ctx, progress) as client, closing(progress):
                if submit:
                    job = client.submit(operation, kwargs["workspace"], **call_kwargs)
                    if not kwargs.get("wait"):
                        click.echo(job.id)
                        return
                    click.echo(f"submitted job {job.id}", err=True)
                    result = out.wait(client, job.id, kwargs.get("wait_timeout")).result
                else:
                    method = getattr(client, operation.replace("-", "_"))
                    with progress.waiting():
                        result = method(kwargs["workspace"], **call_kwargs)
            out.output(result, kwargs)

    return command


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
        job = out.wait(client, job.id, None)
        failure: out.CommandFailed | None = None
        try:
            out.output(job.result, kwargs)
        except out.CommandFailed as exc:  # --strict: still draw the patches that were tested
            failure = exc
        plots.write_plot(kwargs["plot_file"], client.plot(job, kind, fmt, **options))
    if failure is not None:
        raise failure


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


def make_command(operation: str, submit: bool = False) -> click.Command:
    """Build the ``operation`` command: blocking (top level) or queued (``jobs submit``)."""
    help_text = _HELP[operation] + (
        "\n\nQueued as an asynchronous job; prints its id (or, with --wait, the result)."
        if submit
        else "\n\nWORKSPACE is a path or - for stdin (the default)."
    )
    return click.command(name=operation, help=help_text)(
        operation_options(_run(operation, submit), operation, submit)
    )


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


def _job_state_command(name: str, method: str, doc: str) -> None:
    """``jobs NAME JOB_ID``: print the job's state as ``client.<method>(JOB_ID)`` answers it."""

    @jobs.command(name, help=doc)
    @click.argument("job_id")
    @connection_options
    def command(job_id: str) -> None:
        with _connected() as client:
            out.emit(out.job_json(getattr(client, method)(job_id)), None)


_job_state_command(
    "status", "job", "Print the job's state (status, progress, result once done) as JSON."
)
_job_state_command("cancel", "cancel", "Cancel a queued or running job; prints its state.")


@jobs.command("wait")
@click.argument("job_id")
@click.option(
    "--wait-timeout", type=float, default=None, metavar="SECONDS", help="Give up after this long."
)
@OUTPUT_FILE
@click.option("--value/--no-value", default=True, help="For fit jobs: print twice_nll.")
@connection_options
def jobs_wait(
    job_id: str, wait_timeout: float | None, output_file: str | None, value: bool
) -> None:
    """Wait for a job (progress on stderr), then print its result as pyhf JSON."""
    with _connected() as client:
        job = out.wait(client, job_id, wait_timeout)
        out.emit(result_to_json(job.result, value=value), output_file)


@jobs.command("list")
@click.option("--status", default=None, help="Only jobs with this status.")
@connection_options
def jobs_list(status: str | None) -> None:
    """List the server's jobs as JSON (id, operation, status, progress)."""
    with _connected() as client:
        out.emit(
            [
                {"id": j.id, "operation": j.operation, "status": j.status, "progress": j.progress}
                for j in client.jobs(status)
            ],
            None,
        )


def make_plot_command(kind: str) -> click.Command:
    """``plot KIND WORKSPACE [operation options] -o FILE``: one synchronous request whose
    answer is the image (``Client.render``)."""

    def command(**kwargs: Any) -> None:
        ctx = click.get_current_context()
        path = kwargs["output"]
        fmt = plots.file_format(path, "--output")
        options = parse_plot_options(kwargs.get("option") or (), kind=kind)
        for name in tables.PLOT_COMMON_OPTIONS:  # those with a flag of their own
            if kwargs.get(name) is not None:
                options[name] = kwargs[name]
        operation = plots.plot_operation(kind, kwargs)
        with out.errors():
            call_kwargs = operation_kwargs(operation, kwargs)
            if operation == CLS and kwargs.get("level") is not None:
                options.setdefault("level", kwargs["level"])  # the brazil line, not a cls option
            with _client(ctx) as client:
                data = client.render(
                    operation, kwargs["workspace"], kind, fmt, options, **call_kwargs
                )
            plots.write_plot(path, data)

    return click.command(
        name=kind,
        help=plots.PLOT_HELP[kind] + "\n\nWORKSPACE is a path or - for stdin (the default).",
    )(plots.plot_command_options(command, kind))


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
    with _connected() as client:
        answer: dict[str, Any] = {"server": client.config.server, "healthz": client.health()}
        try:
            answer["readyz"] = client.ready()
            ready = True
        except ServerError as exc:
            answer["readyz"] = {"status": exc.status, "detail": exc.detail}
            ready = False
        out.emit(answer, None)
        if not ready:
            raise out.CommandFailed("the server is not ready")


@main.command()
@connection_options
def info() -> None:
    """Print the server's /info (version, device, limits) as JSON."""
    with _connected() as client:
        out.emit(client.info(), None)


if __name__ == "__main__":  # pragma: no cover
    main()


def run() -> None:
    """The console script: :func:`main`, then exit at once with its status.

    A command's answer is printed and flushed by then; tearing the interpreter down would
    only free the workspace and patchset objects one by one.
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
        status = 0 if status is None else out.EXIT_FAILED
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BrokenPipeError:  # a reader that stopped early (| head): as Python itself exits
        status = status or 120
    os._exit(status)
