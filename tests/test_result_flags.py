"""``meta.flags`` (#39): answers past their model's limits, and fits that do not converge, are
said wherever a user reads them.

- An upper limit (observed or a band) past the POI's upper bound is flagged exactly where
  pyhf's ``upper_limit`` raises ValueError (its toms748 scan doubles the upper end while a CLs
  there is above the level: a fit outside the bounds); a limit a given scan does not bracket
  (pyhf answers the scan's end without a word) is flagged too.
- A ranking or scan whose POI's best fit lies on its bound (the ranking's refits held there,
  their impacts 0 or truncated) is flagged.
- Every answer from a fit that did not converge is flagged.

Unit tests on small models against pyhf; then a REAL server and the ``pyhf-gpu-client``
command on the published sbottom likelihoods (ATLAS-SUSY-2018-31, HEPData ins1748602): the
warning on stderr names the patch and what, ``--strict`` exits 1, the Python client warns.
"""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
import typing
import warnings
from pathlib import Path

import pytest
import torch
from conftest import shared_workspace
from pyhf_global import pyhf_upper_limit
from service_support import WORKSPACES, running_server, workspace_file
from workspaces import read_json

import pyhf_gpu_client as pgc
from pyhf_gpu_client.protocol import warn_if_doubtful
from pyhf_gpu_client.results import CLsResult, UpperLimitResult, flagged
from pyhf_gpu_server.engine import HistFactoryModel
from pyhf_gpu_server.inference import ranking, scan, upper_limit
from pyhf_gpu_server.inference.hypotest import hypotest, join_toy_parts
from pyhf_gpu_server.inference.toys import ToySlice
from pyhf_gpu_server.service.operations.base import RowStatus
from pyhf_gpu_server.service.operations.cls import unresolved as cls_unresolved
from pyhf_gpu_server.service.operations.ranking import ranking_answer, ranking_flag
from pyhf_gpu_server.service.operations.scan import scan_flags
from pyhf_gpu_server.service.operations.upper_limit import CURVES, limit_flags
from pyhf_gpu_server.service.schemas import FLAG_KINDS, FlagKind, ResultMeta

pyhf = pytest.importorskip("pyhf")

CLIENT_EXE = Path(sys.executable).with_name("pyhf-gpu-client")


def workspace(signal: float, observed: float = 52.0, bounds: list[float] | None = None) -> dict:
    """One bin: ``signal`` events of ``mu``, 50 +- 7 of background, ``observed``."""
    spec = pyhf.simplemodels.uncorrelated_background([signal], [50.0], [7.0]).spec
    parameters = [] if bounds is None else [{"name": "mu", "bounds": [bounds]}]
    return {
        **spec,
        "observations": [{"name": "singlechannel", "data": [observed]}],
        "measurements": [{"name": "m", "config": {"poi": "mu", "parameters": parameters}}],
        "version": "1.0.0",
    }


def pyhf_model(spec: dict):
    """pyhf's model and observed data of ``spec`` (numpy backend)."""
    pyhf.set_backend("numpy")
    ws = pyhf.Workspace(spec)
    model = ws.model()
    return model, ws.data(model)


def two_bins(observed: list[float]) -> dict:
    """Two bins: 9 and 7 signal events of ``mu``, 50 +- 2 and 52 +- 3 of background,
    ``observed``."""
    spec = pyhf.simplemodels.uncorrelated_background([9.0, 7.0], [50.0, 52.0], [2.0, 3.0]).spec
    return {**workspace(0.0), **spec, "observations": [{"name": "singlechannel", "data": observed}]}


def whole_and_slices(model: HistFactoryModel, ntoys: int, seed: int, size: int) -> tuple:
    """A toy-based test at mu = 1, whole and in slices of ``size`` toys."""
    whole = hypotest(model, 1.0, calctype="toybased", ntoys=ntoys, seed=seed)
    slices = [
        hypotest(model, 1.0, calctype="toybased", ntoys=ntoys, seed=seed, toys=[s])
        for s in ToySlice.cut(0, ntoys, size)
    ]
    return whole, slices


# --- upper limits ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("signal", "bounds"),
    [
        (1.0, None),  # every limit past the bound 10
        (3.0, None),  # the +2 sigma band alone (12.65)
        (12.0, None),  # none
        (3.0, [0.0, 12.0]),  # the +2 sigma band just past the bound...
        (3.0, [0.0, 13.0]),  # ...and just inside it
    ],
)
def test_a_limit_past_the_bound_is_flagged_exactly_where_pyhf_raises(signal, bounds) -> None:
    spec = workspace(signal, bounds=bounds)
    result = upper_limit(HistFactoryModel.from_workspace(spec))
    hi = 10.0 if bounds is None else bounds[1]
    limits = [float(result.obs[0]), *result.exp[0].tolist()]
    (flags,) = limit_flags(result, "mu", None)
    past = [c for c in range(6) if limits[c] > hi]
    assert result.beyond_bounds[0].tolist() == [c in past for c in range(6)]
    model, data = pyhf_model(spec)
    if past:
        (flag,) = flags
        assert flag.kind == "limit_beyond_bounds"
        assert f"limits past the upper bound {hi:g} of the POI 'mu'" in flag.detail
        assert all(CURVES[c] in flag.detail for c in past)
        assert "pyhf's upper_limit raises ValueError" in flag.detail
        with pytest.raises(ValueError, match="lies outside of its bounds"):
            pyhf.infer.intervals.upper_limits.upper_limit(data, model)
    else:
        assert flags == ()
        obs, exp = pyhf_upper_limit(data, model)
        expected = [float(obs), *(float(e) for e in exp)]
        assert limits == pytest.approx(expected, rel=1e-3)


def test_a_poi_without_effect_has_no_limit_and_says_so() -> None:
    """A signal of 0 events: CLs is 1 at every POI value, pyhf's ``upper_limit`` raises
    ValueError (its scan doubles past the bound); here every limit is inf (null in JSON), the
    fits converged, and the flag says that no limit was found and why, not that fits failed."""
    spec = workspace(0.0)
    result = upper_limit(HistFactoryModel.from_workspace(spec))
    assert torch.isinf(result.obs).all() and torch.isinf(result.exp).all()
    assert result.converged.all() and result.beyond_bounds.all()
    ((flag,),) = limit_flags(result, "mu", None)
    assert flag.kind == "limit_beyond_bounds"
    assert flag.detail == (
        "limits past the upper bound 10 of the POI 'mu': none found for "
        + ", ".join(CURVES)
        + " (null): CLs stays above the level at every value tested, as where the POI does "
        "not change the expected counts (CLs at the bound above the level 0.05, where pyhf's "
        "upper_limit raises ValueError)"
    )
    model, data = pyhf_model(spec)
    with pytest.raises(ValueError, match="lies outside of its bounds"):
        pyhf.infer.intervals.upper_limits.upper_limit(data, model)


@pytest.mark.parametrize(
    ("signal", "grid"),
    [(12.0, (1.5, 4.0)), (3.0, (0.0, 8.0)), (3.0, (0.0, 10.0)), (12.0, (0.0, 4.0))],
)
def test_a_limit_the_scan_does_not_bracket_is_flagged_where_pyhf_answers_the_scan_end(
    signal, grid
) -> None:
    """pyhf's ``linear_grid_scan`` answers the scan's end for a curve the scan does not
    bracket (``np.interp`` clamps): ours the same, flagged for exactly those curves."""
    spec = workspace(signal)
    values = [grid[0] + (grid[1] - grid[0]) * i / 10 for i in range(11)]
    result = upper_limit(
        HistFactoryModel.from_workspace(spec), scan=torch.tensor(values, dtype=torch.float64)
    )
    ours = [float(result.obs[0]), *result.exp[0].tolist()]
    model, data = pyhf_model(spec)
    obs, exp = pyhf.infer.intervals.upper_limits.upper_limit(
        data, model, scan=torch.tensor(values).numpy()
    )
    theirs = [float(obs), *(float(e) for e in exp)]
    assert ours == pytest.approx(theirs, rel=1e-4)
    at_end = {c: theirs[c] for c in range(6) if theirs[c] in (values[0], values[-1])}
    (flags,) = limit_flags(result, "mu", values)
    said = " ".join(f.detail for f in flags)
    assert all(f.kind == "limit_outside_scan" for f in flags)
    assert {c for c in range(6) if result.outside_scan[0, c]} == set(at_end)
    for c, end in at_end.items():
        which = "last" if end == values[-1] else "first"
        assert f"answered as its {which} value {end:g}" in said and CURVES[c] in said
    assert bool(flags) == bool(at_end)


# --- ranking and scan -----------------------------------------------------------------------


def test_ranking_and_scan_flag_the_poi_on_its_bound() -> None:
    """A deficit puts the POI's best fit on its bound 0: every impact is 0 there (cabinetry's
    too), and the ranking and the scan say so; an excess leaves it inside, and nothing is
    said."""
    spec = pyhf.simplemodels.uncorrelated_background([12.0, 11.0], [50.0, 52.0], [3.0, 7.0]).spec
    for observed, on_bound in (([40.0, 41.0], True), ([62.0, 61.0], False)):
        ws = {
            **spec,
            "observations": [{"name": "singlechannel", "data": observed}],
            "measurements": [{"name": "m", "config": {"poi": "mu", "parameters": []}}],
            "version": "1.0.0",
        }
        model = HistFactoryModel.from_workspace(ws)
        ranked = ranking(model)
        row = ranking_answer(ranked).model_dump()
        flags = ranking_flag(
            "mu",
            *(float(ranked.poi_bound[0]), int(ranked.refits_at_bound[0]), int(ranked.refits[0])),
        )
        profile = scan(model, "mu", steps=5)
        (scan_said,) = scan_flags(profile.poi_bound, "mu", 1)
        nuisance = scan(model, "uncorr_bkguncrt[0]", steps=5)
        if on_bound:
            assert row["poi"]["bestfit"] == 0.0
            assert row["postfit_up"] == row["postfit_down"] == [0.0, 0.0]
            (flag,) = flags
            assert flag.kind == "poi_at_bound"
            assert "the best fit of the POI 'mu' lies on its bound 0" in flag.detail
            assert "8 of its 8 refits ended on a bound" in flag.detail
            for said in (scan_said, scan_flags(nuisance.poi_bound, "mu", 1)[0]):
                assert [f.kind for f in said] == ["poi_at_bound"]
                assert "lies on its bound 0" in said[0].detail
        else:
            assert 0.5 < row["poi"]["bestfit"] < 1.5
            assert flags == scan_said == () and math.isnan(float(nuisance.poi_bound[0]))


# --- the flag's declaration and the client's reading -------------------------------------------


def test_the_flag_kinds_are_declared_once_with_their_descriptions() -> None:
    assert set(typing.get_args(FlagKind)) == set(FLAG_KINDS)
    schema = ResultMeta.model_json_schema()
    flag = schema["$defs"]["ResultFlag"]
    assert set(flag["properties"]["kind"]["enum"]) == set(FLAG_KINDS)
    assert all(kind in flag["properties"]["kind"]["description"] for kind in FLAG_KINDS)
    assert schema["properties"]["flags"]["items"] == {"$ref": "#/$defs/ResultFlag"}


def test_the_client_reads_the_flags_of_any_result_and_warns_by_kind() -> None:
    """Flags are read from ``meta.flags`` whatever the operation (the server's words, the
    place prefixed); an answer past its model's limits warns as a BeyondBoundsWarning, a
    DoubtfulResultWarning's subclass; a server that sends no flags: its ``converged``."""
    limit = {"kind": "limit_beyond_bounds", "detail": "limits past the upper bound 10"}
    stuck = {"kind": "not_converged", "detail": "its fits did not converge"}
    results = {
        "p1": UpperLimitResult(1.0, [1.0] * 5, 0.05, meta={"patch": "p1", "flags": [limit]}),
        "p2": [CLsResult(0.1, [0.1] * 5, meta={"test_poi": 2.0, "flags": [stuck]})],
        "p3": UpperLimitResult(1.0, [1.0] * 5, 0.05, meta={"flags": [], "converged": True}),
        "p4": CLsResult(0.1, [0.1] * 5, meta={"converged": False}),  # an older server
    }
    found = flagged(results)
    assert [(f.kind, f.line) for f in found] == [
        ("limit_beyond_bounds", "patch 'p1': limits past the upper bound 10"),
        ("not_converged", "patch 'p2', test_poi 2.0: its fits did not converge"),
        (
            "not_converged",
            "patch 'p4': its fits did not converge (meta.converged false): its numbers may "
            "not be the minimum's",
        ),
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_if_doubtful(results)
    assert [w.category for w in caught] == [
        pgc.BeyondBoundsWarning,
        pgc.DoubtfulResultWarning,
        pgc.DoubtfulResultWarning,
    ]
    assert issubclass(pgc.BeyondBoundsWarning, pgc.DoubtfulResultWarning)
    with warnings.catch_warnings(record=True) as caught:  # accept extrapolated limits alone
        warnings.simplefilter("always")
        warnings.simplefilter("ignore", pgc.BeyondBoundsWarning)
        warn_if_doubtful(results)
    assert [w.category for w in caught] == [pgc.DoubtfulResultWarning] * 2


# --- a real server, the command line and the Python client, on published likelihoods ---------

SBOTTOM_A = WORKSPACES / "atlas-susy-2018-31-sbottom-A"
SBOTTOM_B = WORKSPACES / "atlas-susy-2018-31-sbottom-B"
#: region B's published point whose expected +2 sigma limit (13.5) lies past mu_SIG's upper
#: bound 10 (the others inside), and whose best fit mu_SIG lies on its lower bound 0
PAST_BOUND = "sbottom_1000_850_60"
#: region A's published point whose conditional fit at mu_SIG = 5 does not converge
UNCONVERGED = "sbottom_600_400_60"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("flags")) as process:
        yield process.url


def client_command(server: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The installed ``pyhf-gpu-client`` command against ``server``."""
    return subprocess.run(
        [str(CLIENT_EXE), "--server", server, *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def published(folder: Path, name: str, *options: str) -> list[str]:
    """Arguments of one published point of ``folder``'s HEPData patchset (gzip, as read)."""
    return [
        str(workspace_file(folder, "BkgOnly.json")),
        "--patchset",
        str(workspace_file(folder, "patchset.hepdata.json")),
        "--patch-name",
        name,
        *options,
    ]


def warnings_of(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("Warning: ")]


def assert_strict_fails(server: str, args: list[str], stdout: str) -> None:
    """``--strict``: the same output, exit 1."""
    strict = client_command(server, *args, "--strict")
    assert strict.returncode == 1, strict.stderr
    assert strict.stdout == stdout
    assert "on the results (the warnings above)" in strict.stderr


@pytest.mark.parametrize("low", [-5.0, 0.0, 0.5])
def test_qtilde_of_a_poi_not_bounded_at_zero_warns_where_pyhf_warns(
    server, tmp_path, caplog, low
) -> None:
    """q~ (``cls``' default, every upper limit's) of a POI whose lower bound is not 0: pyhf's
    ``qmu_tilde`` logs a warning (above 0 it then raises ValueError); the client warns on
    stderr, ``--strict`` exits 1; ``q`` does not."""
    spec = workspace(12.0, bounds=[low, 10.0])
    path = tmp_path / "ws.json"
    path.write_text(json.dumps(spec))
    model, data = pyhf_model(spec)
    raised = None
    with caplog.at_level(logging.WARNING, logger="pyhf"):
        try:
            pyhf.infer.hypotest(1.0, data, model, test_stat="qtilde")
        except ValueError as exc:
            raised = str(exc)
    assert (raised is not None) == (low > 0.0)
    assert raised is None or "(index: 0, value: 0.0) lies outside of its bounds" in raised
    pyhf_warns = "not bounded at zero" in caplog.text
    assert pyhf_warns == (low != 0.0)
    for args in (["cls", str(path)], ["upper-limit", str(path)]):
        run = client_command(server, *args)
        assert run.returncode == 0, run.stderr
        said = [w for w in warnings_of(run.stderr) if "q~" in w]
        if not pyhf_warns:
            assert said == []
            continue
        (warning,) = said
        assert f"the POI 'mu' has the lower bound {low:g}" in warning
        assert ("raise it to 0" in warning) == (low < 0.0)
        assert ("raises ValueError" in warning) == (low > 0.0)
        assert_strict_fails(server, args, run.stdout)
    if pyhf_warns:
        with pgc.Client(server) as client, pytest.warns(pgc.BeyondBoundsWarning, match="q~"):
            client.cls(spec)
    run = client_command(server, "cls", str(path), "--test-stat", "q")
    assert run.returncode == 0 and not [w for w in warnings_of(run.stderr) if "q~" in w]


@pytest.mark.slow
def test_published_limit_past_its_bound_warns_where_pyhf_raises(server) -> None:
    """The issue's case: an expected +2 sigma limit past the POI's bound [0, 10] was answered
    without a word; pyhf raises ValueError on the same input."""
    args = ["upper-limit", *published(SBOTTOM_B, PAST_BOUND)]
    run = client_command(server, *args)
    assert run.returncode == 0, run.stderr
    limits = json.loads(run.stdout)[PAST_BOUND]
    assert limits["upper_limit_exp"][4] > 10.0 > max(limits["upper_limit_exp"][:4])
    (warning,) = warnings_of(run.stderr)
    assert warning.startswith(
        f"Warning: patch {PAST_BOUND!r}: limits past the upper bound 10 of the POI 'mu_SIG': "
        f"expected +2 sigma {limits['upper_limit_exp'][4]:.4g} (CLs at the bound above the "
        "level 0.05, where pyhf's upper_limit raises ValueError"
    )
    assert_strict_fails(server, args, run.stdout)

    patchset = pyhf.PatchSet(read_json(SBOTTOM_B, "patchset.hepdata.json"))
    spec = patchset.apply(read_json(SBOTTOM_B, "BkgOnly.json"), PAST_BOUND)
    model, data = pyhf_model(spec)
    with pytest.raises(ValueError, match=r"value: 20\) lies outside of its bounds: \(0, 10\)"):
        pyhf.infer.intervals.upper_limits.upper_limit(data, model)

    with pgc.Client(server) as client, pytest.warns(pgc.BeyondBoundsWarning, match=PAST_BOUND):
        client.upper_limit(
            workspace_file(SBOTTOM_B, "BkgOnly.json"),
            patchset=workspace_file(SBOTTOM_B, "patchset.hepdata.json"),
            patch_names=[PAST_BOUND],
        )


@pytest.mark.slow
def test_published_ranking_and_scan_with_the_poi_on_its_bound_warn(server) -> None:
    """The issue's case: the POI's best fit on its bound 0, impacts of exactly 0 among the top
    five, and no word; now a warning naming the patch, and ``--strict`` exits 1."""
    args = ["ranking", *published(SBOTTOM_B, PAST_BOUND, "--top", "5")]
    run = client_command(server, *args)
    assert run.returncode == 0, run.stderr
    ranked = json.loads(run.stdout)[PAST_BOUND]
    assert ranked["poi"]["bestfit"] == 0.0
    zeros = sum(
        0.0 in pair for pair in zip(ranked["postfit_up"], ranked["postfit_down"], strict=True)
    )
    assert zeros >= 4
    (warning,) = warnings_of(run.stderr)
    assert warning.startswith(
        f"Warning: patch {PAST_BOUND!r}: the best fit of the POI 'mu_SIG' lies on its bound 0: "
        "the refits cannot move it past"
    )
    assert_strict_fails(server, args, run.stdout)

    args = ["scan", *published(SBOTTOM_B, PAST_BOUND, "--steps", "3")]
    run = client_command(server, *args)
    assert run.returncode == 0, run.stderr
    (warning,) = warnings_of(run.stderr)
    assert warning.startswith(
        f"Warning: patch {PAST_BOUND!r}: the best fit of the POI 'mu_SIG' lies on its bound 0"
    )
    assert_strict_fails(server, args, run.stdout)


@pytest.mark.slow
def test_published_likelihood_whose_fits_do_not_converge_warns_and_strict_fails(server) -> None:
    """Issue #39 item 3, on a real published likelihood with default options: region A's
    point ``sbottom_600_400_60`` tested at mu_SIG = 5 (inside its bounds [0, 10]): the fit of
    the data at mu_SIG = 5 pushes four nuisance parameters onto their bounds +-5 and does not
    converge within the minimiser's 200 iterations (pyhf's SLSQP says 'terminated
    successfully' there at -2 log L = 479.41, above the 461.53 our fit from the init reaches:
    its answer is not the minimum's either, and it says nothing). The command line warns on
    stderr naming the patch, ``--strict`` exits 1."""
    args = ["cls", *published(SBOTTOM_A, UNCONVERGED, "--test-poi", "5")]
    run = client_command(server, *args)
    assert run.returncode == 0, run.stderr
    assert set(json.loads(run.stdout)[UNCONVERGED]) == {"CLs_obs", "CLs_exp"}
    # the conditional fit to the Asimov data, run again from the data's conditional minimum,
    # lands elsewhere too: said as well
    assert warnings_of(run.stderr) == [
        f"Warning: patch {UNCONVERGED!r}, test_poi 5.0: its fits did not converge "
        "(meta.converged false): its numbers may not be the minimum's",
        f"Warning: patch {UNCONVERGED!r}, test_poi 5.0: its fits from extra starts reached "
        "different minima (meta.starts_agreed false): the answer is the lowest found",
    ], run.stderr
    assert_strict_fails(server, args, run.stdout)


# --- parameters without curvature --------------------------------------------------------------


def shapefactor_workspace(identifiable: bool = True) -> dict:
    """A data-driven background: its normalisation ``k`` from a control region, and per-bin
    ``shapefactor`` in a region one of whose bins has no events (its factor's best fit is on
    its bound 0, where the likelihood has no curvature along it), besides a signal region.
    ``identifiable`` False: the signal region's background has its own per-bin factors too,
    so the POI (at its bound 0) can be traded against them: no direction of the Hessian is
    alone to blame."""
    mc = [{"name": "lumi", "type": "lumi", "data": None}]
    dd_sr = [{"name": "k", "type": "normfactor", "data": None}]
    if not identifiable:
        dd_sr.append({"name": "sf_sr", "type": "shapefactor", "data": None})
    channels = {
        "CR": (
            [("dd", [50.0, 40.0], [{"name": "k", "type": "normfactor", "data": None}])],
            [52, 38],
        ),
        "VR": (
            [
                (
                    "dd",
                    [10.0, 8.0, 1.0],
                    [
                        {"name": "k", "type": "normfactor", "data": None},
                        {"name": "sf", "type": "shapefactor", "data": None},
                    ],
                ),
                (
                    "mc",
                    [3.0, 2.0, 0.5],
                    [{"name": "stat_vr", "type": "staterror", "data": [0.5, 0.4, 0.2]}, *mc],
                ),
            ],
            [13, 9, 0],
        ),
        "SR": (
            [
                ("sig", [2.0, 4.0, 3.0], [{"name": "mu", "type": "normfactor", "data": None}]),
                ("dd", [10.0, 8.0, 6.0], dd_sr),
                (
                    "mc",
                    [3.0, 2.0, 2.0],
                    [{"name": "stat_sr", "type": "staterror", "data": [0.5, 0.4, 0.4]}, *mc],
                ),
            ],
            [16, 15, 11] if identifiable else [13, 9, 8],
        ),
    }
    lumi = {
        "name": "lumi",
        "auxdata": [1.0],
        "sigmas": [0.02],
        "bounds": [[0.9, 1.1]],
        "inits": [1.0],
    }
    return {
        "channels": [
            {
                "name": name,
                "samples": [{"name": s, "data": d, "modifiers": m} for s, d, m in samples],
            }
            for name, (samples, _) in channels.items()
        ],
        "observations": [
            {"name": name, "data": [float(n) for n in observed]}
            for name, (_, observed) in channels.items()
        ],
        "measurements": [{"name": "m", "config": {"poi": "mu", "parameters": [lumi]}}],
        "version": "1.0.0",
    }


def test_a_parameter_without_curvature_is_held_for_the_others_uncertainties() -> None:
    """The shapefactor of a bin without events fits to its bound 0, where ``-2 log L`` has no
    curvature along it: the Hessian is indefinite and had no inverse (every uncertainty
    NaN). It is held there for the others', which equal MINUIT's (cabinetry) with that
    parameter fixed at 0 (a tight reference: MINUIT's own Hesse of the free parameter at a
    bound comes from its bound transform); its own uncertainty is NaN. The block form's
    diagonal is the dense Hessian's."""
    import cabinetry
    import numpy as np

    from pyhf_gpu_server.inference import fit
    from pyhf_gpu_server.inference.objective import TwiceNLL
    from pyhf_gpu_server.inference.rows import rows_of

    spec = shapefactor_workspace()
    model = HistFactoryModel.from_workspace(spec)
    ours = fit(model)
    j = model.par_names.index("sf[2]")
    assert ours.converged.all() and ours.bestfit[0, j] == 0.0
    assert math.isnan(ours.uncertainty[0, j]) and model.bin_parameters.n_per_bin
    others = [c for c in range(model.n_pars) if c != j]
    rows = rows_of(model, None, None)
    block = TwiceNLL(model, rows.data, rows.element).block_hessian(ours.bestfit, rows.element)
    assert torch.equal(block.diagonal(), block.dense().diagonal(dim1=-2, dim2=-1))
    assert block.diagonal()[0, j] == 0.0

    theirs, data = pyhf_model(spec)
    assert theirs.config.par_names == model.par_names
    init, fixed = theirs.config.suggested_init(), theirs.config.suggested_fixed()
    init[j], fixed[j] = 0.0, True
    pyhf.set_backend("numpy", "minuit")
    try:
        reference = cabinetry.fit.fit(theirs, data, init_pars=init, fix_pars=fixed)
    finally:
        pyhf.set_backend("numpy")
    np.testing.assert_allclose(ours.bestfit[0, others], reference.bestfit[others], atol=2e-3)
    np.testing.assert_allclose(
        ours.uncertainty[0, others], reference.uncertainty[others], rtol=1e-2
    )


def two_normfactors_workspace(per_bin: bool) -> dict:
    """Three bins; the background carries two free normfactors ``k1`` and ``k2`` (only their
    product is measured: ``-2 log L`` is flat along ``k1 / k2``) and a normsys; ``per_bin``:
    a third sample with a staterror (per-bin parameters: the block form)."""
    background = {
        "name": "background",
        "data": [50.0, 30.0, 20.0],
        "modifiers": [
            {"name": "k1", "type": "normfactor", "data": None},
            {"name": "k2", "type": "normfactor", "data": None},
            {"name": "syst", "type": "normsys", "data": {"hi": 1.1, "lo": 0.9}},
        ],
    }
    other = {"name": "other", "data": [10.0, 10.0, 10.0], "modifiers": []}
    if per_bin:
        other["modifiers"] = [{"name": "st", "type": "staterror", "data": [1.0, 1.0, 1.0]}]
    signal = {
        "name": "signal",
        "data": [5.0, 3.0, 1.0],
        "modifiers": [{"name": "mu", "type": "normfactor", "data": None}],
    }
    return {
        "channels": [{"name": "sr", "samples": [signal, background, other]}],
        "observations": [{"name": "sr", "data": [60.0, 45.0, 28.0]}],
        "measurements": [{"name": "m", "config": {"poi": "mu", "parameters": []}}],
        "version": "1.0.0",
    }


@pytest.mark.parametrize("per_bin", [False, True], ids=["dense", "block"])
def test_a_flat_direction_of_two_parameters_holds_one_for_the_others_uncertainties(per_bin):
    """Two normfactors of one sample: the Hessian at the best fit is singular (every
    uncertainty was NaN). The later one is held there, its uncertainty NaN; the others' equal
    those of the finite-difference Hessian of pyhf's own logpdf with it fixed (the
    well-posed model: MINUIT's Hesse on it, through cabinetry, is 10 % off here)."""
    import numpy as np

    from pyhf_gpu_server.inference import fit

    spec = two_normfactors_workspace(per_bin)
    model = HistFactoryModel.from_workspace(spec)
    assert bool(model.bin_parameters.n_per_bin) == per_bin
    ours = fit(model)
    labels = model.par_names
    k2 = labels.index("k2")
    assert ours.converged.all()
    uncertainty = ours.uncertainty[0].tolist()
    assert [label for label, u in zip(labels, uncertainty, strict=True) if u != u] == ["k2"]

    theirs, data = pyhf_model(spec)
    x = ours.bestfit[0].numpy()
    free = [c for c in range(len(x)) if c != k2]
    step = 1e-4

    def twice_nll(point) -> float:
        return -2.0 * float(theirs.logpdf(point, data)[0])

    hessian = np.zeros((len(free), len(free)))  # central differences
    for a, i in enumerate(free):
        for b, j in enumerate(free):
            corners = []
            for si, sj in ((1, 1), (1, -1), (-1, 1), (-1, -1)):
                point = x.copy()
                point[i] += si * step
                point[j] += sj * step
                corners.append(twice_nll(point))
            hessian[a, b] = (corners[0] - corners[1] - corners[2] + corners[3]) / (4 * step**2)
    reference = np.sqrt(np.diag(np.linalg.inv(0.5 * hessian)))
    np.testing.assert_allclose([uncertainty[c] for c in free], reference, rtol=1e-4)


def test_parameters_without_uncertainty_are_flagged_where_they_are_read(server, tmp_path) -> None:
    """Through the command line: ``fit``, ``ranking`` and ``yields`` warn on stderr naming
    the parameter without uncertainty and answer the others (the ranking's post-fit impacts
    and the post-fit yields' uncertainties finite); where no direction alone is to blame, the
    fit says that the Hessian is not positive definite and answers no uncertainty."""
    path = tmp_path / "ws.json"
    path.write_text(json.dumps(shapefactor_workspace()))
    fitted = client_command(server, "fit", str(path), "--uncertainties")
    assert fitted.returncode == 0, fitted.stderr
    (said,) = warnings_of(fitted.stderr)
    assert "1 of 12 parameters have no uncertainty" in said and "(sf[2])" in said
    uncertainties = json.loads(fitted.stdout)["uncertainties"]
    assert math.isnan(uncertainties["sf"][2])  # null in the JSON answer, NaN as pyhf prints
    assert all(u > 0 for us in uncertainties.values() for u in us if not math.isnan(u))

    ranked = client_command(server, "ranking", str(path))
    assert ranked.returncode == 0, ranked.stderr
    assert any("(sf[2])" in line for line in warnings_of(ranked.stderr))
    ranking_json = json.loads(ranked.stdout)
    k = ranking_json["labels"].index("sf[2]")
    assert ranking_json["postfit_up"][k] is None and ranking_json["poi"]["uncertainty"] > 0
    finite = [u for c, u in enumerate(ranking_json["postfit_up"]) if c != k]
    assert all(u is not None for u in finite) and any(u != 0 for u in finite)

    yields = client_command(server, "yields", str(path))
    assert yields.returncode == 0, yields.stderr
    assert any("(sf[2])" in line for line in warnings_of(yields.stderr))
    assert "null" not in yields.stdout.replace('"goodness_of_fit": null', "")

    path.write_text(json.dumps(shapefactor_workspace(identifiable=False)))
    singular = client_command(server, "fit", str(path), "--uncertainties")
    assert singular.returncode == 0, singular.stderr
    (said,) = warnings_of(singular.stderr)
    assert "the Hessian at the best fit is not positive definite" in said
    assert all(
        math.isnan(u) for us in json.loads(singular.stdout)["uncertainties"].values() for u in us
    )


def test_a_toy_test_counts_its_toys_whose_fits_did_not_converge():
    """stau's first signal point with 750 toys (seed 1): a few toys' fits stop at the
    minimiser's 200 iterations (pyhf's scipy fit of the same toys ends higher, or raises). The
    flag counts them and says the fits to the data converged, rather than doubting every
    number; its slices joined count the same."""
    workspace, patchset, _ = shared_workspace("atlas-susy-2018-04-stau")
    name = patchset["patches"][0]["metadata"]["name"]
    applied = pyhf.PatchSet(patchset).apply(pyhf.Workspace(workspace), name)
    model = HistFactoryModel.from_workspace(applied)
    whole, slices = whole_and_slices(model, 750, 1, 250)
    for result in (whole, join_toy_parts(slices)):
        (status,) = RowStatus.of_hypotests(result)
        failed, toys, data_converged = status.toys
        assert 0 < failed < 10 and toys == 1500 and data_converged
        assert status.converged is False
        (flag,) = status.flags()
        assert flag.kind == "not_converged"
        assert flag.detail.startswith(f"the fits of {failed} of its 1500 toys did not converge")
        assert "off by up to" in flag.detail and "fits to the data converged" in flag.detail
    assert sum(int(s.toys.unconverged) for s in slices) == failed


# --- discovery p-values beyond what the toys (or doubles) resolve --------------------------


def test_a_discovery_p_value_of_zero_is_flagged_with_what_the_toys_bound(server, tmp_path):
    """An excess of about 4.7 sigma: with 100 toys none at mu = 0 is as signal-like as the
    data, so p0_obs is 0 and z_obs null; the flag says p0 < 0.01, Z > 2.33 (each toy's q0
    checked below the data's here), and ``--strict`` exits 1. With asymptotics the same data
    has p0 1.4e-6 (pyhf's) and no flag; an excess of thousands of events has p0 below the smallest
    double (pyhf's 0, Z infinite), where Z = sqrt(q0) asymptotically: pyhf's q0 (scipy at 1e-12)
    gives it, unflagged."""
    spec = two_bins([80.0, 76.0])
    path = tmp_path / "excess.json"
    path.write_text(json.dumps(spec))
    args = ["significance", str(path), "--calctype", "toybased", "--ntoys", "100"]
    run = client_command(server, *args)
    assert run.returncode == 0, run.stderr
    found = json.loads(run.stdout)
    assert found["p0_obs"] == 0.0 and math.isnan(found["z_obs"])
    assert found["p0_exp"] > 0 and math.isfinite(found["z_exp"])
    (warning,) = warnings_of(run.stderr)
    assert warning == (
        "Warning: the result: p0_obs is 0: none of its 100 toys at mu = 0 is as signal-like as "
        "the data, so p0 < 0.01 and Z > 2.33 (z_obs null); more toys (ntoys) resolve it"
    )
    assert_strict_fails(server, args, run.stdout)
    tests = hypotest(
        HistFactoryModel.from_workspace(spec), 0.0, test_stat="q0", calctype="toybased", ntoys=100
    )
    assert tests.toys is not None and (tests.toys.signal[0] < tests.toys.teststat[0]).all()

    run = client_command(server, "significance", str(path))
    assert run.returncode == 0 and warnings_of(run.stderr) == []
    model, data = pyhf_model(spec)
    p0 = float(pyhf.infer.hypotest(0.0, data, model, test_stat="q0"))
    assert 1e-6 < json.loads(run.stdout)["p0_obs"] == pytest.approx(p0, rel=1e-3)

    spec["observations"] = [{"name": "singlechannel", "data": [5000.0, 4000.0]}]
    path.write_text(json.dumps(spec))
    run = client_command(server, "significance", str(path))
    assert run.returncode == 0, run.stderr
    found = json.loads(run.stdout)
    assert found["p0_obs"] == 0.0 and warnings_of(run.stderr) == []
    model, data = pyhf_model(spec)
    assert float(pyhf.infer.hypotest(0.0, data, model, test_stat="q0")) == 0.0
    pyhf.set_backend("numpy", pyhf.optimize.scipy_optimizer(tolerance=1e-12))
    config = model.config
    init, bounds, fixed = (
        config.suggested_init(),
        config.suggested_bounds(),
        config.suggested_fixed(),
    )
    q0 = float(pyhf.infer.test_statistics.q0(0.0, data, model, init, bounds, fixed))
    assert found["z_obs"] == pytest.approx(math.sqrt(q0), rel=1e-7) and found["z_obs"] > 37.5


def test_a_toy_cls_of_zero_over_zero_is_flagged(server, tmp_path):
    """A deficit far below the background (20 and 22 events on 50 and 52): the data are less
    signal-like than every toy of both hypotheses, so the toy CLs is 0 / 0 (pyhf: NaN, where
    its asymptotic CLs is 6e-5); null and flagged, whole and joined from slices."""
    spec = two_bins([20.0, 22.0])
    model, data = pyhf_model(spec)
    assert 1e-5 < float(pyhf.infer.hypotest(1.0, data, model)) < 1e-4
    whole, slices = whole_and_slices(HistFactoryModel.from_workspace(spec), 200, 3, 100)
    for result in (whole, join_toy_parts(slices)):
        assert result.clsb_obs.item() == result.clb_obs.item() == 0.0
        assert math.isnan(result.cls_obs.item())
        ((flag,),) = cls_unresolved(result)
        assert flag.kind == "p_value_unresolved"
        assert flag.detail.startswith("CLs_obs is 0 / 0 (null): the data are less signal-like")
        assert "of its 200 toys at the tested POI and 200 at the background" in flag.detail

    path = tmp_path / "deficit.json"
    path.write_text(json.dumps(spec))
    args = ["cls", str(path), "--calctype", "toybased", "--ntoys", "200"]
    run = client_command(server, *args)
    assert run.returncode == 0, run.stderr
    assert math.isnan(json.loads(run.stdout)["CLs_obs"])
    (warning,) = warnings_of(run.stderr)
    assert warning.startswith("Warning: test_poi 1.0: CLs_obs is 0 / 0 (null)")
    assert_strict_fails(server, args, run.stdout)
    run = client_command(server, "cls", str(path))
    assert run.returncode == 0 and warnings_of(run.stderr) == []


def signal_only_bin(observed: float, shifted: bool = False) -> dict:
    """Two bins; in bin 1 only the signal (scaled by ``mu``) predicts events, ``observed``
    are seen; ``shifted``: a histosys of the background moves bin 1 off 0 (fillable there)."""
    background = {"name": "background", "data": [10.0, 0.0], "modifiers": []}
    background["modifiers"].append(
        {"name": "norm", "type": "normsys", "data": {"hi": 1.1, "lo": 0.9}}
    )
    if shifted:
        shape = {"hi_data": [10.0, 0.5], "lo_data": [10.0, 0.0]}
        background["modifiers"].append({"name": "shape", "type": "histosys", "data": shape})
    signal = {
        "name": "signal",
        "data": [5.0, 3.0],
        "modifiers": [{"name": "mu", "type": "normfactor", "data": None}],
    }
    return {
        "channels": [{"name": "sr", "samples": [signal, background]}],
        "observations": [{"name": "sr", "data": [12.0, observed]}],
        "measurements": [{"name": "m", "config": {"poi": "mu", "parameters": []}}],
        "version": "1.0.0",
    }


def test_events_only_the_signal_can_fill_are_flagged_where_pyhf_fails(server, tmp_path) -> None:
    """A bin with events where only the POI's samples predict any: at POI = 0 the data have
    no probability, so the background-only fits of a hypothesis test have no minimum and
    pyhf's ``hypotest`` raises. ``cls``, ``upper-limit`` and ``significance`` (asymptotic and
    with toys) warn naming the bin, ``--strict`` exits 1; the same workspace without those
    events, or with a background histosys that can fill the bin (its nominal 0: pyhf fails
    there too, from its init, where the bin's rate is 0), is not flagged so."""
    cases = {
        "impossible": signal_only_bin(2.0),
        "empty": signal_only_bin(0.0),
        "fillable": signal_only_bin(2.0, shifted=True),
    }
    for name, spec in cases.items():
        model, data = pyhf_model(spec)
        try:
            pyhf.infer.hypotest(1.0, data, model)
            pyhf_failed = False
        except pyhf.exceptions.FailedMinimization:
            pyhf_failed = True
        if name != "fillable":
            assert pyhf_failed == (name == "impossible"), name
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(spec))
        commands = [
            ["cls", str(path)],
            ["upper-limit", str(path)],
            ["significance", str(path)],
            ["significance", str(path), "--calctype", "toybased", "--ntoys", "200"],
        ]
        for args in commands:
            run = client_command(server, *args)
            assert run.returncode == 0, run.stderr
            said = [w for w in warnings_of(run.stderr) if "only samples scaled by the POI" in w]
            if name != "impossible":
                assert said == [], (name, args, run.stderr)
                continue
            (warning,) = said
            assert "channel 'sr' bin 1 has 2 observed events" in warning, warning
            assert_strict_fails(server, args, run.stdout)
