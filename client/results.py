"""Typed results. Each converts back to the JSON that pyhf's CLI prints (``to_pyhf_json``);
those pyhf has no command for (ranking, scan, yields) to the server's JSON (``to_json``).

The server's answers are parsed by :func:`parse_result`, which recognises the three shapes the
service uses: one result (a JSON object with the operation's keys), a scan over several
``test_poi`` values (a JSON list) and a patchset batch (a JSON object ``{patch_name: ...}``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import types
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypedDict, TypeVar, cast, get_args, get_origin, get_type_hints

from . import tables

__all__ = [
    "BOUNDS_FLAGS",
    "OPERATIONS",
    "CLsResult",
    "ChannelYields",
    "FitResult",
    "Flag",
    "GoodnessOfFit",
    "Job",
    "LikelihoodResult",
    "PoiEstimate",
    "RankingResult",
    "Result",
    "ResultFlag",
    "ResultMeta",
    "SampleYields",
    "Scan2DResult",
    "ScanResult",
    "SignificanceResult",
    "UpperLimitResult",
    "YieldsResult",
    "doubtful",
    "flagged",
    "parse_result",
    "result_to_json",
]

#: operation name (as in ``POST /jobs``) -> endpoint path
OPERATIONS: dict[str, str] = {name: "/" + name for name in tables.OPERATION_NAMES}


class ResultFlag(TypedDict):
    """One entry of ``meta.flags``: its ``kind`` (e.g. ``"not_converged"``) and ``detail``,
    the sentence clients show (:class:`Flag` is the parsed form)."""

    kind: str
    detail: str


class ResultMeta(TypedDict, total=False):
    """A result's ``meta``, as the server declares it (its ``ResultMeta``): how the result was
    computed. Kept as the server's JSON object (a dict); every key optional here, as answers
    built by hand (and older servers) may leave keys out."""

    device: str
    dtype: str
    model_id: str
    cache: str
    batch_rows: int
    converged: bool | None
    starts: int | None
    starts_agreed: bool | None
    flags: list[ResultFlag]
    test_poi: float | None
    patch: str | None
    stacked_apart: str | None
    ignored_observations: list[str] | None
    worker: str | None
    timings: dict[str, float]


def _float(value: Any) -> float:
    """JSON number (or null / "nan" / "inf" strings some servers emit) -> float."""
    return math.nan if value is None else float(value)


def _floats(values: Any) -> list[float]:
    return [_float(v) for v in values]


def _extra(data: Mapping[str, Any], cls: type, *renamed: str) -> dict[str, Any]:
    """The keys of ``data`` that are none of ``cls``'s fields (nor ``renamed``, the keys of
    fields named otherwise) nor ``meta``."""
    known = {f.name for f in dataclasses.fields(cls)}.union(renamed, ("meta",))
    return {k: v for k, v in data.items() if k not in known}


@functools.cache
def _field_types(cls: type) -> list[tuple[dataclasses.Field[Any], Any]]:
    """``cls``'s dataclass fields with their types (resolved annotations)."""
    hints = get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls)]


def _convert(kind: Any, value: Any) -> Any:
    """A JSON value as a field of type ``kind``: numbers by :func:`_float` (null: NaN), nested
    results by their ``from_json``, lists and dicts item by item; null stays ``None`` where
    ``kind`` allows it."""
    if get_origin(kind) is types.UnionType:  # X | None
        if value is None:
            return None
        kind = next(m for m in get_args(kind) if m is not type(None))
    origin, args = get_origin(kind), get_args(kind)
    if origin is list:
        return [_convert(args[0], v) for v in value]
    if origin is dict:
        return {k: _convert(args[1], v) for k, v in value.items()}
    if kind is float:
        return _float(value)
    if kind is Any:
        return value
    if hasattr(kind, "from_json"):
        return kind.from_json(value)
    return kind(value)  # str, int, bool


def _from_json(cls: type, data: Mapping[str, Any], **parsed: Any) -> Any:
    """``cls``, a dataclass mirroring the server's JSON, from ``data``: the fields not in
    ``parsed`` read from their keys by their types (:func:`_convert`); a missing key gives
    the field's default, NaN for a number, else KeyError; ``meta`` a copy of the answer's
    (empty if none), ``extra`` by :func:`_extra`."""
    for f, kind in _field_types(cls):
        if f.name in parsed:
            continue
        if f.name == "meta":
            parsed["meta"] = cast(ResultMeta, dict(data.get("meta") or {}))
        elif f.name == "extra":
            parsed["extra"] = _extra(data, cls)
        elif f.name in data:
            parsed[f.name] = _convert(kind, data[f.name])
        elif kind is float:
            parsed[f.name] = math.nan
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise KeyError(f.name)
    return cls(**parsed)


def _json_value(value: Any) -> Any:
    """A parsed value back to the server's JSON: NaN -> null (as the server sends it), nested
    records by their ``to_json``."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, _Record):
        return value.to_json()
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _json_value(v) for k, v in value.items()}
    return value


_R = TypeVar("_R", bound="_Record")


class _Record:
    """A result that mirrors the server's JSON field for field (dataclass fields, plus the
    optional ``meta`` and ``extra``): :meth:`to_json` gives that JSON back.

    Numbers the server sent as ``null`` are NaN here and ``null`` again in :meth:`to_json`.
    """

    KEY: ClassVar[str]

    @classmethod
    def from_json(cls: type[_R], data: Mapping[str, Any]) -> _R:
        """Parse the server's JSON of this result (see :func:`_from_json`)."""
        return _from_json(cls, data)

    def to_json(self, meta: bool = True) -> dict[str, Any]:
        """The server's JSON of this result (``meta`` included unless ``meta=False``)."""
        out: dict[str, Any] = dict(getattr(self, "extra", None) or {})
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            if f.name not in ("meta", "extra"):
                out[f.name] = _json_value(getattr(self, f.name))
        if meta and getattr(self, "meta", None):
            out["meta"] = dict(self.meta)  # type: ignore[attr-defined]
        return out


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
    meta: ResultMeta = field(default_factory=ResultMeta)
    extra: dict[str, Any] = field(default_factory=dict)

    KEY: ClassVar[str] = "CLs_obs"

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CLsResult:
        """Parse one server answer (``{"CLs_obs": ..., "CLs_exp": [...], "meta": {...}}``)."""
        poi = (data.get("meta") or {}).get("test_poi")
        return _from_json(
            cls,
            data,
            cls_obs=_float(data["CLs_obs"]),
            cls_exp=_floats(data.get("CLs_exp", [])),
            test_poi=None if poi is None or isinstance(poi, list) else float(poi),
            extra=_extra(data, cls, "CLs_obs", "CLs_exp"),
        )

    def to_pyhf_json(self) -> dict[str, Any]:
        """Exactly the keys of ``pyhf cls``: ``{"CLs_obs": float, "CLs_exp": [5 floats]}``."""
        return {"CLs_obs": self.cls_obs, "CLs_exp": list(self.cls_exp)}


@dataclass
class GoodnessOfFit(_Record):
    """Saturated-model goodness of fit of a fit (cabinetry's ``fit.goodness_of_fit``).

    Attributes:
        p_value: ``P(chi2_ndof >= delta_twice_nll)``; NaN (``null`` on the wire) if ``ndof <= 0``.
        delta_twice_nll: -2 ln L of the fit minus the saturated model's.
        ndof: main bins minus free unconstrained parameters.
    """

    p_value: float
    delta_twice_nll: float
    ndof: int


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
        goodness_of_fit: the :class:`GoodnessOfFit`, when asked for (``goodness_of_fit=True``).
    """

    mle_parameters: dict[str, list[float]]
    twice_nll: float | None = None
    uncertainties: dict[str, list[float]] | None = None
    corr_mat: list[list[float]] | None = None
    meta: ResultMeta = field(default_factory=ResultMeta)
    extra: dict[str, Any] = field(default_factory=dict)
    goodness_of_fit: GoodnessOfFit | None = None

    KEY: ClassVar[str] = "mle_parameters"

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FitResult:
        """Parse one server answer of ``POST /fit``."""
        return _from_json(cls, data)

    def to_pyhf_json(self, value: bool = True, uncertainties: bool = False) -> dict[str, Any]:
        """The keys of ``pyhf fit`` (``twice_nll`` only with ``value``, as ``--value`` does).

        With ``uncertainties=True`` the ``uncertainties`` and ``corr_mat`` keys are added; the
        ``goodness_of_fit`` object is whenever the server sent one (it was asked for).
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
        if self.goodness_of_fit is not None:
            out["goodness_of_fit"] = self.goodness_of_fit.to_json()
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
    meta: ResultMeta = field(default_factory=ResultMeta)
    extra: dict[str, Any] = field(default_factory=dict)

    KEY: ClassVar[str] = "upper_limit_obs"

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> UpperLimitResult:
        """Parse one server answer of ``POST /upper-limit``."""
        return _from_json(
            cls,
            data,
            upper_limit_obs=_float(data["upper_limit_obs"]),
            upper_limit_exp=_floats(data.get("upper_limit_exp", [])),
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
        p0_exp_set: the expected p0's -2..+2 sigma band, pyhf's order (``None`` if not sent).
    """

    p0_obs: float
    p0_exp: float
    z_obs: float
    z_exp: float
    p0_exp_set: list[float] | None = None
    meta: ResultMeta = field(default_factory=ResultMeta)
    extra: dict[str, Any] = field(default_factory=dict)
    #: the answer's own spellings of the four numbers, kept so that to_pyhf_json reproduces them
    keys: tuple[str, str, str, str] = ("p0_obs", "p0_exp", "z_obs", "z_exp")

    KEY: ClassVar[str] = "p0_obs"
    #: the spellings tolerated for each number, the server's first
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
        used = [next((n for n in names if n in data), names[0]) for names in cls._ALIASES.values()]
        return _from_json(
            cls,
            data,
            **{key: _float(data.get(name)) for key, name in zip(cls._ALIASES, used, strict=True)},
            extra=_extra(data, cls, *used),
            keys=(used[0], used[1], used[2], used[3]),
        )

    def to_pyhf_json(self) -> dict[str, Any]:
        """The server's keys (``p0_obs``, ``p0_exp``, ``z_obs``, ``z_exp``, ``p0_exp_set``, ...),
        without ``meta``."""
        p0o, p0e, zo, ze = self.keys
        out = {**self.extra, p0o: self.p0_obs, p0e: self.p0_exp, zo: self.z_obs, ze: self.z_exp}
        if self.p0_exp_set is not None:
            out["p0_exp_set"] = list(self.p0_exp_set)
        return out


@dataclass
class LikelihoodResult(_Record):
    """Fits at one tested POI value (``POST /likelihood``): ``data`` and, with ``asimov``,
    ``asimov`` each ``{"fixed": fit, "free": fit}`` where a fit is ``{"twice_nll",
    "parameters", "converged"}`` (the free fit only when asked for); ``model`` (``describe``)
    and ``at_parameters`` (``parameters``) as the server sends them."""

    test_poi: float
    data: dict[str, Any]
    asimov: dict[str, Any] | None = None
    model: dict[str, Any] | None = None
    at_parameters: dict[str, Any] | None = None
    meta: ResultMeta = field(default_factory=ResultMeta)
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def matches(cls, data: Mapping[str, Any]) -> bool:
        """One row's answer (not a patchset's ``{patch: ...}``)."""
        return "test_poi" in data and isinstance(data.get("data"), Mapping) and "meta" in data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LikelihoodResult:
        """Parse one server answer of ``POST /likelihood``."""
        return _from_json(cls, data, test_poi=_float(data["test_poi"]))


@dataclass
class PoiEstimate(_Record):
    """The POI's best fit and Hessian uncertainty (in a :class:`RankingResult`)."""

    name: str
    bestfit: float
    uncertainty: float


@dataclass
class RankingResult(_Record):
    """Impacts of nuisance parameters on the POI (cabinetry's ``RankingResults``), one entry
    per parameter in every list, largest impact first as the server sends them.

    Attributes:
        labels: parameter labels (``"lumi"``, ``"staterror_SR[0]"``).
        bestfit, uncertainty: each parameter's best fit and Hessian uncertainty.
        prefit_uncertainty: the width of its constraint term (0 when unconstrained).
        prefit_up, prefit_down, postfit_up, postfit_down: the POI's shift when the parameter
            is fixed at its best fit plus/minus its pre-/post-fit uncertainty and the POI refit.
        pull, constraint: ``(bestfit - centre) / prefit_uncertainty`` and
            ``uncertainty / prefit_uncertainty`` (NaN for unconstrained parameters).
        fits_converged: whether all four refits of the parameter converged.
        poi: the POI's :class:`PoiEstimate`.
    """

    labels: list[str]
    bestfit: list[float]
    uncertainty: list[float]
    prefit_uncertainty: list[float]
    prefit_up: list[float]
    prefit_down: list[float]
    postfit_up: list[float]
    postfit_down: list[float]
    pull: list[float]
    constraint: list[float]
    fits_converged: list[bool]
    poi: PoiEstimate
    meta: ResultMeta = field(default_factory=ResultMeta)
    extra: dict[str, Any] = field(default_factory=dict)

    KEY: ClassVar[str] = "labels"
    #: the per-parameter lists of numbers
    NUMBERS: ClassVar[tuple[str, ...]] = (
        "bestfit",
        "uncertainty",
        "prefit_uncertainty",
        "prefit_up",
        "prefit_down",
        "postfit_up",
        "postfit_down",
        "pull",
        "constraint",
    )

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RankingResult:
        """Parse one server answer of ``POST /ranking``."""
        if data.get("fits_converged") is None:  # not sent: all converged
            return _from_json(cls, data, fits_converged=[True] * len(data["labels"]))
        return _from_json(cls, data)

    def __len__(self) -> int:
        return len(self.labels)

    def impacts(self, by: str = "postfit") -> list[float]:
        """Per parameter, ``max(|up|, |down|)`` of its ``by`` (``"postfit"``/``"prefit"``)
        impacts, the measure the ranking is sorted by."""
        if by not in ("postfit", "prefit"):
            raise ValueError(f"by must be 'postfit' or 'prefit', not {by!r}")
        ups, downs = getattr(self, f"{by}_up"), getattr(self, f"{by}_down")
        return [max(abs(u), abs(d)) for u, d in zip(ups, downs, strict=True)]

    def select(self, indices: Iterable[int]) -> RankingResult:
        """A ranking of only the parameters at ``indices``, in that order."""
        chosen = list(indices)
        lists = {name: getattr(self, name) for name in ("labels", *self.NUMBERS, "fits_converged")}
        # str, float and bool lists, one per field: Any, as mypy checks each field's type
        changes: dict[str, Any] = {
            name: [values[i] for i in chosen] for name, values in lists.items()
        }
        return dataclasses.replace(self, **changes)

    def sorted(self, by: str = "postfit") -> RankingResult:
        """Largest ``by`` impact first (NaN impacts last; ties keep their order)."""
        impacts = self.impacts(by)
        order = sorted(
            range(len(self)), key=lambda i: -impacts[i] if not math.isnan(impacts[i]) else math.inf
        )
        return self.select(order)

    def top(self, n: int, by: str = "postfit") -> RankingResult:
        """The ``n`` parameters of largest ``by`` impact."""
        return self.sorted(by).select(range(min(max(n, 0), len(self))))

    def rows(self) -> list[dict[str, Any]]:
        """One dict per parameter: ``label`` and its value of every per-parameter list."""
        names = (*self.NUMBERS, "fits_converged")
        return [
            {"label": label, **{name: getattr(self, name)[i] for name in names}}
            for i, label in enumerate(self.labels)
        ]

    def parameter(self, label: str) -> dict[str, Any]:
        """The :meth:`rows` entry of ``label`` (``KeyError`` if it was not ranked)."""
        if label not in self.labels:
            raise KeyError(label)
        return self.rows()[self.labels.index(label)]


@dataclass
class ScanResult(_Record):
    """A 1D profile-likelihood scan (cabinetry's ``ScanResults``).

    Attributes:
        name: the scanned parameter's label.
        bestfit, uncertainty: its free-fit value and Hessian uncertainty.
        parameter_values: the grid.
        delta_nlls: ``-2 delta ln L`` at each grid value.
    """

    name: str
    bestfit: float
    uncertainty: float
    parameter_values: list[float]
    delta_nlls: list[float]
    meta: ResultMeta = field(default_factory=ResultMeta)
    extra: dict[str, Any] = field(default_factory=dict)

    KEY: ClassVar[str] = "delta_nlls"

    def points(self) -> list[tuple[float, float]]:
        """``(value, delta_nll)`` per grid point."""
        return list(zip(self.parameter_values, self.delta_nlls, strict=True))

    def minimum(self) -> tuple[float, float]:
        """The grid point ``(value, delta_nll)`` of the smallest ``delta_nll`` (NaN skipped)."""
        return min(self.points(), key=lambda p: math.inf if math.isnan(p[1]) else p[1])


@dataclass
class Scan2DResult(_Record):
    """A 2D profile-likelihood scan: ``delta_nlls[i][j]`` at
    ``(parameter_values[0][i], parameter_values[1][j])``.

    Attributes:
        names: the two parameters' labels ``[x, y]``.
        bestfit, uncertainty: their free-fit values and uncertainties ``[x, y]``.
        correlation: their free-fit correlation.
    """

    names: list[str]
    bestfit: list[float]
    uncertainty: list[float]
    correlation: float
    parameter_values: list[list[float]]
    delta_nlls: list[list[float]]
    meta: ResultMeta = field(default_factory=ResultMeta)
    extra: dict[str, Any] = field(default_factory=dict)

    KEY: ClassVar[str] = "names"

    @classmethod
    def matches(cls, data: Mapping[str, Any]) -> bool:
        """Whether ``data`` is one 2D scan answer (a 1D one has ``name``)."""
        return cls.KEY in data and ScanResult.KEY in data

    def points(self) -> list[tuple[float, float, float]]:
        """``(x, y, delta_nll)`` per grid point, x outer."""
        xs, ys = self.parameter_values
        return [(x, y, self.delta_nlls[i][j]) for i, x in enumerate(xs) for j, y in enumerate(ys)]

    def minimum(self) -> tuple[float, float, float]:
        """The grid point ``(x, y, delta_nll)`` of the smallest ``delta_nll`` (NaN skipped)."""
        return min(self.points(), key=lambda p: math.inf if math.isnan(p[2]) else p[2])


@dataclass
class SampleYields(_Record):
    """One sample's (or the total's) yields in a channel, with uncertainties.

    Attributes:
        yields, stdev: per bin.
        channel_yield, channel_stdev: summed over the channel's bins.
    """

    yields: list[float]
    stdev: list[float]
    channel_yield: float
    channel_stdev: float


@dataclass
class ChannelYields(_Record):
    """One channel of a :class:`YieldsResult`: every sample, their total and the data.

    Attributes:
        bins: the channel's number of bins.
        samples: ``{sample: SampleYields}`` in the model's order.
        total: the sum of the samples, with its uncertainty (correlations included).
        data: observed counts per bin; ``channel_data`` their sum.
    """

    bins: int
    samples: dict[str, SampleYields]
    total: SampleYields
    data: list[float]
    channel_data: float

    def rows(self) -> list[tuple[str, list[float], list[float] | None]]:
        """``(sample, values, stdevs)`` for every sample, then ``total``, then ``data``
        (without stdevs); each list has the bins and, last, the channel sum."""
        out: list[tuple[str, list[float], list[float] | None]] = [
            (name, [*s.yields, s.channel_yield], [*s.stdev, s.channel_stdev])
            for name, s in [*self.samples.items(), ("total", self.total)]
        ]
        out.append(("data", [*self.data, self.channel_data], None))
        return out

    def table(self, precision: int = 2) -> list[dict[str, str]]:
        """Rows for display, as cabinetry's ``tabulate.yields``: ``{"sample": name,
        "bin 1": "12.30 ± 1.10", ..., "sum": ...}`` for every sample, ``total`` and ``data``."""
        headers = [f"bin {b + 1}" for b in range(self.bins)] + ["sum"]
        out = []
        for name, values, stdevs in self.rows():
            cells = [
                f"{v:.{precision}f}" if stdevs is None else f"{v:.{precision}f} ± {e:.{precision}f}"
                for v, e in zip(values, stdevs or values, strict=True)
            ]
            out.append({"sample": name, **dict(zip(headers, cells, strict=True))})
        return out


@dataclass
class YieldsResult(_Record):
    """Pre- and post-fit yields per channel, sample and bin (cabinetry's
    ``model_utils.prediction``), with the data.

    Attributes:
        prefit: ``{channel: ChannelYields}`` at the pre-fit parameters and uncertainties.
        postfit: the same at the best fit, with the fit's covariance.
    """

    prefit: dict[str, ChannelYields]
    postfit: dict[str, ChannelYields]
    meta: ResultMeta = field(default_factory=ResultMeta)
    extra: dict[str, Any] = field(default_factory=dict)

    KEY: ClassVar[str] = "postfit"
    FITS: ClassVar[tuple[str, str]] = ("prefit", "postfit")
    #: the columns of :meth:`rows` (and of ``pyhf-gpu-client yields --format csv``)
    COLUMNS: ClassVar[tuple[str, ...]] = ("fit", "channel", "sample", "bin", "yield", "stdev")

    @property
    def channels(self) -> list[str]:
        """The channels' names, in the model's order."""
        return list(self.postfit)

    def channel(self, name: str, fit: str = "postfit") -> ChannelYields:
        """One channel's yields of ``fit`` (``"prefit"`` or ``"postfit"``)."""
        return self._part(fit)[name]

    def _part(self, fit: str) -> dict[str, ChannelYields]:
        if fit not in self.FITS:
            raise ValueError(f"fit must be 'prefit' or 'postfit', not {fit!r}")
        return getattr(self, fit)

    def rows(self) -> list[dict[str, Any]]:
        """One dict per (fit, channel, sample, bin), columns :attr:`COLUMNS`; the samples,
        then ``total``, then ``data`` (``stdev`` None); ``bin`` counts from 0 (the index
        into ``yields``), channel sums are left out."""
        out = []
        for fit in self.FITS:
            for channel, yields in self._part(fit).items():
                for sample, values, stdevs in yields.rows():
                    for b in range(yields.bins):
                        stdev = None if stdevs is None else stdevs[b]
                        row = (fit, channel, sample, b, values[b], stdev)
                        out.append(dict(zip(self.COLUMNS, row, strict=True)))
        return out

    def table(self, fit: str = "postfit", precision: int = 2) -> dict[str, list[dict[str, str]]]:
        """``{channel: ChannelYields.table()}`` of ``fit``: display rows per channel."""
        return {name: c.table(precision) for name, c in self._part(fit).items()}


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


Single = (
    CLsResult
    | FitResult
    | UpperLimitResult
    | SignificanceResult
    | RankingResult
    | ScanResult
    | Scan2DResult
    | YieldsResult
    | LikelihoodResult
)
#: what every operation returns: one result, a list (a ``test_poi`` scan) or ``{patch: ...}``
Result = Single | list[Any] | dict[str, Any]


#: the result classes of each operation, tried in order on one answer
_CLASSES: dict[str, tuple[type[Any], ...]] = {
    tables.CLS: (CLsResult,),
    tables.FIT: (FitResult,),
    tables.UPPER_LIMIT: (UpperLimitResult,),
    tables.SIGNIFICANCE: (SignificanceResult,),
    tables.RANKING: (RankingResult,),
    tables.SCAN: (Scan2DResult, ScanResult),
    tables.YIELDS: (YieldsResult,),
    tables.LIKELIHOOD: (LikelihoodResult,),
}


def _single_class(operation: str, data: Any) -> type[Any] | None:
    """The class of ``data`` when it is one result of ``operation`` (its ``matches``, else
    its ``KEY`` in the object); None for a list or a patchset's ``{patch: ...}``."""
    if not isinstance(data, Mapping):
        return None
    for cls in _CLASSES[operation]:
        matches = getattr(cls, "matches", None)
        if matches(data) if matches is not None else cls.KEY in data:
            return cls
    return None


#: the kinds of ``meta.flags`` that say an answer lies past its model's limits (a limit past
#: the POI's bounds or the scan's ends, the POI's best fit on its bound, q~ of a POI not
#: bounded at 0) rather than a fit that failed: warned as
#: :class:`~pyhf_gpu_client.exceptions.BeyondBoundsWarning`
BOUNDS_FLAGS = frozenset(
    {"limit_beyond_bounds", "limit_outside_scan", "poi_at_bound", "qtilde_poi_bound"}
)


@dataclass(frozen=True)
class Flag:
    """One flag the server set in a result's ``meta.flags``: its ``kind`` and ``line``, the
    sentence that names the result (patch, tested POI) and what was found."""

    kind: str
    line: str

    @property
    def beyond_bounds(self) -> bool:
        """Whether it says the answer lies past its model's limits (:data:`BOUNDS_FLAGS`)."""
        return self.kind in BOUNDS_FLAGS


#: ``(meta key, kind, detail)`` of the flags of a server that sends no ``meta.flags``
_LEGACY_FLAGS = (
    (
        "converged",
        "not_converged",
        "its fits did not converge (meta.converged false): its numbers may not be the minimum's",
    ),
    (
        "starts_agreed",
        "starts_disagree",
        "its fits from extra starts reached different minima (meta.starts_agreed false): the "
        "answer is the lowest found",
    ),
)


def _meta_flags(meta: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(kind, detail)`` of each of ``meta.flags``; from a server that sends none, its
    ``converged`` and ``starts_agreed``."""
    if "flags" in meta:
        return [(str(f.get("kind")), str(f.get("detail"))) for f in meta["flags"] or ()]
    return [(kind, detail) for key, kind, detail in _LEGACY_FLAGS if meta.get(key) is False]


def flagged(result: Any) -> list[Flag]:
    """The flags the server set in the ``meta`` of a parsed result (one, a list or a
    ``{patch: ...}`` dict), whatever its operation; one each, naming the patch and the tested
    POI where there are several.

    >>> meta = {"flags": [{"kind": "poi_at_bound", "detail": "the POI is on its bound 0"}]}
    >>> flagged({"p1": CLsResult(0.1, [0.1] * 5, meta=meta)})
    [Flag(kind='poi_at_bound', line="patch 'p1': the POI is on its bound 0")]
    """
    found: list[Flag] = []
    for meta, patches in result_metas(result):
        place = [f"patch {name!r}" for name in patches]
        if meta.get("test_poi") is not None:
            place.append(f"test_poi {meta['test_poi']}")
        label = ", ".join(place) or "the result"
        for kind, detail in _meta_flags(meta):
            found.append(Flag(kind, f"{label}: {detail}"))
    return found


def result_metas(
    result: Any, patches: tuple[Any, ...] = ()
) -> Iterator[tuple[Any, tuple[Any, ...]]]:
    """The ``meta`` (``{}`` if none) of each result in a parsed result (one, a list or a
    ``{patch: ...}`` dict), with the patch names on its way there."""
    if isinstance(result, list):
        for entry in result:
            yield from result_metas(entry, patches)
    elif isinstance(result, Mapping):
        for name, entry in result.items():
            yield from result_metas(entry, (*patches, name))
    else:
        yield getattr(result, "meta", None) or {}, patches


def doubtful(result: Any) -> list[str]:
    """The lines of :func:`flagged`: what the server flagged in the results' ``meta``.

    >>> doubtful(CLsResult(0.1, [0.1] * 5, meta={"converged": False, "test_poi": 1.0}))
    ["test_poi 1.0: its fits did not converge (meta.converged false): its numbers may not be the minimum's"]
    >>> doubtful({"p1": CLsResult(0.1, [0.1] * 5, meta={"converged": True, "flags": []})})
    []
    """
    return [flag.line for flag in flagged(result)]


def parse_result(operation: str, data: Any) -> Result:
    """Turn a server answer for ``operation`` into typed results, keeping its shape.

    One result -> a dataclass; a JSON list -> a list; ``{"results": ...}`` -> its content;
    any other JSON object -> ``{patch_name: parsed}``.
    """
    if operation not in _CLASSES:
        raise ValueError(f"unknown operation {operation!r}; one of {sorted(_CLASSES)}")
    single = _single_class(operation, data)
    if single is not None:
        return single.from_json(data)
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

    Results pyhf has no command for (ranking, scan, yields) are the server's JSON without
    ``meta``. In a scan (a list of :class:`CLsResult`) each entry also carries ``test_poi`` when known,
    since pyhf has no output format for several hypotheses.
    """
    if isinstance(result, FitResult):
        return result.to_pyhf_json(value=value, uncertainties=uncertainties)
    if isinstance(result, (CLsResult, UpperLimitResult, SignificanceResult)):
        return result.to_pyhf_json()
    if isinstance(result, _Record):
        return result.to_json(meta=False)
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
        operation: ``cls``, ``fit``, ``upper-limit``, ``significance``, ``ranking``, ``scan``
            or ``yields`` (when reported).
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
