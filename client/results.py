"""Typed results. Each converts back to the JSON that pyhf's CLI prints (``to_pyhf_json``).

The server's answers are parsed by :func:`parse_result`, which recognises the three shapes the
service uses: one result (a JSON object with the operation's keys), a scan over several
``test_poi`` values (a JSON list) and a patchset batch (a JSON object ``{patch_name: ...}``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = [
    "OPERATIONS",
    "CLsResult",
    "FitResult",
    "Job",
    "Result",
    "SignificanceResult",
    "UpperLimitResult",
    "parse_result",
    "result_to_json",
]

#: operation name (as in ``POST /jobs``) -> endpoint path
OPERATIONS: dict[str, str] = {
    "cls": "/cls",
    "fit": "/fit",
    "upper-limit": "/upper-limit",
    "significance": "/significance",
}

_META_KEYS = ("meta",)


def _float(value: Any) -> float:
    """JSON number (or null / "nan" / "inf" strings some servers emit) -> float."""
    if value is None:
        return math.nan
    return float(value)


def _floats(values: Any) -> list[float]:
    return [_float(v) for v in values]


def _extra(data: Mapping[str, Any], known: tuple[str, ...]) -> dict[str, Any]:
    return {k: v for k, v in data.items() if k not in known and k not in _META_KEYS}


@dataclass
class CLsResult:
    """One hypothesis test, as ``pyhf cls`` reports it.

    Attributes:
        cls_obs: observed CLs.
        cls_exp: expected CLs band, pyhf order (-2, -1, 0, +1, +2 sigma).
        test_poi: the tested POI value when the server reports it (scans), else ``None``.
        meta: the server's ``meta`` object (timings, device, convergence, ...).
        extra: any further keys the server sent.
    """

    cls_obs: float
    cls_exp: list[float]
    test_poi: float | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    KEY: ClassVar[str] = "CLs_obs"

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CLsResult:
        """Parse one server answer (``{"CLs_obs": ..., "CLs_exp": [...], "meta": {...}}``)."""
        poi = (data.get("meta") or {}).get("test_poi")
        return cls(
            cls_obs=_float(data["CLs_obs"]),
            cls_exp=_floats(data.get("CLs_exp", [])),
            test_poi=None if poi is None or isinstance(poi, list) else float(poi),
            meta=dict(data.get("meta") or {}),
            extra=_extra(data, ("CLs_obs", "CLs_exp")),
        )

    def to_pyhf_json(self) -> dict[str, Any]:
        """Exactly the keys of ``pyhf cls``: ``{"CLs_obs": float, "CLs_exp": [5 floats]}``."""
        return {"CLs_obs": self.cls_obs, "CLs_exp": list(self.cls_exp)}


@dataclass
class FitResult:
    """A maximum-likelihood fit, as ``pyhf fit --value`` reports it, plus uncertainties.

    Attributes:
        mle_parameters: best-fit values per parameter set (pyhf's ``par_map`` names), as lists.
        twice_nll: -2 log L at the best fit (``None`` if the server did not send it).
        uncertainties: per-parameter-set uncertainties (same layout), if sent.
        corr_mat: the correlation matrix (list of rows, pyhf's parameter order), if sent.
        meta: the server's ``meta`` object.
        extra: any further keys the server sent.
    """

    mle_parameters: dict[str, list[float]]
    twice_nll: float | None = None
    uncertainties: dict[str, list[float]] | None = None
    corr_mat: list[list[float]] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    KEY: ClassVar[str] = "mle_parameters"

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FitResult:
        """Parse one server answer of ``POST /fit``."""
        unc = data.get("uncertainties")
        return cls(
            mle_parameters={k: _floats(v) for k, v in data["mle_parameters"].items()},
            twice_nll=None if data.get("twice_nll") is None else _float(data["twice_nll"]),
            uncertainties=None if unc is None else {k: _floats(v) for k, v in unc.items()},
            corr_mat=None
            if data.get("corr_mat") is None
            else [_floats(row) for row in data["corr_mat"]],
            meta=dict(data.get("meta") or {}),
            extra=_extra(data, ("mle_parameters", "twice_nll", "uncertainties", "corr_mat")),
        )

    def to_pyhf_json(self, value: bool = True, uncertainties: bool = False) -> dict[str, Any]:
        """The keys of ``pyhf fit`` (``twice_nll`` only with ``value``, as ``--value`` does).

        With ``uncertainties=True`` the ``uncertainties`` and ``corr_mat`` keys are added.
        """
        out: dict[str, Any] = {
            "mle_parameters": {k: list(v) for k, v in self.mle_parameters.items()}
        }
        if value and self.twice_nll is not None:
            out["twice_nll"] = self.twice_nll
        if uncertainties:
            if self.uncertainties is not None:
                out["uncertainties"] = {k: list(v) for k, v in self.uncertainties.items()}
            if self.corr_mat is not None:
                out["corr_mat"] = [list(r) for r in self.corr_mat]
        return out

    @property
    def bestfit(self) -> dict[str, list[float]]:
        """Alias of :attr:`mle_parameters`."""
        return self.mle_parameters


@dataclass
class UpperLimitResult:
    """An upper limit on the POI (pyhf's ``upper_limit``), at CLs ``level``.

    Attributes:
        upper_limit_obs: observed limit.
        upper_limit_exp: expected limits, pyhf order (-2 .. +2 sigma).
        level: the CLs level (0.05 for 95% CL).
    """

    upper_limit_obs: float
    upper_limit_exp: list[float]
    level: float = 0.05
    meta: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    KEY: ClassVar[str] = "upper_limit_obs"

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> UpperLimitResult:
        """Parse one server answer of ``POST /upper-limit``."""
        return cls(
            upper_limit_obs=_float(data["upper_limit_obs"]),
            upper_limit_exp=_floats(data.get("upper_limit_exp", [])),
            level=_float(data.get("level", 0.05)),
            meta=dict(data.get("meta") or {}),
            extra=_extra(data, ("upper_limit_obs", "upper_limit_exp", "level")),
        )

    def to_pyhf_json(self) -> dict[str, Any]:
        """``{"upper_limit_obs", "upper_limit_exp", "level"}`` (plus any extra server keys)."""
        return {
            **self.extra,
            "upper_limit_obs": self.upper_limit_obs,
            "upper_limit_exp": list(self.upper_limit_exp),
            "level": self.level,
        }


@dataclass
class SignificanceResult:
    """A discovery test of the background-only hypothesis (mu = 0).

    Attributes:
        p0_obs, p0_exp: observed and expected (median, under mu = 1) p-values.
        z_obs, z_exp: the same as significances in standard deviations.
    """

    p0_obs: float
    p0_exp: float | list[float]
    z_obs: float
    z_exp: float | list[float]
    meta: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    #: the server's own key names, kept so that to_pyhf_json reproduces them
    keys: tuple[str, str, str, str] = ("p0_obs", "p0_exp", "z_obs", "z_exp")

    KEY: ClassVar[str] = "p0_obs"
    _ALIASES: ClassVar[dict[str, tuple[str, ...]]] = {
        "p0_obs": ("p0_obs", "p0"),
        "p0_exp": ("p0_exp", "p0_expected"),
        "z_obs": ("z_obs", "Z_obs", "Z", "significance_obs"),
        "z_exp": ("z_exp", "Z_exp", "significance_exp"),
    }

    @classmethod
    def matches(cls, data: Mapping[str, Any]) -> bool:
        """Whether ``data`` looks like one significance answer."""
        return any(k in data for k in cls._ALIASES["p0_obs"]) and any(
            k in data for k in cls._ALIASES["z_obs"]
        )

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SignificanceResult:
        """Parse one server answer of ``POST /significance`` (key spellings are tolerated)."""
        values: dict[str, Any] = {}
        used: list[str] = []
        for attr, names in cls._ALIASES.items():
            name = next((n for n in names if n in data), None)
            used.append(name or names[0])
            raw = data.get(name) if name else None
            values[attr] = (
                _floats(raw)
                if isinstance(raw, list)
                else (math.nan if raw is None else _float(raw))
            )
        return cls(
            **values,
            meta=dict(data.get("meta") or {}),
            extra=_extra(data, tuple(used)),
            keys=(used[0], used[1], used[2], used[3]),
        )

    def to_pyhf_json(self) -> dict[str, Any]:
        """The server's keys (``p0_obs``, ``p0_exp``, ``z_obs``, ``z_exp``, ...), without ``meta``."""
        p0o, p0e, zo, ze = self.keys
        return {**self.extra, p0o: self.p0_obs, p0e: self.p0_exp, zo: self.z_obs, ze: self.z_exp}


@dataclass
class PatchError:
    """A patch of a patchset that the server could not test (the others have results).

    Attributes:
        status: the HTTP status it would have answered alone (422: the patch does not apply,
            or leaves no parameter of interest).
        detail: the server's reason.
    """

    status: int
    detail: Any

    @classmethod
    def matches(cls, data: Mapping[str, Any]) -> bool:
        """Whether a patch's entry is an error (``{"error": {"status", "detail"}}``)."""
        error = data.get("error")
        return set(data) == {"error"} and isinstance(error, Mapping) and "status" in error

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PatchError:
        return cls(status=int(data["error"]["status"]), detail=data["error"].get("detail"))

    def to_json(self) -> dict[str, Any]:
        return {"error": {"status": self.status, "detail": self.detail}}


def patch_errors(result: Any) -> dict[str, PatchError]:
    """The patches of a ``{patch: ...}`` result that could not be tested, by name."""
    if not isinstance(result, Mapping):
        return {}
    return {name: r for name, r in result.items() if isinstance(r, PatchError)}


Single = CLsResult | FitResult | UpperLimitResult | SignificanceResult
#: what every operation returns: one result, a list (a ``test_poi`` scan) or ``{patch: ...}``
Result = Single | list[Any] | dict[str, Any]

_CLASSES: dict[str, type] = {
    "cls": CLsResult,
    "fit": FitResult,
    "upper-limit": UpperLimitResult,
    "significance": SignificanceResult,
}


def _is_single(operation: str, data: Any) -> bool:
    if not isinstance(data, Mapping):
        return False
    if operation == "significance":
        return SignificanceResult.matches(data)
    return _CLASSES[operation].KEY in data


def parse_result(operation: str, data: Any) -> Result:
    """Turn a server answer for ``operation`` into typed results, keeping its shape.

    One result -> a dataclass; a JSON list -> a list; ``{"results": ...}`` -> its content;
    any other JSON object -> ``{patch_name: parsed}``.
    """
    if operation not in _CLASSES:
        raise ValueError(f"unknown operation {operation!r}; one of {sorted(_CLASSES)}")
    if _is_single(operation, data):
        return _CLASSES[operation].from_json(data)
    if isinstance(data, list):
        return [parse_result(operation, item) for item in data]
    if isinstance(data, Mapping):
        if "results" in data and len(set(data) - {"results", "meta"}) == 0:
            return parse_result(operation, data["results"])
        return {
            k: PatchError.from_json(v)
            if isinstance(v, Mapping) and PatchError.matches(v)
            else parse_result(operation, v)
            for k, v in data.items()
            if k != "meta"
        }
    raise ValueError(f"unexpected {operation} answer: {data!r:.200}")


def result_to_json(result: Any, *, value: bool = True, uncertainties: bool = False) -> Any:
    """Convert a parsed result (one, a list or a ``{patch: ...}`` dict) back to pyhf's JSON.

    In a scan (a list of :class:`CLsResult`) each entry also carries ``test_poi`` when known,
    since pyhf has no output format for several hypotheses.
    """
    if isinstance(result, FitResult):
        return result.to_pyhf_json(value=value, uncertainties=uncertainties)
    if isinstance(result, (CLsResult, UpperLimitResult, SignificanceResult)):
        return result.to_pyhf_json()
    if isinstance(result, list):
        out = []
        for item in result:
            js = result_to_json(item, value=value, uncertainties=uncertainties)
            if isinstance(item, CLsResult) and item.test_poi is not None:
                js = {"test_poi": item.test_poi, **js}
            out.append(js)
        return out
    if isinstance(result, PatchError):
        return result.to_json()
    if isinstance(result, Mapping):
        return {
            k: result_to_json(v, value=value, uncertainties=uncertainties)
            for k, v in result.items()
        }
    return result


@dataclass
class Job:
    """An asynchronous job (``POST /jobs``), as ``GET /jobs/{id}`` reports it.

    Attributes:
        id: the job id.
        status: ``queued``, ``running``, ``succeeded``, ``failed`` or ``cancelled``.
        operation: ``cls``, ``fit``, ``upper-limit`` or ``significance`` (when reported).
        progress: fraction done in [0, 1] when the server reports one, else ``None``.
        result: the parsed result once ``succeeded`` (see :func:`parse_result`).
        error: the server's reason once ``failed``.
        raw: the whole JSON object as received.
    """

    id: str
    status: str
    operation: str | None = None
    progress: float | None = None
    result: Any = None
    error: Any = None
    raw: dict[str, Any] = field(default_factory=dict)

    TERMINAL: ClassVar[frozenset[str]] = frozenset({"succeeded", "failed", "cancelled"})

    @property
    def done(self) -> bool:
        """Whether the job reached a final status."""
        return self.status in self.TERMINAL

    @classmethod
    def from_json(cls, data: Mapping[str, Any], operation: str | None = None) -> Job:
        """Parse ``GET /jobs/{id}`` (or the 202 answer of ``POST /jobs``)."""
        op = data.get("operation") or operation
        result = data.get("result")
        if result is not None and op in _CLASSES:
            # keep the raw JSON rather than fail on an unexpected shape
            with contextlib.suppress(KeyError, TypeError, ValueError):
                result = parse_result(op, result)
        return cls(
            id=str(data["id"]),
            status=str(data["status"]),
            operation=op,
            progress=_progress_fraction(data.get("progress")),
            result=result,
            error=data.get("error"),
            raw=dict(data),
        )


def _progress_fraction(progress: Mapping[str, Any] | None) -> float | None:
    """The fraction done of the server's ``{"done": n, "total": m}`` (None before planning)."""
    if not progress or not progress.get("total"):
        return None
    return float(progress["done"]) / float(progress["total"])
