"""Request and response models (pydantic), apart from the logic that acts on them.

A request names its model (``workspace`` or ``workspace_id``, optional ``patches`` applied in
order, or a ``patchset`` with ``patch_names``, a ``measurement`` and ``modifier_settings``) and
the options of its operation. The same fields, plus ``operation``, make an asynchronous job.
"""

from __future__ import annotations

import itertools
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Operation = Literal["cls", "fit", "upper-limit", "significance"]
OPERATIONS: tuple[str, ...] = ("cls", "fit", "upper-limit", "significance")
JobStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]
DIGEST_PATTERN = r"^[0-9a-f]{64}$"
MAX_POIS = 1000
MAX_PATCHES = 10_000

FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]


class _Strict(BaseModel):
    """Unknown fields are errors, so a typo is reported instead of silently ignored."""

    model_config = ConfigDict(extra="forbid")


class ModelSelection(_Strict):
    """Which likelihood: a workspace (inline or uploaded), patched, or a patchset of hypotheses."""

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


class ClsOptions(_Strict):
    """Options of a hypothesis test, named like `pyhf cls`'s."""

    test_poi: (
        FiniteFloat | Annotated[list[FiniteFloat], Field(min_length=1, max_length=MAX_POIS)]
    ) = Field(1.0, description="POI value tested; a list answers a list")
    test_stat: Literal["q", "qtilde"] = "qtilde"
    calctype: Literal["asymptotics", "toybased"] = "asymptotics"
    ntoys: int = Field(2000, ge=1, le=100_000, description="toys per hypothesis (toybased)")
    seed: int | None = Field(None, ge=0, description="toy seed (toybased)")


class FitOptions(_Strict):
    """A maximum-likelihood fit (`pyhf fit --value`) has no options beyond the model."""


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


class SignificanceOptions(_Strict):
    """Discovery significance has no options beyond the model."""


class ClsRequest(ModelSelection, ClsOptions):
    """POST /cls envelope."""


class FitRequest(ModelSelection, FitOptions):
    """POST /fit envelope."""


class UpperLimitRequest(ModelSelection, UpperLimitOptions):
    """POST /upper-limit envelope."""


class SignificanceRequest(ModelSelection, SignificanceOptions):
    """POST /significance envelope."""


REQUEST_MODELS: dict[str, type[ModelSelection]] = {
    "cls": ClsRequest,
    "fit": FitRequest,
    "upper-limit": UpperLimitRequest,
    "significance": SignificanceRequest,
}
OPTION_MODELS: dict[str, type[_Strict]] = {
    "cls": ClsOptions,
    "fit": FitOptions,
    "upper-limit": UpperLimitOptions,
    "significance": SignificanceOptions,
}


class ErrorResponse(BaseModel):
    """Every error answer: a message naming what is wrong and where, or located problems."""

    detail: str | list[dict[str, Any]]


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in {
        400: "malformed JSON or gzip, empty body",
        401: "missing or wrong Bearer token",
        404: "unknown workspace_id",
        413: "body larger than --max-body-mb",
        422: "invalid workspace, patch, patchset, measurement or option",
        429: "queue full (Retry-After)",
        503: "device out of memory or shutting down (Retry-After)",
        504: "took longer than --request-timeout-s",
    }.items()
}


class ResultMeta(BaseModel):
    """How a result was computed (one per hypothesis)."""

    device: str
    dtype: str
    model_id: str
    cache: Literal["hit", "miss"]
    batch_rows: int = Field(description="hypotheses in the engine call that computed this one")
    converged: bool | None = Field(None, description="fit status of the underlying fits")
    starts: int | None = Field(
        None,
        description="start points of each fit (more than 1 where the model has kinked "
        "interpolation codes: the lowest minimum is kept)",
    )
    starts_agreed: bool | None = Field(
        None, description="whether every converged start reached the kept minimum"
    )
    test_poi: float | None = None
    timings: dict[str, float] = Field(description="build_ms, queue_ms, compute_ms, total_ms")


class ClsResult(BaseModel):
    """`pyhf cls` output plus meta."""

    CLs_obs: float | None
    CLs_exp: list[float | None]
    meta: ResultMeta


class FitResult(BaseModel):
    """`pyhf fit --value` output plus uncertainties, correlations and meta."""

    mle_parameters: dict[str, list[float | None]]
    twice_nll: float | None
    uncertainties: dict[str, list[float | None]]
    corr_mat: list[list[float | None]]
    meta: ResultMeta


class UpperLimitResult(BaseModel):
    """Observed and expected (-2..+2 sigma) upper limits on the POI."""

    upper_limit_obs: float | None
    upper_limit_exp: list[float | None]
    level: float
    meta: ResultMeta


class SignificanceResult(BaseModel):
    """Discovery p-values and significances, observed and expected."""

    model_config = ConfigDict(extra="allow")
    meta: ResultMeta


class WorkspaceInfo(BaseModel):
    """An uploaded workspace."""

    workspace_id: str
    digest: dict[str, str]
    measurements: list[str]
    channels: list[str]
    bytes: int


class JobAccepted(BaseModel):
    """POST /jobs answer (202)."""

    id: str
    status: JobStatus
    url: str


class JobProgress(BaseModel):
    """Hypotheses done out of total."""

    done: int
    total: int


class JobView(BaseModel):
    """GET /jobs/{id}."""

    id: str
    operation: Operation
    status: JobStatus
    progress: JobProgress
    created_at: float
    started_at: float | None
    finished_at: float | None
    result: Any = None
    error: Any = None
    failed_patches: int | None = None  # patchset jobs: patches answered with an error entry


class JobList(BaseModel):
    """GET /jobs: newest first."""

    jobs: list[JobView]
