"""pyhf's own validation suite (``tests/test_validation.py``), every case through the server.

The 11 cases (specs from pyhf's ``validation/`` folder and the inline one, with their settings:
interpolation codes, test statistic, POI value) are in ``data/pyhf_validation/cases.json``,
with the reference values pyhf's test records. Each is posted to a real server over HTTP
(``/cls`` for ``q``/``q~``, ``/significance`` for ``q0``, toys included) and checked:

1. against pyhf computed here, on the same workspace and settings, with its fits started from
   many points at a tight tolerance (:mod:`pyhf_global`): within pyhf's own tolerance for the
   case (1e-6 .. 3e-4);
2. against the recorded reference values. Those carry the stopping error of the fits that made
   them (pyhf's scipy SLSQP at its default tolerance; pyhf itself, with a tight tolerance,
   differs from them by up to 3.3e-4 relative, as we do), so they are met within
   ``RECORDED_FIT_ERROR``; except ``2bin_2channel_coupledhistosys``, whose recorded conditional
   fits (to the data and to the Asimov data, at mu = 1) sit in the higher of two basins
   (-2 log L 31.375 and 37.476 against 30.872 and 32.631 at alpha < 0): there the recorded
   values are reproduced by pyhf's single-start fit, and our answer, from the global minima,
   must differ from them;
3. the toy case within Monte Carlo error of the recorded toys.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
import pytest
from pyhf_global import global_pyhf, hypotest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CASES = json.loads((Path(__file__).parent / "data/pyhf_validation/cases.json").read_text())["cases"]
RECORDED_FIT_ERROR = 4e-4
LOCAL_MINIMA_CASE = "2bin_2channel_coupledhistosys"


def ask_server(client: httpx.Client, case: dict) -> tuple[float, list[float], dict]:
    """The server's (observed, expected set, meta) for ``case``, in pyhf's order."""
    body = {"workspace": case["workspace"], "modifier_settings": case["modifier_settings"]}
    if case["calctype"] == "toybased":
        body |= {"calctype": "toybased", "ntoys": 2000, "seed": 0}
    if case["test_stat"] == "q0":
        response = client.post("/significance", json=body)
        assert response.status_code == 200, response.text
        result = response.json()
        return result["p0_obs"], result["p0_exp_set"], result["meta"]
    body |= {"test_poi": case["test_poi"], "test_stat": case["test_stat"]}
    response = client.post("/cls", json=body)
    assert response.status_code == 200, response.text
    result = response.json()
    return result["CLs_obs"], result["CLs_exp"], result["meta"]


def relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def within(ours: list[float], reference: list[float], tolerance) -> bool:
    """pyhf's comparison: relative, or (the inline case) ``np.allclose(rtol, atol)``."""
    if isinstance(tolerance, dict):
        return all(
            abs(a - b) <= tolerance["atol"] + tolerance["rtol"] * abs(b)
            for a, b in zip(ours, reference, strict=True)
        )
    return all(relative(a, b) <= tolerance for a, b in zip(ours, reference, strict=True))


ASYMPTOTIC = [c for c in CASES if c["calctype"] == "asymptotics"]


@pytest.mark.parametrize("case", ASYMPTOTIC, ids=[c["id"] for c in ASYMPTOTIC])
def test_asymptotic_case_matches_pyhf(client, case):
    obs, exp, meta = ask_server(client, case)
    ours = [obs, *exp]
    assert meta["converged"] is True, meta
    with global_pyhf():
        pyhf_obs, pyhf_exp = hypotest(
            case["workspace"], case["modifier_settings"], case["test_poi"], case["test_stat"]
        )
    reference = [float(pyhf_obs), *map(float, pyhf_exp)]
    assert within(ours, reference, case["tolerance"]), (ours, reference)

    recorded = [case["expected"]["obs"], *case["expected"]["exp"]]
    if case["id"] == LOCAL_MINIMA_CASE:
        assert meta["starts"] > 1 and meta["starts_agreed"] is False, meta
        single_obs, single_exp = hypotest(
            case["workspace"], case["modifier_settings"], case["test_poi"], case["test_stat"]
        )
        assert within([float(single_obs), *map(float, single_exp)], recorded, 1e-6)
        assert relative(obs, recorded[0]) > 0.3
    else:
        bound = (
            max(RECORDED_FIT_ERROR, case["tolerance"])
            if isinstance(case["tolerance"], float)
            else case["tolerance"]
        )
        assert within(ours, recorded, bound), (ours, recorded)


TOYS = [c for c in CASES if c["calctype"] == "toybased"]


@pytest.mark.parametrize("case", TOYS, ids=[c["id"] for c in TOYS])
def test_toy_case_within_monte_carlo_error(client, case):
    obs, exp, meta = ask_server(client, case)
    assert meta["converged"] is True, meta
    recorded = [case["expected"]["obs"], *case["expected"]["exp"]]
    ntoys = 2000
    for ours, theirs in zip([obs, *exp], recorded, strict=True):
        p = max(theirs, 1.0 / ntoys)
        sigma = math.sqrt(2 * p * (1 - p) / ntoys)  # two independent toy runs
        assert abs(ours - theirs) <= 4 * sigma + 1e-12, (ours, theirs, sigma)
