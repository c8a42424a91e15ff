"""Large analysis-like HistFactory workspaces (HVTWZ-class), seeded, for scaling benchmarks.

The ATLAS diboson-resonance likelihood of pyhf's GPU talks (``HVTWZ_3500.json``) is not public;
this generator makes workspaces of the same shape: ``channels`` regions of ``bins`` mass bins
each, ``backgrounds`` falling mass spectra per region (exponential times a power law, each its
own slope), a signal peak (a Gaussian in mass, its width growing with the mass), and

- ``systematics`` shared nuisance parameters, half normsys (``syst_norm_k``) and half histosys
  (``syst_shape_k``: a smooth tilt of the spectrum), each sample taking ``per_sample`` of them
  at random, so that one parameter moves samples in many regions;
- per-bin MC statistics on every bin (``staterror`` of each region: one gamma per bin), from
  each sample's own simulated-event count;
- ``floating`` free background normalisations (normfactors ``norm_bkg_k`` on the k-th
  background of every region), the luminosity (``lumi``), and the POI ``mu_SIG``.

Parameters: ``systematics + channels * bins + floating + 3`` (lumi, the signal cross-section,
the POI; :func:`size`). Observed data: a Poisson draw of
the background at its nominal (seeded). The signal can be in the workspace (:func:`workspace`)
or in a patchset of ``patches`` mass points on the background-only workspace
(:func:`background_only` and :func:`patchset`).

    .venv/bin/python benchmarks/generate_large.py --channels 40 --bins 40 --systematics 500 \\
        --out big.json [--patchset big_patchset.json --patches 24]

Example:
    >>> ws = workspace(channels=2, bins=5, systematics=4, per_sample=2, backgrounds=2, seed=1)
    >>> import pyhf
    >>> model = pyhf.Workspace(ws).model()
    >>> model.config.npars, model.config.nmaindata  # 4 + 2 x 5 gammas + 2 floating + 3
    (19, 10)
    >>> size(channels=2, bins=5, systematics=4, floating=2)
    {'parameters': 19, 'bins': 10}
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

POI = "mu_SIG"


def _spectrum(rng: np.random.Generator, bins: int, total: float) -> np.ndarray:
    """A falling mass spectrum over ``bins`` bins summing to about ``total``."""
    x = (np.arange(bins) + 0.5) / bins
    slope = rng.uniform(2.0, 6.0)
    power = rng.uniform(0.5, 2.0)
    shape = np.exp(-slope * x) / (0.05 + x) ** power
    return total * shape / shape.sum()


def _signal(bins: int, mass: float, total: float) -> np.ndarray:
    """A signal peak at ``mass`` (0..1 along the mass axis), width growing with mass."""
    x = (np.arange(bins) + 0.5) / bins
    width = 0.03 + 0.05 * mass
    shape = np.exp(-0.5 * ((x - mass) / width) ** 2) + 1e-6
    return total * shape / shape.sum()


def _modifiers(
    rng: np.random.Generator,
    nominal: np.ndarray,
    systematics: int,
    per_sample: int,
    mc_events: float,
) -> tuple[list[dict[str, Any]], np.ndarray]:
    """A sample's shared systematics (``per_sample`` of them) and its staterror widths."""
    bins = nominal.shape[0]
    x = (np.arange(bins) + 0.5) / bins - 0.5
    modifiers: list[dict[str, Any]] = []
    picks = rng.choice(systematics, size=min(per_sample, systematics), replace=False)
    for k in sorted(int(p) for p in picks):
        if k % 2 == 0:
            size = rng.uniform(0.01, 0.15)
            hi, lo = 1.0 + size, 1.0 / (1.0 + size * rng.uniform(0.7, 1.3))
            modifiers.append(
                {"name": f"syst_norm_{k // 2}", "type": "normsys", "data": {"hi": hi, "lo": lo}}
            )
        else:
            tilt = rng.uniform(-0.2, 0.2) * x + rng.uniform(-0.05, 0.05)
            up = np.clip(nominal * (1.0 + tilt), 1e-6, None)
            down = np.clip(nominal * (1.0 - tilt * rng.uniform(0.7, 1.3)), 1e-6, None)
            modifiers.append(
                {
                    "name": f"syst_shape_{k // 2}",
                    "type": "histosys",
                    "data": {"hi_data": up.tolist(), "lo_data": down.tolist()},
                }
            )
    # simulated events per bin follow the rate: relative MC error 1 / sqrt(events)
    events = np.maximum(mc_events * nominal / nominal.sum(), 25.0)
    return modifiers, nominal / np.sqrt(events)


def _region(
    rng: np.random.Generator,
    c: int,
    bins: int,
    systematics: int,
    per_sample: int,
    backgrounds: int,
    floating: int,
) -> tuple[dict[str, Any], list[float]]:
    """One channel (backgrounds only) and its observed counts."""
    samples, total = [], np.zeros(bins)
    errors2 = np.zeros(bins)
    for b in range(backgrounds):
        nominal = _spectrum(rng, bins, rng.uniform(50.0, 2000.0) / (1 + b))
        modifiers, err = _modifiers(rng, nominal, systematics, per_sample, rng.uniform(1e3, 1e5))
        modifiers.append({"name": "lumi", "type": "lumi", "data": None})
        if b < floating:
            modifiers.append({"name": f"norm_bkg_{b}", "type": "normfactor", "data": None})
        samples.append({"name": f"bkg_{b}", "data": nominal.tolist(), "modifiers": modifiers})
        total += nominal
        errors2 += err**2
    # one staterror per region, its widths on the first sample (pyhf sums them over samples
    # carrying the modifier; all carry it here)
    for sample in samples:
        nominal = np.asarray(sample["data"])
        share = nominal / total
        sample["modifiers"].append(
            {
                "name": f"staterror_SR{c}",
                "type": "staterror",
                "data": (np.sqrt(errors2) * share).tolist(),
            }
        )
    observed = rng.poisson(total).astype(float)
    return {"name": f"SR{c}", "samples": samples}, observed.tolist()


def _signal_sample(
    rng: np.random.Generator, bins: int, mass: float, systematics: int
) -> dict[str, Any]:
    nominal = _signal(bins, mass, rng.uniform(0.2, 1.5))
    modifiers = [
        {"name": POI, "type": "normfactor", "data": None},
        {"name": "lumi", "type": "lumi", "data": None},
        {"name": "signal_xsec", "type": "normsys", "data": {"hi": 1.08, "lo": 0.93}},
    ]
    if systematics:
        k = int(rng.integers(0, max(systematics // 2, 1)))
        modifiers.append(
            {"name": f"syst_norm_{k}", "type": "normsys", "data": {"hi": 1.05, "lo": 0.95}}
        )
    return {"name": "signal", "data": nominal.tolist(), "modifiers": modifiers}


def background_only(
    channels: int = 40,
    bins: int = 40,
    systematics: int = 500,
    per_sample: int = 24,
    backgrounds: int = 7,
    floating: int = 4,
    seed: int = 0,
) -> dict[str, Any]:
    """The background-only workspace (the measurement's POI ``mu_SIG``, as on HEPData)."""
    rng = np.random.default_rng(seed)
    regions = [
        _region(rng, c, bins, systematics, per_sample, backgrounds, floating)
        for c in range(channels)
    ]
    parameters = [
        {
            "name": "lumi",
            "auxdata": [1.0],
            "sigmas": [0.017],
            "bounds": [[0.9, 1.1]],
            "inits": [1.0],
        }
    ]
    return {
        "channels": [r for r, _ in regions],
        "observations": [{"name": r["name"], "data": d} for r, d in regions],
        "measurements": [{"name": "meas", "config": {"poi": POI, "parameters": parameters}}],
        "version": "1.0.0",
    }


def _signal_operations(
    background: dict[str, Any], mass: float, seed: int, systematics: int
) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    bins = len(background["channels"][0]["samples"][0]["data"])
    return [
        {
            "op": "add",
            "path": f"/channels/{c}/samples/-",
            "value": _signal_sample(rng, bins, mass, systematics),
        }
        for c in range(len(background["channels"]))
    ]


def workspace(mass: float = 0.5, injected: float = 0.0, **kwargs: Any) -> dict[str, Any]:
    """A full workspace: :func:`background_only` with a signal at ``mass`` in every region;
    ``injected``: its observations also count a Poisson draw of that many times the signal
    (seeded), so that the POI's best fit is off its bound (0: background only)."""
    background = background_only(**kwargs)
    systematics = kwargs.get("systematics", 500)
    rng = np.random.default_rng(kwargs.get("seed", 0) + 2)
    for op in _signal_operations(background, mass, kwargs.get("seed", 0) + 1, systematics):
        c = int(op["path"].split("/")[2])
        background["channels"][c]["samples"].append(op["value"])
        if injected:
            observed = background["observations"][c]["data"]
            signal = rng.poisson(injected * np.asarray(op["value"]["data"]))
            background["observations"][c]["data"] = (np.asarray(observed) + signal).tolist()
    return background


def patchset(background: dict[str, Any], patches: int = 24, seed: int = 0) -> dict[str, Any]:
    """A pyhf PatchSet of ``patches`` signal mass points on ``background``."""
    systematics = sum(
        1
        for m in {
            mod["name"]
            for ch in background["channels"]
            for s in ch["samples"]
            for mod in s["modifiers"]
        }
        if m.startswith("syst_")
    )
    masses = np.linspace(0.15, 0.85, patches)
    return {
        "metadata": {
            "description": "generated signal mass points",
            "digests": {"sha256": _digest(background)},
            "labels": ["mass"],
            "references": {"hepdata": "ins0000000"},
        },
        "patches": [
            {
                "metadata": {"name": f"mass_{i:02d}", "values": [round(float(m), 4)]},
                "patch": _signal_operations(background, float(m), seed + 100 + i, systematics),
            }
            for i, m in enumerate(masses)
        ],
        "version": "1.0.0",
    }


def _digest(workspace: dict[str, Any]) -> str:
    """pyhf's ``utils.digest`` of a workspace (what ``PatchSet.verify`` compares)."""
    text = json.dumps(workspace, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf8")).hexdigest()


def size(channels: int, bins: int, systematics: int, floating: int = 4) -> dict[str, int]:
    """Parameters and bins of a generated workspace (with its signal): the shared systematics
    (when every one is drawn), one gamma per bin, the floating normalisations, lumi, the
    signal cross-section and the POI."""
    return {
        "parameters": systematics + channels * bins + floating + 3,
        "bins": channels * bins,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--channels", type=int, default=40)
    parser.add_argument("--bins", type=int, default=40)
    parser.add_argument("--systematics", type=int, default=500)
    parser.add_argument("--per-sample", type=int, default=24)
    parser.add_argument("--backgrounds", type=int, default=7)
    parser.add_argument("--floating", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mass", type=float, default=0.5)
    parser.add_argument("--out", type=Path, required=True, help="the workspace (with signal)")
    parser.add_argument("--background", type=Path, help="also the background-only workspace")
    parser.add_argument("--patchset", type=Path, help="also a signal patchset for it")
    parser.add_argument("--patches", type=int, default=24)
    args = parser.parse_args()
    shape = dict(
        channels=args.channels,
        bins=args.bins,
        systematics=args.systematics,
        per_sample=args.per_sample,
        backgrounds=args.backgrounds,
        floating=args.floating,
        seed=args.seed,
    )
    args.out.write_text(json.dumps(workspace(mass=args.mass, **shape)))
    if args.background or args.patchset:
        background = background_only(**shape)
        if args.background:
            args.background.write_text(json.dumps(background))
        if args.patchset:
            args.patchset.write_text(json.dumps(patchset(background, args.patches, args.seed)))
    print(json.dumps(size(args.channels, args.bins, args.systematics, args.floating)))


if __name__ == "__main__":
    main()
