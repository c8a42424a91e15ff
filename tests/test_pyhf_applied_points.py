"""Every published sbottom point (ATLAS-SUSY-2018-31, A: 217, B: 218), as ``pyhf patchset
apply BkgOnly.json patchset.hepdata.json.gz --name <point>`` writes it, through the client and
a real server: accepted like ``pyhf cls`` accepts it, and its CLs within 1e-4 of pyhf's.

Each published patch removes a validation channel and leaves its observations behind; pyhf
ignores an observation of a channel the workspace does not have (``Workspace.data`` takes the
model's channels' observations by name), and so do the server (each result's
``meta.ignored_observations``, and a log line) and the client (a ``Notice:`` line on stderr),
saying so.

pyhf's answers (``pyhf cls`` defaults: qtilde, mu = 1, asymptotics, numpy/scipy) are computed
once by ``tests/data/pyhf_cls_sbottom_published.py`` into ``pyhf_cls_sbottom_published.json``
(pyhf takes seconds a point on a loaded machine). pyhf's default fits do not always reach the
minimum of its own likelihood (SLSQP stops early, or above a lower minimum; at two points with
almost no signal it prints NaN): where this server differs from that answer by more than
1e-4, the file also holds pyhf's answer with every fit also started from this engine's minima,
the lowest kept (``multistart``), and the server must agree with one of the two at every
point.

Every applied workspace is uploaded with the client: the server's checks of a workspace body,
those a ``pyhf-gpu-client cls p.json`` request passes. Their CLs come from one ``--patchset`` request per region, whose
elements are those same workspaces (the published patches on ``BkgOnly.json``, with
jsonpatch's semantics: ``test_points_are_applied_as_pyhf_applies_them``), stacked into few
engine calls; a few points also go as their own request's workspace (one model each, as
``cls p.json`` sends them) and one through the console script.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path
from typing import Any

import jsonpatch
import orjson
import pytest
from conftest import WORKSPACES_DIR, load_json, load_patchset, shared_workspace
from service_support import ServerProcess, running_server

import pyhf_gpu_client as pgc
from pyhf_gpu_client.workspace import observation_notices

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

REFERENCE = Path(__file__).parent / "data" / "pyhf_cls_sbottom_published.json"
ANALYSES = ("atlas-susy-2018-31-sbottom-A", "atlas-susy-2018-31-sbottom-B")
POINTS = {"atlas-susy-2018-31-sbottom-A": 217, "atlas-susy-2018-31-sbottom-B": 218}
TOL = 1e-4
CLIENT_EXE = Path(sys.executable).with_name("pyhf-gpu-client")
ISSUE_POINT = ("atlas-susy-2018-31-sbottom-B", "sbottom_1400_550_60")  # issue #39's example
# the applied workspace's own background (``pyhf-gpu-client cls p.json``'s request) for these
OWN_BACKGROUND = [
    ("atlas-susy-2018-31-sbottom-A", "sbottom_1000_131_1"),
    ("atlas-susy-2018-31-sbottom-B", "sbottom_1200_250_60"),  # two basins in its free fit
]


def notice(index: int, channel: str) -> str:
    return (
        f"observations[{index}] names channel {channel!r}, which the workspace does not have; "
        "ignored, as pyhf does"
    )


def published_patchset(analysis: str) -> dict[str, Any]:
    return load_patchset(WORKSPACES_DIR / analysis / "patchset.hepdata.json.gz")


@cache
def applied_points(analysis: str) -> dict[str, dict[str, Any]]:
    """Point name -> the workspace ``pyhf patchset apply`` writes for it: pyhf's
    ``PatchSet.apply`` is jsonpatch's ``apply_patch`` on a copy of the background
    (``test_points_are_applied_as_pyhf_applies_them`` holds it to pyhf's own)."""
    text = orjson.dumps(shared_workspace(analysis)[0])  # a copy per point, as pyhf's deepcopy
    return {
        patch["metadata"]["name"]: jsonpatch.apply_patch(orjson.loads(text), patch["patch"], True)
        for patch in published_patchset(analysis)["patches"]
    }


@cache
def pyhf_reference(analysis: str) -> dict[str, dict[str, Any]]:
    """Point name -> pyhf's record (``CLs_obs``, ``CLs_exp`` or ``error``)."""
    return {r["name"]: r for r in load_json(REFERENCE)["results"][analysis]}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    with running_server(tmp_path_factory.mktemp("applied-points")) as process:
        yield process


def test_points_are_applied_as_pyhf_applies_them() -> None:
    pyhf = pytest.importorskip("pyhf")
    for analysis, name in [ISSUE_POINT, ("atlas-susy-2018-31-sbottom-A", "sbottom_1000_131_1")]:
        background = pyhf.Workspace(shared_workspace(analysis)[0])
        published = published_patchset(analysis)  # its point alone: pyhf checks each patch
        one = [p for p in published["patches"] if p["metadata"]["name"] == name]
        theirs = pyhf.PatchSet({**published, "patches": one}).apply(background, name)
        written = json.loads(json.dumps(theirs, indent=4, sort_keys=True))  # --output-file
        assert applied_points(analysis)[name] == written
        assert pgc.digest(written) == pyhf.utils.digest(theirs)


def differences(ours: dict[str, Any], theirs: dict[str, Any] | None) -> tuple[float, float]:
    """(|CLs_obs difference|, largest of it and the CLs_exp ones) between two answers in
    pyhf's JSON (inf where pyhf has none, or printed NaN)."""
    if theirs is None or None in (theirs["CLs_obs"], *theirs["CLs_exp"]):
        return math.inf, math.inf
    observed = abs(ours["CLs_obs"] - theirs["CLs_obs"])
    pairs = zip(ours["CLs_exp"], theirs["CLs_exp"], strict=True)
    return observed, max(observed, *(abs(a - b) for a, b in pairs))


def pyhf_agreement(ours: Any, theirs: dict[str, Any]) -> tuple[str, float, float]:
    """Which of pyhf's answers ``ours`` (a CLsResult or pyhf's JSON) is within TOL of (its
    ``pyhf cls`` default first, else the audit's ``multistart``: pyhf at lower minima of its
    own likelihood), with the :func:`differences` to it; ``""`` and the differences to the
    lowest pyhf answer where neither."""
    if isinstance(ours, pgc.CLsResult):
        ours = {"CLs_obs": ours.cls_obs, "CLs_exp": list(ours.cls_exp)}
    observed, largest = differences(ours, theirs)
    if largest <= TOL:
        return "default", observed, largest
    if "multistart" not in theirs:
        return "", observed, largest
    observed, largest = differences(ours, theirs["multistart"])
    return ("multistart" if largest <= TOL else ""), observed, largest


def assert_agrees_with_pyhf(analysis: str, name: str, ours: Any) -> None:
    kind, _, largest = pyhf_agreement(ours, pyhf_reference(analysis)[name])
    assert kind, (name, ours, largest)


def test_every_published_point_is_accepted_and_its_cls_is_pyhfs(server: ServerProcess) -> None:
    accepted, refused, agreed, off = 0, [], {"default": [], "multistart": []}, {}
    disagreeing = []
    with pgc.Client(server.url, timeout=600) as client:
        for analysis in ANALYSES:
            points, reference = applied_points(analysis), pyhf_reference(analysis)
            assert len(points) == POINTS[analysis] and set(points) == set(reference)
            # each applied workspace passes the server's checks of a workspace body
            with ThreadPoolExecutor(4) as pool:
                ids = list(pool.map(client.upload_workspace, points.values()))
            assert len(set(ids)) == len(points)  # pyhf's digests, all distinct
            accepted += len(ids)
            background, patchset = shared_workspace(analysis)[0], published_patchset(analysis)
            results = client.cls(background, patchset=patchset)
            assert list(results) == list(points)
            for name, ours in results.items():
                theirs = reference[name]
                if "error" in theirs:  # pyhf refuses it (no signal: no POI left): so do we
                    assert isinstance(ours, pgc.PatchError) and ours.status == 422, ours
                    assert "mu_SIG" in ours.detail and "mu_SIG" in theirs["error"]
                    refused.append(name)
                    continue
                assert isinstance(ours, pgc.CLsResult), (name, ours)
                observed = [o["name"] for o in points[name]["observations"]]
                assert ours.meta["ignored_observations"] == [
                    notice(observed.index(c), c) for c in theirs["unmatched_observations"]
                ]
                if not ours.meta["starts_agreed"]:
                    disagreeing.append(name)
                kind, observed_difference, largest = pyhf_agreement(ours, theirs)
                if kind:
                    agreed[kind].append(observed_difference)
                else:
                    off[(analysis, name)] = (observed_difference, largest)
    print(
        f"\n{accepted} applied published points accepted; of {accepted - len(refused)} tested "
        f"(pyhf refuses {refused}, so do we): {len(agreed['default'])} within "
        f"{max(agreed['default']):.1e} of `pyhf cls` (CLs_obs; CLs_exp within {TOL:g}), "
        f"{len(agreed['multistart'])} within {max(agreed['multistart'], default=0):.1e} of "
        f"pyhf at its likelihood's lower minima, apart: {off}; starts disagreed (flagged, "
        f"the lowest kept) at {len(disagreeing)}: {disagreeing}"
    )
    assert accepted == 435 and len(refused) == 1
    assert not off, off
    assert "ignored, as pyhf does" in server.log()  # the server's log says it too


def test_an_applied_point_as_its_own_background(server: ServerProcess) -> None:
    """``pyhf-gpu-client cls p.json``'s request, from Python: the applied workspace is the
    request's workspace (concurrent requests, one model each)."""
    with pgc.Client(server.url, timeout=600) as client, ThreadPoolExecutor(2) as pool:
        specs = [applied_points(analysis)[name] for analysis, name in OWN_BACKGROUND]
        results = list(pool.map(client.cls, specs))
        # a patch that removes the leftover observation leaves nothing to ignore
        removed = [{"op": "remove", "path": "/observations/1"}]
        cleaned = client.cls(specs[-1], patches=[removed])
    for (analysis, name), ours in zip(OWN_BACKGROUND, results, strict=True):
        assert_agrees_with_pyhf(analysis, name, ours)
        assert len(ours.meta["ignored_observations"]) == 1
    assert "ignored_observations" not in cleaned.meta
    assert abs(cleaned.cls_obs - results[-1].cls_obs) <= 1e-9


def test_the_console_script_on_an_applied_point(server: ServerProcess, tmp_path: Path) -> None:
    """Issue #39: ``pyhf patchset apply ... --output-file p.json``, then
    ``pyhf-gpu-client cls p.json`` answers pyhf's CLs and a notice on stderr."""
    analysis, name = ISSUE_POINT
    path = tmp_path / "p.json"
    path.write_text(json.dumps(applied_points(analysis)[name], indent=4, sort_keys=True))
    proc = subprocess.run(
        [str(CLIENT_EXE), "cls", str(path)],
        env={**os.environ, "PYHF_GPU_SERVER": server.url},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == f"Notice: {notice(1, 'VRtt_cuts')}\n"
    ours = json.loads(proc.stdout)
    assert set(ours) == {"CLs_obs", "CLs_exp"}
    assert pyhf_agreement(ours, pyhf_reference(analysis)[name])[0] == "default", ours


def test_a_channel_without_observations_is_still_refused(server: ServerProcess) -> None:
    """Only the leftover observation is lenient: a channel with none stays a 422."""
    analysis, name = ISSUE_POINT
    spec = dict(applied_points(analysis)[name])
    spec["observations"] = [o for o in spec["observations"] if o["name"] != "SR_cuts"]
    with pgc.Client(server.url) as client, pytest.raises(pgc.BadRequestError) as info:
        client.cls(spec)
    assert info.value.status == 422
    assert "channel 'SR_cuts' has no entry in 'observations'" in str(info.value)


def test_the_published_patches_on_the_background_say_it_too(server: ServerProcess) -> None:
    """``--patchset``: the background has the channel, each patch removes it; every tested
    patch's meta says which observation its workspace ignored, the client's notice once."""
    analysis = "atlas-susy-2018-31-sbottom-B"
    names = ["sbottom_1400_550_60", "sbottom_1000_131_1", "sbottom_1500_1495_60"]
    with pgc.Client(server.url, timeout=600) as client:
        results = client.cls(
            shared_workspace(analysis)[0], patchset=published_patchset(analysis), patch_names=names
        )
    tested = {name: r for name, r in results.items() if isinstance(r, pgc.CLsResult)}
    assert sorted(tested) == sorted(names[:2])
    for name, ours in tested.items():
        assert ours.meta["ignored_observations"] == [notice(1, "VRtt_cuts")]
        assert_agrees_with_pyhf(analysis, name, ours)
    assert observation_notices(results) == [f"{notice(1, 'VRtt_cuts')} (in 2 patches)"]
