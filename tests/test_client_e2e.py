"""The client against a real ``pyhf-gpu-server`` on loopback, compared with pyhf's own CLI.

One server (CPU, a token, a temporary data directory) serves the whole module. Each test runs
``pyhf-gpu-client`` (in-process with click's CliRunner, or the installed console script) and,
where pyhf has the same command, ``pyhf`` itself on the same input: same keys, same format
(``indent=4, sort_keys=True``), numbers within 1e-4.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from client_support import assert_close, assert_pyhf_format
from service_support import running_server
from workspaces import WORKSPACES_DIR, read_json, workspace_file

import pyhf_gpu_client as pgc
from pyhf_gpu_client import cli

pyhf = pytest.importorskip("pyhf")
from pyhf.cli import cli as pyhf_cli  # noqa: E402
from pyhf_global import pyhf_upper_limit  # noqa: E402

SHARED = WORKSPACES_DIR / "atlas-susy-2018-31-sbottom-B"
SHARED_BKG = str(workspace_file(SHARED, "BkgOnly.json"))
SHARED_PATCHSET = str(workspace_file(SHARED, "patchset.json"))
TOKEN = "e2e-token"
TOL = 1e-4
CLIENT_EXE = Path(sys.executable).with_name("pyhf-gpu-client")


def two_bin_workspace() -> dict[str, Any]:
    """pyhf's docs example 2-bin_1-channel.json, plus a normsys and a second measurement."""
    return {
        "channels": [
            {
                "name": "singlechannel",
                "samples": [
                    {
                        "name": "signal",
                        "data": [12.0, 11.0],
                        "modifiers": [{"name": "mu", "type": "normfactor", "data": None}],
                    },
                    {
                        "name": "background",
                        "data": [50.0, 52.0],
                        "modifiers": [
                            {"name": "uncorr_bkguncrt", "type": "shapesys", "data": [3.0, 7.0]},
                            {
                                "name": "bkg_norm",
                                "type": "normsys",
                                "data": {"hi": 1.05, "lo": 0.93},
                            },
                        ],
                    },
                ],
            }
        ],
        "observations": [{"name": "singlechannel", "data": [51.0, 48.0]}],
        "measurements": [
            {"name": "Measurement", "config": {"poi": "mu", "parameters": []}},
            {
                "name": "tight",
                "config": {"poi": "mu", "parameters": [{"name": "mu", "bounds": [[0.0, 4.0]]}]},
            },
        ],
        "version": "1.0.0",
    }


SIGNAL_PATCH = [{"op": "replace", "path": "/channels/0/samples/0/data", "value": [6.0, 9.0]}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    env = {"PYHF_GPU_API_TOKEN": TOKEN}
    with running_server(tmp_path_factory.mktemp("server"), env=env) as process:
        yield process.url


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("inputs")
    (d / "ws.json").write_text(json.dumps(two_bin_workspace()))
    (d / "patch.json").write_text(json.dumps(SIGNAL_PATCH))
    bad = two_bin_workspace()
    bad["channels"][0]["samples"][0]["modifiers"][0]["type"] = "notamodifier"
    (d / "bad.json").write_text(json.dumps(bad))
    (d / "broken.json").write_text('{"channels": [')
    (d / "broken.json.gz").write_bytes(gzip.compress(b'{"patches": ['))
    return d


def client_cli(server: str, *args: str, input: str | None = None, token: str = TOKEN):
    """Run our CLI in-process with the server and token from the environment."""
    env = {"PYHF_GPU_SERVER": server, "PYHF_GPU_API_TOKEN": token}
    return CliRunner().invoke(cli.main, list(args), input=input, env=env)


def pyhf_cli_run(*args: str) -> str:
    res = CliRunner().invoke(pyhf_cli, list(args))
    assert res.exit_code == 0, res.output
    return res.stdout


# ------------------------------------------------------------------------------ cls / fit


@pytest.mark.parametrize(
    "options",
    [
        [],
        ["--test-poi", "0.5", "--test-stat", "q"],
        ["--measurement", "tight", "--test-poi", "2.0"],
        ["-p", "{patch}", "--backend", "numpy", "--optimizer", "scipy"],
    ],
    ids=["default", "q-0.5", "measurement", "patch"],
)
def test_cls_matches_pyhf(server, files, options):
    options = [o.format(patch=files / "patch.json") for o in options]
    theirs = json.loads(pyhf_cli_run("cls", str(files / "ws.json"), *options))
    res = client_cli(server, "cls", str(files / "ws.json"), *options)
    assert res.exit_code == 0, res.output
    ours = assert_pyhf_format(res.stdout)
    assert sorted(ours) == ["CLs_exp", "CLs_obs"]
    assert_close(ours, theirs)


@pytest.mark.parametrize("value", [True, False])
def test_fit_matches_pyhf(server, files, value):
    flag = ["--value"] if value else []
    theirs = json.loads(pyhf_cli_run("fit", str(files / "ws.json"), *flag))
    res = client_cli(server, "fit", str(files / "ws.json"), *flag)
    assert res.exit_code == 0, res.output
    ours = assert_pyhf_format(res.stdout)
    assert_close(ours, theirs)
    assert ("twice_nll" in ours) == value


def test_fit_uncertainties_and_output_file(server, files, tmp_path):
    out = tmp_path / "fit.json"
    res = client_cli(
        server,
        "fit",
        str(files / "ws.json"),
        "--value",
        "--uncertainties",
        "--output-file",
        str(out),
    )
    assert res.exit_code == 0 and res.stdout == ""
    fit = json.loads(out.read_text())
    assert set(fit) == {"mle_parameters", "twice_nll", "uncertainties", "corr_mat"}
    assert set(fit["uncertainties"]) == set(fit["mle_parameters"])
    n = sum(len(v) for v in fit["mle_parameters"].values())
    assert len(fit["corr_mat"]) == n


def test_stdin_through_the_console_script(server, files):
    """`cat ws.json | pyhf-gpu-client cls` (no argument) and `... cls -`, as a subprocess."""
    env = {**os.environ, "PYHF_GPU_SERVER": server, "PYHF_GPU_API_TOKEN": TOKEN}
    text = (files / "ws.json").read_text()
    theirs = json.loads(pyhf_cli_run("cls", str(files / "ws.json")))
    for args in ([], ["-"]):
        proc = subprocess.run(
            [str(CLIENT_EXE), "cls", *args],
            input=text,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr
        assert_close(assert_pyhf_format(proc.stdout), theirs)


def test_scan_of_test_poi(server, files):
    spec = two_bin_workspace()
    ws = pyhf.Workspace(spec)
    model = ws.model(
        modifier_settings={"normsys": {"interpcode": "code4"}, "histosys": {"interpcode": "code4p"}}
    )
    data = ws.data(model)
    for option in (["--test-poi", "0.5:1.5:3"], ["--test-poi", "0.5,1.0", "--test-poi", "1.5"]):
        res = client_cli(server, "cls", str(files / "ws.json"), *option)
        assert res.exit_code == 0, res.output
        scan = assert_pyhf_format(res.stdout)
        assert [entry["test_poi"] for entry in scan] == [0.5, 1.0, 1.5]
        for entry in scan:
            obs, exp = pyhf.infer.hypotest(entry["test_poi"], data, model, return_expected_set=True)
            assert_close(
                {"CLs_obs": entry["CLs_obs"], "CLs_exp": entry["CLs_exp"]},
                {"CLs_obs": float(obs), "CLs_exp": [float(e) for e in exp]},
            )


# ----------------------------------------------------------------------- beyond pyhf


def test_toybased_with_ntoys_and_seed(server, tmp_path):
    # only Poisson-constrained (shapesys) nuisances: the engine's toys are checked elsewhere
    spec = two_bin_workspace()
    del spec["channels"][0]["samples"][1]["modifiers"][1]  # the normsys
    path = tmp_path / "poisson.json"
    path.write_text(json.dumps(spec))
    args = ["cls", str(path), "--calctype", "toybased", "--ntoys", "300"]
    first = client_cli(server, *args, "--seed", "7")
    assert first.exit_code == 0, first.output
    toys = assert_pyhf_format(first.stdout)
    assert sorted(toys) == ["CLs_exp", "CLs_obs"] and len(toys["CLs_exp"]) == 5
    assert 0.0 <= toys["CLs_obs"] <= 1.0
    again = client_cli(server, *args, "--seed", "7")
    assert again.stdout == first.stdout  # seeded toys are reproducible
    asymptotic = json.loads(client_cli(server, "cls", str(path)).stdout)
    assert abs(toys["CLs_obs"] - asymptotic["CLs_obs"]) < 0.1


@pytest.mark.skipif(not SHARED.exists(), reason="shared workspaces not present")
def test_whole_shared_patchset_in_one_command(server):
    reference = read_json(SHARED / "reference.json")["reference"]["results"]
    patchset = read_json(SHARED / "patchset.json")
    names = [p["metadata"]["name"] for p in patchset["patches"]]
    res = client_cli(server, "cls", SHARED_BKG, "--patchset", SHARED_PATCHSET)
    assert res.exit_code == 0, res.output
    results = assert_pyhf_format(res.stdout)
    assert sorted(results) == sorted(names) and len(results) == 24
    for ref in reference:
        assert_close(results[ref["patch"]], {"CLs_obs": ref["CLs_obs"], "CLs_exp": ref["CLs_exp"]})
    # the 270 kB background was uploaded once, content-addressed
    with pgc.Client(server, token=TOKEN) as client:
        bkg = read_json(SHARED / "BkgOnly.json")
        assert client.has_workspace(pgc.digest(bkg))


@pytest.mark.skipif(not SHARED.exists(), reason="shared workspaces not present")
def test_patchset_fit_and_upper_limit_with_names(server):
    reference = read_json(SHARED / "reference.json")["reference"]["results"]
    chosen = [ref["patch"] for ref in reference[:2]]
    name_args = [arg for name in chosen for arg in ("--patch-name", name)]
    res = client_cli(
        server, "fit", SHARED_BKG, "--value", "--patchset", SHARED_PATCHSET, *name_args
    )
    assert res.exit_code == 0, res.output
    fits = assert_pyhf_format(res.stdout)
    assert sorted(fits) == sorted(chosen)
    for ref in reference[:2]:
        fit = fits[ref["patch"]]
        assert set(fit) == {"mle_parameters", "twice_nll"}
        assert math.isclose(fit["twice_nll"], ref["twice_nll_at_bestfit"], abs_tol=1e-3)
        assert math.isclose(fit["mle_parameters"]["mu_SIG"][0], ref["bestfit_poi"], abs_tol=1e-3)
    res = client_cli(
        server,
        "upper-limit",
        SHARED_BKG,
        "--patchset",
        SHARED_PATCHSET,
        "--patch-name",
        reference[-1]["patch"],  # the strongest signal: a limit a little above mu = 1
        "--scan",
        "0:5:11",  # the automatic scan is tested on the small model
    )
    assert res.exit_code == 0, res.output
    limits = assert_pyhf_format(res.stdout)
    assert list(limits) == [reference[-1]["patch"]]
    limit = limits[reference[-1]["patch"]]
    assert set(limit) == {"upper_limit_obs", "upper_limit_exp", "level"}
    assert limit["upper_limit_obs"] > 1.0  # CLs(mu = 1) = 0.375 > 0.05: mu = 1 is allowed


def test_upper_limit_close_to_pyhf(server, files):
    res = client_cli(server, "upper-limit", str(files / "ws.json"))
    assert res.exit_code == 0, res.output
    ours = assert_pyhf_format(res.stdout)
    assert set(ours) == {"upper_limit_obs", "upper_limit_exp", "level"}
    assert ours["level"] == 0.05 and len(ours["upper_limit_exp"]) == 5
    ws = pyhf.Workspace(two_bin_workspace())
    model = ws.model(
        modifier_settings={"normsys": {"interpcode": "code4"}, "histosys": {"interpcode": "code4p"}}
    )
    obs, exp = pyhf_upper_limit(ws.data(model), model)
    # the server may find the crossing by a different scan/root finder: compare at 1%
    assert math.isclose(ours["upper_limit_obs"], float(obs), rel_tol=1e-2)
    for a, b in zip(ours["upper_limit_exp"], exp, strict=True):
        assert math.isclose(a, float(b), rel_tol=1e-2)
    res = client_cli(
        server, "upper-limit", str(files / "ws.json"), "--level", "0.1", "--scan", "0:5:21"
    )
    assert res.exit_code == 0, res.output
    loose = json.loads(res.stdout)
    assert loose["level"] == 0.1 and loose["upper_limit_obs"] < ours["upper_limit_obs"]


def test_significance(server, tmp_path):
    # an excess over the background, so that the fit is not at the mu = 0 boundary
    spec = two_bin_workspace()
    spec["observations"][0]["data"] = [66.0, 64.0]
    path = tmp_path / "excess.json"
    path.write_text(json.dumps(spec))
    res = client_cli(server, "significance", str(path))
    assert res.exit_code == 0, res.output
    ours = assert_pyhf_format(res.stdout)
    assert {"p0_obs", "p0_exp", "z_obs", "z_exp"} <= set(ours) and "meta" not in ours
    parsed = pgc.SignificanceResult.from_json(ours)
    ws = pyhf.Workspace(spec)
    model = ws.model()
    p0, p0_exp = pyhf.infer.hypotest(
        0.0, ws.data(model), model, test_stat="q0", return_expected_set=True
    )
    assert math.isclose(parsed.p0_obs, float(p0), abs_tol=TOL)
    assert math.isclose(parsed.p0_exp, float(p0_exp[2]), abs_tol=TOL)
    assert math.isclose(parsed.z_obs, statistics.NormalDist().inv_cdf(1 - float(p0)), abs_tol=1e-3)


def test_jobs_submit_status_wait_list_cancel(server, files):
    res = client_cli(server, "jobs", "submit", "cls", str(files / "ws.json"), "--test-poi", "0:2:5")
    assert res.exit_code == 0, res.output
    job_id = res.stdout.strip()
    res = client_cli(server, "jobs", "wait", job_id)
    assert res.exit_code == 0, res.output
    scan = assert_pyhf_format(res.stdout)
    assert [e["test_poi"] for e in scan] == [0.0, 0.5, 1.0, 1.5, 2.0]
    assert res.stderr.splitlines()[-1].startswith(f"job {job_id}: succeeded")
    res = client_cli(server, "jobs", "status", job_id)
    status = assert_pyhf_format(res.stdout)
    assert status["status"] == "succeeded" and status["id"] == job_id
    res = client_cli(server, "jobs", "list")
    assert job_id in [j["id"] for j in json.loads(res.stdout)]
    res = client_cli(server, "jobs", "submit", "fit", str(files / "ws.json"), "--value", "--wait")
    assert res.exit_code == 0, res.output
    assert set(json.loads(res.stdout)) == {"mle_parameters", "twice_nll"}
    res = client_cli(server, "jobs", "status", "0" * 32)
    assert res.exit_code == 1 and "404" in res.output
    # cancelling a finished job: the server's answer (a 409 or the final state) is reported
    res = client_cli(server, "jobs", "cancel", job_id)
    assert res.exit_code in (0, 1) and "Traceback" not in res.output


def test_health_info_and_auth(server, files):
    res = client_cli(server, "health")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["server"] == server
    res = client_cli(server, "info")
    assert res.exit_code == 0, res.output
    assert isinstance(json.loads(res.stdout), dict)
    res = client_cli(server, "cls", str(files / "ws.json"), token="wrong")
    assert res.exit_code == 1 and "401" in res.output and "Traceback" not in res.output


def test_bad_workspace_is_a_clear_error(server, files):
    res = client_cli(server, "cls", str(files / "bad.json"))
    assert res.exit_code == 1
    assert res.output.startswith("Error: the server answered 422")
    assert "Traceback" not in res.output
    res = client_cli(server, "cls", str(files / "broken.json"))
    assert res.exit_code == 1 and "not valid JSON" in res.output
    for broken in ("broken.json", "broken.json.gz"):  # sent as read; the server's 400 explained
        res = client_cli(server, "cls", str(files / "ws.json"), "--patchset", str(files / broken))
        assert res.exit_code == 1 and "Traceback" not in res.output
        assert f"patchset {files / broken} is not valid JSON" in res.output
    res = client_cli(server, "cls", str(files / "ws.json"), "--measurement", "nope")
    assert res.exit_code == 1 and "nope" in res.output


def test_python_api_sync_and_async(server, files):
    spec = two_bin_workspace()
    with pgc.Client(server, token=TOKEN) as client:
        one = client.cls(spec, test_poi=1.0)
        fit = client.fit(files / "ws.json")
        scan = client.cls(spec, test_poi=[0.5, 1.0])
    assert isinstance(one, pgc.CLsResult) and one.meta["device"] == "cpu"
    assert isinstance(fit, pgc.FitResult) and fit.uncertainties is not None
    assert math.isclose(scan[1].cls_obs, one.cls_obs, abs_tol=1e-9)

    async def several():
        async with pgc.AsyncClient(server, token=TOKEN) as client:
            return await asyncio.gather(*(client.cls(spec, test_poi=x) for x in (0.5, 1.0)))

    results = asyncio.run(several())
    # server-sent events of a job end with "done" carrying the final state
    with pgc.Client(server, token=TOKEN) as client:
        job = client.submit("cls", spec, test_poi=[0.5, 1.0])
        events = list(client.events(job))
    assert events[-1]["event"] == "done" and events[-1]["data"]["status"] == "succeeded"
    assert math.isclose(results[1].cls_obs, one.cls_obs, abs_tol=1e-9)
    with pgc.Client(server, token=TOKEN) as client, pytest.raises(pgc.BadRequestError) as info:
        client.cls(spec, test_stat="q0")
    assert info.value.status == 422


PUBLISHED = SHARED / "patchset.hepdata.json.gz"
NO_SIGNAL = "sbottom_1500_1495_60"  # this published point's patch only removes a channel


@pytest.mark.skipif(not PUBLISHED.exists(), reason="shared workspaces not present")
def test_published_patchset_reports_untestable_points_and_strict_fails(server):
    reference = read_json(SHARED / "reference.hepdata.json")["results"]
    chosen = [*reference, NO_SIGNAL]
    args = [
        "cls",
        SHARED_BKG,
        "--patchset",
        str(PUBLISHED),  # gzip-compressed, as HEPData ships it
        *[arg for name in chosen for arg in ("--patch-name", name)],
    ]
    res = client_cli(server, *args)
    assert res.exit_code == 0, res.output
    results = assert_pyhf_format(res.stdout)
    assert sorted(results) == sorted(reference)  # the untestable point is not in the JSON...
    for name, ref in reference.items():
        assert_close(results[name], {"CLs_obs": ref["CLs_obs"], "CLs_exp": ref["CLs_exp"]})
    assert NO_SIGNAL in res.stderr and "422" in res.stderr  # ...but reported on stderr
    strict = client_cli(server, *args, "--strict")
    assert strict.exit_code == 1
    assert strict.stdout == res.stdout
    assert "1 of 2 patches were not tested" in strict.stderr
