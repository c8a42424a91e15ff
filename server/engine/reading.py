"""What one sample of one channel contributes to a model, read once, in name space.

A :class:`SampleReading` depends on nothing but the sample's own JSON (and the histosys
interpolation code): its nominal rates, its modifiers by ``(type, name)``, the histosys basis
coefficients and normsys variations in modifier order, the plain multipliers in order, the
staterror uncertainties and shapesys parameter requirements. Parameter indices, bin offsets
and everything shared between samples are resolved later, per model
(:mod:`pyhf_gpu_server.engine.translate`), so a reading is reused by every model that holds
the same sample object.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from sys import intern
from typing import Any

import numpy as np
import pyhf

from .interpolation import histosys_coefficients
from .layout import MULTIPLIER_TYPES

MODIFIER_TYPES = tuple(pyhf.modifiers.histfactory_set)  # pyhf's builder order
# pyhf's parameter requirements (paramset type, sizes, defaults) of each modifier type
REQUIRED_PARSET = {
    mtype: importlib.import_module(f"pyhf.modifiers.{mtype}").required_parset
    for mtype in MODIFIER_TYPES
}


@dataclass(eq=False)
class SampleReading:
    """One sample of one channel. ``modifiers`` holds pyhf's view (the last of equal
    ``(type, name)`` keys wins); ``duplicate`` names the first repeated key, which the engine
    refuses.

    Histosys and normsys entries go modifier by modifier, bin by bin (as read_model lists
    them), each with its modifier's id in the translator's name registry and its bin in the
    channel."""

    source: dict[str, Any]
    name: str
    data: list[float]
    nominal: np.ndarray  # [n]
    modifiers: dict[tuple[str, str], dict[str, Any]]  # (type, name) -> modifier, in order
    sorted_keys: dict[tuple[str, str], None]  # the (type, name) keys, sorted
    types: frozenset[str]  # the modifier types present
    duplicate: tuple[str, str] | None  # (name, type)
    unknown_type: bool
    inconsistent: bool  # per-bin modifier data whose length is not the sample's
    multipliers: list[tuple[str, str]]  # (type, name) of the plain multipliers, in order
    staterror: dict[str, np.ndarray]  # name -> uncertainties
    shapesys: dict[str, dict[str, Any]]  # name -> pyhf's parameter requirement
    histosys_ids: np.ndarray  # [E_h]
    histosys_bins: np.ndarray  # [E_h]
    histosys_values: np.ndarray  # [E_h, K] basis coefficients
    normsys_ids: np.ndarray  # [E_n]
    normsys_bins: np.ndarray  # [E_n]
    normsys_lo: np.ndarray  # [E_n]
    normsys_hi: np.ndarray  # [E_n]

    @property
    def n_bins(self) -> int:
        return len(self.data)


def read_sample(
    sample: dict[str, Any], histosys_code: str, name_ids: dict[str, int]
) -> SampleReading:
    """Read one channel's sample (a dict of the workspace schema); histosys and normsys names
    get ids in ``name_ids`` (new names are added)."""
    data = sample["data"]
    n = len(data)
    nominal = np.asarray(data, dtype=np.float64)
    modifiers: dict[tuple[str, str], dict[str, Any]] = {}
    duplicate = None
    for modifier in sample["modifiers"]:
        # interned: the model-wide merges of these keys compare them by identity (str():
        # intern takes no str subclass, such as numpy's, that a Python caller may pass)
        key = (intern(str(modifier["type"])), intern(str(modifier["name"])))
        if duplicate is None and key in modifiers:
            duplicate = (key[1], key[0])
        modifiers[key] = modifier
    types = frozenset(mtype for mtype, _ in modifiers)
    inconsistent = False
    multipliers, staterror, shapesys = [], {}, {}
    histosys, lo_data, hi_data, normsys, lo, hi = [], [], [], [], [], []
    for (mtype, mname), modifier in modifiers.items():
        mdata = modifier["data"]
        if mtype == "histosys":
            if len(mdata["lo_data"]) == len(mdata["hi_data"]) == n:
                histosys.append(name_ids.setdefault(mname, len(name_ids)))
                lo_data.append(mdata["lo_data"])
                hi_data.append(mdata["hi_data"])
            else:
                inconsistent = True
        elif mtype == "normsys":
            normsys.append(name_ids.setdefault(mname, len(name_ids)))
            lo.append(mdata["lo"])
            hi.append(mdata["hi"])
        elif mtype in MULTIPLIER_TYPES:
            multipliers.append((mtype, mname))
            if mtype in ("staterror", "shapesys") and len(mdata) != n:
                inconsistent = True
            elif mtype == "staterror":
                staterror[mname] = np.asarray(mdata, dtype=np.float64)
            elif mtype == "shapesys":
                shapesys[mname] = REQUIRED_PARSET["shapesys"](data, mdata)

    shape = (len(histosys), n)
    coefficients = histosys_coefficients(
        histosys_code,
        np.asarray(lo_data, dtype=np.float64).reshape(shape),
        nominal,
        np.asarray(hi_data, dtype=np.float64).reshape(shape),
    )  # [K, J, n]
    return SampleReading(
        source=sample,
        name=sample["name"],
        data=data,
        nominal=nominal,
        modifiers=modifiers,
        sorted_keys=dict.fromkeys(sorted(modifiers)),
        types=types,
        duplicate=duplicate,
        unknown_type=not types <= set(MODIFIER_TYPES),
        inconsistent=inconsistent,
        multipliers=multipliers,
        staterror=staterror,
        shapesys=shapesys,
        histosys_ids=np.repeat(np.asarray(histosys, dtype=np.int64), n),
        histosys_bins=np.tile(np.arange(n), len(histosys)),
        histosys_values=coefficients.reshape(len(coefficients), -1).T,
        normsys_ids=np.repeat(np.asarray(normsys, dtype=np.int64), n),
        normsys_bins=np.tile(np.arange(n), len(normsys)),
        normsys_lo=np.repeat(np.asarray(lo, dtype=np.float64), n),
        normsys_hi=np.repeat(np.asarray(hi, dtype=np.float64), n),
    )
