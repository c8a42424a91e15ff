"""A spey backend on the pyhf-gpu service: spey's hypothesis tests, its fits on the server.

spey (>= 0.2.7) finds likelihood backends by the entry point group ``spey.backend.plugins``;
this package registers :class:`PyhfGpuBackend` there as ``"pyhf-gpu"``. It is built like
spey-pyhf's ``"pyhf"`` backend, from a background-only workspace and a signal patch, and
answers spey's ``negative_loglikelihood``, ``minimize_negative_loglikelihood`` and their
Asimov twins with ``POST /likelihood`` (:meth:`pyhf_gpu_client.Client.likelihood`), so that
spey's own scipy loop never runs: spey's ``StatisticalModel`` asks the backend first.

What spey-pyhf does, done the same way: interpolation codes ``code4`` (normsys) and ``code4p``
(histosys); ``apriori`` data is the background expectation with the nominal auxiliary data,
``observed`` and ``aposteriori`` fit the observed data; the POI is bounded by
``[0 or max(minimum_poi, -10), poi_upper_bound (10)]`` in free fits; the Asimov data of
``q``/``qtilde`` (``q0``) are the expected data at the conditional fit at POI 0 (1).

One request answers the fixed-POI fits on the data and on its Asimov data, and (the first
time) both free fits: answers are cached per (data, Asimov test statistic, POI), so spey's
``exclusion_confidence_level`` costs one request and ``poi_upper_limit`` one per root-finding
step. :func:`exclusion_confidence_levels` answers many signal patches on one background in
one request, as spey computes CLs from the same four fits.

Example::

    import spey
    stat_model = spey.get_backend("pyhf-gpu")(
        background_only_model="BkgOnly.json", signal_patch=patch, analysis="stau"
    )
    stat_model.exclusion_confidence_level(), stat_model.poi_upper_limit()

The server is ``$PYHF_GPU_SERVER`` (token ``$PYHF_GPU_API_TOKEN``), as for
:class:`~pyhf_gpu_client.Client`, or ``server=``/``token=``/``client=``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
from spey import ExpectationType
from spey.base import BackendBase, ModelConfig
from spey.hypothesis_testing.asymptotic_calculator import compute_asymptotic_confidence_level
from spey.hypothesis_testing.test_statistics import compute_teststatistics
from spey.system.exceptions import AsimovTestStatZero

from . import __version__
from .exceptions import BadRequestError
from .results import PatchError
from .workspace import JSONSource, WorkspaceId, digest, load_json

__all__ = ["PyhfGpuBackend", "exclusion_confidence_levels"]

#: spey-pyhf's modifier settings, which its models are built with
MODIFIER_SETTINGS = {"normsys": {"interpcode": "code4"}, "histosys": {"interpcode": "code4p"}}
#: spey's default POI upper bound (``BackendBase.config``), spey-pyhf's too
POI_UPPER_BOUND = 10.0
_CLIENTS: dict[tuple[str | None, str | None], Any] = {}


def shared_client(server: str | None = None, token: str | None = None) -> Any:
    """One :class:`~pyhf_gpu_client.Client` per (server, token), kept open: the backends of
    a reinterpretation loop share its connections and its uploaded background."""
    key = (server, token)
    if key not in _CLIENTS:
        from ._client import Client

        _CLIENTS[key] = Client(server, token=token)
    return _CLIENTS[key]


def _background(source: JSONSource | WorkspaceId) -> dict[str, Any] | WorkspaceId:
    """A background-only workspace as spey-pyhf takes it (a dict or a path), or the id of one
    uploaded to the server (a :class:`WorkspaceId`, or a sha256 that names no file)."""
    if isinstance(source, WorkspaceId):
        return source
    if (
        isinstance(source, str)
        and set(source) <= set("0123456789abcdef")
        and len(source) == 64
        and not os.path.exists(source)
    ):
        return WorkspaceId(source)
    return load_json(source)


def minimum_poi(
    background: Mapping[str, Any] | WorkspaceId, patch: Sequence[Mapping[str, Any]]
) -> float:
    """spey-pyhf's lowest POI keeping every signal bin's rate >= 0: ``-min(b / s)`` over the
    bins with signal (``b`` the channel's summed background samples, in float32 as there);
    ``-inf`` where there is no signal, or the background is known by its id only."""
    if isinstance(background, WorkspaceId):
        return -math.inf
    ratios = []
    for index, channel in enumerate(background.get("channels", [])):
        signal = next(
            (
                np.array(op.get("value", {}).get("data", []), dtype=np.float32)
                for op in patch
                if int(op["path"].split("/")[2]) == index
            ),
            np.array([], dtype=np.float32),
        )
        if len(signal) == 0:
            continue
        total = np.zeros(len(channel["samples"][0]["data"]), dtype=np.float32)
        for sample in channel["samples"]:
            total += np.array(sample["data"], dtype=np.float32)
        nonzero = signal != 0.0
        ratios.append(np.min(total[nonzero] / signal[nonzero]) if nonzero.any() else np.inf)
    return float(-np.min(ratios).astype(np.float32)) if ratios else -math.inf


def _operations(patch: Any) -> list[dict[str, Any]]:
    """A JSON patch's operations (a pyhf ``Patch`` ``{metadata, patch}`` too)."""
    if isinstance(patch, Mapping) and "patch" in patch:
        return list(patch["patch"])
    return list(patch)


def _data_kind(expected: ExpectationType) -> str:
    """The dataset spey-pyhf fits for ``expected``: apriori the background expectation."""
    return "apriori" if expected == ExpectationType.apriori else "observed"


def _free_bounds(config: ModelConfig) -> tuple[float, float]:
    lo, hi = config.suggested_bounds[config.poi_index]
    return float(lo), float(hi)


def _asimov_stat(test_statistics: str) -> str:
    return {"qmu": "q", "qmutilde": "qtilde"}.get(test_statistics, test_statistics)


def _allows_negative(stat: str) -> bool:
    """spey's rule: only ``q`` lets the POI's estimate be negative."""
    return stat == "q"


class PyhfGpuBackend(BackendBase):
    """A full HistFactory likelihood (background-only workspace + signal patch) fitted by the
    pyhf-gpu service.

    Args:
        signal_patch: the JSON patch adding the signal (spey-pyhf's ``signal_patch``; a pyhf
            ``Patch`` ``{metadata, patch}`` too).
        background_only_model: the background-only workspace: a dict, a path, or the id of
            a workspace uploaded to the server (:class:`~pyhf_gpu_client.WorkspaceId`).
        measurement: the workspace's measurement (default: its first).
        server, token: the service (default ``$PYHF_GPU_SERVER``, ``$PYHF_GPU_API_TOKEN``).
        client: a :class:`~pyhf_gpu_client.Client` to use instead (its server and token).

    Building it asks the server once (the model's parameters, and what spey's observed CLs at
    POI 1 needs): a bad workspace, patch or id fails here with the server's message.
    """

    name: str = "pyhf-gpu"
    version: str = __version__
    author: str = "pyhf-gpu"
    spey_requires: str = ">=0.2.7,<0.3.0"
    doi: ClassVar[list[str]] = []
    arXiv: ClassVar[list[str]] = []

    def __init__(
        self,
        signal_patch: Any,
        background_only_model: JSONSource | WorkspaceId,
        *,
        measurement: str | None = None,
        server: str | None = None,
        token: str | None = None,
        client: Any = None,
    ) -> None:
        self.signal_patch = _operations(signal_patch)
        self.background = _background(background_only_model)
        self.measurement = measurement
        self.client = client if client is not None else shared_client(server, token)
        self._minimum_poi = minimum_poi(self.background, self.signal_patch)
        # (data, dataset: "data" or the Asimov test statistic, POI) -> (-2 log L, parameters)
        self._fixed: dict[tuple[Any, str, float], tuple[float, np.ndarray]] = {}
        # (data, dataset, POI bounds) -> (-2 log L, parameters) of the free fit (bounds None:
        # the model's, before it is known)
        self._free: dict[tuple[Any, str, tuple[float, float] | None], tuple[float, np.ndarray]] = {}
        self._model: dict[str, Any] | None = None
        self._stat = "qtilde"  # the Asimov data spey asked for last: prefetched alongside
        self._ask("observed", [1.0], asimov="qtilde", bounds=self._bounds(False))

    # ------------------------------------------------------------------ requests, cached

    def _bounds(self, allow_negative_signal: bool) -> tuple[float, float] | None:
        """The free fits' POI bounds (None before the model is known: the first request
        asks for spey-pyhf's default ones, ``[0, 10]``, the ones spey's CLs uses)."""
        if self._model is None:
            return (0.0, POI_UPPER_BOUND) if not allow_negative_signal else None
        return _free_bounds(self.config(allow_negative_signal=allow_negative_signal))

    def _ask(
        self,
        data: Any,
        pois: Sequence[float],
        asimov: str | None,
        bounds: tuple[float, float] | None,
        free: bool = True,
    ) -> None:
        """One request: fixed fits at ``pois`` on ``data`` (and its Asimov data), the free
        fits within ``bounds`` if ``free``; every answer cached."""
        describe = self._model is None
        answers = self._likelihood(
            data, pois, asimov=asimov, free_fit=free, poi_bounds=bounds, describe=describe
        )
        for answer in answers:
            if answer.model is not None:
                self._model = answer.model
            for dataset, fits in (("data", answer.data), (asimov, answer.asimov)):
                if dataset is None or fits is None:  # no Asimov data asked: none answered
                    continue
                self._fixed[data, dataset, answer.test_poi] = _fit(fits["fixed"])
                if fits.get("free") is not None:
                    key = bounds or _free_bounds(self.config())
                    self._free[data, dataset, key] = _fit(fits["free"])
        if bounds is None:  # the model's bounds: known now
            self._free = {
                (d, s, b if b is not None else _free_bounds(self.config())): v
                for (d, s, b), v in self._free.items()
            }

    def _likelihood(self, data: Any, pois: Sequence[float], **options: Any) -> Any:
        """``POST /likelihood`` of the signal patch on the background at ``pois``, on ``data``
        (a dataset's name, or a given dataset as a tuple)."""
        return self.client.likelihood(
            self.background,
            [float(p) for p in pois],
            data=list(data) if isinstance(data, tuple) else data,
            patches=[self.signal_patch],
            modifier_settings=MODIFIER_SETTINGS,
            measurement=self.measurement,
            **options,
        )

    def _fixed_fit(self, data: Any, dataset: str, poi: float) -> tuple[float, np.ndarray]:
        """The fit with the POI at ``poi`` (asking, with the Asimov fit at the same POI)."""
        key = (data, dataset, float(poi))
        if key not in self._fixed:
            asimov: str | None = self._stat if dataset == "data" else dataset
            if isinstance(data, tuple):  # a given dataset (toys): no Asimov data with it
                asimov = None
            bounds = self._bounds(_allows_negative(asimov or self._stat))
            free = (data, asimov or "data", bounds) not in self._free
            self._ask(data, [poi], asimov, bounds, free)
        return self._fixed[key]

    def _free_fit(self, data: Any, dataset: str, allow_negative: bool) -> tuple[float, np.ndarray]:
        """The free fit (asking, with the fixed fits at POI 1 prefetched)."""
        bounds = self._bounds(allow_negative)
        key = (data, dataset, bounds)
        if key not in self._free:
            asimov = None if isinstance(data, tuple) else ("q" if allow_negative else "qtilde")
            if dataset != "data":
                asimov = dataset
            self._ask(data, [1.0], asimov, bounds)
        return self._free[key]

    @staticmethod
    def _data_of(expected: ExpectationType, data: Any) -> Any:
        if data is None:
            return _data_kind(expected)
        return tuple(float(v) for v in np.asarray(data, dtype=float).ravel())

    @staticmethod
    def _supported(poi_test: Any = 0.0, par_bounds: Any = None, **kwargs: Any) -> None:
        """What the server answers: one POI value, the model's parameter bounds; otherwise
        spey's own optimiser runs (NotImplementedError is its cue)."""
        if isinstance(poi_test, Mapping) or par_bounds is not None or "fixed_poi_value" in kwargs:
            raise NotImplementedError("pyhf-gpu answers one fixed POI with the model's bounds")

    # ------------------------------------------------------------------ spey's interface

    @property
    def is_alive(self) -> bool:
        """Whether some signal bin is positive (spey-pyhf's rule)."""
        return any(
            value > 0.0
            for op in self.signal_patch
            if op.get("value") is not None
            for value in op["value"].get("data", [])
        )

    def config(
        self, allow_negative_signal: bool = True, poi_upper_bound: float = POI_UPPER_BOUND
    ) -> ModelConfig:
        """The model's parameters, POI bounds as spey-pyhf sets them: from
        ``max(minimum_poi, -10)`` (or 0 without negative signal) to ``poi_upper_bound``."""
        if self._model is None:
            self._ask("observed", [1.0], "qtilde", (0.0, POI_UPPER_BOUND))
        model = self._described
        poi = model["poi_index"]
        bounds = [tuple(b) for b in model["bounds"]]
        bounds[poi] = (
            max(self._minimum_poi, -10.0) if allow_negative_signal else 0.0,
            poi_upper_bound if poi_upper_bound else bounds[poi][1],
        )
        return ModelConfig(
            poi_index=poi,
            minimum_poi=self._minimum_poi,
            suggested_init=list(model["init"]),
            suggested_bounds=bounds,
            parameter_names=list(model["par_names"]),
            suggested_fixed=list(model["fixed"]),
        )

    def negative_loglikelihood(
        self,
        poi_test: float = 1.0,
        expected: ExpectationType = ExpectationType.observed,
        data: Any = None,
        return_parameters: bool = False,
        init_pars: Any = None,
        par_bounds: Any = None,
        **kwargs: Any,
    ) -> float | tuple[float, np.ndarray]:
        """``-log L`` profiled at ``poi_test`` (and the parameters with
        ``return_parameters``)."""
        self._supported(poi_test, par_bounds, **kwargs)
        twice_nll, pars = self._fixed_fit(self._data_of(expected, data), "data", poi_test)
        return (twice_nll / 2.0, pars.copy()) if return_parameters else twice_nll / 2.0

    def asimov_negative_loglikelihood(
        self,
        poi_test: float = 1.0,
        expected: ExpectationType = ExpectationType.observed,
        test_statistics: str = "qtilde",
        init_pars: Any = None,
        par_bounds: Any = None,
        **kwargs: Any,
    ) -> float:
        """``-log L`` of the Asimov data of ``test_statistics``, profiled at ``poi_test``."""
        self._supported(poi_test, par_bounds, **kwargs)
        self._stat = _asimov_stat(test_statistics)
        return self._fixed_fit(_data_kind(expected), self._stat, poi_test)[0] / 2.0

    def minimize_negative_loglikelihood(
        self,
        expected: ExpectationType = ExpectationType.observed,
        allow_negative_signal: bool = True,
        data: Any = None,
        init_pars: Any = None,
        par_bounds: Any = None,
        poi_indices: Sequence[int | str] | None = None,
        **kwargs: Any,
    ) -> tuple[Any, float]:
        """The free fit as spey's ``maximize_likelihood`` returns it: ``(muhat, min -log L)``
        (``({index or name: value}, min -log L)`` for ``poi_indices``)."""
        self._supported(par_bounds=par_bounds, **kwargs)
        fit = self._free_fit(self._data_of(expected, data), "data", allow_negative_signal)
        return self._estimate(fit, poi_indices)

    def minimize_asimov_negative_loglikelihood(
        self,
        expected: ExpectationType = ExpectationType.observed,
        test_statistics: str = "qtilde",
        init_pars: Any = None,
        par_bounds: Any = None,
        poi_indices: Sequence[int | str] | None = None,
        **kwargs: Any,
    ) -> tuple[Any, float]:
        """The free fit to the Asimov data of ``test_statistics``: ``(muhatA, min -log L)``."""
        self._supported(par_bounds=par_bounds, **kwargs)
        self._stat = _asimov_stat(test_statistics)
        fit = self._free_fit(_data_kind(expected), self._stat, _allows_negative(self._stat))
        return self._estimate(fit, poi_indices)

    @property
    def _described(self) -> dict[str, Any]:
        """The model as the server described it (``__init__``'s request asks for it)."""
        assert self._model is not None, "the first request describes the model"
        return self._model

    def _estimate(self, fit: tuple[float, np.ndarray], poi_indices: Any) -> tuple[Any, float]:
        twice_nll, pars = fit
        if poi_indices is None:
            return float(pars[self._described["poi_index"]]), twice_nll / 2.0
        names = self._described["par_names"]
        picked = {
            k: float(pars[names.index(k) if isinstance(k, str) else int(k)]) for k in poi_indices
        }
        return picked, twice_nll / 2.0

    def _at(self, pars: Sequence[float] | np.ndarray, data: Any) -> dict[str, Any]:
        """The model at a parameter point: its expected data and ``-2 log L`` of ``data``."""
        point = [float(v) for v in np.asarray(pars, dtype=float).ravel()]
        poi = point[self._described["poi_index"]]
        (answer,) = self._likelihood(data, [poi], free_fit=False, describe=True, parameters=point)
        return {**answer.at_parameters, "model": answer.model}

    def expected_data(self, pars: Sequence[float]) -> list[float]:
        """The expected data at ``pars``: main bins, then auxiliary data (one request)."""
        return [math.nan if v is None else v for v in self._at(pars, "observed")["expected_data"]]

    def get_logpdf_func(
        self, expected: ExpectationType = ExpectationType.observed, data: Any = None
    ) -> Callable[[np.ndarray], float]:
        """``log L(pars)``, one request per call: only spey's own optimiser needs it (a
        multi-POI test, or custom parameter bounds), and runs slowly with it."""
        chosen = self._data_of(expected, data)
        return lambda pars: -self._at(pars, chosen)["twice_nll"] / 2.0

    def get_sampler(self, pars: np.ndarray) -> Callable[..., np.ndarray]:
        """Pseudo-data at ``pars`` as pyhf draws them: Poisson main bins, auxiliary data
        Poisson or Normal around their expectation (one request, then numpy)."""
        at = self._at(pars, "observed")
        expected = np.array([math.nan if v is None else v for v in at["expected_data"]])
        n_main = at["model"]["n_main"]
        poisson = np.array(at["model"]["aux_poisson"], dtype=bool)
        sigma = np.array(at["model"]["aux_sigma"], dtype=float)

        def sampler(number_of_samples: int, include_auxiliary: bool = True) -> np.ndarray:
            rng = np.random.default_rng()
            main = rng.poisson(np.clip(expected[:n_main], 0, None), (number_of_samples, n_main))
            if not include_auxiliary:
                return main.astype(float)
            aux_mean = expected[n_main:]
            normal = rng.normal(aux_mean, sigma, (number_of_samples, len(aux_mean)))
            counts = rng.poisson(np.clip(aux_mean, 0, None), (number_of_samples, len(aux_mean)))
            return np.concatenate([main, np.where(poisson, counts, normal)], axis=1)

        return sampler


def _fit(point: Mapping[str, Any]) -> tuple[float, np.ndarray]:
    """``(-2 log L, parameters)`` of a fit of the answer (null: NaN)."""
    nll = point["twice_nll"]
    pars = np.array([math.nan if v is None else v for v in point["parameters"]], dtype=float)
    return (math.nan if nll is None else float(nll)), pars


def _patchset(background: Any, patches: Sequence[Any]) -> dict[str, Any]:
    """The signal patches as one pyhf PatchSet on ``background``: one element each, named
    ``signal_<i>`` (pyhf's schema wants a reference: a placeholder HEPData record)."""
    sha = background if isinstance(background, WorkspaceId) else digest(background)
    return {
        "metadata": {
            "name": "spey_signals",
            "description": "signal patches of pyhf_gpu_client.spey.exclusion_confidence_levels",
            "references": {"hepdata": "ins0000000"},
            "digests": {"sha256": str(sha)},
            "labels": ["index"],
        },
        "patches": [
            {"metadata": {"name": f"signal_{i}", "values": [i]}, "patch": patch}
            for i, patch in enumerate(patches)
        ],
        "version": "1.0.0",
    }


def exclusion_confidence_levels(
    background_only_model: JSONSource | WorkspaceId,
    signal_patches: Sequence[Any] | Mapping[str, Any],
    poi_test: float = 1.0,
    expected: ExpectationType = ExpectationType.observed,
    allow_negative_signal: bool = False,
    *,
    measurement: str | None = None,
    server: str | None = None,
    token: str | None = None,
    client: Any = None,
) -> list[list[float]] | dict[str, list[float]]:
    """spey's ``exclusion_confidence_level`` (asymptotic) of many signal patches on one
    background, in one request: the four fits of each (free and fixed at ``poi_test``, on
    the data and on its Asimov data) on the server, CLs from them by spey's own formulae.

    ``signal_patches``: a list (answers a list, in order) or ``{name: patch}`` (answers
    ``{name: ...}``). Each answer is what spey returns: ``[1 - CLs]`` for ``observed``, the
    five expected ``1 - CLs`` otherwise. With ``allow_negative_signal`` (the ``q`` test
    statistic) the POI's lower bound is each patch's own (spey-pyhf's ``minimum_poi``): one
    request per distinct bound.
    """
    client = client if client is not None else shared_client(server, token)
    background = _background(background_only_model)
    given = signal_patches.values() if isinstance(signal_patches, Mapping) else signal_patches
    patches = [_operations(p) for p in given]
    stat = "q" if allow_negative_signal else "qtilde"
    groups: dict[float, list[int]] = {}
    for i, patch in enumerate(patches):
        lower = max(minimum_poi(background, patch), -10.0) if allow_negative_signal else 0.0
        groups.setdefault(lower, []).append(i)
    answers: dict[int, Any] = {}
    for lower, members in groups.items():
        patchset = _patchset(background, [patches[i] for i in members])
        found = client.likelihood(
            background,
            float(poi_test),
            data=_data_kind(expected),
            asimov=stat,
            poi_bounds=(lower, POI_UPPER_BOUND),
            describe=True,
            patchset=patchset,
            modifier_settings=MODIFIER_SETTINGS,
            measurement=measurement,
        )
        for j, i in enumerate(members):
            answers[i] = found[f"signal_{j}"]
    levels = [_confidence_levels(answers[i], poi_test, expected, stat) for i in range(len(patches))]
    if isinstance(signal_patches, Mapping):
        return dict(zip(signal_patches, levels, strict=True))
    return levels


def _confidence_levels(
    answer: Any, poi_test: float, expected: ExpectationType, stat: str
) -> list[float]:
    """spey's ``exclusion_confidence_level`` from one row's four fits (its own formulae)."""
    if isinstance(answer, PatchError):  # a patch the server could not test
        raise BadRequestError(answer.status, answer.detail)
    poi = answer.model["poi_index"]
    (free, pars), (fixed, _) = _fit(answer.data["free"]), _fit(answer.data["fixed"])
    (free_a, pars_a), (fixed_a, _) = _fit(answer.asimov["free"]), _fit(answer.asimov["fixed"])
    # the POI is bounded at 0 for qtilde, so spey's q~ never asks the likelihood at 0 instead
    try:
        _, sqrt_qmu_a, delta = compute_teststatistics(
            poi_test,
            (float(pars[poi]), free / 2.0),
            lambda mu: -fixed / 2.0,
            (float(pars_a[poi]), free_a / 2.0),
            lambda mu: -fixed_a / 2.0,
            stat,
        )
        pvalues, expected_pvalues = compute_asymptotic_confidence_level(sqrt_qmu_a, delta, stat)
    except AsimovTestStatZero:  # spey's answer then
        pvalues, expected_pvalues = [1.0], [1.0] * 5
    chosen = pvalues if expected == ExpectationType.observed else expected_pvalues
    return [0.0 if np.isnan(x) else 1.0 - x for x in chosen]
