"""Stacked models (a patchset in one batched model) equal their patches built one at a time."""

from __future__ import annotations

import pyhf
import pytest
import torch
from conftest import WORKSPACES_DIR, load_patchset, shared_workspace
from hand_built import all_modifiers_workspace, with_signal_scale

from pyhf_gpu_server.engine import HistFactoryModel, IncompatibleModelsError

N_PATCHES = 4


@pytest.fixture(scope="module")
def patchset_models(shared_name):
    workspace, patchset, _ = shared_workspace(shared_name)
    names = [p["metadata"]["name"] for p in patchset["patches"]][:N_PATCHES]
    stacked = HistFactoryModel.from_patchset(workspace, patchset, patch_names=names)
    singles = [
        HistFactoryModel.from_workspace(workspace, patches=[pyhf.PatchSet(patchset)[name]])
        for name in names
    ]
    return stacked, singles


def test_stacked_patchset_equals_single_patches(patchset_models):
    stacked, singles = patchset_models
    assert stacked.n_elements == len(singles)
    assert stacked.element_names == [s.element_names[0] for s in singles]
    # background samples are shared between the patches: far fewer variants than samples
    assert stacked.n_variants < sum(s.n_variants for s in singles)
    generator = torch.Generator().manual_seed(7)
    rows = 4 * stacked.n_elements
    element = torch.arange(rows) % stacked.n_elements
    low, high = stacked.bounds[0, :, 0], stacked.bounds[0, :, 1]
    init = stacked.init[0]
    pars = init + 0.1 * (
        torch.rand(rows, stacked.n_pars, generator=generator, dtype=torch.float64) - 0.5
    ) * (high - low)
    pars = torch.maximum(torch.minimum(pars, high), low)
    data = stacked.observed[element]
    expected = stacked.expected_data(pars, element)
    logpdf = stacked.logpdf(pars, data, element)
    for row in range(rows):
        single = singles[int(element[row])]
        torch.testing.assert_close(
            expected[row], single.expected_data(pars[row : row + 1])[0], rtol=1e-12, atol=1e-12
        )
        torch.testing.assert_close(
            logpdf[row],
            single.logpdf(pars[row : row + 1], data[row : row + 1])[0],
            rtol=1e-12,
            atol=0,
        )
        torch.testing.assert_close(stacked.init[int(element[row])], single.init[0])
        torch.testing.assert_close(stacked.observed[int(element[row])], single.observed[0])


def test_stack_of_models_equals_from_patchset(patchset_models):
    stacked, singles = patchset_models
    restacked = HistFactoryModel.stack(singles)
    assert restacked.structure_key == stacked.structure_key
    element = torch.arange(restacked.n_elements)
    pars = restacked.init
    torch.testing.assert_close(
        restacked.expected_data(pars, element), stacked.expected_data(pars, element)
    )


def test_same_structure_other_numbers_stack():
    base = all_modifiers_workspace()
    models = [HistFactoryModel.from_workspace(with_signal_scale(base, s)) for s in (0.5, 1.0, 2.0)]
    assert len({m.structure_key for m in models}) == 1
    stacked = HistFactoryModel.stack(models)
    assert stacked.n_elements == 3
    element = torch.tensor([2, 0, 1])
    pars = stacked.init[element]
    for row, e in enumerate(element.tolist()):
        torch.testing.assert_close(
            stacked.expected_data(pars, element)[row],
            models[e].expected_data(pars[row : row + 1])[0],
        )


def test_different_structures_never_mix():
    base = HistFactoryModel.from_workspace(all_modifiers_workspace())
    other = HistFactoryModel.from_workspace(all_modifiers_workspace(), measurement="other_poi")
    settings = HistFactoryModel.from_workspace(
        all_modifiers_workspace(), modifier_settings={"normsys": {"interpcode": "code1"}}
    )
    simple = HistFactoryModel.from_workspace(
        pyhf.Workspace.build(
            pyhf.simplemodels.uncorrelated_background([1.0], [2.0], [0.5]), [2.0, 16.0]
        )
    )
    for model in (other, settings, simple):
        assert model.structure_key != base.structure_key
        with pytest.raises(IncompatibleModelsError, match="cannot be stacked"):
            HistFactoryModel.stack([base, model])
    with pytest.raises(IncompatibleModelsError, match="devices or dtypes"):
        HistFactoryModel.stack([base, base.to(dtype=torch.float32)])


def _heterogeneous(name: str, file: str, count: int):
    """``count`` patches of a shared heterogeneous/published patchset, stacked and alone."""
    workspace = shared_workspace(name)[0]
    patchset = load_patchset(WORKSPACES_DIR / name / file)
    patches, seen = [], set()
    for patch in patchset["patches"]:  # patches with distinct sets of signal modifiers
        modifiers = frozenset(
            (m["name"], m["type"])
            for op in patch["patch"]
            if op["op"] == "add"
            for m in op["value"].get("modifiers", ())
        )
        if modifiers and modifiers not in seen and len(patches) < count:
            seen.add(modifiers)
            patches.append(patch)
    names = [p["metadata"]["name"] for p in patches]
    stacked = HistFactoryModel.from_patchset(workspace, patchset, patch_names=names)
    singles = [
        HistFactoryModel.from_workspace(workspace, patches=[p["patch"]], name=n)
        for p, n in zip(patches, names, strict=True)
    ]
    return stacked, singles


@pytest.mark.parametrize(
    ("name", "file"),
    [
        ("atlas-susy-2018-04-stau", "patchset.heterogeneous.json"),
        ("atlas-susy-2019-09-3l-onshell", "patchset.heterogeneous.json"),
        ("atlas-susy-2018-31-sbottom-A", "patchset.hepdata.json.gz"),
        ("atlas-susy-2018-31-sbottom-B", "patchset.hepdata.json.gz"),
    ],
)
def test_heterogeneous_patches_stack_and_equal_each_alone(name, file):
    # every patch with its own set of signal modifiers (all 24 of a heterogeneous file)
    stacked, singles = _heterogeneous(name, file, 24)
    # the signals carry different modifier sets: a union of parameters, one model
    assert len({tuple(s.par_names) for s in singles}) > 1
    assert stacked.n_pars >= max(s.n_pars for s in singles)
    assert stacked.stack.n_slots >= 1 and stacked.stack.n_common >= 1
    generator = torch.Generator().manual_seed(3)
    rows = 2 * stacked.n_elements
    element = torch.arange(rows) % stacked.n_elements
    low, high = stacked.bounds[element, :, 0], stacked.bounds[element, :, 1]
    init = stacked.init[element]
    noise = torch.rand(rows, stacked.n_pars, generator=generator, dtype=torch.float64) - 0.5
    pars = torch.where(stacked.fixed[element], init, init + 0.1 * noise * (high - low))
    data = stacked.observed[element]
    expected = stacked.expected_data(pars, element, include_auxdata=False)
    logpdf = stacked.logpdf(pars, data, element)
    deviance = stacked.deviance(pars, data, element)
    _, jacobian = stacked.expected_main_jacobian(pars, element)
    for row in range(rows):
        e = int(element[row])
        single, columns = singles[e], stacked.element_columns(e)
        own = pars[row : row + 1, columns]
        assert stacked.par_names[stacked.poi_index] == single.par_names[single.poi_index]
        assert [stacked.par_names[c] for c in columns] == single.par_names
        torch.testing.assert_close(stacked.init[e, columns], single.init[0], rtol=0, atol=0)
        torch.testing.assert_close(
            expected[row],
            single.expected_data(own, include_auxdata=False)[0],
            rtol=1e-12,
            atol=1e-12,
        )
        own_data = single.observed
        torch.testing.assert_close(data[row, : stacked.n_main], own_data[0, : single.n_main])
        torch.testing.assert_close(
            logpdf[row], single.logpdf(own, own_data)[0], rtol=1e-12, atol=1e-12
        )
        torch.testing.assert_close(
            deviance[row], single.deviance(own, own_data)[0], rtol=1e-12, atol=1e-12
        )
        _, single_jacobian = single.expected_main_jacobian(own)
        torch.testing.assert_close(
            jacobian[row][:, columns], single_jacobian[0], rtol=1e-12, atol=1e-12
        )
        absent = sorted(set(range(stacked.n_pars)) - set(columns))
        assert not jacobian[row][:, absent].any()


def test_a_budget_splits_stacks_by_their_union():
    """Patches that each bring a uniquely named histosys: without a budget one stack (the
    union of them all), with one the groups stay within its parameters and its variants'
    histosys bytes, and an element alone always makes a group."""
    from pyhf_gpu_server.engine.stacking import StackBudget, partition
    from pyhf_gpu_server.engine.translate import WorkspaceTranslator

    spec = all_modifiers_workspace()
    translator = WorkspaceTranslator(spec)
    sample = spec["channels"][0]["samples"][0]
    layouts = [
        translator.element(
            [
                {
                    "op": "add",
                    "path": "/channels/0/samples/0/modifiers/-",
                    "value": {
                        "name": f"own_{k}",
                        "type": "histosys",
                        "data": {
                            "hi_data": [x + 1 for x in sample["data"]],
                            "lo_data": sample["data"],
                        },
                    },
                }
            ],
            f"p{k}",
        )
        for k in range(12)
    ]
    assert partition(layouts) == [list(range(12))]
    n_pars = layouts[0].n_pars
    by_parameters = partition(layouts, StackBudget(n_pars + 3, 2**40))
    assert [len(g) for g in by_parameters] == [4, 4, 4]  # 3 more parameters a group
    one = 8 * layouts[0].samples[0].histosys.shape[0] * layouts[0].n_main
    histosys = len(layouts[0].histosys_params)
    samples = len(layouts[0].samples)
    # room for the first element and two more (one more histosys and sample object each)
    room = one * (histosys + 2) * (samples + 2)
    by_bytes = partition(layouts, StackBudget(10**6, room))
    assert all(len(g) <= 3 for g in by_bytes) and len(by_bytes) >= 4
    assert sorted(i for g in by_bytes for i in g) == list(range(12))
    assert partition(layouts, StackBudget(1, 1)) == [[k] for k in range(12)]
