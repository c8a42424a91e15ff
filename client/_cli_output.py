"""Output of the command line: pyhf's JSON or text tables on stdout or in --output-file, notices
and warnings on stderr (an error exit with --strict), job progress, and the client's exceptions
as one-line messages and exit codes."""

from __future__ import annotations

import csv
import io
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing, contextmanager
from typing import IO, Any

import click

from ._base import ClientBase
from .exceptions import PyhfGpuError, ServerError, TransportError, format_detail
from .results import Job, YieldsResult, doubtful, patch_errors, result_to_json
from .workspace import observation_notices

EXIT_FAILED = 1
EXIT_UNREACHABLE = 3


class CommandFailed(click.ClickException):
    """A failure reported as ``Error: <message>`` on stderr, exit 1."""

    exit_code = EXIT_FAILED


class Unreachable(CommandFailed):
    """The server could not be reached or timed out: exit 3."""

    exit_code = EXIT_UNREACHABLE


@contextmanager
def errors() -> Iterator[None]:
    """Turn the client's exceptions into one-line messages and exit codes (no traceback)."""
    try:
        yield
    except ServerError as exc:
        raise CommandFailed(
            f"the server answered {exc.status}: {format_detail(exc.detail)}"
        ) from None
    except TransportError as exc:
        raise Unreachable(str(exc)) from None
    except (PyhfGpuError, ValueError) as exc:  # a workspace that cannot be read, a job's end
        raise CommandFailed(str(exc)) from None


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
    patched = not isinstance(result, YieldsResult)
    writer.writerow((("patch",) if patched else ()) + YieldsResult.COLUMNS)
    for patch, yields in _by_patch(result):
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
    """Job progress on stderr: a redrawn bar on a terminal, plain lines otherwise; on a
    terminal, while a request waits for its answer before it becomes a job, the seconds it
    has waited (from the first, every ``TICK_S``)."""

    WIDTH = 30
    TICK_S = 0.5

    def __init__(self, stream: IO[str] | None = None, tty: bool | None = None) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self._last: tuple[str, int] | None = None
        self._drawn = False
        self._lock = threading.Lock()
        self._waiting = threading.Event()  # set: no request waits (nothing to tick)
        self._waiting.set()
        self._ticked = ""  # the waiting line on the terminal now

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """On a terminal, redraw ``waiting for the server: N s`` from the first second until
        the block ends (the line then erased) or the request becomes a job (its bar takes
        over)."""
        if not self.tty:
            yield
            return
        self._waiting = threading.Event()
        ticker = threading.Thread(target=self._tick, args=(time.monotonic(),), daemon=True)
        ticker.start()
        try:
            yield
        finally:
            with self._lock:
                self._waiting.set()
                if self._ticked:
                    self.stream.write("\r" + " " * len(self._ticked) + "\r")
                    self.stream.flush()
                    self._ticked = ""
            ticker.join()

    def _tick(self, start: float) -> None:
        """The ticker of :meth:`waiting`: a redraw every ``TICK_S`` until told to stop."""
        while not self._waiting.wait(self.TICK_S):
            with self._lock:
                waited = time.monotonic() - start
                if not self._waiting.is_set() and waited >= 1.0:
                    self._ticked = f"waiting for the server: {waited:.0f} s"
                    self.stream.write("\r" + self._ticked)
                    self.stream.flush()

    def __call__(self, job: Job) -> None:
        """Report one polled state of ``job``."""
        with self._lock:
            self._waiting.set()  # the job's bar from now on, over the waiting line
            self._ticked = ""
            self._report(job)

    def _report(self, job: Job) -> None:
        """Draw ``job``'s state: the bar, or a line when the state changed."""
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


def output(result: Any, kwargs: dict[str, Any]) -> None:
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


def wait(client: ClientBase, job_id: str, timeout: float | None) -> Job:
    with closing(Progress()) as progress:
        return client.wait(job_id, timeout=timeout, on_update=progress)


def job_json(job: Job) -> dict[str, Any]:
    data = {k: v for k, v in job.raw.items() if k != "result"}
    if job.result is not None:
        data["result"] = result_to_json(job.result)
    return data or {"id": job.id, "status": job.status}
