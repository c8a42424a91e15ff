"""Small hand-built workspaces that exercise every modifier type and measurement setting."""

from __future__ import annotations

import copy

import numpy as np


def lumi_setting(sigma: float, bounds: tuple[float, float], nominal: float = 1.0) -> dict:
    """A measurement's ``lumi`` parameter: auxdata and init ``nominal``, width ``sigma``."""
    return {
        "name": "lumi",
        "auxdata": [nominal],
        "sigmas": [sigma],
        "bounds": [list(bounds)],
        "inits": [nominal],
    }


def all_modifiers_workspace() -> dict:
    """Two channels; normfactor, lumi, shapefactor, staterror (one bin without uncertainty,
    one shared by both channels), shapesys (one bin without nominal), normsys and histosys
    on several samples; measurement inits, bounds, fixed parameters and lumi settings."""
    sr = {
        "name": "SR",
        "samples": [
            {
                "name": "signal",
                "data": [3.0, 5.0, 2.0],
                "modifiers": [
                    {"name": "mu", "type": "normfactor", "data": None},
                    {"name": "lumi", "type": "lumi", "data": None},
                    {"name": "sig_norm", "type": "normsys", "data": {"hi": 1.1, "lo": 0.85}},
                ],
            },
            {
                "name": "bkg1",
                "data": [20.0, 15.0, 10.0],
                "modifiers": [
                    {"name": "lumi", "type": "lumi", "data": None},
                    {
                        "name": "jes",
                        "type": "histosys",
                        "data": {"hi_data": [22.0, 16.5, 10.2], "lo_data": [18.5, 14.0, 9.1]},
                    },
                    {"name": "xsec", "type": "normsys", "data": {"hi": 1.2, "lo": 0.9}},
                    {"name": "stat_shared", "type": "staterror", "data": [1.5, 0.0, 1.1]},
                    {"name": "shape_free", "type": "shapefactor", "data": None},
                ],
            },
            {
                "name": "bkg2",
                "data": [8.0, 0.0, 4.0],
                "modifiers": [
                    {
                        "name": "jes",
                        "type": "histosys",
                        "data": {"hi_data": [9.0, 0.0, 4.5], "lo_data": [7.5, 0.0, 3.0]},
                    },
                    {"name": "xsec", "type": "normsys", "data": {"hi": 1.05, "lo": 0.7}},
                    {"name": "extreme", "type": "normsys", "data": {"hi": 40.0, "lo": 0.01}},
                    {"name": "bkg2_shape", "type": "shapesys", "data": [1.0, 0.5, 0.8]},
                    {"name": "stat_shared", "type": "staterror", "data": [0.9, 0.0, 0.6]},
                ],
            },
        ],
    }
    cr = {
        "name": "CR",
        "samples": [
            {
                "name": "bkg1",
                "data": [100.0, 80.0],
                "modifiers": [
                    {"name": "lumi", "type": "lumi", "data": None},
                    {
                        "name": "jes",
                        "type": "histosys",
                        "data": {"hi_data": [104.0, 85.0], "lo_data": [97.0, 78.0]},
                    },
                    {"name": "xsec", "type": "normsys", "data": {"hi": 1.2, "lo": 0.9}},
                    {"name": "stat_shared", "type": "staterror", "data": [4.0, 3.0]},
                    {"name": "bkg1_norm", "type": "normfactor", "data": None},
                ],
            },
            {
                "name": "bkg2",
                "data": [30.0, 25.0],
                "modifiers": [
                    {
                        "name": "res",
                        "type": "histosys",
                        "data": {"hi_data": [33.0, 26.0], "lo_data": [28.0, 25.5]},
                    },
                    {"name": "bkg1_norm", "type": "normfactor", "data": None},
                    {"name": "stat_shared", "type": "staterror", "data": [2.0, 1.5]},
                ],
            },
        ],
    }
    return {
        "channels": [sr, cr],
        "observations": [
            {"name": "SR", "data": [33.0, 22.0, 15.0]},
            {"name": "CR", "data": [128.0, 109.0]},
        ],
        "measurements": [
            {
                "name": "meas",
                "config": {
                    "poi": "mu",
                    "parameters": [
                        lumi_setting(0.025, (0.8, 1.2)),
                        {"name": "mu", "bounds": [[0.0, 8.0]], "inits": [0.7]},
                        {"name": "jes", "inits": [0.3], "bounds": [[-4.0, 4.0]]},
                        {"name": "res", "fixed": True, "inits": [0.2]},
                        {"name": "bkg1_norm", "bounds": [[0.5, 2.0]]},
                    ],
                },
            },
            {
                "name": "other_poi",
                "config": {
                    "poi": "bkg1_norm",
                    "parameters": [lumi_setting(0.04, (0.5, 1.5), nominal=0.98)],
                },
            },
        ],
        "version": "1.0.0",
    }


def with_signal_scale(workspace: dict, scale: float) -> dict:
    """A copy whose signal sample is scaled: same structure, other numbers."""
    result = copy.deepcopy(workspace)
    for channel in result["channels"]:
        for sample in channel["samples"]:
            if sample["name"] == "signal":
                sample["data"] = [scale * x for x in sample["data"]]
    return result


def symmetric_workspace(seed: int) -> dict:
    """One channel, two bins: a signal, a background with an even histosys (``hi == lo``,
    above the nominal), one with an even normsys (``hi == lo = 1.2``) and one with an
    ordinary normsys; the data 30-60% above the backgrounds."""
    rng = np.random.default_rng(100 + seed)
    nominal = np.round(rng.uniform(40, 90, (3, 2)), 1)
    shifted = np.round(nominal[0] * rng.uniform(1.1, 1.4, 2), 1).tolist()
    samples = [
        {
            "name": "signal",
            "data": np.round(rng.uniform(3, 10, 2), 1).tolist(),
            "modifiers": [{"name": "mu", "type": "normfactor", "data": None}],
        },
        {
            "name": "even_shape",
            "data": nominal[0].tolist(),
            "modifiers": [
                {
                    "name": "shape",
                    "type": "histosys",
                    "data": {"hi_data": shifted, "lo_data": shifted},
                }
            ],
        },
        {
            "name": "even_norm",
            "data": nominal[1].tolist(),
            "modifiers": [{"name": "norm", "type": "normsys", "data": {"hi": 1.2, "lo": 1.2}}],
        },
        {
            "name": "plain",
            "data": nominal[2].tolist(),
            "modifiers": [
                {"name": "plain", "type": "normsys", "data": {"hi": 1.1, "lo": 0.9}},
                # hi == lo == nominal: no shift at all, nothing to start off
                {
                    "name": "idle",
                    "type": "histosys",
                    "data": {"hi_data": nominal[2].tolist(), "lo_data": nominal[2].tolist()},
                },
            ],
        },
    ]
    observed = np.round(nominal.sum(0) * rng.uniform(1.3, 1.6, 2))
    return {
        "channels": [{"name": "sr", "samples": samples}],
        "observations": [{"name": "sr", "data": observed.tolist()}],
        "measurements": [{"name": "m", "config": {"poi": "mu", "parameters": []}}],
        "version": "1.0.0",
    }


def large_scale_shapesys_workspace(seed: int = 2, bins: int = 40) -> dict:
    """Three regions whose main background has a shapesys with Poisson scales of 10^4-10^6
    (relative widths 10^-2 to 10^-3 on counts of 10^4-10^6, as some published likelihoods
    have), a minor background with a wide shapesys and a floating normalisation that fits to
    its bound: a deviance of ~10^3 summed from counts of ~10^7, whose rounding errors (~10^-8)
    are far above an absolute convergence tolerance of 10^-10."""
    rng = np.random.default_rng(seed)
    channels, observations = [], []
    peak = np.exp(-0.5 * ((np.arange(bins) - bins / 2) / 3) ** 2) * 200
    for c in range(3):
        background = rng.uniform(5e3, 5e5, bins)
        relative = 10 ** (-0.5 * rng.uniform(4, 6, bins))  # tau = relative^-2: 1e4 .. 1e6
        minor = rng.uniform(10, 500, bins)
        channels.append(
            {
                "name": f"c{c}",
                "samples": [
                    {
                        "name": "signal",
                        "data": peak.tolist(),
                        "modifiers": [{"name": "mu", "type": "normfactor", "data": None}],
                    },
                    {
                        "name": "background",
                        "data": background.tolist(),
                        "modifiers": [
                            {
                                "name": f"shape_{c}",
                                "type": "shapesys",
                                "data": (background * relative).tolist(),
                            },
                            {"name": "norm", "type": "normsys", "data": {"hi": 1.05, "lo": 0.95}},
                        ],
                    },
                    {
                        "name": "minor",
                        "data": minor.tolist(),
                        "modifiers": [
                            {
                                "name": f"minor_shape_{c}",
                                "type": "shapesys",
                                "data": (minor * 0.3).tolist(),
                            },
                            {"name": f"minor_norm_{c}", "type": "normfactor", "data": None},
                        ],
                    },
                ],
            }
        )
        counts = rng.poisson(background * rng.normal(1, 0.02, bins) + minor * 0.2)
        observations.append({"name": f"c{c}", "data": counts.astype(float).tolist()})
    return {
        "channels": channels,
        "observations": observations,
        "measurements": [{"name": "m", "config": {"poi": "mu", "parameters": []}}],
        "version": "1.0.0",
    }
