"""The client's plots against a real ``pyhf-gpu-server`` on loopback: ``pyhf-gpu-client plot``
(one synchronous request answering the image), ``--plot FILE`` on an operation (a job, then
its plot) and ``Client.plot`` / ``plot_kinds`` / ``render``.

One CPU server serves the module; the model is the small published workspace (``SMALL``,
ATLAS-SUSY-2018-31 region B) with one signal point as a patch, or four points of its patchset
(two signal shapes by two scales, so the exclusion plane has an area). The images are checked
by their signatures and sizes only (the client has no matplotlib); what they show is checked
in the server's plot tests.
"""

from __future__ import annotations

import json
import struct

import pytest
from click.testing import CliRunner
from client_support import run_cli
from service_support import SMALL, WORKSPACES
from workspaces import read_json, workspace_file

import pyhf_gpu_client as pgc
from pyhf_gpu_client import cli

FOLDER = WORKSPACES / SMALL
BKG = str(workspace_file(FOLDER, "BkgOnly.json"))
PATCHSET = str(workspace_file(FOLDER, "patchset.json"))
NAMES = ["sig_s0_x0p3", "sig_s0_x1", "sig_s1_x0p3", "sig_s1_x1"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

pytestmark = pytest.mark.skipif(not FOLDER.exists(), reason="shared workspaces not present")


@pytest.fixture(scope="module")
def patch(tmp_path_factory) -> str:
    """The signal point ``sig_s1_x1`` as a pyhf Patch file (``-p``)."""
    patchset = read_json(FOLDER / "patchset.json")
    (chosen,) = (p for p in patchset["patches"] if p["metadata"]["name"] == "sig_s1_x1")
    path = tmp_path_factory.mktemp("inputs") / "signal.json"
    path.write_text(json.dumps(chosen))
    return str(path)


def png_size(data: bytes) -> tuple[int, int]:
    """Width and height of a PNG from its IHDR chunk (the first, right after the signature)."""
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def names_args() -> list[str]:
    return ["--patchset", PATCHSET, *[a for n in NAMES for a in ("--patch-name", n)]]


def test_plot_brazil_png(server, patch, tmp_path):
    out = tmp_path / "brazil.png"
    printed = run_cli(
        server.url,
        "plot",
        "brazil",
        BKG,
        "-p",
        patch,
        "--test-poi",
        "0:2:5",
        "--dpi",
        "50",
        "--option",
        "figsize=6,4",
        "--label",
        "ATLAS Internal",
        "-o",
        str(out),
    )
    assert printed == ""
    assert png_size(out.read_bytes()) == (300, 200)  # figsize x dpi
    # without --test-poi: the upper limit's scan, drawn as SVG
    limit = tmp_path / "limit.svg"
    run_cli(server.url, "plot", "brazil", BKG, "-p", patch, "-o", str(limit))
    assert "<svg" in limit.read_text()


def test_cls_patchset_with_plot_prints_cls_and_writes_the_exclusion(server, tmp_path):
    out = tmp_path / "exclusion.svg"
    res = CliRunner().invoke(
        cli.main,
        ["cls", BKG, *names_args(), "--plot", str(out)],
        env={"PYHF_GPU_SERVER": server.url},
    )
    assert res.exit_code == 0, res.output
    printed = json.loads(res.stdout)
    assert sorted(printed) == sorted(NAMES)
    for entry in printed.values():
        assert set(entry) == {"CLs_obs", "CLs_exp"} and len(entry["CLs_exp"]) == 5
    assert "submitted job" in res.stderr  # the CLs ran once, as a job
    svg = out.read_text()
    assert "<svg" in svg and svg.rstrip().endswith("</svg>")


def test_ranking_with_plot(server, patch, tmp_path):
    out = tmp_path / "ranking.png"
    printed = json.loads(
        run_cli(server.url, "ranking", BKG, "-p", patch, "--top", "5", "--plot", str(out))
    )
    assert len(printed["labels"]) == 5 and printed["poi"]["name"] == "mu_SIG"
    width, height = png_size(out.read_bytes())
    assert width > 100 and height > 100


def test_python_client_plot_of_a_job(server, patch):
    with pgc.Client(server.url) as client:
        job = client.submit("cls", BKG, patchset=PATCHSET, patch_names=NAMES)
        client.wait(job, timeout=120)
        assert client.plot_kinds(job) == ["exclusion"]
        svg = client.plot(job, "exclusion", "svg", label="ATLAS Internal")
        assert svg.lstrip().startswith(b"<?xml") and b"<svg" in svg
        with pytest.raises(pgc.BadRequestError) as info:
            client.plot(job, "pulls")
        assert info.value.status == 422 and "exclusion" in info.value.message
        png = client.render("fit", BKG, "pulls", plot_options={"dpi": 40}, patches=[patch])
        assert png[:8] == PNG_SIGNATURE
