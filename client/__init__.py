"""pyhf-gpu-client: a thin client of the pyhf-gpu fitting service (no torch, no pyhf needed).

Command line: ``pyhf-gpu-client cls WORKSPACE`` prints exactly what ``pyhf cls`` prints.
Python::

    from pyhf_gpu_client import Client

    with Client("http://gpu-node:8000") as client:
        result = client.cls("workspace.json", test_poi=1.0)
        result.cls_obs, result.cls_exp, result.to_pyhf_json()
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .exceptions import (
    AuthenticationError,
    BadRequestError,
    BeyondBoundsWarning,
    DoubtfulResultWarning,
    JobCancelledError,
    JobError,
    JobFailedError,
    NotFoundError,
    PyhfGpuError,
    RateLimitedError,
    ServerError,
    ServiceUnavailableError,
    TimeoutError,
    TransportError,
    WaitTimeoutError,
    WorkspaceError,
)
from .results import (
    ChannelYields,
    CLsResult,
    FitResult,
    GoodnessOfFit,
    Job,
    PatchError,
    PoiEstimate,
    RankingResult,
    SampleYields,
    Scan2DResult,
    ScanResult,
    SignificanceResult,
    UpperLimitResult,
    YieldsResult,
    parse_result,
    patch_errors,
    result_to_json,
)
from .workspace import WorkspaceId, digest, load_json

if TYPE_CHECKING:
    from ._client import AsyncClient, Client


def __getattr__(name: str) -> Any:
    """``Client`` and ``AsyncClient``, imported with httpx when first asked for (the command
    line speaks ``http.client`` and never imports httpx), and ``__version__``, read from the
    installed metadata when asked (importing ``importlib.metadata`` is slow)."""
    if name in ("Client", "AsyncClient"):
        from . import _client

        return getattr(_client, name)
    if name != "__version__":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pyhf-gpu")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "0.0.0"


__all__ = [
    "AsyncClient",
    "AuthenticationError",
    "BadRequestError",
    "BeyondBoundsWarning",
    "CLsResult",
    "ChannelYields",
    "Client",
    "DoubtfulResultWarning",
    "FitResult",
    "GoodnessOfFit",
    "Job",
    "JobCancelledError",
    "JobError",
    "JobFailedError",
    "NotFoundError",
    "PatchError",
    "PoiEstimate",
    "PyhfGpuError",
    "RankingResult",
    "RateLimitedError",
    "SampleYields",
    "Scan2DResult",
    "ScanResult",
    "ServerError",
    "ServiceUnavailableError",
    "SignificanceResult",
    "TimeoutError",
    "TransportError",
    "UpperLimitResult",
    "WaitTimeoutError",
    "WorkspaceError",
    "WorkspaceId",
    "YieldsResult",
    "__version__",
    "digest",
    "load_json",
    "parse_result",
    "patch_errors",
    "result_to_json",
]
