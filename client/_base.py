"""The client API, defined once, run by small drivers (no I/O here, no httpx import).

Every public method is written once in :class:`ClientBase` as a function that builds a
sans-IO flow (:mod:`pyhf_gpu_client.protocol`); the :class:`_api` descriptor makes it a method
that hands the flow to the instance's driver, ``_run``: blocking, sending with ``_send``
(``Client``: httpx; ``StdlibClient``: ``http.client``, the command line's), or a coroutine
(``AsyncClient``). So ``Client().cls(ws)`` and ``await AsyncClient().cls(ws)`` return the same.
"""

from __future__ import annotations

import functools
import inspect
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

from . import protocol as p
from . import tables
from .exceptions import TransportError
from .results import Job, Result
from .workspace import JSONSource, WorkspaceId, load_json

__all__ = ["ClientBase"]

T = TypeVar("T")


def _lazy(build: Callable[..., p.Flow[T]], *args: Any, **kwargs: Any) -> p.Flow[T]:
    """Build the flow only when the driver starts it (errors surface on call/await alike)."""
    return (yield from build(*args, **kwargs))


class _api:
    """Descriptor: ``instance.name(...)`` -> ``instance._run(flow_builder(instance, ...))``."""

    def __init__(self, build: Callable[..., Any]) -> None:
        self.build = build
        # a descriptor, not a callable: update_wrapper copies __name__, __doc__... all the same
        functools.update_wrapper(self, build)  # type: ignore[arg-type]

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self
        build = self.build

        @functools.wraps(build)
        def method(*args: Any, **kwargs: Any) -> Any:
            return instance._run(_lazy(build, instance, *args, **kwargs))

        method.__signature__ = self.signature  # type: ignore[attr-defined]
        return method

    @functools.cached_property
    def signature(self) -> inspect.Signature:
        """The public signature: no ``self``; ``p.Flow[X]`` shown as ``X``."""
        sig = inspect.signature(self.build)
        ret = sig.return_annotation
        if isinstance(ret, str) and ret.startswith("p.Flow[") and ret.endswith("]"):
            ret = ret[len("p.Flow[") : -1]
        return sig.replace(parameters=list(sig.parameters.values())[1:], return_annotation=ret)


def _job_id(job: Job | str) -> str:
    return job.id if isinstance(job, Job) else str(job)


#: a method's arguments that are not envelope fields (see :func:`_body`)
_NOT_FIELDS = frozenset({"self", "workspace", "operation", "options"})


def _body(operation: str, args: dict[str, Any], *skip: str, **given: Any) -> dict[str, Any]:
    """:func:`~pyhf_gpu_client.protocol.build_options` of a method's arguments (its
    ``locals()``): its named ones but ``skip`` (``given`` replacing some), then ``**options``."""
    named = {k: v for k, v in args.items() if k not in _NOT_FIELDS and k not in skip}
    return p.build_options(operation, **{**named, **given}, **args["options"])


class ClientBase:
    """Configuration, state and the API; subclasses provide ``_send`` or ``_run`` (the I/O)."""

    def __init__(
        self,
        server: str | None = None,
        *,
        token: str | None = None,
        timeout: float | p.Timeout | Any | None = p.DEFAULT_TIMEOUT,
        retries: int = 4,
        backoff: float = 0.5,
        compress: bool = True,
        upload_threshold: int = 64 * 1024,
        headers: dict[str, str] | None = None,
        job_after: float | None = 10.0,
        on_job_update: Callable[[Job], None] | None = None,
    ) -> None:
        """Configure a client.

        Args:
            server: base URL; default ``$PYHF_GPU_SERVER`` or ``http://127.0.0.1:8000``.
            token: API token; default ``$PYHF_GPU_API_TOKEN``.
            timeout: seconds (or a :class:`~pyhf_gpu_client.protocol.Timeout`, or an
                ``httpx.Timeout``) for one request; ``None`` waits forever.
            retries: retries after the first attempt for connection errors, 429 and 503.
            backoff: first backoff delay in seconds (doubling; a ``Retry-After`` wins).
            compress: gzip request bodies of 1 KiB or more (``Content-Encoding: gzip``).
            upload_threshold: workspaces with at least this many JSON bytes are uploaded once
                (``POST /workspaces``, content-addressed) and then referenced by id.
            headers: extra headers for every request.
            job_after: seconds after which a blocking call the server is still computing
                becomes a job there (``Prefer: respond-async``), which the call follows to its
                end (at most ``timeout``); ``None``: never (the server's
                ``--request-timeout-s`` ends it).
            on_job_update: called with each polled state of such a job (progress).
        """
        self.config = p.ClientConfig(
            server=server or os.environ.get(p.ENV_SERVER) or p.DEFAULT_SERVER,
            token=token if token is not None else os.environ.get(p.ENV_TOKEN) or None,
            timeout=timeout,
            retry=p.RetryPolicy(max_attempts=max(1, retries + 1), backoff=backoff),
            compress=compress,
            upload_threshold=upload_threshold,
            job_after=job_after,
            on_job_update=on_job_update,
        )
        self.state = p.ClientState()
        self._headers = {**self.config.headers(), **(headers or {})}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config.server!r})"

    def _send(self, request: p.Request) -> Any:  # pragma: no cover - provided by subclasses
        raise NotImplementedError

    def _run(self, flow: p.Flow[T]) -> Any:
        """Drive a flow, blocking: send its requests with ``_send`` (which raises the client's
        :class:`~pyhf_gpu_client.exceptions.TransportError`), sleep its sleeps, return its
        value."""
        outcome: Any = None
        error: TransportError | None = None
        while True:
            command = p.advance(flow, outcome, error)
            if isinstance(command, p.Done):
                return command.value
            outcome, error = None, None
            if isinstance(command, p.Sleep):
                time.sleep(command.seconds)
                continue
            try:
                outcome = self._send(command)
            except TransportError as exc:
                error = exc

    def _operation(self, operation: str, args: dict[str, Any], **given: Any) -> p.Flow[Result]:
        """The flow of ``operation`` called with a method's arguments (see :func:`_body`)."""
        body = _body(operation, args, **given)
        return p.operation_flow(operation, args["workspace"], body, self.config, self.state)

    # ------------------------------------------------------------------ the API, once

    @_api
    def cls(
        self,
        workspace: JSONSource,
        test_poi: float | Sequence[float] = 1.0,
        *,
        test_stat: str = "qtilde",
        calctype: str = "asymptotics",
        ntoys: int | None = None,
        seed: int | None = None,
        measurement: str | None = None,
        patches: Sequence[Any] | None = None,
        patchset: JSONSource | None = None,
        patch_names: Sequence[str] | None = None,
        **options: Any,
    ) -> p.Flow[Result]:
        """CLs of ``test_poi``, as ``pyhf cls`` (``POST /cls``).

        Returns a :class:`CLsResult`; a list of them when ``test_poi`` is a sequence; with a
        ``patchset``, ``{patch_name: ...}`` for the named patches (all by default).
        ``ntoys`` and ``seed`` apply to ``calctype="toybased"`` (server defaults when ``None``).
        ``options`` are passed to the server as further envelope fields.
        """
        return self._operation("cls", locals())

    @_api
    def fit(
        self,
        workspace: JSONSource,
        *,
        goodness_of_fit: bool = False,
        measurement: str | None = None,
        patches: Sequence[Any] | None = None,
        patchset: JSONSource | None = None,
        patch_names: Sequence[str] | None = None,
        **options: Any,
    ) -> p.Flow[Result]:
        """Maximum-likelihood fit, as ``pyhf fit --value`` plus uncertainties (``POST /fit``).

        Returns a :class:`FitResult` (``{patch_name: FitResult}`` with a ``patchset``).
        ``goodness_of_fit=True`` adds its saturated-model :class:`GoodnessOfFit` (cabinetry's).
        """
        # goodness_of_fit is not sent unless asked for
        return self._operation("fit", locals(), goodness_of_fit=goodness_of_fit or None)

    @_api
    def upper_limit(
        self,
        workspace: JSONSource,
        *,
        level: float | None = None,
        scan: Sequence[float] | None = None,
        measurement: str | None = None,
        patches: Sequence[Any] | None = None,
        patchset: JSONSource | None = None,
        patch_names: Sequence[str] | None = None,
        **options: Any,
    ) -> p.Flow[Result]:
        """Observed and expected upper limits on the POI (``POST /upper-limit``).

        Returns an :class:`UpperLimitResult` (``{patch_name: ...}`` with a ``patchset``).
        ``level`` defaults to the server's (0.05, i.e. 95% CL); ``scan`` (increasing POI values)
        to the engine's automatic scan.
        """
        return self._operation(
            tables.UPPER_LIMIT, locals(), scan=None if scan is None else [float(v) for v in scan]
        )

    @_api
    def significance(
        self,
        workspace: JSONSource,
        *,
        calctype: str = "asymptotics",
        ntoys: int | None = None,
        seed: int | None = None,
        measurement: str | None = None,
        patches: Sequence[Any] | None = None,
        patchset: JSONSource | None = None,
        patch_names: Sequence[str] | None = None,
        **options: Any,
    ) -> p.Flow[Result]:
        """Discovery p-value and significance, observed and expected (``POST /significance``),
        as pyhf's ``hypotest(0.0, ..., test_stat="q0")``.

        Returns a :class:`SignificanceResult` (``{patch_name: ...}`` with a ``patchset``).
        ``calctype="toybased"`` computes p0 from ``ntoys`` toys drawn with ``seed`` (server
        defaults when ``None``).
        """
        return self._operation("significance", locals())

    @_api
    def ranking(
        self,
        workspace: JSONSource,
        *,
        parameters: str | Sequence[str] | None = None,
        top: int | None = None,
        measurement: str | None = None,
        patches: Sequence[Any] | None = None,
        patchset: JSONSource | None = None,
        patch_names: Sequence[str] | None = None,
        **options: Any,
    ) -> p.Flow[Result]:
        """Impacts of nuisance parameters on the POI, with pulls and constraints
        (``POST /ranking``, cabinetry's ``fit.ranking``).

        Returns a :class:`RankingResult`, largest impact first (``{patch_name: ...}`` with a
        ``patchset``). ``parameters``: labels to rank (``"lumi"``, ``"staterror_SR[0]"``;
        default every free parameter but the POI); ``top``: only the largest ``top`` impacts.
        """
        return self._operation("ranking", locals())

    @_api
    def scan(
        self,
        workspace: JSONSource,
        parameter: str | None = None,
        values: Sequence[float] | None = None,
        range: Sequence[float] | None = None,
        steps: int = 11,
        *,
        parameter_y: str | None = None,
        values_y: Sequence[float] | None = None,
        range_y: Sequence[float] | None = None,
        steps_y: int = 11,
        measurement: str | None = None,
        patches: Sequence[Any] | None = None,
        patchset: JSONSource | None = None,
        patch_names: Sequence[str] | None = None,
        **options: Any,
    ) -> p.Flow[Result]:
        """Profile-likelihood scan, ``-2 delta ln L`` over a grid (``POST /scan``,
        cabinetry's ``fit.scan``).

        ``parameter`` (default the POI) is scanned over ``values``, ``steps`` evenly spaced
        points of ``range = (low, high)``, or with neither ``steps`` points over each patch's
        best fit +- 3 uncertainties (cabinetry's default). With ``parameter_y`` / ``values_y`` /
        ``range_y`` / ``steps_y`` a 2D scan over both grids. Returns a :class:`ScanResult` or
        :class:`Scan2DResult` (``{patch_name: ...}`` with a ``patchset``).
        """
        return self._operation("scan", locals())

    @_api
    def yields(
        self,
        workspace: JSONSource,
        *,
        measurement: str | None = None,
        patches: Sequence[Any] | None = None,
        patchset: JSONSource | None = None,
        patch_names: Sequence[str] | None = None,
        **options: Any,
    ) -> p.Flow[Result]:
        """Pre- and post-fit yields per channel, sample and bin with uncertainties, and the
        data (``POST /yields``, cabinetry's ``model_utils.prediction``).

        Returns a :class:`YieldsResult` (``{patch_name: ...}`` with a ``patchset``).
        """
        return self._operation("yields", locals())

    @_api
    def likelihood(
        self,
        workspace: JSONSource,
        test_poi: float | Sequence[float] = 1.0,
        *,
        data: str | Sequence[float] = "observed",
        asimov: str | None = None,
        free_fit: bool = True,
        poi_bounds: tuple[float, float] | None = None,
        describe: bool = False,
        parameters: Sequence[float] | None = None,
        measurement: str | None = None,
        patches: Sequence[Any] | None = None,
        patchset: JSONSource | None = None,
        patch_names: Sequence[str] | None = None,
        **options: Any,
    ) -> p.Flow[Result]:
        """Profile ``-2 log L`` with the POI fixed at ``test_poi`` and the free minimum
        (``POST /likelihood``), on ``data`` (``"observed"``, ``"apriori"`` or a dataset) and,
        with ``asimov`` (``"q"``, ``"qtilde"``, ``"q0"``), on its Asimov data: what a
        likelihood front end such as spey asks (:mod:`pyhf_gpu_client.spey`).

        Returns a :class:`LikelihoodResult` (a list for a sequence of ``test_poi``;
        ``{patch_name: ...}`` with a ``patchset``). ``poi_bounds`` bound the POI in the free
        fits; ``describe`` adds the model's parameters; ``parameters`` the expected data and
        ``-2 log L`` at that point.
        """
        return self._operation(
            "likelihood",
            locals(),
            data=data if isinstance(data, str) else [float(v) for v in data],
            free_fit=None if free_fit else False,
            poi_bounds=None if poi_bounds is None else [float(v) for v in poi_bounds],
            describe=describe or None,
            parameters=None if parameters is None else [float(v) for v in parameters],
        )

    @_api
    def run_patchset(
        self,
        workspace: JSONSource,
        patchset: JSONSource,
        operation: str = "cls",
        *,
        patch_names: Sequence[str] | None = None,
        **options: Any,
    ) -> p.Flow[dict[str, Any]]:
        """Run ``operation`` for every patch of ``patchset`` (or ``patch_names``) in one batch.

        Returns ``{patch_name: result}``.
        """
        # a patchset's answer: {patch: result}
        return cast("p.Flow[dict[str, Any]]", self._operation(operation, locals()))

    @_api
    def submit(
        self,
        operation: str,
        workspace: JSONSource,
        *,
        measurement: str | None = None,
        patches: Sequence[Any] | None = None,
        patchset: JSONSource | None = None,
        patch_names: Sequence[str] | None = None,
        **options: Any,
    ) -> p.Flow[Job]:
        """Queue ``operation`` as an asynchronous job (``POST /jobs``); returns the :class:`Job`.

        ``options`` as for the blocking methods (``test_poi``, ``test_stat``, ``level``,
        ``parameters``, ``top``, a scan's ``parameter``/``values``/``range``/``steps``, ...).
        """
        body = _body(operation, locals())
        return p.submit_flow(operation, workspace, body, self.config, self.state)

    @_api
    def wait(
        self,
        job: Job | str,
        *,
        timeout: float | None = None,
        poll_interval: float = 0.25,
        on_update: Callable[[Job], None] | None = None,
    ) -> p.Flow[Job]:
        """Poll until ``job`` ends; return it with ``.result`` parsed.

        ``on_update`` is called with every polled state (progress reporting).
        Raises :class:`JobFailedError`, :class:`JobCancelledError` or :class:`WaitTimeoutError`.
        """
        return p.wait_flow(_job_id(job), self.config, timeout, poll_interval, on_update=on_update)

    @_api
    def job(self, job: Job | str) -> p.Flow[Job]:
        """The current state of a job (``GET /jobs/{id}``)."""
        return p.job_flow(_job_id(job), self.config)

    @_api
    def cancel(self, job: Job | str) -> p.Flow[Job]:
        """Cancel a job (``DELETE /jobs/{id}``)."""
        return p.cancel_flow(_job_id(job), self.config)

    @_api
    def jobs(self, status: str | None = None) -> p.Flow[list[Job]]:
        """The server's jobs (``GET /jobs``), optionally only those with ``status``."""
        return p.list_jobs_flow(self.config, status)

    @_api
    def plot(self, job: Job | str, kind: str, format: str = "png", **options: Any) -> p.Flow[bytes]:
        """A plot of a finished job's result (``GET /jobs/{id}/plots/{kind}.{format}``), as
        PNG or SVG bytes.

        ``kind``: ``brazil``, ``exclusion`` (cls), ``pulls``, ``correlation`` (fit),
        ``ranking``, ``scan``, ``yields``; :meth:`plot_kinds` lists those that fit the job.
        ``options`` go to the renderer: ``dpi``, ``figsize=(w, h)``, ``title``, ``label``,
        ``rlabel``, ``patch`` (of a patchset job), ``top``, ``threshold``, ``level``,
        ``channels=[...]``, ``stage``, ``log_y``, ... Raises :class:`BadRequestError` (409)
        until the job succeeded, (422) for a kind that does not fit it.
        """
        return p.plot_flow(_job_id(job), kind, format, options, self.config)

    @_api
    def plot_kinds(self, job: Job | str) -> p.Flow[list[str]]:
        """The plot kinds that fit a job (``GET /jobs/{id}/plots``)."""
        return p.plot_kinds_flow(_job_id(job), self.config)

    @_api
    def render(
        self,
        operation: str,
        workspace: JSONSource,
        kind: str,
        format: str = "png",
        plot_options: dict[str, Any] | None = None,
        *,
        measurement: str | None = None,
        patches: Sequence[Any] | None = None,
        patchset: JSONSource | None = None,
        patch_names: Sequence[str] | None = None,
        **options: Any,
    ) -> p.Flow[bytes]:
        """Run ``operation`` synchronously and get a plot of its answer instead of the result:
        PNG or SVG bytes (``POST /<operation>`` with ``"plot": {"kind", "format", ...}``).

        ``options`` are the operation's, as for :meth:`submit` (``test_poi=[0, 0.5, 1]``, a
        scan's ``parameter``/``values``/``range``, ``top``, ...); ``plot_options`` the
        renderer's, as for :meth:`plot`. The server answers 422 before any work when ``kind``
        does not fit the request (e.g. ``brazil`` for one ``test_poi``).
        """
        body = _body(operation, locals(), "kind", "format", "plot_options")
        return p.render_flow(
            operation, workspace, body, kind, format, plot_options, self.config, self.state
        )

    @_api
    def upload_workspace(self, workspace: JSONSource) -> p.Flow[WorkspaceId]:
        """Upload ``workspace`` unless the server holds it already; its content-addressed id,
        a :class:`WorkspaceId` to pass instead of the workspace from then on."""
        return p.upload_workspace(load_json(workspace), self.config, self.state)

    @_api
    def has_workspace(self, workspace_id: str) -> p.Flow[bool]:
        """Whether the server holds the workspace ``workspace_id`` (``GET /workspaces/{id}``)."""
        return p.has_workspace(workspace_id, self.config)

    @_api
    def health(self) -> p.Flow[Any]:
        """``GET /healthz`` (one attempt: a probe should not wait)."""
        return p.get_json_flow("/healthz", self.config, retry=False)

    @_api
    def ready(self) -> p.Flow[Any]:
        """``GET /readyz`` (one attempt)."""
        return p.get_json_flow("/readyz", self.config, retry=False)

    @_api
    def info(self) -> p.Flow[Any]:
        """``GET /info``: version, device, limits."""
        return p.get_json_flow("/info", self.config)

    @_api
    def metrics(self) -> p.Flow[str]:
        """``GET /metrics`` (Prometheus text)."""
        return p.get_text_flow("/metrics", self.config)
