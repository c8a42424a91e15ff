"""Toy-based discovery significance through a real server, its job and the client CLI.

``POST /significance`` takes ``calctype``, ``ntoys`` and ``seed`` as ``/cls`` does, and answers
pyhf's ``hypotest(0.0, data, model, test_stat="q0", calctype="toybased", ...)``: p0 (its first
value) and the expected band of p0, with their significances. Checked:

- against pyhf computed here on a small workspace, within Monte Carlo error (4 binomial
  standard errors of the two independent toy runs);
- through the client CLI on pyhf's validation case ``1bin_shapesys_q0_toys``, against the values
  pyhf's test records (2000 toys), within the same error;
- reproducible from ``seed`` (a job answers what the synchronous request does), and a seed
  outside what torch's generators take (0 .. 2^64 - 1) is a 422 naming ``seed``.

pyhf 0.7.6's toy calculator passes numpy's removed ``interpolation`` keyword to
``np.percentile``; the reference runs with that one call spelled as numpy now wants it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from statistics import NormalDist
from typing import Any

import httpx
import numpy as np
import pyhf
import pytest
from click.testing import CliRunner
from pyhf.tensor import numpy_backend
from service_support import ServerProcess, simple_workspace, wait_for_job

from pyhf_gpu_client import cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NTOYS = 2000
PYHF_NTOYS = 500  # pyhf fits its toys one by one: ~5 s
CASES = json.loads((Path(__file__).parent / "data/pyhf_validation/cases.json").read_text())
TOY_CASE = next(c for c in CASES["cases"] if c["id"] == "1bin_shapesys_q0_toys")
MAX_SEED = 2**64 - 1


def excess_workspace() -> dict[str, Any]:
    """A two-bin workspace with an excess over the background (p0 about 0.12)."""
    workspace = simple_workspace()
    workspace["observations"][0]["data"] = [60.0, 58.0]
    return workspace


def toys(ntoys: int = NTOYS, seed: int = 0) -> dict[str, Any]:
    """The options of a toy-based significance."""
    return {"calctype": "toybased", "ntoys": ntoys, "seed": seed}


def within_monte_carlo_error(ours: float, theirs: float, n_ours: int, n_theirs: int) -> bool:
    """``|ours - theirs|`` within 4 binomial standard errors of two independent toy runs."""
    p = max(theirs, 1.0 / n_theirs)
    sigma = math.sqrt(p * (1 - p) * (1 / n_ours + 1 / n_theirs))
    return abs(ours - theirs) <= 4 * sigma + 1e-12


def pyhf_toy_significance(
    workspace: dict[str, Any], ntoys: int, monkeypatch: pytest.MonkeyPatch
) -> tuple[float, list[float]]:
    """pyhf's toy-based (p0, expected set of p0)."""

    def percentile(self, tensor_in, q, axis=None, interpolation="linear"):
        return np.percentile(tensor_in, q, axis=axis, method=interpolation)

    monkeypatch.setattr(numpy_backend.numpy_backend, "percentile", percentile)
    ws = pyhf.Workspace(workspace)
    model = ws.model()
    np.random.seed(0)
    p0, p0_set = pyhf.infer.hypotest(
        0.0,
        ws.data(model),
        model,
        test_stat="q0",
        calctype="toybased",
        ntoys=ntoys,
        return_expected_set=True,
        track_progress=False,
    )
    return float(p0), [float(v) for v in p0_set]


def assert_significance_within_monte_carlo_error(
    answer: dict[str, Any], p0: float, p0_set: list[float], n_reference: int
) -> None:
    """Observed p0 and its expected band as the reference's; Z and the median from them."""
    ours = [answer["p0_obs"], *answer["p0_exp_set"]]
    for value, reference in zip(ours, [p0, *p0_set], strict=True):
        assert within_monte_carlo_error(value, reference, NTOYS, n_reference), (ours, p0, p0_set)
    assert answer["p0_exp"] == answer["p0_exp_set"][2]
    assert math.isclose(answer["z_obs"], NormalDist().inv_cdf(1 - answer["p0_obs"]))


def test_toy_significance_matches_pyhf(client: httpx.Client, monkeypatch: pytest.MonkeyPatch):
    response = client.post("/significance", json={"workspace": excess_workspace(), **toys()})
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["meta"]["converged"] is True, answer["meta"]
    p0, p0_set = pyhf_toy_significance(excess_workspace(), PYHF_NTOYS, monkeypatch)
    assert_significance_within_monte_carlo_error(answer, p0, p0_set, PYHF_NTOYS)
    asymptotic = client.post("/significance", json={"workspace": excess_workspace()}).json()
    assert answer["p0_obs"] != asymptotic["p0_obs"]


def test_client_cli_toy_significance_matches_pyhf_validation(server: ServerProcess, tmp_path):
    path = tmp_path / "workspace.json"
    path.write_text(json.dumps(TOY_CASE["workspace"]))
    options = ["--calctype", "toybased", "--ntoys", str(NTOYS), "--seed", "0"]
    env = {"PYHF_GPU_SERVER": server.url}
    res = CliRunner().invoke(cli.main, ["significance", str(path), *options], env=env)
    assert res.exit_code == 0, res.output
    answer = json.loads(res.stdout)
    expected = TOY_CASE["expected"]
    assert_significance_within_monte_carlo_error(answer, expected["obs"], expected["exp"], NTOYS)


def test_toy_significance_is_reproducible_from_its_seed(client: httpx.Client):
    body = {"workspace": excess_workspace(), **toys(ntoys=300, seed=7)}
    first, again = (client.post("/significance", json=body).json() for _ in range(2))
    other_seed = client.post("/significance", json={**body, "seed": 8}).json()
    job = client.post("/jobs", json={"operation": "significance", **body}).json()
    result = wait_for_job(client, job["id"])["result"]
    values = ("p0_obs", "p0_exp_set", "z_obs", "z_exp")
    assert [first[k] for k in values] == [again[k] for k in values] == [result[k] for k in values]
    assert [first[k] for k in values] != [other_seed[k] for k in values]


def test_toy_options_in_the_query_string(client: httpx.Client):
    query = "calctype=toybased&ntoys=300&seed=7"
    by_query = client.post(f"/significance?{query}", json=excess_workspace())
    assert by_query.status_code == 200, by_query.text
    by_body = client.post(
        "/significance", json={"workspace": excess_workspace(), **toys(ntoys=300, seed=7)}
    )
    assert by_query.json()["p0_exp_set"] == by_body.json()["p0_exp_set"]


@pytest.mark.parametrize("route", ["/significance", "/cls", "/jobs"])
@pytest.mark.parametrize("seed", [MAX_SEED + 1, 2**70, -1])
def test_a_seed_torch_cannot_take_is_a_422_naming_it(client: httpx.Client, route: str, seed: int):
    body = {"workspace": excess_workspace(), **toys(ntoys=10, seed=seed)}
    if route == "/jobs":
        body["operation"] = "significance"
    response = client.post(route, json=body)
    assert response.status_code == 422, response.text
    assert [problem["loc"] for problem in response.json()["detail"]] == [["body", "seed"]]


def test_the_largest_seed_is_taken(client: httpx.Client):
    body = {"workspace": excess_workspace(), **toys(ntoys=10, seed=MAX_SEED)}
    response = client.post("/significance", json=body)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("option", "value"), [("calctype", "toys"), ("ntoys", 0), ("ntoys", 100_001)]
)
def test_bad_toy_options_are_a_422_naming_them(client: httpx.Client, option: str, value: Any):
    body = {"workspace": excess_workspace(), **toys(), option: value}
    response = client.post("/significance", json=body)
    assert response.status_code == 422, response.text
    assert [problem["loc"] for problem in response.json()["detail"]] == [["body", option]]
