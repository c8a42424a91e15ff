"""Long hypotheses cut in parts: a ranking with more ranked parameters than
:data:`~pyhf_gpu_server.service.operations.ranking.RANK_BLOCK`, and a large model's toys
(:func:`~pyhf_gpu_server.service.operations.base.toy_part_size`), run as one row per part (so
a job's progress moves and the device serves others between parts), and the parts joined
answer what the whole hypothesis answers."""

from __future__ import annotations

import numpy as np
import pyhf
import pytest
import torch
from conftest import shared_workspace
from hand_built import all_modifiers_workspace
from service_support import wait_for_job
from test_inference_support import DEVICE, one_thread  # noqa: F401 (fixture)

from pyhf_gpu_server.engine import HistFactoryModel
from pyhf_gpu_server.execution import EngineRows
from pyhf_gpu_server.inference import FitOptions, ranking
from pyhf_gpu_server.inference.hypotest import hypotest
from pyhf_gpu_server.inference.ranking import ranked_parameters
from pyhf_gpu_server.inference.toys import TOY_BLOCK, ToySlice
from pyhf_gpu_server.service.operations import ranking as ranking_operation
from pyhf_gpu_server.service.operations.base import toy_part_size
from pyhf_gpu_server.service.operations.ranking import RANKED, Ranking, ranking_answer
from pyhf_gpu_server.service.requests import Row
from pyhf_gpu_server.service.schemas import RankingOptions

pytestmark = pytest.mark.usefixtures("one_thread")


def published_model(name: str, patches: int = 1) -> HistFactoryModel:
    workspace, patchset, _ = shared_workspace(name)
    names = [p["metadata"]["name"] for p in patchset["patches"]][:patches]
    return HistFactoryModel.from_patchset(workspace, patchset, patch_names=names, device=DEVICE)


def engine_rows(model: HistFactoryModel, elements: list[int], parts: list) -> EngineRows:
    """Rows as the engine call builds them (``EngineCall.engine_rows``)."""
    element = torch.tensor(elements, dtype=torch.long, device=model.device)
    columns = [model.element_columns(e) for e in elements]
    return EngineRows(element, None, columns, FitOptions(), None, parts)


def assert_same_answer(one, other, atol: float) -> None:
    """Two ranking row results: the same parameters in the same order, the same numbers."""
    a, b = one.answer.model_dump(), other.answer.model_dump()
    assert a["labels"] == b["labels"]
    assert a["fits_converged"] == b["fits_converged"]
    for name in RANKED:
        np.testing.assert_allclose(a[name], b[name], rtol=0, atol=atol, err_msg=name)
    assert a["poi"]["name"] == b["poi"]["name"]
    np.testing.assert_allclose(a["poi"]["bestfit"], b["poi"]["bestfit"], rtol=0, atol=atol)
    assert one.status == other.status
    assert one.flags == other.flags


def pyhf_ranked(model: pyhf.Model, names: list[str] | None = None) -> list[str]:
    """The labels cabinetry's ranking refits on a pyhf model: its free parameters but the
    POI (``suggested_fixed``), those ``names`` names (labels or set names) if given."""
    fixed = model.config.suggested_fixed()
    free = [
        label
        for j, label in enumerate(model.config.par_names)
        if not fixed[j] and j != model.config.poi_index
    ]
    if names is None:
        return free
    named = [
        label for name in names for label in free if label.split("[")[0] == name or label == name
    ]
    return list(dict.fromkeys(named))


@pytest.mark.parametrize(
    "name", ["atlas-susy-2018-04-stau", "atlas-susy-2018-31-sbottom-B"], ids=["stau", "sbottom"]
)
def test_ranked_parameters_are_pyhfs_free_parameters(name):
    """The parts are cut from the element's layout before any model is built: its free
    parameters but the POI in pyhf's order, or the named ones in their order, as pyhf's model
    of the same patch has them; and the ranking refits those."""
    model = published_model(name)
    layout = model.elements[0]
    workspace, patchset, _ = shared_workspace(name)
    first = patchset["patches"][0]["metadata"]["name"]
    theirs = pyhf.PatchSet(patchset).apply(pyhf.Workspace(workspace), first).model()
    named = [layout.parameters[-1].name, layout.par_names[1], "lumi"]
    for names in (None, named):
        labels = [layout.par_names[j] for j in ranked_parameters(layout, names)]
        assert labels == pyhf_ranked(theirs, names) and len(labels) > 2
        ranked = ranking(model, parameters=names)
        assert [ranked.labels[c] for c in ranked.columns[0]] == labels
    every = all_modifiers_workspace()
    named = ["xsec", "stat_shared", "bkg1_norm"]  # stat_shared has a fixed (zero-count) bin
    layout = HistFactoryModel.from_workspace(every, device=DEVICE).elements[0]
    labels = [layout.par_names[j] for j in ranked_parameters(layout, named)]
    assert labels == pyhf_ranked(pyhf.Workspace(every).model(), named)


def test_parts_joined_answer_as_the_whole(monkeypatch):
    """stau's 118 ranked parameters dealt into three parts of at most 40 (three rows of one
    call, besides another patch's whole row), joined: the whole ranking's parameters, order
    (ties in pyhf's order), impacts, status and flags; and with ``top``, its largest impacts."""
    model = published_model("atlas-susy-2018-04-stau", patches=2)
    operation = Ranking()
    whole = operation.run(model, engine_rows(model, [0, 1], [None, None]), RankingOptions())
    monkeypatch.setattr(ranking_operation, "RANK_BLOCK", 40)
    parts = operation.parts(RankingOptions(), model.elements[0])
    assert parts == [(0, 3), (1, 3), (2, 3)]
    for top in (None, 7):
        options = RankingOptions(top=top)
        rows = engine_rows(model, [0, 0, 0, 1], [*parts, None])
        results = operation.run(model, rows, options)
        assert all(r.part is not None for r in results[:3]) and results[3].part is None
        layout = model.elements[0]
        ranked = [layout.par_names[j] for j in ranked_parameters(layout, None)]
        for k, result in enumerate(results[:3]):  # every third: 40, 39 and 39 of them
            assert sorted(result.answer.labels) == sorted(ranked[k::3])
        joined = operation.join(results[:3])
        expected = whole[0]
        if top is not None:
            expected = operation.run(model, engine_rows(model, [0], [None]), options)[0]
            assert len(joined.answer.labels) == top
        assert_same_answer(joined, expected, atol=1e-7)
        assert_same_answer(
            results[3], operation.run(model, engine_rows(model, [1], [None]), options)[0], atol=1e-7
        )


def injected_workspace(bins: int = 270, seed: int = 5) -> dict:
    """A generated search of ``bins`` bins (a shapesys gamma each, a normsys, a floating
    minor background): more ranked parameters than one part holds, and data with signal at
    1.5 times its nominal rate, so that the POI's best fit lies inside its bounds and the
    impacts are not 0."""
    rng = np.random.default_rng(seed)
    signal = 5 + 20 * np.exp(-0.5 * ((np.arange(bins) - bins / 3) / 20) ** 2)
    background = rng.uniform(50, 200, bins)
    minor = rng.uniform(5, 20, bins)
    observed = rng.poisson(background + minor + 1.5 * signal).astype(float)
    samples = [
        ("signal", signal, [{"name": "mu", "type": "normfactor", "data": None}]),
        (
            "background",
            background,
            [
                {"name": "shape", "type": "shapesys", "data": (0.05 * background).tolist()},
                {"name": "bkg_norm", "type": "normsys", "data": {"hi": 1.1, "lo": 0.9}},
            ],
        ),
        ("minor", minor, [{"name": "minor_norm", "type": "normfactor", "data": None}]),
    ]
    return {
        "channels": [
            {
                "name": "sr",
                "samples": [
                    {"name": name, "data": data.tolist(), "modifiers": modifiers}
                    for name, data, modifiers in samples
                ],
            }
        ],
        "observations": [{"name": "sr", "data": observed.tolist()}],
        "measurements": [{"name": "m", "config": {"poi": "mu", "parameters": []}}],
        "version": "1.0.0",
    }


@pytest.mark.slow
def test_a_large_ranking_runs_in_parts_on_a_server(client):
    """Through a real server: a 272-parameter ranking as a job counts its two parts in its
    progress, and answers as the synchronous request (whose parts run one engine call each,
    as a job's) and as the whole ranking in process (the free fit of each part in its own
    row, the parts' refits joined)."""
    workspace = injected_workspace()
    accepted = client.post("/jobs", json={"operation": "ranking", "workspace": workspace})
    assert accepted.status_code == 202, accepted.text
    job = wait_for_job(client, accepted.json()["id"], timeout_s=300)
    assert job["status"] == "succeeded", job
    assert job["progress"] == {"done": 2, "total": 2}
    result = job["result"]
    answered = client.post("/ranking", json={"workspace": workspace, "top": 20})
    assert answered.status_code == 200, answered.text
    top = answered.json()
    assert top["meta"]["batch_rows"] == 1  # a part at a time, in the jobs lane, even so
    assert top["labels"] == result["labels"][:20]
    np.testing.assert_allclose(top["postfit_up"], result["postfit_up"][:20], rtol=0, atol=1e-8)

    model = HistFactoryModel.from_workspace(workspace, device=DEVICE)
    whole = ranking_answer(ranking(model)).model_dump()
    assert 0.5 < whole["poi"]["bestfit"] < 3.0  # the injected signal: impacts not all 0
    assert len(result["labels"]) == 272 and result["labels"] == whole["labels"]
    for name in RANKED:
        ours = np.array([np.nan if v is None else v for v in result[name]])
        np.testing.assert_allclose(ours, whole[name], rtol=0, atol=1e-6, err_msg=name)
    assert result["meta"]["converged"] is True


@pytest.mark.slow
def test_a_large_models_toys_run_in_finer_parts_on_a_server(client):
    """Through a real server: the 272-parameter search's toys are cut finer than a block
    (parts of 46 toys), counted in a job's progress, and the parts joined answer as the
    synchronous request and as the whole row's toys drawn at once in process (each part
    draws its blocks whole and keeps its share: the same toys however the row is cut)."""
    workspace, mu = injected_workspace(), 1.6
    body = {"test_poi": mu, "calctype": "toybased", "ntoys": 100, "seed": 7}
    model = HistFactoryModel.from_workspace(workspace, device=DEVICE)
    assert toy_part_size(model.elements[0]) == 46 < TOY_BLOCK
    accepted = client.post("/jobs", json={"operation": "cls", "workspace": workspace, **body})
    assert accepted.status_code == 202, accepted.text
    job = wait_for_job(client, accepted.json()["id"], timeout_s=300)
    assert job["status"] == "succeeded", job
    assert job["progress"] == {"done": 3, "total": 3}  # 46 + 46 + 8 toys
    answered = client.post("/cls", json={"workspace": workspace, **body})
    assert answered.status_code == 200, answered.text
    for result in (job["result"], answered.json()):
        assert result["meta"]["converged"] is True

    key = Row("", mu, (0, 100)).toy_slice(100).key  # the bare workspace's element: ""
    whole = hypotest(
        model, mu, calctype="toybased", ntoys=100, seed=7, toys=[ToySlice(key, 0, 100)]
    )
    assert 0.0 < float(whole.cls_obs[0]) < 1.0
    for result in (job["result"], answered.json()):
        assert result["CLs_obs"] == pytest.approx(float(whole.cls_obs[0]), abs=1e-12)
        assert result["CLs_exp"] == pytest.approx(whole.cls_exp[0].tolist(), abs=1e-12)
