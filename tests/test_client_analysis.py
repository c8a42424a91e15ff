"""cabinetry-style analysis commands (ranking, scan, yields, fit --goodness-of-fit) of the
client against a real ``pyhf-gpu-server`` on loopback.

One CPU server serves the module; the model is the small published workspace (``SMALL``,
ATLAS-SUSY-2018-31 region B) with its patchset's first signal point as a patch, or its first
two points as a patchset. Each test runs ``pyhf-gpu-client`` in-process (click's CliRunner)
and checks the printed output; the numbers themselves are checked against cabinetry in the
inference tests.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import pytest
from client_support import assert_close, assert_pyhf_format, run_cli
from service_support import SMALL, WORKSPACES
from workspaces import read_json, workspace_file

import pyhf_gpu_client as pgc

FOLDER = WORKSPACES / SMALL
BKG = str(workspace_file(FOLDER, "BkgOnly.json"))
PATCHSET = str(workspace_file(FOLDER, "patchset.json"))

pytestmark = pytest.mark.skipif(not FOLDER.exists(), reason="shared workspaces not present")


@pytest.fixture(scope="module")
def names() -> list[str]:
    """The patchset's first two signal points."""
    patchset = read_json(FOLDER / "patchset.json")
    return [p["metadata"]["name"] for p in patchset["patches"][:2]]


@pytest.fixture(scope="module")
def patch(tmp_path_factory) -> str:
    """The first signal point as a pyhf Patch file (``-p``)."""
    patchset = read_json(FOLDER / "patchset.json")
    path = tmp_path_factory.mktemp("inputs") / "signal.json"
    path.write_text(json.dumps(patchset["patches"][0]))
    return str(path)


def run_json(url: str, *args: str) -> Any:
    """As ``run_cli``, the output parsed (printed as pyhf prints: indent=4, sorted keys)."""
    return assert_pyhf_format(run_cli(url, *args))


def patchset_args(names: list[str]) -> list[str]:
    return ["--patchset", PATCHSET, *[a for n in names for a in ("--patch-name", n)]]


def impacts(ranking: dict[str, Any]) -> list[float]:
    return [
        max(abs(u), abs(d))
        for u, d in zip(ranking["postfit_up"], ranking["postfit_down"], strict=True)
    ]


# ----------------------------------------------------------------------------------- ranking


def test_ranking_sorted_by_impact_per_patch(server, names, patch):
    both = run_json(server.url, "ranking", BKG, *patchset_args(names))
    assert sorted(both) == sorted(names)
    for name in names:
        ranking = both[name]
        assert "meta" not in ranking and ranking["poi"]["name"] == "mu_SIG"
        assert "mu_SIG" not in ranking["labels"] and len(ranking["labels"]) > 50
        assert len(set(ranking["labels"])) == len(ranking["labels"])
        found = impacts(ranking)
        assert found == sorted(found, reverse=True)  # largest impact first
        assert found[0] > 0
        parsed = pgc.RankingResult.from_json(ranking)
        assert parsed.sorted().labels == parsed.labels
    # one patch, the largest three: the head of the same ranking
    top = run_json(server.url, "ranking", BKG, "-p", patch, "--top", "3")
    assert top["labels"] == both[names[0]]["labels"][:3]
    assert_close(top["postfit_up"], both[names[0]]["postfit_up"][:3], 1e-6, 1e-6)
    chosen = run_json(server.url, "ranking", BKG, "-p", patch, "--parameter", "lumi")
    assert chosen["labels"] == ["lumi"]


def test_submitted_ranking_equals_the_synchronous_one(server, patch):
    args = ["ranking", BKG, "-p", patch, "--top", "5"]
    direct = run_json(server.url, *args)
    job_id = run_cli(server.url, "jobs", "submit", *args).strip()
    waited = run_json(server.url, "jobs", "wait", job_id, "--wait-timeout", "120")
    assert waited["labels"] == direct["labels"]
    assert_close(waited, direct, 1e-9, 1e-9)


# -------------------------------------------------------------------------------------- scan


def test_scan_1d(server, patch):
    scan = run_json(server.url, "scan", BKG, "-p", patch, "--range", "0", "2", "--steps", "5")
    assert scan["name"] == "mu_SIG"
    assert scan["parameter_values"] == [0.0, 0.5, 1.0, 1.5, 2.0]
    assert len(scan["delta_nlls"]) == 5
    parsed = pgc.ScanResult.from_json(scan)
    value, lowest = parsed.minimum()
    assert abs(lowest) < 1e-6  # the minimum of -2 delta ln L is ~0 ...
    assert abs(value - scan["bestfit"]) <= 0.25  # ... at the grid point nearest the best fit
    assert all(d >= -1e-6 for d in scan["delta_nlls"])


def test_scan_2d(server, patch):
    scan = run_json(
        server.url,
        "scan",
        BKG,
        "-p",
        patch,
        "--values",
        "0,1,2",
        "--parameter-y",
        "lumi",
        "--range-y",
        "0.95",
        "1.05",
        "--steps-y",
        "3",
    )
    assert scan["names"] == ["mu_SIG", "lumi"]
    assert_close(scan["parameter_values"], [[0.0, 1.0, 2.0], [0.95, 1.0, 1.05]], 1e-9, 1e-9)
    assert len(scan["delta_nlls"]) == 3 and all(len(row) == 3 for row in scan["delta_nlls"])
    x, y, lowest = pgc.Scan2DResult.from_json(scan).minimum()
    assert abs(lowest) < 1e-4 and (x, y) == (0.0, 1.0)
    assert -1.0 <= scan["correlation"] <= 1.0


# ------------------------------------------------------------------------------------ yields


def test_yields_table_csv_and_json(server, patch, tmp_path):
    pyhf = pytest.importorskip("pyhf")
    bkg = read_json(FOLDER / "BkgOnly.json")
    signal = json.loads(Path(patch).read_text())["patch"]  # the pyhf Patch's jsonpatch
    model = pyhf.Workspace(bkg).model(patches=[signal])
    channels, samples = model.config.channels, model.config.samples
    bins = model.config.channel_nbins

    table = run_cli(server.url, "yields", BKG, "-p", patch, "--format", "table")
    for fit in ("prefit", "postfit"):
        for channel in channels:
            assert f"{fit} yields, channel {channel}:" in table
    assert table.count("\ndata ") == 2 * len(channels)
    assert table.count("\ntotal ") == 2 * len(channels) and "±" in table

    out = tmp_path / "yields.csv"
    assert (
        run_cli(
            server.url, "yields", BKG, "-p", patch, "--format", "csv", "--output-file", str(out)
        )
        == ""
    )
    rows = list(csv.DictReader(out.open(newline="")))
    per_fit = sum((len(samples) + 2) * bins[c] for c in channels)  # samples, total, data
    assert len(rows) == 2 * per_fit
    assert {r["channel"] for r in rows} == set(channels)
    assert {r["sample"] for r in rows} == {*samples, "total", "data"}
    data = {r["channel"]: float(r["yield"]) for r in rows if r["sample"] == "data"}
    observed = {o["name"]: o["data"][0] for o in bkg["observations"]}
    assert data == observed  # one bin per channel in this analysis

    result = run_json(server.url, "yields", BKG, "-p", patch)
    parsed = pgc.YieldsResult.from_json(result)
    assert parsed.to_json() == result
    for channel in channels:
        post = parsed.channel(channel)
        total = sum(s.channel_yield for s in post.samples.values())
        assert math.isclose(post.total.channel_yield, total, rel_tol=1e-9)


# ------------------------------------------------------------------------- goodness of fit


def test_fit_goodness_of_fit(server, names, patch):
    fit = run_json(server.url, "fit", BKG, "-p", patch, "--goodness-of-fit")
    gof = fit["goodness_of_fit"]
    assert set(gof) == {"p_value", "delta_twice_nll", "ndof"}
    assert 0.0 <= gof["p_value"] <= 1.0 and gof["delta_twice_nll"] >= -1e-9
    assert isinstance(gof["ndof"], int)
    plain = run_json(server.url, "fit", BKG, "-p", patch)
    assert "goodness_of_fit" not in plain
    batch = run_json(server.url, "fit", BKG, *patchset_args(names), "--goodness-of-fit")
    assert sorted(batch) == sorted(names)
    assert all(0.0 <= batch[n]["goodness_of_fit"]["p_value"] <= 1.0 for n in names)
