"""Host-side reading of a pyhf model into plain arrays: the precompute done once at load.

pyhf parses and validates the workspace and fixes the parameter layout (``Model.config``:
``par_order``, ``par_slice``, ``param_set``, ``suggested_*``, ``auxdata``); this module reads
that layout and the model's ``spec`` through pyhf's public API and turns every modifier into
numbers that the device kernel only has to multiply and add:

- per sample, the nominal rates over all main bins, the histosys basis coefficients, the
  normsys log-space coefficients (one entry per affected bin) and the parameter indices
  of every plain multiplier (normfactor, lumi, shapefactor, staterror, shapesys);
- per auxiliary datum, the parameter it constrains, its Normal sigma or Poisson scale.

The result is an :class:`ElementLayout` (one model); :func:`pyhf_gpu_server.engine.model`
stacks any number of them with equal ``stack_key`` onto one device (:mod:`.stacking`).
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import pyhf

from .errors import UnsupportedModelError
from .interpolation import histosys_coefficients, normsys_coefficients

MULTIPLIER_TYPES = ("normfactor", "lumi", "shapefactor", "staterror", "shapesys")
SUPPORTED_TYPES = (*MULTIPLIER_TYPES, "histosys", "normsys")


@dataclass
class SampleLayout:
    """One sample's numbers over all main bins (zeros where a channel lacks the sample).

    Parameter indices (``histosys`` axis 1, ``normsys_param``, ``multipliers``) are the
    element's own: into its ``histosys_params``, ``normsys_params`` and parameter vector.
    Arrays are read, never written: a translator shares a background sample's arrays, or the
    whole sample where the elements number their parameters alike, between the elements of
    its patches (the arrays it keeps are read-only).
    """

    name: str
    nominal: np.ndarray  # [N]
    histosys: np.ndarray  # [K, J_h, N] basis coefficients per histosys parameter
    normsys_param: np.ndarray  # [T] index into the normsys parameter list
    normsys_bin: np.ndarray  # [T] main bin
    normsys_coefficients: np.ndarray  # [8, T]
    multipliers: list[list[int]]  # per bin, the parameter indices that multiply it


@dataclass(frozen=True)
class ParameterSet:
    """One of pyhf's parameter sets (``config.param_set(name)``) as plain values."""

    name: str
    n_parameters: int
    is_scalar: bool
    constraint: str | None  # "normal", "poisson" or None (unconstrained)
    modifier_type: str

    def labels(self) -> list[str]:
        """pyhf's ``par_names`` entries of this set: ``name``, or ``name[i]`` per component."""
        if self.is_scalar:
            return [self.name]
        return [f"{self.name}[{i}]" for i in range(self.n_parameters)]


@dataclass
class ElementLayout:
    """Everything the device model needs from one workspace (after its patches), in the
    element's own parameter space: pyhf's ``par_order``, ``suggested_*`` and ``auxdata``."""

    name: str
    channels: list[tuple[str, int]]  # pyhf's (sorted) channel order, with bin counts
    parameters: list[ParameterSet]  # pyhf's par_order
    poi_name: str | None
    samples: list[SampleLayout]  # pyhf's config.samples order
    histosys_code: str
    normsys_code: str
    histosys_params: list[int]  # parameter index per histosys parameter
    normsys_params: list[int]  # parameter index per normsys parameter
    aux_param: np.ndarray  # [A] parameter constrained by each auxiliary datum
    aux_is_poisson: np.ndarray  # [A] bool
    aux_sigma: np.ndarray  # [A] Normal sigma (1 for Poisson slots)
    aux_scale: np.ndarray  # [A] Poisson rate factor tau (1 for Normal slots)
    init: np.ndarray  # [P]
    bounds: np.ndarray  # [P, 2]
    fixed: np.ndarray  # [P] bool
    observed: np.ndarray  # [N + A]

    @property
    def par_names(self) -> list[str]:
        """pyhf's ``config.par_names``."""
        return [label for parset in self.parameters for label in parset.labels()]

    @property
    def n_pars(self) -> int:
        return len(self.init)

    @property
    def n_main(self) -> int:
        return sum(n for _, n in self.channels)

    @property
    def poi_index(self) -> int | None:
        """pyhf's ``config.poi_index``."""
        if self.poi_name is None:
            return None
        return self.par_start(self.poi_name)

    def par_start(self, name: str) -> int:
        """pyhf's ``config.par_slice(name).start``."""
        return offsets({p.name: p.n_parameters for p in self.parameters})[name]

    def bin_name(self, index: int) -> str:
        """``"channel 'SR' bin 3"`` for main bin ``index``."""
        for name, bins in self.channels:
            if index < bins:
                return f"channel {name!r} bin {index}"
            index -= bins
        raise IndexError(index)

    @cached_property
    def poi_only_bins(self) -> list[int]:
        """The main bins with observed events that only samples scaled by the POI can fill:
        every other sample's nominal rate and histosys shifts are 0 there, so at POI = 0 the
        rate is 0 whatever the other parameters, and the likelihood of the data is 0 (once
        per layout: every hypothesis test of the element asks)."""
        poi = self.poi_index
        observed = self.observed[: self.n_main]
        if poi is None or not (observed > 0).any():
            return []
        candidate = observed > 0
        for sample in self.samples:
            filled = sample.nominal != 0
            if sample.histosys.size:
                filled |= (sample.histosys != 0).reshape(-1, self.n_main).any(0)
            for b in np.flatnonzero(candidate & filled):  # the bins still in question only
                candidate[b] = poi in sample.multipliers[b]
        return np.flatnonzero(candidate).tolist()

    @property
    def stack_key(self) -> str:
        """Elements with equal keys stack into one model, whatever their parameters: same
        channels and bins, POI and interpolation codes."""
        key = [self.channels, self.poi_name, self.histosys_code, self.normsys_code]
        return hashlib.sha256(json.dumps(key).encode()).hexdigest()


def interpolation_codes(model: pyhf.Model) -> tuple[str, str]:
    """The (histosys, normsys) interpolation codes pyhf uses for ``model``.

    A type missing from ``modifier_settings`` takes the default of pyhf's applier, as pyhf does.
    """
    settings = model.config.modifier_settings or {}
    histosys, normsys = (
        settings.get(mtype, {}).get("interpcode", applier_code(mtype))
        for mtype in ("histosys", "normsys")
    )
    return histosys, normsys


def applier_code(mtype: str) -> str:
    """The interpolation code pyhf's applier of ``mtype`` takes when none is set."""
    applier = pyhf.modifiers.histfactory_set[mtype][1]
    return inspect.signature(applier.__init__).parameters["interpcode"].default


def offsets(sizes: dict[str, int]) -> dict[str, int]:
    """Where each consecutive block of the given sizes starts.

    >>> offsets({"a": 2, "b": 3, "c": 1})
    {'a': 0, 'b': 2, 'c': 5}
    """
    starts, start = {}, 0
    for key, size in sizes.items():
        starts[key] = start
        start += size
    return starts


def _bin_offsets_of_per_bin_modifiers(config, spec) -> dict[str, dict[str, int]]:
    """For staterror and shapesys: the parameter offset of each channel's first bin.

    pyhf numbers such a parameter over the global bins of the channels that carry it.
    """
    carriers: dict[str, set[str]] = {}
    for channel in spec["channels"]:
        for sample in channel["samples"]:
            for modifier in sample["modifiers"]:
                if modifier["type"] in ("staterror", "shapesys"):
                    carriers.setdefault(modifier["name"], set()).add(channel["name"])
    per_bin: dict[str, dict[str, int]] = {}
    for name, channels in carriers.items():
        # pyhf's (sorted) channel order
        nbins = {c: config.channel_nbins[c] for c in config.channels if c in channels}
        if sum(nbins.values()) != config.param_set(name).n_parameters:
            raise UnsupportedModelError(f"modifier {name!r}: unexpected parameter layout")
        per_bin[name] = offsets(nbins)
    return per_bin


def aux_arrays(
    sets: Iterable[tuple[int, int, bool, Sequence[float] | None, Sequence[float] | None]],
) -> dict[str, np.ndarray]:
    """:class:`ElementLayout`'s ``aux_*`` arrays from the constrained parameter sets in pyhf's
    ``auxdata_order``, each as (first parameter, size, Poisson, Normal widths (None: 1),
    Poisson factors)."""
    params: list[int] = []
    is_poisson: list[bool] = []
    sigmas: list[float] = []
    scales: list[float] = []
    for start, n, poisson, widths, factors in sets:
        params.extend(range(start, start + n))
        is_poisson.extend([poisson] * n)
        sigmas.extend([1.0] * n if poisson or widths is None else widths)
        if poisson:  # a Poisson constraint's parameter set has its factors
            assert factors is not None
            scales.extend(factors)
        else:
            scales.extend([1.0] * n)
    return {
        "aux_param": np.asarray(params, dtype=np.int64),
        "aux_is_poisson": np.asarray(is_poisson, dtype=bool),
        "aux_sigma": np.asarray(sigmas, dtype=np.float64),
        "aux_scale": np.asarray(scales, dtype=np.float64),
    }


def _aux_layout(config) -> dict[str, np.ndarray]:
    sets = []
    for name in config.auxdata_order:
        parset = config.param_set(name)
        if parset.pdf_type not in ("poisson", "normal"):
            raise UnsupportedModelError(
                f"constraint type {parset.pdf_type!r} of parameter {name!r} is not supported"
            )
        poisson = parset.pdf_type == "poisson"
        sigmas = None if poisson else getattr(parset, "sigmas", None)
        factors = parset.factors if poisson else None
        sets.append((config.par_slice(name).start, parset.n_parameters, poisson, sigmas, factors))
    arrays = aux_arrays(sets)
    if len(arrays["aux_param"]) != len(config.auxdata):
        raise UnsupportedModelError("auxiliary data layout does not match pyhf's")
    return arrays


def read_model(model: pyhf.Model, observed: list[float], name: str = "nominal") -> ElementLayout:
    """Read a built pyhf model (and its observed data, aux included) into an ElementLayout."""
    config = model.config
    spec = model.spec
    histosys_code, normsys_code = interpolation_codes(model)
    n_main = config.nmaindata

    histosys_names = [n for n, t in config.modifiers if t == "histosys"]
    normsys_names = [n for n, t in config.modifiers if t == "normsys"]
    unsupported = sorted({t for _, t in config.modifiers if t not in SUPPORTED_TYPES})
    if unsupported:
        raise UnsupportedModelError(f"modifier type(s) not supported by the engine: {unsupported}")
    histosys_index = {n: j for j, n in enumerate(histosys_names)}
    normsys_index = {n: j for j, n in enumerate(normsys_names)}
    per_bin_offsets = _bin_offsets_of_per_bin_modifiers(config, spec)
    n_basis = histosys_coefficients(histosys_code, [0.0], [0.0], [0.0]).shape[0]

    samples = {
        s: SampleLayout(
            name=s,
            nominal=np.zeros(n_main),
            histosys=np.zeros((n_basis, len(histosys_names), n_main)),
            normsys_param=np.zeros(0, dtype=np.int64),
            normsys_bin=np.zeros(0, dtype=np.int64),
            normsys_coefficients=np.zeros((8, 0)),
            multipliers=[[] for _ in range(n_main)],
        )
        for s in config.samples
    }
    normsys_entries: dict[str, list[tuple[int, int, float, float]]] = {s: [] for s in samples}
    modifier_layout = []

    for channel in spec["channels"]:
        cname = channel["name"]
        bins = config.channel_slices[cname]
        nbins = config.channel_nbins[cname]
        for sample in channel["samples"]:
            layout = samples[sample["name"]]
            nominal = np.asarray(sample["data"], dtype=np.float64)
            layout.nominal[bins] = nominal
            seen = set()
            for modifier in sample["modifiers"]:
                mname, mtype, mdata = modifier["name"], modifier["type"], modifier["data"]
                if (mname, mtype) in seen:
                    raise UnsupportedModelError(
                        f"modifier {mname!r} ({mtype}) appears twice on sample "
                        f"{sample['name']!r} in channel {cname!r}"
                    )
                seen.add((mname, mtype))
                modifier_layout.append([cname, sample["name"], mname, mtype])
                start = config.par_slice(mname).start
                if mtype == "histosys":
                    layout.histosys[:, histosys_index[mname], bins] = histosys_coefficients(
                        histosys_code, mdata["lo_data"], nominal, mdata["hi_data"]
                    )
                elif mtype == "normsys":
                    normsys_entries[sample["name"]].extend(
                        (normsys_index[mname], b, mdata["lo"], mdata["hi"])
                        for b in range(bins.start, bins.stop)
                    )
                else:
                    if mtype in ("normfactor", "lumi"):
                        indices = [start] * nbins
                    elif mtype == "shapefactor":
                        indices = [start + i for i in range(nbins)]
                    else:  # staterror, shapesys: numbered over the carrying channels' bins
                        offset = per_bin_offsets[mname][cname]
                        indices = [start + offset + i for i in range(nbins)]
                    for b, index in zip(range(bins.start, bins.stop), indices, strict=True):
                        layout.multipliers[b].append(index)

    for sname, entries in normsys_entries.items():
        if entries:
            params, bins_, lo, hi = (np.asarray(x) for x in zip(*entries, strict=True))
            samples[sname].normsys_param = params.astype(np.int64)
            samples[sname].normsys_bin = bins_.astype(np.int64)
            samples[sname].normsys_coefficients = normsys_coefficients(normsys_code, lo, hi)

    parameters = []
    for pname in config.par_order:
        parset = config.param_set(pname)
        mtype = next(t for n, t in config.modifiers if n == pname)
        constraint = parset.pdf_type if parset.constrained else None
        parameters.append(
            ParameterSet(pname, parset.n_parameters, parset.is_scalar, constraint, mtype)
        )
    return ElementLayout(
        name=name,
        channels=[(c, config.channel_nbins[c]) for c in config.channels],
        parameters=parameters,
        poi_name=config.poi_name,
        samples=[samples[s] for s in config.samples],
        histosys_code=histosys_code,
        normsys_code=normsys_code,
        histosys_params=[config.par_slice(n).start for n in histosys_names],
        normsys_params=[config.par_slice(n).start for n in normsys_names],
        **_aux_layout(config),
        init=np.asarray(config.suggested_init(), dtype=np.float64),
        bounds=np.asarray(config.suggested_bounds(), dtype=np.float64),
        fixed=np.asarray(config.suggested_fixed(), dtype=bool),
        observed=np.asarray(observed, dtype=np.float64),
    )
