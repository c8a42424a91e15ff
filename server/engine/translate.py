"""Workspace JSON straight to the engine's :class:`ElementLayout`, without a ``pyhf.Model``.

:func:`translate` gives exactly what :func:`pyhf_gpu_server.engine.layout.read_model` reads
from ``pyhf.Workspace(spec).model(measurement_name=..., modifier_settings=...)`` and
``ws.data(model)``: pyhf's parameter order and sets, suggested inits, bounds and fixed
parameters (measurement settings included), auxiliary data, constraint widths and Poisson
factors (staterror and shapesys computed as pyhf does, bit for bit), observed data, sample
and channel order, interpolation codes and POI. Invalid models raise pyhf's exception
classes with pyhf's messages (:class:`UnsupportedModelError` where the engine refuses more,
as ``read_model`` does).

Where pyhf fails without one of its own exceptions, or builds something the engine cannot use,
this module raises instead, naming the JSON path of what is wrong: pyhf's exception classes
for a staterror carried by samples on different sets of channels (pyhf: ``AssertionError``),
a lumi parameter without ``inits``/``bounds``/``auxdata`` in the measurement (pyhf:
``TypeError``) and bad ``modifier_settings`` (:func:`codes_from_settings`, checked before the
workspace); :class:`DuplicateNameError`, before any other check, for a name used twice where
it must be unique; :class:`InvalidWorkspaceError` for measurement bounds that are not [low,
high] pairs with low < high and inits outside their bounds; :class:`UnsupportedModelError`
for a shapefactor on channels of different sizes and lumi settings with other than one value.

:class:`WorkspaceTranslator` is the warm form for many patches of one background: a patch is
applied without copying what it leaves alone (:mod:`.patching`), the samples it does not touch
keep their readings (:mod:`.reading`, keyed by object identity) and only the model-wide
numbering is redone, so the cost of :meth:`~WorkspaceTranslator.element` follows the patch.

Example:
    >>> spec = {
    ...     "channels": [{"name": "SR", "samples": [
    ...         {"name": "signal", "data": [5.0, 2.0],
    ...          "modifiers": [{"name": "mu", "type": "normfactor", "data": None}]},
    ...         {"name": "bkg", "data": [50.0, 60.0],
    ...          "modifiers": [{"name": "unc", "type": "shapesys", "data": [5.0, 12.0]}]},
    ...     ]}],
    ...     "observations": [{"name": "SR", "data": [52.0, 63.0]}],
    ...     "measurements": [{"name": "meas", "config": {"poi": "mu", "parameters": []}}],
    ...     "version": "1.0.0",
    ... }
    >>> layout = translate(spec)
    >>> layout.par_names, layout.init.tolist()
    (['mu', 'unc[0]', 'unc[1]'], [1.0, 1.0, 1.0])
    >>> layout.observed.tolist()  # main data, then the shapesys factors (nominal / sigma)^2
    [52.0, 63.0, 100.0, 25.0]
    >>> translator = WorkspaceTranslator(spec)
    >>> scaled = [{"op": "replace", "path": "/channels/0/samples/0/data", "value": [10.0, 4.0]}]
    >>> [s.nominal.tolist() for s in translator.element(scaled, "scaled").samples]
    [[50.0, 60.0], [10.0, 4.0]]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property, partial
from itertools import groupby
from operator import attrgetter, is_, itemgetter
from typing import Any

import numpy as np
import pyhf
from pyhf.exceptions import (
    InvalidInterpCode,
    InvalidMeasurement,
    InvalidModel,
    InvalidModifier,
    Unsupported,
)

from . import schema
from .errors import (
    DuplicateNameError,
    InvalidWorkspaceError,
    ModelTooLargeError,
    UnsupportedModelError,
)
from .interpolation import (
    HISTOSYS_CODES,
    NORMSYS_CODES,
    histosys_coefficients,
    normsys_coefficients,
)
from .layout import ElementLayout, ParameterSet, SampleLayout, applier_code, aux_arrays, offsets
from .paramsets import (
    Paramset,
    build_paramset,
    reduce_requirements,
    setting_problem,
    user_configs,
)
from .patching import apply_patch
from .reading import MODIFIER_TYPES, REQUIRED_PARSET, SampleReading, read_sample

# pyhf's _ModelConfig default, used when no modifier_settings are given at all
DEFAULT_MODIFIER_SETTINGS = {
    "normsys": {"interpcode": "code4"},
    "histosys": {"interpcode": "code4p"},
}
_CODES = {"histosys": HISTOSYS_CODES, "normsys": NORMSYS_CODES}
_PER_BIN_TYPES = ("staterror", "shapesys")  # numbered over the bins of the carrying channels
# requirements that do not depend on the sample
_FIXED_REQUIREMENTS = {
    mtype: REQUIRED_PARSET[mtype](None, None)
    for mtype in ("histosys", "lumi", "normfactor", "normsys")
}
# histosys numberings whose background arrays a translator keeps (see _kept_histosys)
KEPT_HISTOSYS_NUMBERINGS = 2
# model numberings a translator tells apart at once (ids of the samples it keeps per numbering)
KEPT_NUMBERINGS = 256
# small valid items of the workspace schema's arrays
_STAND_INS = {
    "samples": {"name": "", "data": [0.0], "modifiers": []},
    "channels": {"name": "", "samples": [{"name": "", "data": [0.0], "modifiers": []}]},
    "observations": {"name": "", "data": [0.0]},
    "measurements": {"name": "", "config": {"poi": "", "parameters": []}},
}


def codes_from_settings(modifier_settings: Mapping[str, Any] | None) -> tuple[str, str]:
    """The (histosys, normsys) interpolation codes of pyhf's ``modifier_settings``.

    ``None`` means pyhf's default settings (code4p, code4); a type missing from given
    settings takes the default of pyhf's applier (code0, code1). pyhf ignores settings of
    unknown modifier types and fails with an ``AssertionError`` or ``TypeError`` on codes or
    options its appliers do not take: here :class:`~pyhf.exceptions.InvalidModifier`,
    :class:`~pyhf.exceptions.InvalidInterpCode` and :class:`~pyhf.exceptions.Unsupported`,
    each naming the setting's path in the request (``/modifier_settings/...``).
    """
    settings = DEFAULT_MODIFIER_SETTINGS if modifier_settings is None else modifier_settings
    unknown = [mtype for mtype in settings if mtype not in MODIFIER_TYPES]
    if unknown:
        raise InvalidModifier(
            f"{unknown[0]} not among {list(MODIFIER_TYPES)} (at /modifier_settings/{unknown[0]})"
        )
    for mtype in MODIFIER_TYPES:
        options = settings.get(mtype, {})
        allowed = {"interpcode"} if mtype in _CODES else set()
        if not isinstance(options, Mapping) or set(options) - allowed:
            raise Unsupported(
                f"Unsupported modifier_settings for {mtype} at /modifier_settings/{mtype}: "
                f"{options!r} (only {sorted(allowed)} can be set)."
            )
    codes = []
    for mtype in ("histosys", "normsys"):
        code = settings.get(mtype, {}).get("interpcode", applier_code(mtype))
        if code not in _CODES[mtype]:
            raise InvalidInterpCode(
                f"{mtype} interpolation code {code!r} at /modifier_settings/{mtype}/interpcode "
                f"is not one of {_CODES[mtype]}"
            )
        codes.append(code)
    return codes[0], codes[1]


def measurement_config(spec: Mapping[str, Any], measurement: str | None) -> dict[str, Any]:
    """The ``config`` of the named (or first) measurement, as ``Workspace.get_measurement``."""
    measurements = spec.get("measurements", [])
    names = [m["name"] for m in measurements]
    if not names:
        raise InvalidMeasurement("No measurements have been defined.")
    if measurement is None:
        return measurements[0]["config"]
    if measurement not in names:
        raise InvalidMeasurement(
            f"no measurement by name '{measurement:s}' was found in the workspace, "
            "pick from one of the valid ones above"
        )
    return measurements[names.index(measurement)]["config"]


def unmatched_observations(spec: Mapping[str, Any]) -> list[str]:
    """One notice per entry of ``observations`` that names a channel the workspace does not
    have (a patch that removed a channel leaves its observations behind). pyhf ignores them:
    ``Workspace.data`` takes the observations of the model's channels by name; so does the
    engine, and says so (meta ``ignored_observations``, the client's notice).

    Example:
        >>> unmatched_observations({"channels": [{"name": "SR"}],
        ...     "observations": [{"name": "SR"}, {"name": "VR"}]})
        ["observations[1] names channel 'VR', which the workspace does not have; ignored, as pyhf does"]
    """
    channels = {channel["name"] for channel in spec["channels"]}
    return [
        f"observations[{o}] names channel {observation['name']!r}, which the workspace does "
        "not have; ignored, as pyhf does"
        for o, observation in enumerate(spec.get("observations", []))
        if observation["name"] not in channels
    ]


def ignored_observations(
    spec: Mapping[str, Any], patch_operations: Sequence[Mapping[str, Any]], channels: Sequence[str]
) -> list[str]:
    """:func:`unmatched_observations` of an element: ``spec`` with ``patch_operations``
    applied, whose channels (its layout's) are ``channels``. The observations are the
    background's unless an operation touches them (then the patch is applied again).

    Example:
        >>> spec = {"observations": [{"name": "SR"}, {"name": "VR"}]}
        >>> ignored_observations(spec, [{"op": "remove", "path": "/channels/1"}], ["SR"])
        ["observations[1] names channel 'VR', which the workspace does not have; ignored, as pyhf does"]
        >>> ignored_observations(spec, [{"op": "remove", "path": "/observations/1"}], ["SR"])
        []
    """
    touched = any(
        isinstance(op.get(key), str) and (op[key] == "" or op[key].startswith("/observations"))
        for op in patch_operations
        for key in ("path", "from")
    )
    observations = (
        apply_patch(spec, list(patch_operations)).get("observations", [])
        if touched
        else spec.get("observations", [])
    )
    named = {"channels": [{"name": c} for c in channels], "observations": observations}
    return unmatched_observations(named)


class WorkspaceTranslator:
    """Translates a background workspace and any JSON patches of it, reusing per-sample work.

    The background is kept by reference: it must not be changed afterwards. It is validated
    (pyhf's ``workspace.json``) once here and, with ``validate``, every patched workspace is
    too, where only what a patch brings in costs time.
    """

    def __init__(
        self,
        spec: dict[str, Any],
        *,
        measurement: str | None = None,
        modifier_settings: Mapping[str, Any] | None = None,
        validate: bool = True,
        max_layout_bytes: int | None = None,
    ) -> None:
        """Check the settings, validate ``spec`` and read every sample of it; elements whose
        histosys arrays would take more than ``max_layout_bytes`` are refused
        (:class:`ModelTooLargeError`) before they are built."""
        self.histosys_code, self.normsys_code = codes_from_settings(modifier_settings)
        self.max_layout_bytes = max_layout_bytes
        if validate:
            schema.validate(spec, "workspace.json")
        self.spec = spec
        self.measurement = measurement
        self.validate = validate
        self.name_ids: dict[str, int] = {}  # histosys / normsys name -> id in the readings
        self._readings = {
            id(sample): read_sample(sample, self.histosys_code, self.name_ids)
            for channel in spec["channels"]
            for sample in channel["samples"]
        }
        # the (valid, never changed) items of the background's arrays, by array
        self._background_ids = {
            key: {id(item) for item in spec.get(key, [])}
            for key in ("channels", "observations", "measurements")
        }
        self._background_ids["samples"] = set(self._readings)
        self._background_readings = {id(reading) for reading in self._readings.values()}
        self._paramsets: dict[tuple, tuple[dict | None, tuple[dict, ...], Paramset]] = {}
        self._kept_values: dict[str, dict[tuple, Any]] = {
            kind: {} for kind in ("keys", "normsys", "staterror", "samples")
        }
        # model numberings (parameters, histosys and normsys lists, bins) -> an id never
        # given twice, the key of the samples kept for them
        self._numbering_ids: dict[tuple, int] = {}
        self._numberings_seen = 0
        # histosys numbering (the model's histosys names, its bins) -> the background samples'
        # arrays, for the last KEPT_HISTOSYS_NUMBERINGS numberings only
        self._histosys_arrays: dict[tuple, dict[tuple, np.ndarray]] = {}

    def element(
        self, patch_operations: list[dict[str, Any]], name: str = "nominal"
    ) -> ElementLayout:
        """The layout of the background with ``patch_operations`` (RFC 6902) applied:
        ``translate(jsonpatch.apply_patch(spec, patch_operations), ...)``."""
        spec = apply_patch(self.spec, patch_operations) if patch_operations else self.spec
        if self.validate and spec is not self.spec:
            self._validate_patched(spec)
        readings = [[self._reading(s) for s in channel["samples"]] for channel in spec["channels"]]
        return _Assembly(self, spec, readings).layout(name)

    def _reading(self, sample: dict[str, Any]) -> SampleReading:
        """The background's reading of ``sample``, or a new one for a sample the patch made."""
        reading = self._readings.get(id(sample))
        if reading is not None and reading.source is sample:
            return reading
        return read_sample(sample, self.histosys_code, self.name_ids)

    def _validate_patched(self, spec: Any) -> None:
        """pyhf's schema check of a patched workspace, at the cost of what the patch brought in.

        An array is valid when each item is and there are enough of them, so every item that
        is the background's own (valid, never changed) collapses into one small valid
        stand-in; pyhf's own check of the whole gives the message when this check fails."""
        skeleton = spec
        if isinstance(spec, dict):
            skeleton = dict(spec)
            for key in ("channels", "observations", "measurements"):
                if isinstance(spec.get(key), list):
                    skeleton[key] = self._collapsed(spec[key], key)
            for i, channel in enumerate(skeleton.get("channels", [])):
                if isinstance(channel, dict) and isinstance(channel.get("samples"), list):
                    samples = self._collapsed(channel["samples"], "samples")
                    skeleton["channels"][i] = {**channel, "samples": samples}
        if not schema.conforms(skeleton, "workspace.json"):
            pyhf.schema.validate(spec, "workspace.json")

    def _collapsed(self, items: list[Any], array: str) -> list[Any]:
        """``items`` without the background's own, plus one stand-in if there were any."""
        known = self._background_ids[array]
        new = [item for item in items if id(item) not in known]
        return [*new, _STAND_INS[array]] if len(new) < len(items) else new

    def _paramset(
        self, name: str, requirements: list[dict[str, Any]], config: dict[str, Any] | None
    ) -> Paramset:
        """The parameter set of ``name``, kept for the same requirement and config objects
        (the fixed ones, and those kept for the background's samples: a staterror's widths);
        an entry holds them, so their ids in its key stay theirs."""
        key = (name, *map(id, requirements), id(config))
        kept = self._paramsets.get(key)
        if kept is not None and kept[0] is config and all(map(is_, kept[1], requirements)):
            return kept[2]
        if len(self._paramsets) > 8 * len(self._readings):
            self._paramsets.clear()
        paramset = build_paramset(name, reduce_requirements(name, requirements, config or {}))
        self._paramsets[key] = (config, tuple(requirements), paramset)
        return paramset

    def _kept_histosys(self, numbering: tuple) -> dict[tuple, np.ndarray]:
        """The background samples' histosys arrays kept for ``numbering`` (most recent
        ``KEPT_HISTOSYS_NUMBERINGS`` numberings: a stream of signals with their own histosys
        names makes a new one each time)."""
        kept = self._histosys_arrays.pop(numbering, {})
        self._histosys_arrays[numbering] = kept  # now the most recent
        while len(self._histosys_arrays) > KEPT_HISTOSYS_NUMBERINGS:
            del self._histosys_arrays[next(iter(self._histosys_arrays))]
        return kept

    def _numbering_id(self, numbering: tuple) -> int | None:
        """The id of a model's ``numbering`` seen before (lately), else None (it gets one: a
        stream of signals that each renumber the parameters keeps no samples)."""
        found = self._numbering_ids.get(numbering)
        if found is None:
            if len(self._numbering_ids) >= KEPT_NUMBERINGS:
                self._numbering_ids.clear()
            self._numbering_ids[numbering] = self._numberings_seen
            self._numberings_seen += 1
        return found

    def _background_only(self, readings: list[SampleReading]) -> bool:
        """Whether ``readings`` are all the background's own (not a patch's new samples)."""
        return self._background_readings.issuperset(map(id, readings))

    def _kept(self, kind: str, key: tuple, readings: list[SampleReading], compute: Callable):
        """``compute()``, kept under ``key`` if it depends on background ``readings`` only
        (these live as long as the translator, so their ids in ``key`` stay theirs)."""
        if not self._background_only(readings):
            return compute()
        kept = self._kept_values[kind]
        if key not in kept:
            if len(kept) > 4 * len(self._readings):
                kept.clear()
            kept[key] = compute()
        return kept[key]


def translate(
    spec: dict[str, Any],
    *,
    measurement: str | None = None,
    modifier_settings: Mapping[str, Any] | None = None,
    name: str = "nominal",
    validate: bool = True,
) -> ElementLayout:
    """The layout of workspace ``spec`` (validated against pyhf's schema unless told not to)."""
    translator = WorkspaceTranslator(
        spec, measurement=measurement, modifier_settings=modifier_settings, validate=validate
    )
    return translator.element([], name)


class _Assembly:
    """One model from its samples' readings: pyhf's checks (in pyhf's order), parameter sets
    and numbering, then the arrays of the layout."""

    def __init__(
        self,
        translator: WorkspaceTranslator,
        spec: dict[str, Any],
        readings: list[list[SampleReading]],
    ) -> None:
        self.translator = translator
        self.spec = spec
        self.spec_readings = readings
        names = [channel["name"] for channel in spec["channels"]]
        _check_unique_names(spec, names, readings)
        self.config = measurement_config(spec, translator.measurement)
        self.spec_channels = names
        self.by_channel = dict(zip(names, readings, strict=True))
        self.channels = sorted(names)
        self.nbins = {c: self.by_channel[c][0].n_bins for c in self.channels}
        self.start = offsets(self.nbins)
        self.n_main = sum(self.nbins.values())
        self.samples = sorted({r.name for channel in readings for r in channel})
        by_name = attrgetter("name")
        self.walk = [(c, r) for c in self.channels for r in sorted(self.by_channel[c], key=by_name)]
        self.type_order = self._type_order()
        self.modifiers = sorted((m, t) for t, names in self.type_order.items() for m in names)

    def _type_order(self) -> dict[str, dict[str, SampleReading | None]]:
        """Per modifier type, its names as pyhf numbers them: by first appearance over
        (channel, sample, name) in sorted order, except staterror (sorted by name); with the
        first sample where they appear for shapefactor and shapesys."""
        keys: dict[tuple[str, str], None] = {}
        for _, readings in groupby(self.walk, key=itemgetter(0)):
            keys.update(self._channel_keys([reading for _, reading in readings]))
        order: dict[str, dict[str, SampleReading | None]] = {t: {} for t in MODIFIER_TYPES}
        for mtype, mname in keys:
            order.setdefault(mtype, {})[mname] = None
        order["staterror"] = dict.fromkeys(sorted(order["staterror"]))
        for mtype in ("shapefactor", "shapesys"):
            for _, reading in self.walk if order[mtype] else ():
                for key in reading.sorted_keys if mtype in reading.types else ():
                    if key[0] == mtype and order[mtype][key[1]] is None:
                        order[mtype][key[1]] = reading
        return order

    def _channel_keys(self, readings: list[SampleReading]) -> dict[tuple[str, str], None]:
        """The (type, name) keys of one channel's ``readings`` (in walk order) by first
        appearance; kept while they are the background's (one merge per channel, not one
        per sample, for the patches that leave the channel alone)."""

        def merged() -> dict[tuple[str, str], None]:
            keys: dict[tuple[str, str], None] = {}
            for reading in readings:
                keys.update(reading.sorted_keys)
            return keys

        return self.translator._kept("keys", tuple(map(id, readings)), readings, merged)

    def layout(self, name: str) -> ElementLayout:
        self._check_modifier_types()
        self._check_sample_sizes()
        self._check_modifier_data()
        paramsets = self._paramsets()
        poi = self._poi(paramsets)
        self._check_parameter_settings(paramsets)
        self._check_shapefactor_sizes()
        return self._element(name, paramsets, poi)

    # --- pyhf's checks, in the order pyhf makes them -----------------------------------------
    def _check_modifier_types(self) -> None:
        """Unknown modifier types, and shapesys (not shareable) names on two samples."""
        if not any(r.unknown_type or "shapesys" in r.types for _, r in self.walk):
            return
        seen: set[str] = set()
        for cname, channel in zip(self.spec_channels, self.spec_readings, strict=True):
            for reading in channel:
                for modifier in reading.source["modifiers"]:
                    if modifier["type"] not in MODIFIER_TYPES:
                        raise InvalidModifier(
                            f"{modifier['type']} not among {list(MODIFIER_TYPES)}"
                        )
                    key = f"{modifier['type']}/{modifier['name']}"
                    if modifier["type"] == "shapesys" and key in seen:
                        raise InvalidModel(
                            f"Trying to add paramset {key} on {reading.name} sample in {cname} "
                            "channel but other paramsets exist with the same name."
                        )
                    seen.add(key)

    def _check_sample_sizes(self) -> None:
        for cname, reading in self.walk:
            if reading.n_bins != self.nbins[cname]:
                raise InvalidModel(
                    f"expected {self.nbins[cname]} size sample data but got {reading.n_bins}"
                )

    def _check_modifier_data(self) -> None:
        """Per-bin modifier data of the sample's length; one staterror, one set of channels."""
        if any(r.inconsistent for _, r in self.walk):
            self._raise_inconsistent()
        for mname, parts in self.staterror_parts.items():
            carriers: dict[str, list[str]] = {}
            for cname, reading in parts:
                carriers.setdefault(reading.name, []).append(cname)
            if len({tuple(channels) for channels in carriers.values()}) > 1:
                raise InvalidModel(
                    f"The staterror modifier '{mname}' must be on the same channels for every "
                    f"sample that has it: {dict(sorted(carriers.items()))}"
                )

    def _raise_inconsistent(self) -> None:
        """pyhf's message about the first modifier (its order) with data of the wrong size."""
        for mtype in ("histosys", "shapesys", "staterror"):
            keys = ("lo_data", "hi_data") if mtype == "histosys" else ("data",)
            for mname in (m for m, t in self.modifiers if t == mtype):
                for sname in self.samples:
                    sizes = self._concatenated_sizes(mtype, mname, sname, keys)
                    if len(set(sizes.values())) > 1:
                        described = " and ".join(f"'{k}' of length {sizes[k]}" for k in keys)
                        raise InvalidModifier(
                            f"The '{sname}' sample {mtype} modifier '{mname}' has data shape "
                            "inconsistent with the sample.\n"
                            f"{sname} has 'data' of length {sizes['nominal']} but {mname} "
                            f"has {described}."
                        )
        cname, reading = next((c, r) for c, r in self.walk if r.inconsistent)
        raise InvalidModifier(
            f"A modifier of sample '{reading.name}' in channel '{cname}' has data shape "
            "inconsistent with the sample."
        )

    def _concatenated_sizes(self, mtype, mname, sname, keys) -> dict[str, int]:
        """Sizes of a modifier's data over all channels, as pyhf's builders concatenate it."""
        sizes = dict.fromkeys(("nominal", *keys), 0)
        for cname in self.channels:
            reading = next((r for r in self.by_channel[cname] if r.name == sname), None)
            n = reading.n_bins if reading else self.nbins[cname]
            sizes["nominal"] += n
            modifier = reading.modifiers.get((mtype, mname)) if reading else None
            for key in keys:
                if modifier is None:  # pyhf pads with the nominal data (or zeros)
                    sizes[key] += n
                else:
                    data = modifier["data"]
                    sizes[key] += len(data[key] if mtype == "histosys" else data)
        return sizes

    @cached_property
    def staterror_parts(self) -> dict[str, list[tuple[str, SampleReading]]]:
        """staterror name -> the (channel, sample) pairs that carry it, in sorted order."""
        parts: dict[str, list[tuple[str, SampleReading]]] = {}
        for cname, reading in self.walk:
            for mname in reading.staterror:
                parts.setdefault(mname, []).append((cname, reading))
        return parts

    # --- parameters ----------------------------------------------------------------------------
    def _paramsets(self) -> list[Paramset]:
        """pyhf's parameter sets in ``par_order``: by modifier type in pyhf's builder order,
        then in the type's order (:meth:`_type_order`)."""
        required: dict[str, list[dict[str, Any]]] = {}
        for mtype, names in self.type_order.items():
            for mname, reading in names.items():
                required.setdefault(mname, []).append(self._requirement(mtype, mname, reading))
        self.parameter_settings = user_configs(self.config["parameters"])
        paramsets = [
            self.translator._paramset(pname, requirements, self.parameter_settings.get(pname))
            for pname, requirements in required.items()
        ]
        if not paramsets:
            raise InvalidModel("No parameters specified for the Model.")
        return paramsets

    def _requirement(self, mtype: str, mname: str, reading: SampleReading | None) -> dict:
        # shapefactor and shapesys names come with the first sample where they appear
        if mtype == "shapefactor":
            assert reading is not None
            return REQUIRED_PARSET[mtype](reading.data, None)
        if mtype == "shapesys":
            assert reading is not None
            return reading.shapesys[mname]
        if mtype == "staterror":
            return self._staterror_requirement(mname)
        return _FIXED_REQUIREMENTS[mtype]

    def _staterror_requirement(self, mname: str) -> dict[str, Any]:
        """pyhf's staterror requirement (kept while the samples that carry it are the
        background's own)."""
        parts = self.staterror_parts[mname]
        key = (
            mname,
            *((cname, id(reading)) for cname, reading in parts),
            # one bin in all: numpy sums the samples' column pairwise, zeros included
            tuple(self.samples) if self.n_main == 1 else None,
        )
        return self.translator._kept(
            "staterror", key, [r for _, r in parts], lambda: self._staterror_computed(mname)
        )

    def _staterror_computed(self, mname: str) -> dict[str, Any]:
        """pyhf's staterror widths, sqrt(sum (delta / sum nominal)^2), with pyhf's arithmetic
        (scalar per bin, numpy sums over full-length rows: equal bit for bit); bins with zero
        width are fixed (width 1). With more than one bin, numpy sums the rows of each column
        in order, so a bin's width follows from the samples that carry the modifier there."""
        parts = self.staterror_parts[mname]
        carriers = sorted({reading.name for _, reading in parts})
        total = np.sum([self.nominals[s] for s in carriers], axis=0)
        terms = np.zeros((len(self.samples), self.n_main))
        mask = np.zeros(self.n_main, dtype=bool)
        for cname, reading in parts:
            start = self.start[cname]
            row = self.samples.index(reading.name)
            mask[start : start + reading.n_bins] = True
            for k, delta in enumerate(reading.staterror[mname]):
                sum_k = total[start + k]
                terms[row, start + k] = (delta / sum_k) ** 2 if sum_k > 0 else 0.0
        sigmas = np.sqrt(np.sum(terms, axis=0))[mask]
        fixed = (sigmas == 0).tolist()
        sigmas[fixed] = 1.0
        return REQUIRED_PARSET["staterror"](sigmas, fixed)

    @cached_property
    def n_basis(self) -> int:
        """The histosys basis functions of the translator's code (``K``)."""
        return histosys_coefficients(self.translator.histosys_code, [0.0], [0.0], [0.0]).shape[0]

    @cached_property
    def nominals(self) -> dict[str, np.ndarray]:
        """Each sample's nominal rates over all main bins (zeros where it is absent)."""
        nominals = {s: np.zeros(self.n_main) for s in self.samples}
        for cname, reading in self.walk:
            start = self.start[cname]
            nominals[reading.name][start : start + reading.n_bins] = reading.nominal
        return nominals

    def _poi(self, paramsets: list[Paramset]) -> str | None:
        poi = self.config["poi"]
        if poi == "":
            return None
        sizes = {p.name: p.n_parameters for p in paramsets}
        if poi not in sizes:
            raise InvalidModel(
                f"The parameter of interest '{poi:s}' cannot be fit as it is not declared in "
                "the model specification."
            )
        if sizes[poi] > 1:
            raise InvalidModel(
                f"The parameter '{poi:s}' contains multiple components and is not currently "
                "supported as parameter of interest."
            )
        return poi

    def _check_parameter_settings(self, paramsets: list[Paramset]) -> None:
        """The bounds and inits the measurement sets: [low, high] pairs with low < high, inits
        inside them (pyhf builds any, and its fits start outside or fail); pyhf's defaults
        always are."""
        for paramset in paramsets:
            config = self.parameter_settings.get(paramset.name)
            if config is None or ("bounds" not in config and "inits" not in config):
                continue
            problem = setting_problem(paramset)
            if problem is not None:
                key, component, what = problem
                key = key if key in config else "bounds"  # a default init, the set bounds
                raise InvalidWorkspaceError(
                    f"parameter {paramset.name!r} at {self._setting_path(config)}/{key}/"
                    f"{component}: {what}"
                )

    def _setting_path(self, config: dict[str, Any]) -> str:
        """The JSON path of a parameter setting of the chosen measurement."""
        measurements = self.spec["measurements"]
        m = next(i for i, entry in enumerate(measurements) if entry["config"] is self.config)
        p = next(i for i, entry in enumerate(self.config["parameters"]) if entry is config)
        return f"/measurements/{m}/config/parameters/{p}"

    def _check_shapefactor_sizes(self) -> None:
        """What ``read_model`` refuses beyond pyhf: a shapefactor over channels of another size
        than its parameters (pyhf sizes it by the first channel)."""
        sizes: dict[str, set[int]] = {}
        for cname, reading in self.walk:
            for mtype, mname in reading.multipliers if "shapefactor" in reading.types else ():
                if mtype == "shapefactor":
                    sizes.setdefault(mname, set()).add(self.nbins[cname])
        for mname, nbins in sizes.items():
            if len(nbins) > 1:
                raise UnsupportedModelError(
                    f"shapefactor {mname!r} is on channels of different sizes {sorted(nbins)}"
                )

    def _observed(self, channel: str, index: int | None) -> list[float]:
        """The observed counts of ``channel`` (at ``/observations/<index>``): one per bin, none
        negative (a patch may have removed or changed them; pyhf would fail with a KeyError or
        fit negative counts)."""
        if index is None:
            raise InvalidModel(f"channel {channel!r} has no entry in 'observations'")
        data = self.spec["observations"][index]["data"]
        if len(data) != self.nbins[channel]:
            raise InvalidModel(
                f"the observations of channel {channel!r} at /observations/{index}/data have "
                f"{len(data)} bins, the channel has {self.nbins[channel]}"
            )
        negative = [i for i, value in enumerate(data) if value < 0]
        if negative:
            raise InvalidModel(
                f"the observations of channel {channel!r} have negative counts at "
                f"/observations/{index}/data/{negative[0]} (bins {negative[:10]})"
            )
        return data

    # --- the layout ------------------------------------------------------------------------------
    def _element(self, name: str, paramsets: list[Paramset], poi: str | None) -> ElementLayout:
        par_start = offsets({p.name: p.n_parameters for p in paramsets})
        first_type: dict[str, str] = {}
        for mname, mtype in self.modifiers:
            first_type.setdefault(mname, mtype)
        histosys = [m for m, t in self.modifiers if t == "histosys"]
        normsys = [m for m, t in self.modifiers if t == "normsys"]
        self._check_histosys_size(len(histosys))
        samples = self._samples(par_start, histosys, normsys)
        auxdata = [x for p in paramsets if p.constraint for x in p.auxdata]
        index = {o["name"]: i for i, o in enumerate(self.spec["observations"])}
        observed = [x for c in self.channels for x in self._observed(c, index.get(c))] + auxdata
        return ElementLayout(
            name=name,
            channels=[(c, self.nbins[c]) for c in self.channels],
            parameters=[
                ParameterSet(p.name, p.n_parameters, p.is_scalar, p.constraint, first_type[p.name])
                for p in paramsets
            ],
            poi_name=poi,
            samples=samples,
            histosys_code=self.translator.histosys_code,
            normsys_code=self.translator.normsys_code,
            histosys_params=[par_start[m] for m in histosys],
            normsys_params=[par_start[m] for m in normsys],
            **_aux_layout(paramsets, par_start),
            init=np.asarray([x for p in paramsets for x in p.inits], dtype=np.float64),
            bounds=np.asarray([b for p in paramsets for b in p.bounds], dtype=np.float64),
            fixed=np.asarray([f for p in paramsets for f in p.fixed], dtype=bool),
            observed=np.asarray(observed, dtype=np.float64),
        )

    def _check_histosys_size(self, n_histosys: int) -> None:
        """Refuse an element whose histosys arrays (each sample over every histosys modifier
        and bin of the model, then as many again stacked and on the device) would exceed the
        translator's bound: a small body of many channels, each with its own sample and
        histosys, asks for memory that grows with the cube of the channels."""
        bound = self.translator.max_layout_bytes
        if bound is None or not n_histosys:
            return
        need = 8 * self.n_basis * n_histosys * self.n_main * len(self.samples)
        if need > bound:
            raise ModelTooLargeError(
                f"its histosys arrays would take ~{need / 2**20:.0f} MiB ({len(self.samples)} "
                f"samples x {n_histosys} histosys modifiers x {self.n_main} bins x {self.n_basis} "
                "coefficients: each sample is laid out over every histosys modifier and bin), "
                f"more than the {bound / 2**20:.0f} MiB one model may take"
            )

    def _samples(self, par_start, histosys, normsys) -> list[SampleLayout]:
        """Each sample's arrays, as read_model builds them over the workspace in its order. A
        sample whose readings are all the background's is kept for every element numbered
        alike: one object, which stacking remaps once."""
        carriers: dict[str, list[tuple[str, int, SampleReading]]] = {s: [] for s in self.samples}
        for cname, channel in zip(self.spec_channels, self.spec_readings, strict=True):
            for reading in channel:
                carriers[reading.name].append((cname, self.start[cname], reading))
        per_bin = self._per_bin_offsets()
        numbering = _Numbering(
            par_start,
            per_bin,
            self._columns(histosys),
            (self.n_basis, len(histosys), self.n_main),
            self._columns(normsys),
            self.translator._kept_histosys((*histosys, self.n_main)),
        )
        numbering_id = self.translator._numbering_id(
            (
                self.n_main,
                tuple(histosys),
                tuple(normsys),
                tuple(par_start.items()),
                tuple((m, tuple(channels.items())) for m, channels in per_bin.items()),
            )
        )
        if numbering_id is None:  # a numbering seen first: kept once it comes again
            return [self._sample(name, parts, numbering) for name, parts in carriers.items()]
        return [
            self.translator._kept(
                "samples",
                (name, numbering_id, *((start, id(r)) for _, start, r in parts)),
                [r for _, _, r in parts],
                partial(self._sample, name, parts, numbering),
            )
            for name, parts in carriers.items()
        ]

    def _sample(self, name: str, parts, numbering: _Numbering) -> SampleLayout:
        """One sample's arrays; ``parts``: its (channel, first bin, reading), in workspace
        order."""
        layout = SampleLayout(
            name=name,
            nominal=self.nominals[name],
            histosys=self._histosys(parts, numbering),
            normsys_param=np.zeros(0, dtype=np.int64),
            normsys_bin=np.zeros(0, dtype=np.int64),
            normsys_coefficients=np.zeros((8, 0)),
            multipliers=self._multipliers(parts, numbering),
        )
        normsys_parts = [(start, r) for _, start, r in parts if len(r.normsys_ids)]
        if normsys_parts:
            self._normsys(layout, normsys_parts, numbering.normsys_column)
        return layout

    def _histosys(self, parts, numbering: _Numbering) -> np.ndarray:
        """One sample's histosys coefficients ``[K, J_h, N]``. A sample whose readings are all
        the background's keeps its array (read-only, shared by the elements) while the
        model's histosys parameters and bins stay as they are: most patches add a signal and
        leave the other samples' arrays, a few MB on a large model, alone."""
        carriers = [(start, r) for _, start, r in parts if len(r.histosys_ids)]
        key = tuple((start, id(reading)) for start, reading in carriers)
        own = self.translator._background_only([reading for _, reading in carriers])
        array = numbering.kept_histosys.get(key) if own else None
        if array is None:
            array = _sample_histosys(carriers, numbering.histosys_column, numbering.histosys_shape)
            if own:
                array.flags.writeable = False
                numbering.kept_histosys[key] = array
        return array

    def _columns(self, names: list[str]) -> np.ndarray:
        """Registry id -> position in ``names`` (the model's histosys or normsys list)."""
        name_ids = self.translator.name_ids
        column = np.full(len(name_ids), -1, dtype=np.int64)
        column[[name_ids[m] for m in names]] = np.arange(len(names))
        return column

    def _multipliers(self, parts, numbering: _Numbering) -> list[list[int]]:
        """Per bin, the parameters that multiply one sample, in workspace order."""
        par_start, per_bin = numbering.par_start, numbering.offsets
        bins: list[list[int]] = [[] for _ in range(self.n_main)]
        for cname, start, reading in parts:
            template = [
                (par_start[m] + per_bin[m][cname], 1)
                if t in _PER_BIN_TYPES
                else (par_start[m], int(t == "shapefactor"))
                for t, m in reading.multipliers
            ]
            for k in range(self.nbins[cname]):
                bins[start + k].extend(i + step * k for i, step in template)
        return bins

    def _normsys(self, layout: SampleLayout, parts, column: np.ndarray) -> None:
        """One sample's normsys entries (modifier by modifier, bin by bin, in workspace order)
        and their coefficients, computed over exactly read_model's arrays."""
        counts = [len(r.normsys_ids) for _, r in parts]
        layout.normsys_param = column[np.concatenate([r.normsys_ids for _, r in parts])]
        layout.normsys_bin = np.concatenate([r.normsys_bins for _, r in parts]) + np.repeat(
            [start for start, _ in parts], counts
        )
        readings = [r for _, r in parts]
        layout.normsys_coefficients = self.translator._kept(
            "normsys",
            tuple(map(id, readings)),
            readings,
            lambda: normsys_coefficients(
                self.translator.normsys_code,
                np.concatenate([r.normsys_lo for r in readings]),
                np.concatenate([r.normsys_hi for r in readings]),
            ),
        )

    def _per_bin_offsets(self) -> dict[str, dict[str, int]]:
        """staterror / shapesys name -> channel -> offset of its first bin in the parameter set."""
        carriers = {
            mname: dict.fromkeys(cname for cname, _ in parts)
            for mname, parts in self.staterror_parts.items()
        }
        for cname, reading in self.walk:
            for mname in reading.shapesys:
                carriers[mname] = {cname: None}  # shapesys can not be shared
        return {
            mname: offsets({c: self.nbins[c] for c in channels})
            for mname, channels in carriers.items()
        }


@dataclass(frozen=True)
class _Numbering:
    """What the layout of a sample needs of its model's numbering: parameter starts, the
    per-bin parameter sets' first bin per channel, histosys and normsys positions by name id,
    the histosys array shape, the background's histosys arrays kept for it."""

    par_start: dict[str, int]
    offsets: dict[str, dict[str, int]]
    histosys_column: np.ndarray
    histosys_shape: tuple[int, int, int]
    normsys_column: np.ndarray
    kept_histosys: dict[tuple, np.ndarray]


def _check_unique_names(
    spec: dict[str, Any], channels: list[str], readings: list[list[SampleReading]]
) -> None:
    """:class:`DuplicateNameError` for the first name used twice where it must be unique:
    channels, samples within a channel, a modifier's name and type on one sample,
    measurements, observations (pyhf merges channels and takes the first measurement)."""
    _check_unique(channels, "channel name", "/channels")
    for c, (cname, channel) in enumerate(zip(channels, readings, strict=True)):
        path = f"/channels/{c}/samples"
        _check_unique([r.name for r in channel], "sample name", path, f" in channel {cname!r}")
        for s, reading in enumerate(channel):
            if reading.duplicate is not None:
                _raise_duplicate_modifier(reading, cname, f"{path}/{s}/modifiers")
    for array in ("measurements", "observations"):
        names = [entry["name"] for entry in spec.get(array, [])]
        _check_unique(names, f"{array[:-1]} name", f"/{array}")


def _check_unique(names: list[str], what: str, path: str, within: str = "") -> None:
    """:class:`DuplicateNameError` naming the first of ``names`` (at ``path``/i) used twice."""
    if len(set(names)) == len(names):
        return
    first: dict[str, int] = {}
    for i, name in enumerate(names):
        if name in first:
            raise DuplicateNameError(
                f"duplicate {what} {name!r}{within} at {path}/{i} (first at {path}/{first[name]})"
            )
        first[name] = i


def _raise_duplicate_modifier(reading: SampleReading, channel: str, path: str) -> None:
    """:class:`DuplicateNameError` naming the sample's modifier whose name and type repeat."""
    first: dict[tuple[str, str], int] = {}
    for i, modifier in enumerate(reading.source["modifiers"]):
        key = (modifier["name"], modifier["type"])
        if key in first:
            raise DuplicateNameError(
                f"duplicate modifier {key[0]!r} ({key[1]}) on sample {reading.name!r} in "
                f"channel {channel!r} at {path}/{i} (first at {path}/{first[key]})"
            )
        first[key] = i


def _sample_histosys(
    carriers: list[tuple[int, SampleReading]], column: np.ndarray, shape: tuple[int, int, int]
) -> np.ndarray:
    """One sample's histosys coefficients ``shape = [K, J_h, N]`` from the readings that carry
    it (each with its channel's first bin), ``column``: registry id -> histosys position."""
    array = np.zeros(shape)
    if carriers:
        counts = [len(r.histosys_ids) for _, r in carriers]
        array[
            :,
            column[np.concatenate([r.histosys_ids for _, r in carriers])],
            np.concatenate([r.histosys_bins for _, r in carriers])
            + np.repeat([start for start, _ in carriers], counts),
        ] = np.concatenate([r.histosys_values for _, r in carriers]).T
    return array


def _aux_layout(paramsets: list[Paramset], par_start: dict[str, int]) -> dict[str, np.ndarray]:
    """The ``aux_*`` arrays of the constrained parameter sets (:func:`.layout.aux_arrays`)."""
    return aux_arrays(
        (par_start[p.name], p.n_parameters, p.constraint == "poisson", p.sigmas, p.factors)
        for p in paramsets
        if p.constraint is not None
    )
