"""The plot kinds of ``pyhf_gpu_server.plots``, drawn from real results of the shared ATLAS
workspaces (fits, CLs scans, a patchset of published signal points, computed in-process) and
from small hand-made JSON for the kinds whose operations are still being built (ranking,
yields, scan): valid SVG and PNG with the expected text, sizes and content, contours where
there should be, thread safety without global state, and errors naming the kind and field."""

from __future__ import annotations

import contextlib
import copy
import io
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import matplotlib
import numpy as np
import pytest
import torch
from conftest import WORKSPACES_DIR, load_json, load_patchset
from matplotlib import _pylab_helpers
from matplotlib.contour import ContourSet
from matplotlib.image import imread

from pyhf_gpu_server import inference, plots
from pyhf_gpu_server.engine import HistFactoryModel
from pyhf_gpu_server.service import plotting
from pyhf_gpu_server.service.errors import ServiceError
from pyhf_gpu_server.service.operations.cls import cls_answers
from pyhf_gpu_server.service.operations.fit import fit_answer
from pyhf_gpu_server.service.operations.upper_limit import limit_answers

pytestmark = pytest.mark.timeout(300)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SVG_NS = "{http://www.w3.org/2000/svg}"


# ------------------------------------------------------------------------- real results
@pytest.fixture(scope="module")
def real() -> dict:
    """Results computed in-process as the service computes them."""
    out = {}
    onshell = WORKSPACES_DIR / "atlas-susy-2019-09-3l-onshell"
    workspace = load_json(onshell / "BkgOnly.json")
    model = HistFactoryModel.from_patchset(
        workspace, load_json(onshell / "patchset.json"), patch_names=["sig_s1_x1"]
    )
    out["fit"] = fit_answer(inference.fit(model)).model_dump()  # POST /fit's answer, less meta
    out["fit_workspace"] = workspace

    sbottom = WORKSPACES_DIR / "atlas-susy-2018-31-sbottom-A"
    background = load_json(sbottom / "BkgOnly.json")
    model = HistFactoryModel.from_patchset(
        background, load_json(sbottom / "patchset.json"), patch_names=["sig_s1_x8"]
    )
    pois = [0.1 * i for i in range(1, 16)]
    tests = inference.hypotest(model, pois)
    out["test_poi"] = pois
    out["cls"] = [  # POST /cls with a list of test_poi: one result per value, meta.test_poi
        {**answer.model_dump(), "meta": {"test_poi": p}}
        for answer, p in zip(cls_answers(tests), pois, strict=True)
    ]
    scan = torch.tensor(pois, dtype=model.dtype)  # the same shapes as the tests: quicker
    (limits,) = limit_answers(inference.upper_limit(model, scan=scan))
    out["upper_limit"] = limits.model_dump()

    published = load_patchset(sbottom / "patchset.hepdata.json.gz")
    values = {p["metadata"]["name"]: p["metadata"]["values"] for p in published["patches"]}
    names = [
        n
        for n, (m_sb, m_n2, m_n1) in values.items()
        if m_n1 == 60 and m_sb in (1200, 1300, 1400, 1500) and m_n2 in (250, 450, 650, 850, 1050)
    ]
    assert len(names) == 20
    model = HistFactoryModel.from_patchset(background, published, patch_names=names)
    tests = inference.hypotest(model, 1.0)
    patchset_answer = {
        n: answer.model_dump() for n, answer in zip(names, cls_answers(tests), strict=True)
    }
    patchset_answer["sbottom_1500_1495_60"] = {  # a patch the service could not test
        "error": {"status": 422, "detail": "InvalidModel: no POI"}
    }
    out["patchset"] = patchset_answer
    out["values"] = {n: values[n][:2] for n in names}
    out["published"] = published
    return out


def ranking_json(fit: dict) -> dict:
    """cabinetry-like ranking JSON over the fit's parameters (impacts made up)."""
    labels, best, unc = [], [], []
    for name, vals in fit["mle_parameters"].items():
        for i, v in enumerate(vals):
            labels.append(name if len(vals) == 1 else f"{name}[{i}]")
            best.append(v)
            unc.append(fit["uncertainties"][name][i])
    impact = np.random.default_rng(7).lognormal(-3, 1, len(labels))
    return {
        "labels": labels,
        "bestfit": best,
        "uncertainty": unc,
        "prefit_up": (1.2 * impact).tolist(),
        "prefit_down": (-1.1 * impact).tolist(),
        "postfit_up": impact.tolist(),
        "postfit_down": (-0.9 * impact).tolist(),
    }


def yields_json(channels: int = 3, bins: int = 4) -> dict:
    """Yields JSON of the documented shape: {prefit/postfit: {channel: {...}}}."""
    rng = np.random.default_rng(3)
    stage = {}
    for c in range(channels):
        samples = {
            name: {"yields": (scale * rng.uniform(0.5, 1.5, bins)).tolist(), "stdev": [1.0] * bins}
            for name, scale in (("ttbar", 40.0), ("W+jets", 15.0), ("diboson", 4.0))
        }
        total = np.sum([s["yields"] for s in samples.values()], axis=0)
        stage[f"SR_{c}"] = {
            "bins": [100.0 * i for i in range(bins + 1)],
            "samples": samples,
            "total": {"yields": total.tolist(), "stdev": (0.1 * total).tolist()},
            "data": rng.poisson(total).tolist(),
        }
    return {"prefit": stage, "postfit": stage}


SCAN_1D = {
    "name": "mu_SIG",
    "bestfit": 0.9,
    "uncertainty": 0.4,
    "parameter_values": np.linspace(-0.5, 2.5, 13).tolist(),
    "delta_nlls": ((np.linspace(-0.5, 2.5, 13) - 0.9) ** 2 / 0.16).tolist(),
}


def scan_2d() -> dict:
    x, y = np.linspace(0, 2, 21), np.linspace(0.5, 1.5, 17)
    gx, gy = np.meshgrid(x, y, indexing="ij")
    z = ((gx - 1) / 0.3) ** 2 + ((gy - 1) / 0.15) ** 2
    return {
        "parameters": ["mu_SIG", "mu_ttbar"],
        "values_x": x.tolist(),
        "values_y": y.tolist(),
        "delta_nlls": z.tolist(),
    }


def cases(real: dict) -> dict[str, tuple[str, object, dict, list[str]]]:
    """name -> (kind, result, options, texts the SVG must contain)."""
    fit = real["fit"]
    return {
        "brazil": (
            "brazil",
            real["cls"],
            {"upper_limit": real["upper_limit"], "xlabel": "μ_SIG"},
            ["μ_SIG", "Observed CL$_s$", "Expected ±2σ", "Observed 95% CL limit"],
        ),
        "brazil-upper-limit": (
            "brazil",
            real["upper_limit"],
            {},
            ["95% CL upper limit on μ", "Observed:"],
        ),
        "exclusion": (
            "exclusion",
            real["patchset"],
            {"values": real["values"], "labels": ["m(b̃₁) [GeV]", "m(χ̃⁰₂) [GeV]"]},
            ["m(b̃₁) [GeV]", "m(χ̃⁰₂) [GeV]", "Observed CL$_s$", "1 patch answered an error"],
        ),
        "pulls": (
            "pulls",
            fit,
            {"workspace": real["fit_workspace"]},
            ["COMB_MUON_MS", "lumi", "ON_staterror_SR1_WZ_cuts", r"\hat{\theta}"],
        ),
        "correlation": ("correlation", fit, {}, ["correlation", "max |ρ| ≥ 0.2"]),
        "ranking": ("ranking", ranking_json(fit), {"poi_label": "μ_SIG"}, ["Δμ_SIG", "Pull"]),
        "yields": (
            "yields",
            yields_json(),
            {},
            ["SR_0", "SR_2", "ttbar", "Data / Model", "Post-fit"],
        ),
        "scan": ("scan", SCAN_1D, {}, ["mu_SIG", "1σ", "2σ", r"-2\,\Delta\ln L"]),
        "scan-2d": ("scan", scan_2d(), {}, ["mu_SIG", "mu_ttbar", "68% CL", "95% CL"]),
    }


CASE_NAMES = [
    "brazil",
    "brazil-upper-limit",
    "exclusion",
    "pulls",
    "correlation",
    "ranking",
    "yields",
    "scan",
    "scan-2d",
]


def svg_texts(svg: bytes) -> tuple[ET.Element, str]:
    """The parsed SVG and the text of its comments (matplotlib writes each text as a comment
    above its glyph paths)."""
    parser = ET.XMLParser(target=ET.TreeBuilder(insert_comments=True))
    root = ET.fromstring(svg, parser=parser)
    comments = [e.text or "" for e in root.iter() if e.tag is ET.Comment]
    return root, "\n".join(comments)


def decode_png(png: bytes) -> np.ndarray:
    assert png.startswith(PNG_SIGNATURE)
    return imread(io.BytesIO(png), format="png")


# ----------------------------------------------------------------------------- the kinds
@pytest.mark.parametrize("name", CASE_NAMES)
def test_kind_renders_svg_and_png(real, name):
    kind, result, options, texts = cases(real)[name]
    svg = plots.render(kind, result, "svg", **options)
    root, comments = svg_texts(svg)
    assert root.tag == f"{SVG_NS}svg"
    assert b"<svg" in svg
    for text in texts:
        assert text in comments, f"{text!r} not drawn in the {name} plot"

    dpi = 40
    png = plots.render(kind, result, "png", dpi=dpi, **options)
    image = decode_png(png)
    width, height = (float(root.get(k).removesuffix("pt")) / 72 for k in ("width", "height"))
    assert abs(image.shape[0] - height * dpi) <= 1 and abs(image.shape[1] - width * dpi) <= 1
    pixels = image[..., :3].reshape(-1, 3)
    assert np.ptp(pixels, axis=0).max() > 0.5, "a single colour"
    assert len(np.unique((pixels * 255).astype(np.uint8), axis=0)) > 20


def test_png_size_follows_dpi_and_figsize(real):
    png = plots.render("scan", SCAN_1D, "png", dpi=80, figsize=[5, 4])
    assert decode_png(png).shape[:2] == (320, 400)
    png = plots.render("brazil", real["cls"], "png", dpi=55.5, figsize=[7.5, 5.5])
    image = decode_png(png)
    assert abs(image.shape[1] - 7.5 * 55.5) <= 1 and abs(image.shape[0] - 5.5 * 55.5) <= 1


def _contour_paths(fig) -> dict[str, int]:
    """gid -> vertices of the figure's contour sets."""
    out = {}
    for ax in fig.axes:
        for artist in ax.collections:
            if isinstance(artist, ContourSet):
                out[artist.get_gid()] = sum(len(p.vertices) for p in artist.get_paths())
    return out


def test_exclusion_draws_contours_from_real_cls(real):
    kind, result, options, _ = cases(real)["exclusion"]
    contours = _contour_paths(plots.figure(kind, result, **options))
    for gid in ("observed-contour", "expected-contour", "expected-band"):
        assert contours.get(gid, 0) > 4, (gid, contours)
    root, _ = svg_texts(plots.render(kind, result, "svg", **options))
    group = next(e for e in root.iter() if e.get("id") == "observed-contour")
    assert any(e.tag == f"{SVG_NS}path" for e in group.iter())


def test_exclusion_from_patchset_metadata_and_one_value(real):
    # values and labels straight from the published patchset's metadata (three masses)
    fig = plots.figure("exclusion", real["patchset"], patchset=real["published"])
    ax = fig.axes[0]
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("m_sbottom [GeV]", "m_neutralino2 [GeV]")
    assert "1 patch answered an error (skipped)" in [t.get_text() for t in fig.texts]
    assert _legend_title(fig) == "m_neutralino1 = 60 GeV (20 of 20 points)"
    # one value per patch: CLs versus it (a slice at m_sbottom = 1400)
    values = {n: [v[1]] for n, v in real["values"].items() if v[0] == 1400}
    answer = {n: real["patchset"][n] for n in values}
    svg = plots.render("exclusion", answer, "svg", values=values, labels=["m(χ̃⁰₂)"])
    assert "Observed CL$_s$" in svg_texts(svg)[1]


def test_brazil_inputs(real):
    # an upper-limit answer that carries its scan's CLs values draws the curves on it
    answer = {
        **real["upper_limit"],
        "scan": real["test_poi"],
        "CLs_obs": [r["CLs_obs"] for r in real["cls"]],
        "CLs_exp": [r["CLs_exp"] for r in real["cls"]],
    }
    labels = plots.figure("brazil", answer).axes[0].get_legend_handles_labels()[1]
    assert "Observed CL$_s$" in labels
    assert any(lab.startswith("Observed 95% CL limit: ") for lab in labels)
    # a patchset answer {patch: [results]}: the patch option picks one
    patchset = {"sig": real["cls"], "bad": {"error": {"status": 422, "detail": "no POI"}}}
    plots.figure("brazil", patchset, patch="sig")
    with pytest.raises(ValueError, match=r"brazil plot: .*'patch' option \(one of bad, sig"):
        plots.figure("brazil", patchset)
    with pytest.raises(ValueError, match=r"brazil plot: patch 'bad' answered an error"):
        plots.figure("brazil", patchset, patch="bad")
    # without limits, they are interpolated from the curves
    fig = plots.figure("brazil", real["cls"])
    assert any("interpolated" in t.get_text() for t in fig.texts)


def test_scan_2d_contours():
    contours = _contour_paths(plots.figure("scan", scan_2d()))
    assert contours["contour-68"] > 4 and contours["contour-95"] > 4


def test_pulls_choose_constrained_parameters(real):
    fit = real["fit"]
    ticks = lambda fig: [t.get_text() for t in fig.axes[0].get_yticklabels()]  # noqa: E731
    exact = ticks(plots.figure("pulls", fit, workspace=real["fit_workspace"]))
    assert "mu_SIG" not in exact and "mu_ON_WZSF_0j" not in exact  # POI and normfactor
    assert "lumi" in exact and "ON_staterror_SR1_WZ_cuts" in exact
    guessed = plots.figure("pulls", fit)
    assert "mu_SIG" not in ticks(guessed) and "lumi" not in ticks(guessed)
    assert any("guessed" in t.get_text() for t in guessed.texts)
    capped = plots.figure("pulls", fit, workspace=real["fit_workspace"], top=25)
    assert len(ticks(capped)) == 25
    assert capped.get_size_inches()[1] < plots.figure("pulls", fit).get_size_inches()[1]
    subset = ticks(plots.figure("pulls", fit, parameters=["COMB_MUON_MS", "TL_WZ_muR"]))
    assert subset == ["COMB_MUON_MS", "TL_WZ_muR"]
    assert plots.figure("pulls", fit).get_size_inches()[1] <= 24.0  # capped height


def test_correlation_threshold_and_annotations(real):
    fit = real["fit"]
    labels = lambda fig: [t.get_text() for t in fig.axes[0].get_yticklabels()]  # noqa: E731
    n = len(fit["corr_mat"])
    default = plots.figure("correlation", fit)  # > 50 parameters: threshold 0.2
    shown = len(labels(default))
    assert 1 < shown < n
    notes = [t.get_text() for t in default.texts]
    assert f"{shown} of {n} parameters with max |ρ| ≥ 0.2" in notes
    everything = plots.figure("correlation", fit, threshold=0)  # capped at the 80 most correlated
    assert len(labels(everything)) == 80
    assert not everything.axes[0].texts  # too many to write the values
    few = plots.figure("correlation", fit, parameters=list(fit["mle_parameters"])[:8], threshold=0)
    assert len(labels(few)) == 8
    assert sum(t.get_text() == "1.00" for t in few.axes[0].texts) == 8  # annotated diagonal
    # bounded: a render costs at most 200 x 200 cells, and 60 x 60 written values
    with pytest.raises(plots.PlotInputError, match="top must be at most 200, not 100000"):
        plots.figure("correlation", fit, threshold=0, top=100_000)
    with pytest.raises(plots.PlotInputError, match="at most 60 rows"):
        plots.figure("correlation", fit, threshold=0, annotate=True)


def test_ranking_top_and_yields_channels(real):
    ranking = plots.figure("ranking", ranking_json(real["fit"]), top=7)
    assert len(ranking.axes[0].get_yticklabels()) == 7
    many = yields_json(channels=15, bins=2)
    fig = plots.figure("yields", many, stage="prefit", max_channels=4)
    assert len(fig.axes) == 8  # 4 channels x (main + ratio)
    assert any("4 of 15 channels" in t.get_text() for t in fig.texts)
    fig = plots.figure("yields", many, channels=["SR_3"])
    assert len(fig.axes) == 2


# ------------------------------------------------------------------- threads, no state
@pytest.mark.slow
def test_concurrent_rendering_is_identical_and_leaves_no_state(real):
    kind, result, options, _ = cases(real)["exclusion"]
    before = copy.deepcopy(dict(matplotlib.rcParams))
    serial = plots.render(kind, result, "png", dpi=50, **options)
    start = threading.Barrier(4)

    def draw(_):
        start.wait()
        return plots.render(kind, result, "png", dpi=50, **options)

    with ThreadPoolExecutor(4) as pool:
        pngs = list(pool.map(draw, range(4)))
    assert all(png == serial for png in pngs)

    # different kinds at once match their serial renders (mathtext, contours, log axes)
    jobs = [cases(real)[n] for n in ("brazil", "scan-2d", "pulls", "yields")]
    alone = [plots.render(k, r, "png", dpi=40, **o) for k, r, o, _ in jobs]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda j: plots.render(j[0], j[1], "png", dpi=40, **j[2]), jobs))
    assert together == alone

    assert dict(matplotlib.rcParams) == before
    assert _pylab_helpers.Gcf.get_num_fig_managers() == 0  # nothing registered with pyplot


# -------------------------------------------------------------------------------- errors
def test_unknown_kind_format_and_option():
    with pytest.raises(ValueError, match=r"unknown plot kind 'histogram'.*brazil"):
        plots.render("histogram", {}, "png")
    with pytest.raises(ValueError, match=r"unknown format 'pdf'"):
        plots.render("scan", SCAN_1D, "pdf")
    with pytest.raises(ValueError, match=r"scan plot: unknown option 'colour'"):
        plots.render("scan", SCAN_1D, "svg", colour="red")


@pytest.mark.parametrize(
    ("kind", "result", "options", "message"),
    [
        ("pulls", {"twice_nll": 1.0}, {}, r"pulls plot: .*'mle_parameters'"),
        ("correlation", {"mle_parameters": {"a": [1.0]}}, {}, r"correlation plot: .*'corr_mat'"),
        ("brazil", [{"CLs_obs": 0.1}], {"test_poi": [1.0]}, r"brazil plot: .*'CLs_exp'"),
        ("brazil", [{"CLs_obs": 0.1, "CLs_exp": [0.1] * 5}], {}, r"brazil plot: .*test_poi"),
        ("brazil", {"upper_limit_obs": 1.0}, {}, r"brazil plot: .*'upper_limit_exp'"),
        (
            "exclusion",
            {"a": {"CLs_obs": 0.1, "CLs_exp": [0.1] * 5}},
            {},
            r"exclusion plot: .*values",
        ),
        ("exclusion", [1, 2], {"values": {}}, r"exclusion plot: .*patchset answer"),
        (
            "ranking",
            {"labels": ["a"], "bestfit": [0.0], "uncertainty": [1.0]},
            {},
            r"ranking plot: .*'prefit_up'",
        ),
        ("yields", {"prefit": {"SR": {"data": [1]}}}, {}, r"yields plot: .*'samples'"),
        ("scan", {"name": "mu", "parameter_values": [0, 1]}, {}, r"scan plot: .*'delta_nlls'"),
        ("scan", {"parameters": ["a", "b"], "values_x": [0, 1]}, {}, r"scan plot: .*'values_y'"),
        ("pulls", [1, 2], {}, r"pulls plot: .*fit answer"),
        ("brazil", [{"CLs_obs": 0.1, "CLs_exp": [0.1] * 4}], {"test_poi": [1]}, r"5 values"),
    ],
)
def test_wrong_results_name_kind_and_field(kind, result, options, message):
    with pytest.raises(ValueError, match=message):
        plots.render(kind, result, "png", **options)


@contextlib.contextmanager
def drawing_lock_held_elsewhere() -> Iterator[None]:
    """Another thread holds the renderers' drawing lock for the duration of the block."""
    from pyhf_gpu_server.plots import _base

    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with _base._LOCK:
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(10)
        yield
    finally:
        release.set()
        holder.join()


def test_a_render_waits_for_the_others_at_most_render_wait_s(real, monkeypatch):
    """Renders are serialised (matplotlib's state is process-wide): one that cannot have the
    drawing lock within RENDER_WAIT_S gives up with PlotBusyError (the service's 503) instead
    of waiting without a bound; once the lock is free it draws."""
    from pyhf_gpu_server.plots import _base

    monkeypatch.setattr(_base, "RENDER_WAIT_S", 0.2)
    with drawing_lock_held_elsewhere():
        start = time.monotonic()
        with pytest.raises(plots.PlotBusyError, match=r"other plots have been drawing for 0\.2 s"):
            plots.render("pulls", real["fit"], "svg")
        assert time.monotonic() - start < 2
    assert plots.render("pulls", real["fit"], "svg").startswith(b"<?xml")


def test_an_abandoned_render_gives_up_its_wait_and_its_drawing(real):
    """A render whose client went away stops waiting for the drawing lock (within
    ABANDON_POLL_S, not RENDER_WAIT_S) and, once it holds it, is not written."""
    from pyhf_gpu_server.plots import _base

    with drawing_lock_held_elsewhere():
        gone_at = time.monotonic() + 0.3
        start = time.monotonic()
        with pytest.raises(plots.PlotAbandonedError, match="went away before it was drawn"):
            plots.render("pulls", real["fit"], "svg", abandoned=lambda: time.monotonic() > gone_at)
        assert time.monotonic() - start < 0.3 + 5 * _base.ABANDON_POLL_S < _base.RENDER_WAIT_S
    with pytest.raises(plots.PlotAbandonedError, match="while it was drawn"):
        plots.render("pulls", real["fit"], "svg", abandoned=lambda: True)
    assert plots.render("pulls", real["fit"], "svg", abandoned=lambda: False).startswith(b"<?xml")


# ---------------------------------------------------------------- exclusion: one slice
SLICE_LABELS = ["m_sbottom", "m_neutralino2", "m_neutralino1"]


def _cls(m_sbottom: float, m_neutralino2: float, m_neutralino1: float) -> dict:
    """A CLs answer that falls with m_sbottom (faster at higher m_neutralino1) and crosses
    0.05 inside the grids below; the expected band around it."""
    log_cls = -(m_sbottom - 1000) / 120 * (1 + m_neutralino1 / 200) + m_neutralino2 / 800
    cls = 10 ** min(log_cls, 0.0)
    return {
        "CLs_obs": cls,
        "CLs_exp": [min(1.0, cls * f) for f in (0.2, 0.5, 0.8, 1.4, 2.5)],
    }


def two_slices() -> tuple[dict, dict]:
    """(patchset, answer) over three masses: 20 points at m_neutralino1 = 60 GeV (m_sbottom
    1000..1300 x m_neutralino2 250..1050) and 9 at 100 GeV (on other m_neutralino2 values, so
    that the points of both, flattened, are a plane of 29 distinct points)."""
    points = [
        (sb, n2, 60.0) for sb in (1000, 1100, 1200, 1300) for n2 in (250, 450, 650, 850, 1050)
    ]
    points += [(sb, n2, 100.0) for sb in (1000, 1150, 1300) for n2 in (350, 550, 750)]
    patches = [
        {"metadata": {"name": f"sb_{sb:g}_{n2:g}_{n1:g}", "values": [sb, n2, n1]}, "patch": []}
        for sb, n2, n1 in points
    ]
    patchset = {"metadata": {"labels": SLICE_LABELS}, "patches": patches, "version": "1.0.0"}
    answer = {p["metadata"]["name"]: _cls(*p["metadata"]["values"]) for p in patches}
    return patchset, answer


def _contours(fig) -> dict[str, np.ndarray]:
    """gid -> the vertices of the exclusion figure's contour sets (main axes)."""
    return {
        artist.get_gid(): np.concatenate([p.vertices for p in artist.get_paths()])
        for artist in fig.axes[0].collections
        if isinstance(artist, ContourSet)
    }


def _alone(patchset: dict, answer: dict, keep, axes=(0, 1)) -> dict[str, np.ndarray]:
    """The contours of only the points ``keep(values)`` picks, with their ``axes`` values."""
    values = {
        p["metadata"]["name"]: [p["metadata"]["values"][a] for a in axes]
        for p in patchset["patches"]
        if keep(p["metadata"]["values"])
    }
    return _contours(plots.figure("exclusion", {n: answer[n] for n in values}, values=values))


def _legend_title(fig) -> str:
    return fig.axes[0].get_legend().get_title().get_text()


def test_exclusion_contour_of_a_sliced_patchset_is_the_slice_alone():
    patchset, answer = two_slices()
    fig = plots.figure("exclusion", answer, patchset=patchset)
    drawn = _contours(fig)
    alone = _alone(patchset, answer, lambda v: v[2] == 60)
    assert set(drawn) == set(alone) == {"expected-band", "expected-contour", "observed-contour"}
    for gid, vertices in alone.items():
        assert len(vertices) > 4, gid
        np.testing.assert_array_equal(drawn[gid], vertices, err_msg=gid)
    # the choice is named on the plot, the masses have their unit
    assert _legend_title(fig) == "m_neutralino1 = 60 GeV (20 of 29 points)"
    ax = fig.axes[0]
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("m_sbottom [GeV]", "m_neutralino2 [GeV]")
    assert len(ax.collections[-1].get_offsets()) == 20  # the tested points of the slice only
    # the 29 points flattened onto one plane (what the plot must not draw) give another line
    mixed = _alone(patchset, answer, lambda v: True)
    assert mixed["observed-contour"].shape != alone["observed-contour"].shape or not np.allclose(
        mixed["observed-contour"], alone["observed-contour"]
    )


def test_exclusion_slice_and_axes_options():
    patchset, answer = two_slices()
    # slice: the values of the coordinates off the axes (a list, or one number)
    for chosen in ([100], 100.0):
        fig = plots.figure("exclusion", answer, patchset=patchset, slice=chosen)
        assert _legend_title(fig) == "m_neutralino1 = 100 GeV (9 of 29 points)"
        alone = _alone(patchset, answer, lambda v: v[2] == 100)
        for gid, vertices in alone.items():
            np.testing.assert_array_equal(_contours(fig)[gid], vertices, err_msg=gid)
    # axes: the plane's two coordinates, in the order given (x then y)
    fig = plots.figure("exclusion", answer, patchset=patchset, axes=[1, 0])
    assert (fig.axes[0].get_xlabel(), fig.axes[0].get_ylabel()) == (
        "m_neutralino2 [GeV]",
        "m_sbottom [GeV]",
    )
    swapped = _alone(patchset, answer, lambda v: v[2] == 60, axes=(1, 0))
    np.testing.assert_array_equal(_contours(fig)["observed-contour"], swapped["observed-contour"])
    # one axis: CLs versus it, in the most populated slice of the other two
    fig = plots.figure("exclusion", answer, patchset=patchset, axes=[0], slice=[450, 60])
    assert _legend_title(fig) == "m_neutralino2 = 450 GeV, m_neutralino1 = 60 GeV (4 of 29 points)"
    assert len(fig.axes[0].lines[1].get_xdata()) == 4  # the observed curve: 4 m_sbottom values
    # labels with a unit keep it; a label that is no mass has none
    patchset["metadata"]["labels"] = ["m_stop [TeV]", "scale", "m_neutralino1"]
    fig = plots.figure("exclusion", answer, patchset=patchset)
    assert (fig.axes[0].get_xlabel(), fig.axes[0].get_ylabel()) == ("m_stop [TeV]", "scale")
    # the query strings' types: slice is numbers
    assert plotting.query_options({"slice": ["60"], "axes": ["1,0"]}) == {
        "slice": [60.0],
        "axes": [1, 0],
    }


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"slice": [75]},
            r"exclusion plot: no tested point at m_neutralino1 = 75 GeV; the slices \(points\): "
            r"m_neutralino1 = 60 GeV \(20\); m_neutralino1 = 100 GeV \(9\)",
        ),
        (
            {"slice": [60, 250]},
            r"slice gives the values of the coordinates off the axes, m_neutralino1: 1 number",
        ),
        ({"axes": [0, 0]}, r"axes must be one or two different indices .*0 m_sbottom"),
        ({"axes": [0, 1, 2]}, r"axes must be one or two"),
        ({"axes": [0, 1], "slice": "sixty"}, r"slice must be a list of numbers"),
    ],
)
def test_exclusion_refuses_a_slice_it_cannot_draw(options, message):
    patchset, answer = two_slices()
    with pytest.raises(plots.PlotInputError, match=message):
        plots.figure("exclusion", answer, patchset=patchset, **options)


def test_exclusion_refuses_points_on_no_common_plane():
    """Points that share no slice of 3 (each its own m_neutralino1) are not drawn as one
    plane: the refusal names the most populated slice and the others."""
    patchset, answer = two_slices()
    for i, patch in enumerate(patchset["patches"]):
        patch["metadata"]["values"][2] = 10.0 * (i // 2)  # two points per value at most
    with pytest.raises(
        plots.PlotInputError,
        match=r"the most populated slice, m_neutralino1 = 0 GeV, has 2 of 29 points: too few "
        r"for a contour \(3\); .*cannot be drawn as one without mixing slices",
    ):
        plots.figure("exclusion", answer, patchset=patchset)
    # the service answers 422 with the renderer's message
    with pytest.raises(ServiceError) as refused:
        plotting.render(
            plotting.PlotRequest("exclusion", "png"),
            "cls",
            {"patchset": patchset},
            answer,
            lambda _: None,
        )
    assert refused.value.status_code == 422 and "mixing slices" in refused.value.detail


def test_the_examples_in_the_docstrings():
    """The units rule, the ratio panel's range and ticks, the options' parsing, as their
    docstrings show them."""
    import doctest

    from pyhf_gpu_server.plots import slices, yields

    for module in (slices, yields, plotting, plots):
        failures, attempted = doctest.testmod(module)
        assert failures == 0 and attempted > 0, module.__name__
