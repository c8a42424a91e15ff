"""The exceptions raised by :mod:`pyhf_gpu_client`.

Everything the client raises on purpose derives from :class:`PyhfGpuError`::

    PyhfGpuError
    ├── WorkspaceError            the workspace/patch input could not be read (client side)
    ├── TransportError            the server could not be reached or did not answer in time
    │   └── TimeoutError          a connect/read/write timeout (after retries where retrying is safe)
    ├── ServerError               the server answered with an HTTP error (``status``, ``detail``)
    │   ├── BadRequestError       4xx other than the ones below (400, 409, 413, 415, 422, ...)
    │   ├── AuthenticationError   401 / 403
    │   ├── NotFoundError         404
    │   ├── RateLimitedError      429 (raised once the retries are spent)
    │   └── ServiceUnavailableError  503 (raised once the retries are spent)
    └── JobError                  an asynchronous job ended without a result (``job``)
        ├── JobFailedError
        ├── JobCancelledError
        └── WaitTimeoutError      :meth:`Client.wait` gave up before the job finished

A result the server flagged (its ``meta.flags``: fits that did not converge, extra starts that
reached different minima, a p-value of 0 beyond what its toys resolve) is returned with a
:class:`DoubtfulResultWarning` (a ``UserWarning``: shown once per place and message by
default; ``warnings.simplefilter("error", DoubtfulResultWarning)`` makes it raise); one whose
answer lies past its model's limits (a limit past the POI's bounds, where pyhf raises
ValueError, or outside the scan; the POI's best fit on its bound) with its subclass
:class:`BeyondBoundsWarning`.
"""

from __future__ import annotations

import builtins
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from .results import Job

__all__ = [
    "AuthenticationError",
    "BadRequestError",
    "BeyondBoundsWarning",
    "DoubtfulResultWarning",
    "JobCancelledError",
    "JobError",
    "JobFailedError",
    "NotFoundError",
    "PyhfGpuError",
    "RateLimitedError",
    "ServerError",
    "ServiceUnavailableError",
    "TimeoutError",
    "TransportError",
    "WaitTimeoutError",
    "WorkspaceError",
]


class PyhfGpuError(Exception):
    """Base class of every error the client raises on purpose."""


class WorkspaceError(PyhfGpuError, ValueError):
    """A workspace, patch or patchset given to the client could not be read or is not JSON."""


class TransportError(PyhfGpuError):
    """The server could not be reached, or the connection broke before an answer came."""

    def __init__(self, message: str, *, retryable: bool = True) -> None:
        super().__init__(message)
        #: whether sending the same request again is safe and may help
        self.retryable = retryable


class TimeoutError(TransportError, builtins.TimeoutError):
    """A connect, read or write timeout. Also a :class:`builtins.TimeoutError`."""


class ServerError(PyhfGpuError):
    """The server answered with an HTTP error status.

    Attributes:
        status: the HTTP status code.
        detail: the server's ``detail`` (a string, or the structured validation errors).
        retry_after: seconds from a ``Retry-After`` header, if any.
    """

    def __init__(
        self,
        status: int,
        detail: Any,
        *,
        method: str = "",
        url: str = "",
        retry_after: float | None = None,
    ) -> None:
        self.status = status
        self.detail = detail
        self.method = method
        self.url = url
        self.retry_after = retry_after
        super().__init__(f"{status}: {format_detail(detail)}")

    @property
    def message(self) -> str:
        """The server's message as one readable string."""
        return format_detail(self.detail)


class BadRequestError(ServerError):
    """The server rejected the request (a 4xx status without a more specific class)."""


class AuthenticationError(BadRequestError):
    """401 or 403: a missing, wrong or insufficient API token."""


class NotFoundError(BadRequestError):
    """404: unknown route, workspace id or job id."""


class RateLimitedError(ServerError):
    """429 Too Many Requests, still answered after the configured retries."""


class ServiceUnavailableError(ServerError):
    """503 Service Unavailable (e.g. overloaded or not ready), still answered after the retries."""


class JobError(PyhfGpuError):
    """An asynchronous job ended without a result; ``job`` holds its last known state."""

    def __init__(self, message: str, job: Job) -> None:
        super().__init__(message)
        self.job = job


class JobFailedError(JobError):
    """The job's status is ``failed``; ``job.error`` holds the server's reason."""


class JobCancelledError(JobError):
    """The job's status is ``cancelled``."""


class WaitTimeoutError(JobError, builtins.TimeoutError):
    """Waiting for a job took longer than the ``timeout`` given to ``wait``."""


def format_detail(detail: Any) -> str:
    """Render a FastAPI-style ``detail`` (string, dict or list of validation errors) readably."""
    if detail is None:
        return "(no detail)"
    if isinstance(detail, str):
        return detail
    if isinstance(detail, list):
        parts = []
        for item in detail:
            if isinstance(item, dict) and "msg" in item:
                loc = ".".join(str(p) for p in item.get("loc", ()) if p != "body")
                parts.append(f"{loc}: {item['msg']}" if loc else str(item["msg"]))
            else:
                parts.append(format_detail(item))
        return "; ".join(parts)
    if isinstance(detail, dict):
        if "message" in detail:
            return str(detail["message"])
        if "msg" in detail:
            return str(detail["msg"])
    return str(detail)


class DoubtfulResultWarning(UserWarning):
    """A result the server flagged in its ``meta.flags``: fits that did not converge
    (``converged: false``), extra starts that reached different minima (``starts_agreed:
    false``), a p-value of 0 beyond what its toys resolve (``p_value_unresolved``), or an
    answer past its model's limits (:class:`BeyondBoundsWarning`). The numbers are returned;
    the message names the result and what was found."""


class BeyondBoundsWarning(DoubtfulResultWarning):
    """A result whose answer lies past its model's limits (``meta.flags`` of kind
    ``limit_beyond_bounds``, ``limit_outside_scan``, ``poi_at_bound``, ``qtilde_poi_bound``): an
    upper limit or band past the POI's bounds (pyhf's ``upper_limit`` raises ValueError there)
    or outside the given scan, a ranking or scan whose POI's best fit lies on its bound, a q~
    test of a POI whose lower bound is not 0 (pyhf warns there). A
    :class:`DoubtfulResultWarning`, so filters on that cover it; filter this one alone to
    accept, say, limits extrapolated past the bounds."""
