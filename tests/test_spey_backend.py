"""The spey backend ``pyhf-gpu`` (``pyhf_gpu_client.spey``) against spey-pyhf, computed here.

spey's ``exclusion_confidence_level`` and ``poi_upper_limit`` through our backend (its fits on
a real server, ``POST /likelihood``) must agree with spey-pyhf's (pyhf's numpy backend,
spey's scipy fits) within 1e-4 for ``observed``, ``aposteriori`` and ``apriori``:

- on a small hand-built likelihood (normsys, histosys, staterror, shapesys, lumi; a
  parameter init off its nominal value, so that ``apriori``'s background-only sum is
  tested), CLs and upper limits;
- on a reference patch of each shared workspace that spey-pyhf fits within the time of a test
  (``sig_s1_x1`` of ATLAS-SUSY-2018-31 region B: 60 parameters; the others, 66 to 119
  parameters, take spey-pyhf 15 s a CLs and minutes an upper limit on this machine:
  ``benchmarks/bench_spey.py --parity`` compares every reference patch of every shared
  workspace), CLs computed here, and upper limits against spey-pyhf's in
  ``data/spey_pyhf_upper_limits.json`` (two minutes of its fits; its script writes it);
- the batched helper (``exclusion_confidence_levels``) agrees with the backend, one request.

Upper limits compare relatively (1e-4): spey's root finder stops at ``rtol=1e-4``. Where
spey-pyhf's own fit is imprecise (SLSQP's default ``tol=1e-6`` stops above the minimum of a
flat likelihood), its free minimum lies above ours and the comparison is with spey-pyhf fitted
at ``tol=1e-10``.
"""

from __future__ import annotations

import copy
import json
import logging
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
from hand_built import lumi_setting

#: the loggers' levels before spey loads a backend (spey-pyhf's sets ``pyhf.pdf`` and
#: ``pyhf.workspace`` at CRITICAL when loaded), given back after this module's tests
_LEVELS = {
    name: logger.level
    for name, logger in logging.Logger.manager.loggerDict.items()
    if isinstance(logger, logging.Logger)
}

spey = pytest.importorskip("spey")
pytest.importorskip("spey_pyhf")

from service_support import ServerProcess  # noqa: E402
from workspaces import WORKSPACES_DIR, read_json  # noqa: E402

from pyhf_gpu_client import Client, NotFoundError, WorkspaceId  # noqa: E402
from pyhf_gpu_client.spey import PyhfGpuBackend, exclusion_confidence_levels  # noqa: E402

pytestmark = pytest.mark.timeout(300)
TOLERANCE = 1e-4
EXPECTATIONS = (
    spey.ExpectationType.observed,
    spey.ExpectationType.aposteriori,
    spey.ExpectationType.apriori,
)
SHARED = ("atlas-susy-2018-31-sbottom-B", "sig_s1_x1")
SPEY_PYHF_LIMITS = Path(__file__).parent / "data" / "spey_pyhf_upper_limits.json"


@pytest.fixture(autouse=True, scope="module")
def _quiet_spey() -> Iterator[None]:
    """spey quiet at ERROR while this module runs; every logger's level as it was before, for
    the tests that run next in this process."""
    logging.getLogger("Spey").setLevel(logging.ERROR)
    yield
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if isinstance(logger, logging.Logger):
            logger.setLevel(_LEVELS.get(name, logging.NOTSET))


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[Client]:
    with Client(server.url, timeout=300) as opened:
        yield opened


def hand_built() -> tuple[dict, list[dict]]:
    """A small likelihood as spey-pyhf takes it (a background-only workspace, the patch adding
    the signal): a control and a signal region; lumi, histosys (init 0.3: the apriori data
    are the nominal background sum, not the expectation at the inits), normsys, staterror,
    shapesys."""
    lumi = {"name": "lumi", "type": "lumi", "data": None}
    xsec = {"name": "xsec", "type": "normsys", "data": {"hi": 1.15, "lo": 0.9}}

    def jes(hi: list[float], lo: list[float]) -> dict:
        return {"name": "jes", "type": "histosys", "data": {"hi_data": hi, "lo_data": lo}}

    def stat(name: str, data: list[float]) -> dict:
        return {"name": name, "type": "staterror", "data": data}

    control = [lumi, jes([104.0], [97.0]), xsec, stat("staterror_CR", [4.0])]
    signal_region = [lumi, jes([22.0, 12.5], [18.5, 11.2]), xsec, stat("staterror_SR", [1.5, 1.2])]
    fakes = {"name": "fakes_unc", "type": "shapesys", "data": [1.0, 0.8]}
    background = {
        "channels": [
            {"name": "CR", "samples": [{"name": "bkg", "data": [100.0], "modifiers": control}]},
            {
                "name": "SR",
                "samples": [
                    {"name": "bkg", "data": [20.0, 12.0], "modifiers": signal_region},
                    {"name": "fakes", "data": [5.0, 3.0], "modifiers": [fakes]},
                ],
            },
        ],
        "observations": [{"name": "CR", "data": [103.0]}, {"name": "SR", "data": [27.0, 17.0]}],
        "measurements": [
            {
                "name": "meas",
                "config": {
                    "poi": "mu",
                    "parameters": [lumi_setting(0.02, (0.9, 1.1)), {"name": "jes", "inits": [0.3]}],
                },
            }
        ],
        "version": "1.0.0",
    }
    signal = {
        "name": "signal",
        "data": [4.0, 6.0],
        "modifiers": [
            {"name": "mu", "type": "normfactor", "data": None},
            lumi,
            {"name": "sig_xsec", "type": "normsys", "data": {"hi": 1.1, "lo": 0.9}},
        ],
    }
    return background, [{"op": "add", "path": "/channels/1/samples/2", "value": signal}]


def shared() -> tuple[dict, list[dict]]:
    name, patch_name = SHARED
    background = read_json(WORKSPACES_DIR / name / "BkgOnly.json")
    patchset = read_json(WORKSPACES_DIR / name / "patchset.json")
    patch = next(p for p in patchset["patches"] if p["metadata"]["name"] == patch_name)
    return background, patch["patch"]


def models(background: dict, patch: list[dict], client: Client):
    """Ours and spey-pyhf's statistical models of the same likelihood."""
    ours = spey.get_backend("pyhf-gpu")(
        background_only_model=background, signal_patch=patch, client=client
    )
    theirs = spey.get_backend("pyhf")(background_only_model=background, signal_patch=patch)
    return ours, theirs


def assert_close(ours, theirs, rel: bool, spey_pyhf_tight) -> None:
    """Within 1e-4 of spey-pyhf (relatively for limits); else its fit was imprecise: within
    1e-4 of spey-pyhf fitted tightly."""
    ours, theirs = list(map(float, ours)), list(map(float, theirs))
    if all(
        math.isclose(a, b, rel_tol=rel * TOLERANCE, abs_tol=(not rel) * TOLERANCE)
        for a, b in zip(ours, theirs, strict=True)
    ):
        return
    tight = list(map(float, spey_pyhf_tight()))
    assert ours == pytest.approx(tight, rel=rel * TOLERANCE, abs=(not rel) * TOLERANCE), (
        ours,
        theirs,
        tight,
    )


def as_list(value) -> list[float]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def test_hand_built_cls_and_upper_limits_agree_with_spey_pyhf(client: Client) -> None:
    background, patch = hand_built()
    ours, theirs = models(background, patch, client)
    for expected in EXPECTATIONS:
        assert_close(
            ours.exclusion_confidence_level(expected=expected),
            theirs.exclusion_confidence_level(expected=expected),
            False,
            lambda e=expected: theirs.exclusion_confidence_level(expected=e, tol=1e-10),
        )
        assert_close(
            as_list(ours.poi_upper_limit(expected=expected)),
            as_list(theirs.poi_upper_limit(expected=expected)),
            True,
            lambda e=expected: as_list(
                theirs.poi_upper_limit(expected=e, optimiser_arguments={"tol": 1e-10})
            ),
        )
    # the likelihood itself: spey's -log L at POI 1 and the free fit, as spey-pyhf's
    assert ours.likelihood(1.0) == pytest.approx(theirs.likelihood(1.0), abs=1e-5)


def test_shared_workspace_cls_agree_with_spey_pyhf(client: Client) -> None:
    background, patch = shared()
    ours, theirs = models(background, patch, client)
    # "all": the observed 1 - CLs and the expected set of the fits to the data (aposteriori)
    for expected in ("all", spey.ExpectationType.apriori):
        found = ours.exclusion_confidence_level(expected=expected)
        reference = theirs.exclusion_confidence_level(expected=expected)
        flat = (lambda v: [*v[0], *v[1]]) if expected == "all" else list
        assert_close(
            flat(found),
            flat(reference),
            False,
            lambda e=expected, f=flat: f(theirs.exclusion_confidence_level(expected=e, tol=1e-10)),
        )


@pytest.mark.slow
def test_shared_workspace_upper_limits_agree_with_spey_pyhf(client: Client) -> None:
    """spey's ``poi_upper_limit`` (its own root search over our likelihoods) on the published
    sbottom-B point, for each expectation type, as spey-pyhf's (1e-4 relative): spey-pyhf's
    limits (two minutes of its fits) are read from ``data/spey_pyhf_upper_limits.json``, which
    ``data/spey_pyhf_upper_limits.py`` writes; the hand-built limits above are computed here."""
    reference = json.loads(SPEY_PYHF_LIMITS.read_text())
    assert (reference["workspace"], reference["patch"]) == SHARED
    background, patch = shared()
    ours = spey.get_backend("pyhf-gpu")(
        background_only_model=background, signal_patch=patch, client=client
    )
    for expected in EXPECTATIONS:
        theirs = reference["limits"][str(expected)]
        assert_close(
            as_list(ours.poi_upper_limit(expected=expected)),
            theirs["default"],
            True,
            lambda t=theirs: t["tol=1e-10"],
        )


def test_batched_helper_answers_many_patches_in_one_request(client: Client, server) -> None:
    background, patch = hand_built()
    scaled = copy.deepcopy(patch)
    scaled[0]["value"]["data"] = [2 * v for v in scaled[0]["value"]["data"]]
    patches = {"nominal": patch, "doubled": scaled}
    for expected in EXPECTATIONS:
        batched = exclusion_confidence_levels(background, patches, expected=expected, client=client)
        for name, signal in patches.items():
            one = spey.get_backend("pyhf-gpu")(
                background_only_model=background, signal_patch=signal, client=client
            )
            assert batched[name] == pytest.approx(
                one.exclusion_confidence_level(expected=expected), abs=1e-6
            )
    assert list(exclusion_confidence_levels(background, [patch], client=client)[0]) == (
        pytest.approx(exclusion_confidence_levels(background, patches, client=client)["nominal"])
    )


def test_one_cls_costs_one_request(client: Client) -> None:
    background, patch = hand_built()
    backend = PyhfGpuBackend(patch, background, client=client)
    calls = []
    ask = backend.client.likelihood

    class Counting:
        def likelihood(self, *args, **kwargs):
            calls.append(kwargs)
            return ask(*args, **kwargs)

    backend.client = Counting()
    model = spey.StatisticalModel(backend, analysis="hand-built")
    model.exclusion_confidence_level()  # built with POI 1's fits: none more
    assert calls == []
    model.exclusion_confidence_level(expected=spey.ExpectationType.apriori)
    model.exclusion_confidence_level(poi_test=2.0, expected=spey.ExpectationType.apriori)
    assert len(calls) == 2


def test_uploaded_background_and_a_bad_id(client: Client) -> None:
    background, patch = hand_built()
    workspace_id = client.upload_workspace(background)
    by_id = spey.get_backend("pyhf-gpu")(
        background_only_model=WorkspaceId(workspace_id), signal_patch=patch, client=client
    )
    inline = spey.get_backend("pyhf-gpu")(
        background_only_model=background, signal_patch=patch, client=client
    )
    assert by_id.exclusion_confidence_level() == pytest.approx(inline.exclusion_confidence_level())
    with pytest.raises(NotFoundError, match="404"):
        PyhfGpuBackend(patch, WorkspaceId("0" * 64), client=client)


def test_background_from_a_path(client: Client, tmp_path: Path) -> None:
    import json

    background, patch = hand_built()
    path = tmp_path / "BkgOnly.json"
    path.write_text(json.dumps(background))
    from_path = PyhfGpuBackend(patch, str(path), client=client)
    assert (
        from_path.config().parameter_names
        == PyhfGpuBackend(patch, background, client=client).config().parameter_names
    )


def test_likelihood_route_refuses_bad_input(server: ServerProcess) -> None:
    background, patch = hand_built()
    body = {"workspace": background, "patches": [patch]}
    with server.client() as http:
        for options, words in (
            ({"data": [1.0, 2.0]}, "'data' has 2 values"),
            ({"parameters": [1.0]}, "'parameters' has 1 values"),
            ({"poi_bounds": [3.0, 1.0]}, "low < high"),
            ({"asimov": "qq"}, "asimov"),
        ):
            response = http.post("/likelihood", json={**body, **options})
            assert response.status_code == 422, response.text
            assert words in response.text


def test_expected_data_logpdf_and_sampler_as_spey_pyhf(client: Client) -> None:
    background, patch = hand_built()
    ours, theirs = models(background, patch, client)
    pars = [v + 0.05 for v in theirs.backend.config().suggested_init]
    assert ours.backend.expected_data(pars) == pytest.approx(
        list(theirs.backend.expected_data(pars)), rel=1e-10
    )
    assert ours.backend.get_logpdf_func()(pars) == pytest.approx(
        float(theirs.backend.get_logpdf_func()(pars)), rel=1e-10
    )
    toys = ours.backend.get_sampler(pars)(4)
    n_main = 3
    assert toys.shape == (4, len(ours.backend.expected_data(pars)))
    assert (toys[:, :n_main] == toys[:, :n_main].round()).all()
