"""Request and response models (pydantic), apart from the logic that acts on them.

A request names its model (``workspace`` or ``workspace_id``, optional ``patches`` applied in
order, or a ``patchset`` with ``patch_names``, a ``measurement`` and ``modifier_settings``) and
the options of its operation. The same fields, plus ``operation``, make an asynchronous job.
"""

from __future__ import annotations

import itertools
from typing import Annotated, Any, Literal, TypeAlias

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from .settings import LIMITS, Settings

JobStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]
DIGEST_PATTERN = r"^[0-9a-f]{64}$"
MAX_POIS = 1000
MAX_PATCHES = 10_000
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes an unsigned 64-bit integer

FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]


class _Strict(BaseModel):
    """Unknown fields are errors, so a typo is reported instead of silently ignored."""

    model_config = ConfigDict(extra="forbid")


class ModelSelection(_Strict):
    """Which likelihood: a workspace (inline or uploaded), patched, or a patchset of hypotheses."""

    model_config = ConfigDict(
        json_schema_extra={  # what _one_source checks, said in the schema too
            "oneOf": [{"required": ["workspace"]}, {"required": ["workspace_id"]}],
            "dependentRequired": {"patch_names": ["patchset"]},
            "not": {"required": ["patches", "patchset"]},
        }
    )

    workspace: dict[str, Any] | None = Field(
        None, description="a HistFactory workspace, as `pyhf cls` reads it"
    )
    workspace_id: str | None = Field(
        None,
        pattern=DIGEST_PATTERN,
        description="id of a workspace uploaded with POST /workspaces (its pyhf sha256 digest)",
    )
    patches: list[list[dict[str, Any]] | dict[str, Any]] = Field(
        default_factory=list,
        max_length=MAX_PATCHES,
        description="JSON patches (or pyhf Patch objects {metadata, patch}) applied in order, "
        "like `pyhf cls --patch`",
    )
    patchset: dict[str, Any] | None = Field(
        None, description="a pyhf PatchSet: one result per patch, keyed by patch name"
    )
    patch_names: list[str] | None = Field(
        None, max_length=MAX_PATCHES, description="the patchset's patches to run (default: all)"
    )
    measurement: str | None = Field(None, description="measurement name (default: the first)")
    modifier_settings: dict[str, dict[str, str]] | None = Field(
        None, description='pyhf modifier settings, e.g. {"normsys": {"interpcode": "code4"}}'
    )

    @model_validator(mode="after")
    def _one_source(self) -> ModelSelection:
        """Exactly one of workspace / workspace_id; patch_names only with a patchset."""
        if (self.workspace is None) == (self.workspace_id is None):
            raise ValueError("give exactly one of 'workspace' and 'workspace_id'")
        if self.patch_names is not None and self.patchset is None:
            raise ValueError("'patch_names' needs a 'patchset'")
        if self.patchset is not None and self.patches:
            raise ValueError("give either 'patches' or a 'patchset', not both")
        return self


class CalculatorOptions(_Strict):
    """How p-values are computed (pyhf's ``calctype``): asymptotic formulae, or toys."""

    calctype: Literal["asymptotics", "toybased"] = "asymptotics"
    ntoys: int = Field(2000, ge=1, le=100_000, description="toys per hypothesis (toybased)")
    seed: int | None = Field(
        None,
        ge=0,
        le=MAX_SEED,
        description="toy seed (toybased), an unsigned 64-bit integer as torch's generators take",
    )

    @property
    def toys(self) -> int:
        """Toys per hypothesis: ``ntoys`` when toy-based, else 0."""
        return self.ntoys if self.calctype == "toybased" else 0


class ClsOptions(CalculatorOptions):
    """Options of a hypothesis test, named like `pyhf cls`'s."""

    test_poi: (
        FiniteFloat | Annotated[list[FiniteFloat], Field(min_length=1, max_length=MAX_POIS)]
    ) = Field(1.0, description="POI value tested; a list answers a list")
    test_stat: Literal["q", "qtilde"] = "qtilde"


class FitOptions(_Strict):
    """A maximum-likelihood fit (`pyhf fit --value`), optionally with its goodness of fit."""

    goodness_of_fit: bool = Field(
        False, description="add the saturated-model goodness of fit (as cabinetry's)"
    )


class RankingOptions(_Strict):
    """Which nuisance parameters to rank by their impact on the POI."""

    parameters: Annotated[list[str], Field(min_length=1, max_length=10_000)] | None = Field(
        None,
        description="parameter labels to rank, e.g. 'lumi' or 'staterror_SR[0]' (default: "
        "every free parameter but the POI)",
    )
    top: int | None = Field(None, ge=1, description="answer only the largest N impacts")


Grid = Annotated[list[FiniteFloat], Field(min_length=2, max_length=1000)]


class ScanAxis(_Strict):
    """One axis of a profile-likelihood scan: a parameter and its grid (``values``, ``steps``
    points over ``range``, or, with neither, cabinetry's default: ``steps`` points over each
    patch's best fit +- 3 uncertainties, within the bounds)."""

    parameter: str | None = Field(None, description="parameter label (default: the POI)")
    values: Grid | None = Field(None, description="grid values, increasing")
    range: tuple[FiniteFloat, FiniteFloat] | None = Field(
        None, description="[low, high] of an evenly spaced grid"
    )
    steps: int = Field(
        11,
        ge=2,
        le=1000,
        description="grid points over range (or over the best fit +- 3 uncertainties)",
    )

    @model_validator(mode="after")
    def _one_grid(self) -> ScanAxis:
        """At most one of values and range, increasing."""
        if self.values is not None and self.range is not None:
            raise ValueError("give at most one of 'values' and 'range'")
        if self.values is not None and "steps" in self.model_fields_set:
            raise ValueError("'steps' goes with 'range' (or no grid), not with 'values'")
        grid = self.values or list(self.range or ())
        if any(b <= a for a, b in itertools.pairwise(grid)):
            raise ValueError("grid values must increase")
        return self

    def grid(self) -> list[float] | None:
        """The grid's values; None for the automatic grid (per patch, after its free fit)."""
        if self.values is not None:
            return list(self.values)
        if self.range is None:
            return None
        low, high = self.range
        return [low + (high - low) * i / (self.steps - 1) for i in range(self.steps)]

    @property
    def points(self) -> int:
        """Grid points."""
        return len(self.values) if self.values is not None else self.steps


class ScanOptions(_Strict):
    """A profile-likelihood scan (``-2 delta ln L``) over one axis, or two (``y``)."""

    x: ScanAxis = Field(description="the scanned parameter and its grid")
    y: ScanAxis | None = Field(None, description="a second axis: a 2D scan over the grid x * y")

    @model_validator(mode="after")
    def _points(self) -> ScanOptions:
        """At most 10^5 grid points in all."""
        points = self.x.points * (1 if self.y is None else self.y.points)
        if points > 100_000:
            raise ValueError(f"the scan has {points} grid points; at most 100000")
        return self


class YieldsOptions(_Strict):
    """Pre- and post-fit yields have no options beyond the model."""


class UpperLimitOptions(_Strict):
    """Options of an upper limit scan."""

    level: float = Field(0.05, gt=0.0, lt=1.0, description="CLs level (0.05: 95% CL)")
    scan: Annotated[list[FiniteFloat], Field(min_length=2, max_length=1000)] | None = Field(
        None, description="POI values to scan (default: the engine's automatic scan)"
    )

    @field_validator("scan")
    @classmethod
    def _increasing(cls, scan: list[float] | None) -> list[float] | None:
        """A scan must increase."""
        if scan is not None and any(b <= a for a, b in itertools.pairwise(scan)):
            raise ValueError("scan values must increase")
        return scan


class SignificanceOptions(CalculatorOptions):
    """Discovery significance (pyhf's ``hypotest(0.0, ..., test_stat="q0")``): how p0 is
    computed."""


class _Declared(BaseModel):
    """A response: every field declared and no other (``additionalProperties: false``), so
    the OpenAPI document says exactly what is returned."""

    model_config = ConfigDict(extra="forbid")


class LocatedProblem(_Declared):
    """One problem of a request field: where (``loc``), what, and its kind."""

    loc: list[str | int]
    msg: str
    type: str


class ErrorResponse(_Declared):
    """Every error answer: a message naming what is wrong and where, or located problems."""

    detail: str | list[LocatedProblem]


_ERROR_DESCRIPTIONS = {
    400: "malformed JSON or gzip, empty body",
    401: "missing or wrong Bearer token",
    404: "unknown job or workspace_id",
    408: "the body did not arrive within --body-timeout-s",
    409: "the job already finished",
    413: "body larger than --max-body-mb",
    415: "a Content-Encoding other than gzip",
    422: "invalid workspace, patch, patchset, measurement, option or parameter",
    429: "queue full (Retry-After)",
    503: "device out of memory, shutting down, too many connections, or a store that cannot "
    "be written (Retry-After)",
    504: "took longer than --request-timeout-s",
    507: "the workspace store is full of workspaces that queued or running jobs need",
}
BODY_ERRORS = (400, 408, 413, 415)  # what the body middleware answers on any body


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI ``responses`` of the error ``statuses`` a route can answer."""
    return {
        status: {"model": ErrorResponse, "description": _ERROR_DESCRIPTIONS[status]}
        for status in statuses
    }


#: why a result may not say what it seems to, by kind (``meta.flags``); every client reads the
#: flags generically (their ``detail`` is the sentence it shows), whatever the operation
FLAG_KINDS: dict[str, str] = {
    "not_converged": "a fit behind the result did not meet the minimiser's criterion "
    "(meta.converged false): its numbers may not be the minimum's",
    "starts_disagree": "the fits' extra start points reached different minima (meta."
    "starts_agreed false): the likelihood has several, the answer is the lowest found",
    "limit_beyond_bounds": "an upper limit (observed or a band) lies past the POI's upper "
    "bound: its CLs at the bound is still above the level, where pyhf's upper_limit raises "
    "ValueError; the value is found by fits beyond the bound",
    "limit_outside_scan": "an upper limit (observed or a band) is not bracketed by the given "
    "scan: the answer is the scan's end (as pyhf's, which says nothing), not the limit",
    "poi_at_bound": "the POI's best fit (or a ranking refit's) lies on its bound: impacts "
    "that would move it past the bound are 0 or truncated there, a profile is the bounded one",
    "undetermined_parameters": "some free parameters have no uncertainty (null): the likelihood "
    "has no curvature along them at the best fit, alone or with others (a shapefactor of a bin "
    "without events on its bound 0; the second of two normfactors of one sample), so the "
    "others' uncertainties hold them there; or, where every one is null, the Hessian at the "
    "best fit is not positive definite",
    "p_value_unresolved": "a p-value is 0 beyond what the toys resolve (none as extreme as "
    "the data): a discovery significance is then null (bounded below only), a toy CLs of 0 / 0 "
    "null; more toys resolve it (asymptotically, a p0 below the smallest double is 0 and its "
    "Z is sqrt(q0), unflagged; flagged only where that is not finite)",
    "background_only_impossible": "the data have events in a bin that only the POI's samples "
    "can fill: the background-only hypothesis (POI = 0) gives them no probability, so its fits "
    "(the Asimov data's, the background toys', q0's) have no minimum and the answer rests on "
    "where they stopped (pyhf's fail there)",
    "qtilde_poi_bound": "q~ (test_stat 'qtilde', every upper limit's) asked of a POI whose "
    "lower bound is not 0: q~'s asymptotic formulae assume the POI bounded at 0 (pyhf warns; "
    "above 0 it then raises ValueError); a bound below 0 is raised to 0 in the fits here (pyhf "
    "fits within it)",
}
# the kinds, declared once (a Literal of names known at run time: mypy takes it as Any)
FlagKind: TypeAlias = Literal[tuple(FLAG_KINDS)]  # type: ignore[valid-type]


class ResultFlag(_Declared):
    """A reason to doubt one result: its kind, and what in words (naming the value, the bound,
    the parameter). `pyhf-gpu-client` prints each as a warning on stderr (`--strict`: exit 1),
    the Python client warns, the page marks it."""

    kind: FlagKind = Field(
        description="; ".join(f"`{kind}`: {text}" for kind, text in FLAG_KINDS.items())
    )
    detail: str = Field(description="what was found, in words: the sentence clients show")


def result_flag(kind: FlagKind, detail: str) -> ResultFlag:
    """One entry of ``meta.flags`` (validated: ``kind`` is one of :data:`FLAG_KINDS`)."""
    return ResultFlag(kind=kind, detail=detail)


class ResultMeta(_Declared):
    """How a result was computed (one per hypothesis)."""

    device: str
    dtype: str
    model_id: str
    cache: Literal["hit", "miss"]
    batch_rows: int = Field(description="hypotheses in the engine call that computed this one")
    converged: bool | None = Field(None, description="fit status of the underlying fits")
    starts: int | None = Field(
        None,
        description="start points of each fit (2 for a free fit, also started from the POI "
        "at 0; more where the model has kinked interpolation codes: the lowest minimum is kept)",
    )
    starts_agreed: bool | None = Field(
        None, description="whether every converged start reached the kept minimum"
    )
    flags: list[ResultFlag] = Field(
        default_factory=list,
        description="why this result may not say what it seems to (empty: nothing found): "
        "fits that did not converge or whose starts disagree (as `converged` and "
        "`starts_agreed` say), a limit past the POI's bounds or outside the scan, the POI's "
        "best fit on its bound (ranking, scan)",
    )
    test_poi: float | None = Field(None, description="the tested POI value (cls)")
    patch: str | None = Field(None, description="the patch's name (patchsets)")
    stacked_apart: str | None = Field(
        None, description="why this patch ran in a model of its own (patchsets)"
    )
    ignored_observations: list[str] | None = Field(
        None,
        description="one notice per entry of 'observations' that names a channel the "
        "workspace (after its patches) does not have: ignored, as pyhf ignores it",
    )
    worker: str | None = Field(
        None, description="the Dask worker that computed it (cluster mode, --dask-scheduler)"
    )
    timings: dict[str, float] = Field(
        description="translate_ms, build_ms, queue_ms, compute_ms, total_ms (and worker_ms, "
        "the worker's own time for the batch, in cluster mode)"
    )


class ClsAnswer(_Declared):
    """`pyhf cls` output."""

    CLs_obs: float | None
    CLs_exp: list[float | None]


class ClsResult(ClsAnswer):
    """`pyhf cls` output plus meta."""

    meta: ResultMeta


class SampleYields(_Declared):
    """Yields per bin and in the channel, with their uncertainties (cabinetry's
    ``yield_stdev``: parameter variations combined with the correlation matrix)."""

    yields: list[float | None]
    stdev: list[float | None]
    channel_yield: float | None
    channel_stdev: float | None


class ChannelYields(_Declared):
    """One channel: each sample, their total, and the observed data."""

    bins: int
    samples: dict[str, SampleYields]
    total: SampleYields
    data: list[float]
    channel_data: float


class YieldsAnswer(_Declared):
    """Pre-fit (cabinetry's Asimov parameters, pre-fit uncertainties) and post-fit (best
    fit, Hessian covariance) yields per channel, sample and bin, as cabinetry's
    ``model_utils.prediction``."""

    prefit: dict[str, ChannelYields]
    postfit: dict[str, ChannelYields]


class YieldsResult(YieldsAnswer):
    """Pre-fit (cabinetry's Asimov parameters, pre-fit uncertainties) and post-fit (best
    fit, Hessian covariance) yields per channel, sample and bin, as cabinetry's
    ``model_utils.prediction``."""

    meta: ResultMeta


class GoodnessOfFit(_Declared):
    """Saturated-model goodness of fit (cabinetry's ``goodness_of_fit``)."""

    p_value: float | None = Field(description="P(chi2_ndof >= delta_twice_nll); null if ndof <= 0")
    delta_twice_nll: float | None = Field(
        description="-2 ln L of the fit minus the saturated model's"
    )
    ndof: int = Field(description="main bins minus free unconstrained parameters")


class FitAnswer(_Declared):
    """`pyhf fit --value` output plus uncertainties and correlations."""

    mle_parameters: dict[str, list[float | None]]
    twice_nll: float | None
    uncertainties: dict[str, list[float | None]]
    corr_mat: list[list[float | None]]
    goodness_of_fit: GoodnessOfFit | None = Field(
        None, description="with the goodness_of_fit option"
    )


class FitResult(FitAnswer):
    """`pyhf fit --value` output plus uncertainties, correlations and meta."""

    meta: ResultMeta


class PoiEstimate(_Declared):
    """The POI's best fit and Hessian uncertainty."""

    name: str
    bestfit: float | None
    uncertainty: float | None


class RankingAnswer(_Declared):
    """cabinetry's ``RankingResults`` fields, per ranked parameter, largest impact first:
    impacts are the POI refit with the parameter fixed at its best fit plus/minus its pre-fit
    and post-fit uncertainty, minus the POI's best fit."""

    labels: list[str]
    bestfit: list[float | None]
    uncertainty: list[float | None]
    prefit_uncertainty: list[float | None]
    prefit_up: list[float | None]
    prefit_down: list[float | None]
    postfit_up: list[float | None]
    postfit_down: list[float | None]
    pull: list[float | None]
    constraint: list[float | None]
    fits_converged: list[bool]
    poi: PoiEstimate


class RankingResult(RankingAnswer):
    """cabinetry's ``RankingResults`` fields, per ranked parameter, largest impact first:
    impacts are the POI refit with the parameter fixed at its best fit plus/minus its pre-fit
    and post-fit uncertainty, minus the POI's best fit."""

    meta: ResultMeta


class ScanAnswer(_Declared):
    """cabinetry's ``ScanResults``: ``-2 delta ln L`` of a parameter over its grid."""

    name: str
    bestfit: float | None
    uncertainty: float | None
    parameter_values: list[float]
    delta_nlls: list[float | None]


class ScanResult(ScanAnswer):
    """cabinetry's ``ScanResults``: ``-2 delta ln L`` of a parameter over its grid."""

    meta: ResultMeta


class Scan2DAnswer(_Declared):
    """A 2D scan: ``delta_nlls[i][j]`` at ``(parameter_values[0][i], parameter_values[1][j])``."""

    names: list[str]
    bestfit: list[float | None]
    uncertainty: list[float | None]
    correlation: float | None
    parameter_values: list[list[float]]
    delta_nlls: list[list[float | None]]


class Scan2DResult(Scan2DAnswer):
    """A 2D scan: ``delta_nlls[i][j]`` at ``(parameter_values[0][i], parameter_values[1][j])``."""

    meta: ResultMeta


class UpperLimitAnswer(_Declared):
    """Observed and expected (-2..+2 sigma) upper limits on the POI."""

    upper_limit_obs: float | None
    upper_limit_exp: list[float | None]
    level: float


class UpperLimitResult(UpperLimitAnswer):
    """Observed and expected (-2..+2 sigma) upper limits on the POI."""

    meta: ResultMeta


class SignificanceAnswer(_Declared):
    """Discovery p-values and significances, observed and expected (median, and the
    -2..+2 sigma band of p0 in pyhf's order)."""

    p0_obs: float | None
    p0_exp: float | None
    z_obs: float | None
    z_exp: float | None
    p0_exp_set: list[float | None]


class SignificanceResult(SignificanceAnswer):
    """Discovery p-values and significances, observed and expected (median, and the
    -2..+2 sigma band of p0 in pyhf's order)."""

    meta: ResultMeta


class ErrorEntry(_Declared):
    """A status and detail, as an error answer would carry them."""

    status: int
    detail: str | list[LocatedProblem]


class PatchError(_Declared):
    """A patch of a patchset that could not be tested, in place of its result."""

    error: ErrorEntry


class WorkspaceInfo(_Declared):
    """An uploaded workspace."""

    workspace_id: str
    digest: dict[str, str]
    measurements: list[str]
    channels: list[str]
    bytes: int


class JobAccepted(_Declared):
    """POST /jobs answer (202)."""

    id: str
    status: JobStatus
    url: str


class JobProgress(_Declared):
    """Hypotheses done out of total."""

    done: int
    total: int


class JobViewBase(_Declared):
    """A job: GET /jobs/{id} with its result (the synchronous answer) or error; in a listing
    and in a DELETE answer, ``result``, ``error`` and ``failed_patches`` are null.
    (``operation`` and ``result`` are declared per operation: ``operations.JobView``.)"""

    id: str
    status: JobStatus
    progress: JobProgress
    created_at: float
    started_at: float | None
    finished_at: float | None
    error: ErrorEntry | None = None
    failed_patches: int | None = Field(
        None, description="patchset jobs: patches answered with an error entry"
    )


class Liveness(_Declared):
    """GET /healthz."""

    status: Literal["ok"]


class Readiness(_Declared):
    """GET /readyz: ready (200), or unready (503) with the problems."""

    status: Literal["ready", "unready"]
    problems: list[str]


class Versions(_Declared):
    """Versions of the server and what it runs on (None: not installed)."""

    pyhf_gpu: str | None = Field(alias="pyhf-gpu")
    torch: str | None
    pyhf: str | None
    fastapi: str | None
    python: str
    cuda: str | None


#: The server's limits (:data:`settings.LIMITS`): each field a setting's, with its type and
#: description (declared once, in :class:`~.settings.Settings`).
_LIMIT_FIELDS: dict[str, Any] = {
    name: (
        Settings.model_fields[name].annotation,
        Field(description=Settings.model_fields[name].description),
    )
    for name in LIMITS
}
Limits = create_model(
    "Limits", __base__=_Declared, __doc__="The server's limits (its settings).", **_LIMIT_FIELDS
)


class QueueDepth(_Declared):
    """Hypotheses waiting for the device, per lane."""

    interactive: int
    jobs: int


class WarmModel(_Declared):
    """A warm model of the cache."""

    model_id: str
    elements: int | None
    parameters: int | None
    bytes: int
    hits: int
    build_ms: float
    created_at: float


class JobStoreState(_Declared):
    """The job database: whether this start recreated one that was lost."""

    recreated: bool = Field(
        description="the database was missing (or empty) although the data dir held one before"
    )
    warning: str | None = Field(description="what was found, when recreated")


class ClusterWorker(_Declared):
    """One live Dask worker (with a GPU resource) of the cluster."""

    address: str
    name: str
    device: str | None = Field(description="its torch device (None: it did not answer)")
    device_name: str | None
    in_flight: int = Field(description="batches this API node runs on it now")
    batches: int = Field(description="batches it answered this API node")
    models: list[str] = Field(description="model_ids of its warm models, most recent first")
    model_count: int
    cache_hits: int
    cache_misses: int
    cache_bytes: int


class ClusterState(_Declared):
    """Cluster mode (--dask-scheduler): the scheduler and its workers."""

    scheduler: str
    workers: list[ClusterWorker]
    recipes_sent: int = Field(description="batches that carried their model's recipe")
    models_resent: int = Field(
        description="batches sent again with their recipe after a worker no longer held the model"
    )


class LocalWorkersState(_Declared):
    """The processes forked at start-up that take shares of the CPU work: the translation of
    requests with many new patches and, on a CPU device, the fits of engine calls."""

    workers: int = Field(description="forked at start-up and still in use")
    shared_requests: int = Field(description="requests whose patches they helped translate")
    shared_batches: int = Field(description="engine calls whose fits they shared")


class ServerInfo(_Declared):
    """GET /info: device, versions, limits, queue and warm models."""

    device: str
    device_name: str
    dtype: str
    compile: bool
    versions: Versions
    limits: Limits  # a model built from the settings
    auth: bool
    queue: QueueDepth
    batches_run: int
    local_workers: LocalWorkersState
    models: list[WarmModel] = Field(description="most recently used first")
    device_memory_bytes: float = Field(
        description="allocated CUDA memory, or the warm models' bytes on a CPU"
    )
    started_at: float
    job_store: JobStoreState
    cluster: ClusterState | None = Field(
        None, description="cluster mode only: where the batches run (device: the API node's)"
    )
