"""Plots served by a real server: ``GET /jobs/{id}/plots/{kind}.{svg,png}`` of real jobs on the
shared workspaces (every kind), the ``plot`` of a synchronous request (envelope field or query),
the errors (unknown kind or format 404, a kind that does not fit 422 naming those that do, an
unfinished job 409, bad options 422), the exclusion contour against a linear interpolation of
log CLs along the renderer's triangulation, and 20 plots drawn at once equal to one at a time."""

from __future__ import annotations

import contextlib
import copy
import io
import math
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonpatch
import numpy as np
import pytest
from matplotlib.contour import ContourSet
from matplotlib.image import imread
from matplotlib.path import Path as MplPath
from service_support import WORKSPACES, wait_for_job
from workspaces import read_json

from pyhf_gpu_server import plots
from pyhf_gpu_server.plots.limits import _triangulation

pytestmark = pytest.mark.timeout(300)

SMALL = WORKSPACES / "atlas-susy-2018-31-sbottom-B"  # 60 parameters: quick fits
PLANE = WORKSPACES / "atlas-susy-2018-31-sbottom-A"  # a mass plane the CLs = 0.05 line crosses
SIGNAL = "sig_s1_x1"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def read(path) -> dict[str, Any]:
    return read_json(path)  # BkgOnly.json names BkgOnly.json.gz where only that is on disk


def plane_patchset() -> dict[str, Any]:
    """20 published signal points at m(χ̃⁰₁) = 60 GeV: m(b̃₁) 1200..1500 x m(χ̃⁰₂) 250..1050."""
    published = read(PLANE / "patchset.hepdata.json.gz")
    published["patches"] = [
        p
        for p in published["patches"]
        if p["metadata"]["values"][2] == 60
        and p["metadata"]["values"][0] in (1200, 1300, 1400, 1500)
        and p["metadata"]["values"][1] in (250, 450, 650, 850, 1050)
    ]
    assert len(published["patches"]) == 20
    return published


def signal_patch() -> list[dict[str, Any]]:
    """The JSON-patch operations of the small analysis' signal point ``SIGNAL``."""
    patchset = read(SMALL / "patchset.json")
    return next(p["patch"] for p in patchset["patches"] if p["metadata"]["name"] == SIGNAL)


#: job name -> (operation, options, kinds that fit, texts the SVG of each kind must draw)
JOBS: dict[str, tuple[str, dict[str, Any], dict[str, list[str]]]] = {
    "cls-list": (
        "cls",
        {"test_poi": [0.25 * i for i in range(1, 17)], "named": True},
        {"brazil": ["mu_SIG", "CL$_s$", "Observed CL$_s$", "Expected ±2σ"], "exclusion": []},
    ),
    "upper-limit": (
        "upper-limit",
        {"scan": [0.5 * i for i in range(1, 21)]},
        {"brazil": ["95% CL upper limit on mu_SIG", "Observed:"]},
    ),
    "fit": (
        "fit",
        {},
        {
            "pulls": [r"$(\hat{\theta} - \theta_0)\,/\,\Delta\theta$", "lumi", "ttbar_Gen"],
            "correlation": ["correlation", "mu_SIG"],
        },
    ),
    "ranking": (
        "ranking",
        {"top": 8, "named": True},
        {"ranking": ["Δmu_SIG", r"$(\hat{\theta} - \theta_0)\,/\,\Delta\theta$", "Pull"]},
    ),
    "scan": (
        "scan",
        {"x": {"range": [0.0, 4.0], "steps": 9}},
        {"scan": ["mu_SIG", r"$-2\,\Delta\ln L$", "1σ"]},
    ),
    "scan-2d": (
        "scan",
        {
            "x": {"range": [0.0, 4.0], "steps": 5},
            "y": {"parameter": "mu_ttbar", "range": [0.6, 1.4], "steps": 5},
        },
        {"scan": ["mu_SIG", "mu_ttbar", "68% CL"]},
    ),
    "yields": (
        "yields",
        {"named": True},
        {"yields": ["Events", "Data / Model", "SR_cuts", "CRtt_cuts", "Post-fit"]},
    ),
    "exclusion": ("cls", {}, {"exclusion": ["m_sbottom", "m_neutralino2", "Observed CL$_s$"]}),
    "significance": ("significance", {}, {}),
}


@pytest.fixture(scope="module")
def jobs(client: httpx.Client) -> dict[str, dict[str, Any]]:
    """The finished views of :data:`JOBS`, submitted together."""
    small = client.post("/workspaces", json=read(SMALL / "BkgOnly.json")).json()["workspace_id"]
    plane = client.post("/workspaces", json=read(PLANE / "BkgOnly.json")).json()["workspace_id"]
    small_patchset = read(SMALL / "patchset.json")
    submitted = {}
    for name, (operation, options, _) in JOBS.items():
        body: dict[str, Any] = {"operation": operation, **options}
        if name == "exclusion":
            body.update(workspace_id=plane, patchset=plane_patchset())
        elif body.pop("named", False):  # a patchset of one patch: plots of that patch
            body.update(workspace_id=small, patchset=small_patchset, patch_names=[SIGNAL])
        else:
            body.update(workspace_id=small, patches=[signal_patch()])
        response = client.post("/jobs", json=body)
        assert response.status_code == 202, response.text
        submitted[name] = response.json()["id"]
    views = {name: wait_for_job(client, job_id, 240) for name, job_id in submitted.items()}
    for name, view in views.items():
        assert view["status"] == "succeeded", (name, view["error"])
    return views


def svg_texts(svg: bytes) -> tuple[ET.Element, str]:
    """The parsed SVG and its texts (matplotlib writes each text as a comment)."""
    parser = ET.XMLParser(target=ET.TreeBuilder(insert_comments=True))
    root = ET.fromstring(svg, parser=parser)
    return root, "\n".join(e.text or "" for e in root.iter() if e.tag is ET.Comment)


def decode_png(png: bytes) -> np.ndarray:
    assert png.startswith(PNG_SIGNATURE)
    return imread(io.BytesIO(png), format="png")


def svg_inches(root: ET.Element) -> tuple[float, float]:
    """(width, height) of an SVG written by matplotlib (in pt) in inches."""
    return tuple(float(root.get(k).removesuffix("pt")) / 72 for k in ("width", "height"))


# ------------------------------------------------------------------------------- the kinds
@pytest.mark.parametrize(
    ("name", "kind"), [(name, kind) for name, (_, _, kinds) in JOBS.items() for kind in kinds]
)
def test_every_kind_of_a_real_job_as_svg_and_png(client, jobs, name, kind) -> None:
    job_id = jobs[name]["id"]
    svg = client.get(f"/jobs/{job_id}/plots/{kind}.svg")
    assert svg.status_code == 200, svg.text
    assert svg.headers["content-type"] == "image/svg+xml"
    assert svg.headers["x-content-type-options"] == "nosniff"  # no script in an SVG opened
    assert "default-src 'none'" in svg.headers["content-security-policy"]  # as a document
    root, texts = svg_texts(svg.content)
    for text in JOBS[name][2][kind]:
        assert text in texts, f"{text!r} not drawn in the {kind} plot of {name}"

    dpi = 40
    png = client.get(f"/jobs/{job_id}/plots/{kind}.png", params={"dpi": dpi})
    assert png.status_code == 200, png.text
    assert png.headers["content-type"] == "image/png"
    image = decode_png(png.content)
    width, height = svg_inches(root)
    assert abs(image.shape[1] - width * dpi) <= 1 and abs(image.shape[0] - height * dpi) <= 1
    pixels = image[..., :3].reshape(-1, 3)
    assert len(np.unique((pixels * 255).astype(np.uint8), axis=0)) > 20, "a blank image"


def test_each_job_lists_the_kinds_that_fit(client, jobs) -> None:
    for name, view in jobs.items():
        listing = client.get(f"/jobs/{view['id']}/plots").json()
        assert [p["kind"] for p in listing["plots"]] == list(JOBS[name][2]), name
        assert listing["status"] == "succeeded"
        for plot in listing["plots"]:
            assert plot["png"] == f"/jobs/{view['id']}/plots/{plot['kind']}.png"


def test_options_reach_the_renderer(client, jobs) -> None:
    fit = jobs["fit"]["id"]
    png = client.get(f"/jobs/{fit}/plots/pulls.png", params={"dpi": 50, "figsize": "6,4"})
    assert decode_png(png.content).shape[:2] == (200, 300)
    svg = client.get(
        f"/jobs/{fit}/plots/pulls.svg",
        params={"top": 5, "label": "ATLAS Internal", "rlabel": "13 TeV", "title": "Pulls"},
    )
    _, texts = svg_texts(svg.content)
    assert "5 of " in texts and "ATLAS" in texts and "13 TeV" in texts and "Pulls" in texts
    svg = client.get(f"/jobs/{fit}/plots/correlation.svg", params={"threshold": 0.3})
    assert "parameters with max |ρ| ≥ 0.3" in svg_texts(svg.content)[1]
    yields = jobs["yields"]["id"]
    svg = client.get(f"/jobs/{yields}/plots/yields.svg?channels=SR_cuts&stage=prefit")
    _, texts = svg_texts(svg.content)
    assert "SR_cuts" in texts and "CRtt_cuts" not in texts and "Pre-fit" in texts
    exclusion = jobs["exclusion"]["id"]
    svg = client.get(f"/jobs/{exclusion}/plots/exclusion.svg?level=0.1&labels=mb,mn2")
    _, texts = svg_texts(svg.content)
    assert "CL$_s$ = 0.1" in texts and "mn2" in texts


def test_labels_go_above_the_main_axes(jobs) -> None:
    """``label`` and ``rlabel`` sit above the frame: on a yields grid over the top row's main
    panels (not a ratio panel), beside a colorbar over the plot, above a twin's top axis."""
    labels = {"label": "ATLAS Internal", "rlabel": "13 TeV, 139 fb⁻¹"}
    result = jobs["yields"]["result"][SIGNAL]

    def titled(fig) -> dict:
        return {
            (ax.get_title(loc="left"), ax.get_title(loc="right")): ax.get_ylabel()
            for ax in fig.axes
            if ax.get_title(loc="left") or ax.get_title(loc="right")
        }

    grid = plots.figure("yields", result, columns=3, **labels)
    assert titled(grid) == {("ATLAS", ""): "Events", ("", "13 TeV, 139 fb⁻¹"): "Events"}
    # without columns, the one-bin channels are the bins of one panel, named by the channels
    fig = plots.figure("yields", result, **labels)
    assert titled(fig) == {("ATLAS", "13 TeV, 139 fb⁻¹"): "Events"}
    ratio = fig.axes[0]
    assert [t.get_text() for t in ratio.get_xticklabels()] == ["CRtt_cuts", "SR_cuts", "VRtt_cuts"]
    assert ratio.get_xlabel() == "channel" and ratio.get_ylabel() == "Data / Model"
    for name, kind in (("exclusion", "exclusion"), ("fit", "correlation"), ("ranking", "ranking")):
        result = jobs[name]["result"]
        options = {"patchset": plane_patchset()} if kind == "exclusion" else {}
        fig = plots.figure(kind, result.get(SIGNAL, result), **options, **labels)
        main = fig.axes[0]
        assert (main.get_title(loc="left"), main.get_title(loc="right")) == (
            "ATLAS",
            labels["rlabel"],
        ), kind


# ---------------------------------------------------------------------------------- errors
def test_plot_route_errors_name_what_fits(client, jobs) -> None:
    fit = jobs["fit"]["id"]
    unknown = client.get(f"/jobs/{fit}/plots/histogram.png")
    assert unknown.status_code == 404
    assert "brazil" in unknown.json()["detail"] and "yields" in unknown.json()["detail"]
    assert client.get(f"/jobs/{fit}/plots/pulls.pdf").status_code == 404
    assert client.get("/jobs/no-such-job/plots/pulls.png").status_code == 404
    wrong = client.get(f"/jobs/{fit}/plots/brazil.svg")
    assert wrong.status_code == 422
    assert "pulls, correlation" in wrong.json()["detail"]
    single = client.get(f"/jobs/{jobs['upper-limit']['id']}/plots/exclusion.png")
    assert single.status_code == 422 and "brazil" in single.json()["detail"]
    none = client.get(f"/jobs/{jobs['significance']['id']}/plots/brazil.png")
    assert none.status_code == 422 and "significance" in none.json()["detail"]
    for query, message in [
        ("top=many", "'top' must be an integer"),
        ("top=100000", "top must be at most 400, not 100000"),
        ("colour=red", "unknown plot option 'colour'"),
        ("threshold=0.3", "pulls plot: unknown option 'threshold'"),
        ("dpi=5000", "dpi must be within"),
        ("patch=sig_s0_x1", "not in the answer"),
    ]:
        route = "pulls" if "patch" not in query else "ranking"
        job = fit if route == "pulls" else jobs["ranking"]["id"]
        response = client.get(f"/jobs/{job}/plots/{route}.png?{query}")
        assert response.status_code == 422, (query, response.text)
        assert message in response.json()["detail"], (query, response.text)


def test_an_unfinished_job_answers_409(client) -> None:
    small = client.post("/workspaces", json=read(SMALL / "BkgOnly.json")).json()["workspace_id"]
    body = {  # thousands of toy fits: seconds of work at least
        "operation": "cls",
        "workspace_id": small,
        "patches": [signal_patch()],
        "test_poi": [0.5, 1.0, 2.0],
        "calctype": "toybased",
        "ntoys": 20000,
    }
    job_id = client.post("/jobs", json=body).json()["id"]
    try:
        response = client.get(f"/jobs/{job_id}/plots/brazil.png")
        assert response.status_code == 409, response.text
        assert "once it succeeded" in response.json()["detail"]
    finally:
        client.delete(f"/jobs/{job_id}")
    deadline = time.monotonic() + 60
    while client.get(f"/jobs/{job_id}").json()["status"] != "cancelled":
        assert time.monotonic() < deadline
        time.sleep(0.2)
    response = client.get(f"/jobs/{job_id}/plots/brazil.png")
    assert response.status_code == 409 and "no result" in response.json()["detail"]


# ----------------------------------------------------------------------- synchronous plots
def test_a_synchronous_request_answers_its_plot(client) -> None:
    workspace = jsonpatch.apply_patch(copy.deepcopy(read(SMALL / "BkgOnly.json")), signal_patch())
    query = "test_poi=0.5&test_poi=1&test_poi=2&test_poi=4&plot=brazil&plot_format=png"
    response = client.post(f"/cls?{query}&plot_dpi=40", json=workspace)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "image/png"
    height, width = decode_png(response.content).shape[:2]
    assert height == round(5.5 * 40) and width >= round(7.5 * 40)  # wider: a legend beside

    envelope = {
        "workspace": workspace,
        "plot": {"kind": "pulls", "format": "svg", "top": 12, "title": "sbottom B"},
    }
    response = client.post("/fit", json=envelope)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "image/svg+xml"
    _, texts = svg_texts(response.content)
    assert "sbottom B" in texts and r"\hat{\theta}" in texts and "12 of " in texts

    answer = client.post("/fit", json={"workspace": workspace})  # without a plot: JSON
    assert answer.headers["content-type"] == "application/json"

    for route, body, message in [
        ("/fit?plot=brazil", workspace, "pulls, correlation"),
        ("/cls?plot=brazil", workspace, "a list of test_poi"),
        ("/cls", {"workspace": workspace, "plot": "histogram"}, "unknown plot kind"),
        ("/cls?plot_format=png", workspace, "need 'plot'"),
        ("/significance?plot=brazil", workspace, "no plot kind fits a significance answer"),
        ("/fit?plot=pulls&plot_colour=red", workspace, "unknown plot option 'plot_colour'"),
    ]:
        response = client.post(route, json=body)
        assert response.status_code == 422, (route, response.text)
        assert message in str(response.json()["detail"]), (route, response.text)


# --------------------------------------------------------------------- exclusion contour
def test_exclusion_contour_interpolates_log_cls_along_the_triangulation(jobs) -> None:
    """The observed CLs = 0.05 line crosses each edge of the renderer's triangulation where a
    linear interpolation of log CLs between its two points reaches log 0.05."""
    result = jobs["exclusion"]["result"]
    patchset = plane_patchset()
    values = {p["metadata"]["name"]: p["metadata"]["values"][:2] for p in patchset["patches"]}
    fig = plots.figure("exclusion", result, patchset=patchset)
    (contour,) = [
        a
        for a in fig.axes[0].collections
        if isinstance(a, ContourSet) and a.get_gid() == "observed-contour"
    ]
    drawn = np.concatenate(
        [p.vertices[p.codes != MplPath.CLOSEPOLY] if p.codes is not None else p.vertices
         for p in contour.get_paths()]
    )  # fmt: skip
    names = [n for n in result if "error" not in result[n]]  # the renderer's order
    points = np.array([values[n] for n in names], float)
    log_cls = np.log10(np.clip([result[n]["CLs_obs"] for n in names], 1e-12, None))
    level = math.log10(0.05)
    tri = _triangulation(points[:, 0], points[:, 1])
    expected = []
    for i, j in tri.edges:
        a, b = log_cls[i] - level, log_cls[j] - level
        if a * b < 0:
            expected.append(points[i] + a / (a - b) * (points[j] - points[i]))
    expected = np.array(expected)
    assert len(expected) >= 4
    span = np.ptp(points, axis=0)

    def nearest(found: np.ndarray, among: np.ndarray) -> float:
        return float(np.min(np.max(np.abs(among - found) / span, axis=1)))

    assert max(nearest(v, expected) for v in drawn) < 1e-6  # every vertex is a crossing
    assert max(nearest(e, drawn) for e in expected) < 1e-6  # every crossing is drawn
    # e.g. along m(χ̃⁰₂) = 250 GeV between m(b̃₁) = 1200 and 1300 GeV
    low, high = (result[f"sbottom_{m}_250_60"]["CLs_obs"] for m in (1200, 1300))
    t = (level - math.log10(low)) / (math.log10(high) - math.log10(low))
    assert nearest(np.array([1200 + 100 * t, 250.0]), drawn) < 1e-6


# ------------------------------------------------------------------------ concurrency
@pytest.mark.slow
def test_twelve_plots_at_once_equal_one_at_a_time(client, jobs) -> None:
    routes = [
        f"/jobs/{jobs[name]['id']}/plots/{kind}.png?dpi=30"
        for name, (_, _, kinds) in JOBS.items()
        for kind in kinds
    ]
    routes = (routes * 3)[:12]
    alone = [client.get(route).content for route in routes]
    with ThreadPoolExecutor(12) as pool:
        together = list(pool.map(lambda route: client.get(route).content, routes))
    assert together == alone
    assert all(png.startswith(PNG_SIGNATURE) for png in together)


def test_renders_whose_clients_went_away_give_way(server, client, jobs) -> None:
    """Renders are drawn one at a time: abandoned ones (their clients gave up) are not drawn
    after them, so the next request waits for at most the one already drawing."""
    heavy = f"/jobs/{jobs['fit']['id']}/plots/correlation.png?top=200&threshold=0&annotate=true"
    light = f"/jobs/{jobs['fit']['id']}/plots/pulls.png?dpi=30"
    start = time.monotonic()
    assert client.get(heavy).status_code == 200
    one_heavy = time.monotonic() - start

    def abandon() -> None:
        with contextlib.suppress(httpx.TimeoutException):
            httpx.get(server.url + heavy, timeout=0.2)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda _: abandon(), range(4)))
    start = time.monotonic()
    assert client.get(light).status_code == 200
    waited = time.monotonic() - start
    assert waited < 2 * one_heavy + 2.0, (waited, one_heavy)  # not 4 heavy renders behind it


# ------------------------------------------------------------------- exclusion: one slice
def test_exclusion_names_its_slice_and_takes_the_slice_option(client, jobs) -> None:
    """A three-mass patchset's plane is one slice of the third mass, named on the plot, the
    masses in GeV; ``?slice=`` picks it; a slice without tested points is a 422 naming
    those there are (the renderer's own tests: tests/test_plots.py)."""
    view = jobs["exclusion"]
    route = f"/jobs/{view['id']}/plots/exclusion"
    _, texts = svg_texts(client.get(route + ".svg").content)
    assert "m_neutralino1 = 60 GeV (20 of 20 points)" in texts
    assert "m_sbottom [GeV]" in texts and "m_neutralino2 [GeV]" in texts
    listed = client.get(f"/jobs/{view['id']}/plots").json()["plots"]
    assert {"axes", "slice"} <= set(next(p for p in listed if p["kind"] == "exclusion")["options"])
    assert client.get(route + ".png?slice=60&axes=0,1&dpi=30").status_code == 200
    for query, message in [
        (
            "slice=100",
            "no tested point at m_neutralino1 = 100 GeV; the slices (points): "
            "m_neutralino1 = 60 GeV (20)",
        ),
        ("slice=sixty", "plot option 'slice' must be numbers"),
        ("axes=0,0", "axes must be one or two different indices"),
        ("axes=0,2&slice=250,60", "1 number(s), not 2"),
    ]:
        response = client.get(f"{route}.png?{query}")
        assert response.status_code == 422, (query, response.text)
        assert message in response.json()["detail"], (query, response.text)
