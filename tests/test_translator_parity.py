"""The translator (workspace JSON -> ElementLayout, no pyhf.Model) equals read_model of pyhf's
model exactly: shared workspaces and patchsets, pyhf's simple models, the hand-built models,
random workspaces (hypothesis); warm patches equal a fresh translation; errors are pyhf's."""

from __future__ import annotations

import copy
import doctest
import gzip
import hashlib
import json
from dataclasses import fields
from functools import cache

import jsonpatch
import jsonpointer
import numpy as np
import pyhf
import pytest
from conftest import WORKSPACE_NAMES, WORKSPACES_DIR, load_json
from hand_built import all_modifiers_workspace, with_signal_scale
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from workspaces import workspace_file

from pyhf_gpu_server.engine import patching, reading, translate
from pyhf_gpu_server.engine.errors import (
    DuplicateNameError,
    InvalidWorkspaceError,
    UnsupportedModelError,
)
from pyhf_gpu_server.engine.layout import ElementLayout, SampleLayout, read_model
from pyhf_gpu_server.engine.stacking import StackLayout
from pyhf_gpu_server.engine.translate import WorkspaceTranslator

settings.register_profile(
    "translator", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
HEAVY = "atlas-susy-2019-09-3l-onshell"  # 0.3 s per pyhf model: sampled more sparsely


# ---------------------------------------------------------------------------------- helpers
def assert_layouts_equal(actual: ElementLayout, expected: ElementLayout) -> None:
    """Field by field: arrays of the same dtype and shape, exactly equal; the rest equal."""
    for field in fields(ElementLayout):
        a, e = getattr(actual, field.name), getattr(expected, field.name)
        if field.name == "samples":
            assert [s.name for s in a] == [s.name for s in e]
            for sa, se in zip(a, e, strict=True):
                for sample_field in fields(SampleLayout):
                    _assert_values_equal(
                        getattr(sa, sample_field.name),
                        getattr(se, sample_field.name),
                        f"samples[{se.name}].{sample_field.name}",
                    )
        else:
            _assert_values_equal(a, e, field.name)


def _assert_values_equal(actual, expected, where: str) -> None:
    if isinstance(expected, np.ndarray):
        assert isinstance(actual, np.ndarray), where
        assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape), where
        np.testing.assert_array_equal(actual, expected, err_msg=where)
    else:
        assert actual == expected, where


def pyhf_layout(spec, measurement=None, modifier_settings=None, name="nominal") -> ElementLayout:
    """read_model of pyhf's model of ``spec`` (the oracle)."""
    workspace = pyhf.Workspace(spec, validate=False)
    options = {} if modifier_settings is None else {"modifier_settings": modifier_settings}
    model = workspace.model(measurement_name=measurement, validate=False, **options)
    return read_model(model, workspace.data(model), name)


def outcome(function, *args, **kwargs):
    """The result of a call, or its exception."""
    try:
        return function(*args, **kwargs)
    except Exception as error:
        return error


# pyhf fails with these where the translator raises a pyhf or engine error (translate.py docs)
DOCUMENTED_DEVIATIONS = (AssertionError, TypeError)


def assert_same_outcome(spec, **options) -> None:
    """translate and pyhf + read_model agree: the same layout, or the same error."""
    expected = outcome(pyhf_layout, spec, **options)
    assert_outcomes_equal(outcome(translate.translate, spec, validate=False, **options), expected)


def assert_outcomes_equal(actual, expected) -> None:
    """Equal layouts, or errors of one class and message (or a documented deviation)."""
    if isinstance(expected, ElementLayout):
        assert isinstance(actual, ElementLayout), actual
        assert_layouts_equal(actual, expected)
    elif isinstance(expected, DOCUMENTED_DEVIATIONS):
        assert isinstance(actual, pyhf.exceptions.InvalidModel | UnsupportedModelError), actual
    else:
        assert (type(actual), str(actual)) == (type(expected), str(expected))


def digest(document) -> str:
    return hashlib.sha256(json.dumps(document, sort_keys=True).encode()).hexdigest()


@cache
def patchset(name: str, filename: str) -> dict:
    path = WORKSPACES_DIR / name / filename
    if path.suffix == ".gz":
        return json.loads(gzip.decompress(path.read_bytes()))
    return load_json(path)


def background(name: str) -> dict:
    return load_json(WORKSPACES_DIR / name / "BkgOnly.json")


def patchsets_of(name: str) -> list[str]:
    folder = WORKSPACES_DIR / name
    names = ["patchset.json", "patchset.heterogeneous.json", "patchset.hepdata.json.gz"]
    return [n for n in names if workspace_file(folder, n).exists()]


def sampled(patches: list[dict], count: int) -> list[dict]:
    """``count`` patches spread over the set (all if fewer)."""
    if len(patches) <= count:
        return patches
    return [patches[i] for i in np.linspace(0, len(patches) - 1, count).round().astype(int)]


SHARED_SETS = [(w, p) for w in WORKSPACE_NAMES for p in patchsets_of(w)]


# ------------------------------------------------------------------- shared workspaces
@pytest.fixture(scope="module")
def translators() -> dict[str, WorkspaceTranslator]:
    return {name: WorkspaceTranslator(background(name)) for name in WORKSPACE_NAMES}


@pytest.mark.parametrize("name", WORKSPACE_NAMES)
def test_background_only_workspaces(name):
    """As published (POI mu_SIG, not in the model: pyhf's error) and without a POI."""
    spec = background(name)
    expected = outcome(pyhf_layout, spec)
    with pytest.raises(pyhf.exceptions.InvalidModel) as error:
        translate.translate(spec)
    assert str(error.value) == str(expected)

    without_poi = copy.deepcopy(spec)
    for measurement in without_poi["measurements"]:
        measurement["config"]["poi"] = ""
    assert_layouts_equal(translate.translate(without_poi), pyhf_layout(without_poi))


@pytest.mark.slow
@pytest.mark.parametrize(("name", "filename"), SHARED_SETS)
def test_patched_workspaces_match_pyhf(name, filename):
    """A sample of each patchset (20 of the published hepdata ones; 6 for the heavy one)."""
    count = 6 if name == HEAVY else 20 if filename.endswith(".gz") else 24
    for patch in sampled(patchset(name, filename)["patches"], count):
        spec = jsonpatch.apply_patch(background(name), patch["patch"])
        label = patch["metadata"]["name"]
        assert_outcomes_equal(
            outcome(translate.translate, spec, name=label), outcome(pyhf_layout, spec, name=label)
        )


@pytest.mark.parametrize(("name", "filename"), SHARED_SETS)
def test_warm_patches_equal_fresh_translations(name, filename, translators):
    """Every patch (40 of the hepdata ones) on one warm translator; the background unchanged."""
    spec = background(name)
    before = digest(spec)
    translator = translators[name]
    for patch in sampled(patchset(name, filename)["patches"], 40):
        label = patch["metadata"]["name"]
        patched = jsonpatch.apply_patch(spec, patch["patch"])
        assert_outcomes_equal(
            outcome(translator.element, patch["patch"], label),
            outcome(translate.translate, patched, name=label),
        )
    assert digest(spec) == before


def test_background_samples_share_their_histosys_arrays_between_patches():
    """A background sample's histosys array is kept (read-only) while the model's histosys
    names stay; a patch that brings a new histosys name numbers them anew."""
    name = "atlas-susy-2018-04-stau"
    translator = WorkspaceTranslator(background(name))
    first, second = patchset(name, "patchset.heterogeneous.json")["patches"][:2]
    one = translator.element(first["patch"], "one")
    two = translator.element(second["patch"], "two")
    assert one.histosys_params == two.histosys_params
    shared = [
        (a, b)
        for a, b in zip(one.samples, two.samples, strict=True)
        if a.name != "signal" and a.histosys.any()
    ]
    assert shared and all(a.histosys is b.histosys for a, b in shared)
    assert not any(a.histosys.flags.writeable for a, _ in shared)
    signal = next(i for i, s in enumerate(one.samples) if s.name == "signal")
    assert one.samples[signal].histosys is not two.samples[signal].histosys

    extra = {
        "name": "extra_shape",
        "type": "histosys",
        "data": {"hi_data": [1.0], "lo_data": [0.5]},
    }
    ops = copy.deepcopy(first["patch"])
    ops[0]["value"]["modifiers"].append(extra)
    renumbered = translator.element(ops, "three")
    assert len(renumbered.histosys_params) == len(one.histosys_params) + 1
    assert_layouts_equal(
        renumbered, translate.translate(jsonpatch.apply_patch(background(name), ops), name="three")
    )
    assert_layouts_equal(
        translator.element(first["patch"], "one"),
        translate.translate(jsonpatch.apply_patch(background(name), first["patch"]), name="one"),
    )


def test_background_samples_are_one_object_for_patches_numbered_alike():
    """Published signal points with the same parameters: every background sample is the same
    object in their elements (from the second on), so a stack remaps it once; each layout
    still equals the patched workspace translated afresh, and a patch that renumbers the
    parameters gets its own."""
    name = "atlas-susy-2018-31-sbottom-B"
    patches = {
        p["metadata"]["name"]: p["patch"]
        for p in patchset(name, "patchset.hepdata.json.gz")["patches"][:40]
        if len(p["patch"]) > 1
    }
    translator = WorkspaceTranslator(background(name))
    by_numbering: dict[tuple[str, ...], list[ElementLayout]] = {}
    for label, ops in patches.items():
        element = translator.element(ops, label)
        by_numbering.setdefault(tuple(p.name for p in element.parameters), []).append(element)
    # kept from a numbering's second element on: the second and third share
    one, two = next(group for group in by_numbering.values() if len(group) > 2)[1:3]
    own = {s["name"] for channel in background(name)["channels"] for s in channel["samples"]}
    theirs = {s.name: s for s in two.samples}
    assert [s is theirs.get(s.name) for s in one.samples] == [s.name in own for s in one.samples]
    for element in (one, two):
        spec = jsonpatch.apply_patch(background(name), patches[element.name])
        assert_layouts_equal(element, translate.translate(spec, name=element.name))
    assert StackLayout([one, two]).n_variants == len(one.samples) + 1  # one signal more

    ops = copy.deepcopy(patches[one.name])
    ops[0]["value"]["modifiers"].append({"name": "extra_norm", "type": "normfactor", "data": None})
    renumbered = translator.element(ops, "renumbered")
    assert not any(a is b for a, b in zip(one.samples, renumbered.samples, strict=True))
    spec = jsonpatch.apply_patch(background(name), ops)
    assert_layouts_equal(renumbered, translate.translate(spec, name="renumbered"))


def test_empty_patch_is_the_background(translators):
    name = WORKSPACE_NAMES[0]
    with pytest.raises(pyhf.exceptions.InvalidModel, match="mu_SIG"):
        translators[name].element([], "nominal")
    spec = copy.deepcopy(background(name))
    spec["measurements"][0]["config"]["poi"] = ""
    expected = translate.translate(spec, name="x")
    assert_layouts_equal(WorkspaceTranslator(spec).element([], "x"), expected)
    ops = [{"op": "replace", "path": "/measurements/0/config/poi", "value": ""}]
    assert_layouts_equal(translators[name].element(ops, "x"), expected)


# ----------------------------------------------------------------- pyhf's and ours
def _workspace_of(model: pyhf.Model, observed) -> dict:
    return {
        "channels": model.spec["channels"],
        "observations": [{"name": c, "data": observed} for c in model.config.channels],
        "measurements": [
            {"name": "m", "config": {"poi": "mu", "parameters": model.spec.get("parameters", [])}}
        ],
        "version": "1.0.0",
    }


@pytest.mark.parametrize(
    "model",
    [
        pyhf.simplemodels.uncorrelated_background([5.0, 10.0], [50.0, 60.0], [5.0, 12.0]),
        pyhf.simplemodels.uncorrelated_background([5.0, 0.0], [0.0, 60.0], [5.0, 0.0]),
        pyhf.simplemodels.correlated_background(
            [12.0, 11.0], [50.0, 52.0], [45.0, 57.0], [55.0, 47.0]
        ),
    ],
    ids=["uncorrelated", "uncorrelated_zero_bins", "correlated"],
)
def test_pyhf_simple_models(model):
    assert_same_outcome(_workspace_of(model, [51.0, 48.0]))


def test_names_given_as_numpy_strings_read_as_python_strings():
    """A workspace built in Python may name modifiers with ``numpy.str_`` (pyhf takes them);
    the same layout as from plain strings."""
    spec = all_modifiers_workspace()
    given = copy.deepcopy(spec)
    for channel in given["channels"]:
        for sample in channel["samples"]:
            for modifier in sample["modifiers"]:
                modifier["name"], modifier["type"] = map(
                    np.str_, (modifier["name"], modifier["type"])
                )
    assert_layouts_equal(translate.translate(given), translate.translate(spec))


SETTINGS = [
    None,
    {},
    {"histosys": {"interpcode": "code0"}},
    {"histosys": {"interpcode": "code2"}, "normsys": {"interpcode": "code1"}},
    {"normsys": {"interpcode": "code4"}, "histosys": {"interpcode": "code4p"}},
]


@pytest.mark.parametrize("modifier_settings", SETTINGS)
@pytest.mark.parametrize("measurement", ["meas", "other_poi", None])
@pytest.mark.parametrize("scale", [1.0, 3.5])
def test_hand_built_models(modifier_settings, measurement, scale):
    spec = with_signal_scale(all_modifiers_workspace(), scale)
    options = {"measurement": measurement, "modifier_settings": modifier_settings}
    assert_layouts_equal(translate.translate(spec, **options), pyhf_layout(spec, **options))
    translator = WorkspaceTranslator(all_modifiers_workspace(), **options)
    ops = jsonpatch.make_patch(all_modifiers_workspace(), spec).patch
    assert_layouts_equal(translator.element(ops, "nominal"), translate.translate(spec, **options))


# ------------------------------------------------------------ random workspaces (hypothesis)
CHANNELS = ["SR", "CR_b", "VR"]
SAMPLES = ["signal", "bkg", "ttbar", "zjets"]
finite = st.floats(0.0, 60.0, allow_nan=False).map(lambda x: round(x, 3))
positive = st.floats(0.5, 60.0, allow_nan=False).map(lambda x: round(x, 3))


@st.composite
def workspaces(draw):
    """1-3 channels of 1-4 bins, 1-4 samples, all seven modifier types with names shared
    between samples and channels, measurement settings; sometimes invalid (pyhf's errors)."""
    channel_names = draw(st.lists(st.sampled_from(CHANNELS), min_size=1, max_size=3, unique=True))
    channels, observations, names = [], [], set()
    for cname in channel_names:
        nbins = draw(st.integers(1, 4))
        bins = st.lists(finite, min_size=nbins, max_size=nbins)
        samples = []
        for sname in draw(st.lists(st.sampled_from(SAMPLES), min_size=1, max_size=4, unique=True)):
            data = draw(st.lists(positive | finite, min_size=nbins, max_size=nbins))
            modifiers = draw(_modifiers(cname, sname, nbins, bins))
            names.update((m["name"], m["type"]) for m in modifiers)
            samples.append({"name": sname, "data": data, "modifiers": modifiers})
        channels.append({"name": cname, "samples": samples})
        observations.append({"name": cname, "data": draw(bins)})
    scalars = sorted(n for n, t in names if t in ("normfactor", "normsys", "histosys"))
    poi = draw(st.sampled_from(["", "missing", *scalars, *(n for n, _ in names)]))
    parameters = [
        {
            "name": "lumi",
            "auxdata": [draw(st.floats(0.9, 1.1))],
            "sigmas": [draw(st.floats(0.01, 0.1))],
            "bounds": [[0.5, 1.5]],
            "inits": [draw(st.floats(0.9, 1.1))],
        }
    ]
    for pname in draw(st.lists(st.sampled_from([*scalars, "unused"]), unique=True)):
        setting = {"name": pname}
        if draw(st.booleans()):  # inside every default and drawn bound (ours refuses others)
            setting["inits"] = [draw(st.floats(0.0, 2.0))]
        if draw(st.booleans()):
            setting["bounds"] = [[-3.0, draw(st.floats(2.0, 8.0))]]
        if draw(st.booleans()):
            setting["fixed"] = draw(st.booleans())
        parameters.append(setting)
    for pname in {n for n, t in names if t in ("staterror", "shapesys")}:
        if draw(st.booleans()):
            parameters.append({"name": pname, "fixed": draw(st.booleans())})
    return {
        "channels": channels,
        "observations": observations,
        "measurements": [{"name": "meas", "config": {"poi": poi, "parameters": parameters}}],
        "version": "1.0.0",
    }


def _modifiers(cname, sname, nbins, bins):
    """A random subset of modifiers of every type for one sample of one channel."""
    lo = st.floats(0.5, 0.99)
    hi = st.floats(1.01, 1.8)
    candidates = [
        st.just({"name": "mu", "type": "normfactor", "data": None}),
        st.just({"name": "k_bkg", "type": "normfactor", "data": None}),
        st.just({"name": "lumi", "type": "lumi", "data": None}),
        st.builds(
            lambda a, b: {"name": "xsec", "type": "normsys", "data": {"lo": a, "hi": b}}, lo, hi
        ),
        st.builds(
            lambda a, b: {"name": "jes", "type": "normsys", "data": {"lo": a, "hi": b}}, lo, hi
        ),
        st.builds(
            lambda a, b: {"name": "jes", "type": "histosys", "data": {"lo_data": a, "hi_data": b}},
            bins,
            bins,
        ),
        st.builds(
            lambda a, b: {"name": "res", "type": "histosys", "data": {"lo_data": a, "hi_data": b}},
            bins,
            bins,
        ),
        st.builds(lambda d: {"name": f"stat_{cname}", "type": "staterror", "data": d}, bins),
        st.builds(lambda d: {"name": "stat_all", "type": "staterror", "data": d}, bins),
        st.builds(lambda d: {"name": f"shape_{sname}", "type": "shapesys", "data": d}, bins),
        st.just({"name": f"free_{nbins}", "type": "shapefactor", "data": None}),
    ]
    return st.lists(
        st.one_of(candidates), min_size=1, max_size=6, unique_by=lambda m: (m["name"], m["type"])
    )


@settings(settings.get_profile("translator"))
@given(
    spec=workspaces(),
    modifier_settings=st.sampled_from(SETTINGS),
)
def test_random_workspaces_match_pyhf(spec, modifier_settings):
    assert_same_outcome(spec, modifier_settings=modifier_settings)


# ------------------------------------------------------------------------ pyhf's errors
def _hand_built(edit) -> dict:
    spec = all_modifiers_workspace()
    edit(spec)
    return spec


def _sample(spec, channel, sample):
    return spec["channels"][channel]["samples"][sample]


ERROR_CASES = {
    "unknown measurement": (all_modifiers_workspace(), {"measurement": "nope"}),
    "POI not in the model": (
        _hand_built(lambda s: s["measurements"][0]["config"].update(poi="nope")),
        {},
    ),
    "POI with several components": (
        _hand_built(lambda s: s["measurements"][0]["config"].update(poi="shape_free")),
        {},
    ),
    "parameter set twice": (
        _hand_built(lambda s: s["measurements"][0]["config"]["parameters"].append({"name": "mu"})),
        {},
    ),
    "inits of the wrong size": (
        _hand_built(
            lambda s: s["measurements"][0]["config"]["parameters"].append(
                {"name": "stat_shared", "inits": [1.0]}
            )
        ),
        {},
    ),
    "unused setting": (
        _hand_built(
            lambda s: s["measurements"][0]["config"]["parameters"][1].update(auxdata=[1.0])
        ),
        {},
    ),
    "name reused across types": (
        _hand_built(
            lambda s: _sample(s, 0, 1)["modifiers"].append(
                {"name": "mu", "type": "normsys", "data": {"hi": 1.1, "lo": 0.9}}
            )
        ),
        {},
    ),
    "shapesys shared": (
        _hand_built(
            lambda s: _sample(s, 0, 0)["modifiers"].append(
                {"name": "bkg2_shape", "type": "shapesys", "data": [1.0, 1.0, 1.0]}
            )
        ),
        {},
    ),
    "unknown modifier type": (
        _hand_built(
            lambda s: _sample(s, 0, 0)["modifiers"].append(
                {"name": "x", "type": "mystery", "data": None}
            )
        ),
        {},
    ),
    "sample of the wrong size": (
        _hand_built(lambda s: _sample(s, 1, 0).update(data=[1.0, 2.0, 3.0])),
        {},
    ),
    "histosys data of the wrong size": (
        _hand_built(lambda s: _sample(s, 1, 0)["modifiers"][1]["data"].update(lo_data=[1.0])),
        {},
    ),
    "staterror data of the wrong size": (
        _hand_built(lambda s: _sample(s, 1, 1)["modifiers"][2].update(data=[1.0])),
        {},
    ),
    "shapesys data of the wrong size": (
        _hand_built(lambda s: _sample(s, 0, 2)["modifiers"][3].update(data=[1.0])),
        {},
    ),
    "no parameters": (
        {
            "channels": [{"name": "A", "samples": [{"name": "b", "data": [1.0], "modifiers": []}]}],
            "observations": [{"name": "A", "data": [1.0]}],
            "measurements": [{"name": "m", "config": {"poi": "", "parameters": []}}],
            "version": "1.0.0",
        },
        {},
    ),
    "non-positive normsys": (
        _hand_built(lambda s: _sample(s, 0, 1)["modifiers"][2]["data"].update(lo=-0.1)),
        {},
    ),
}


@pytest.mark.parametrize("case", ERROR_CASES, ids=list(ERROR_CASES))
def test_errors_are_pyhfs(case):
    spec, options = ERROR_CASES[case]
    expected = outcome(pyhf_layout, spec, **options)
    assert isinstance(expected, Exception)
    assert_same_outcome(spec, **options)


def _parameter(spec, index):
    return spec["measurements"][0]["config"]["parameters"][index]


SETTINGS_PATH = "/measurements/0/config/parameters"
# (spec, options, error, text its message holds: the JSON path or the offending name)
DEVIATIONS = {
    "missing observations (pyhf: KeyError)": (
        _hand_built(lambda s: s["observations"].pop()),
        {},
        pyhf.exceptions.InvalidModel,
        "channel 'CR' has no entry in 'observations'",
    ),
    "negative observed counts (pyhf: fits them)": (
        _hand_built(lambda s: s["observations"][0]["data"].__setitem__(2, -1.0)),
        {},
        pyhf.exceptions.InvalidModel,
        "negative counts at /observations/0/data/2",
    ),
    "observations of another size (pyhf: builds it)": (
        _hand_built(lambda s: s["observations"][1]["data"].append(1.0)),
        {},
        pyhf.exceptions.InvalidModel,
        "channel 'CR' at /observations/1/data have 3 bins, the channel has 2",
    ),
    "staterror on different channels (pyhf: AssertionError)": (
        _hand_built(
            lambda s: _sample(s, 0, 0)["modifiers"].append(
                {"name": "stat_shared", "type": "staterror", "data": [0.1, 0.1, 0.1]}
            )
        ),
        {},
        pyhf.exceptions.InvalidModel,
        "'stat_shared' must be on the same channels",
    ),
    "lumi without settings (pyhf: TypeError)": (
        _hand_built(lambda s: s["measurements"][0]["config"]["parameters"].pop(0)),
        {},
        pyhf.exceptions.InvalidModel,
        "The parameter 'lumi' needs",
    ),
    "interpolation code pyhf lacks (pyhf: AssertionError)": (
        all_modifiers_workspace(),
        {"modifier_settings": {"histosys": {"interpcode": "code1"}}},
        pyhf.exceptions.InvalidInterpCode,
        "'code1' at /modifier_settings/histosys/interpcode is not one of "
        "('code0', 'code2', 'code4p')",
    ),
    "option an applier does not take (pyhf: TypeError)": (
        all_modifiers_workspace(),
        {"modifier_settings": {"normfactor": {"interpcode": "code1"}}},
        pyhf.exceptions.Unsupported,
        "normfactor at /modifier_settings/normfactor",
    ),
    "settings of an unknown modifier type (pyhf: ignored)": (
        all_modifiers_workspace(),
        {"modifier_settings": {"magic": {"interpcode": "code1"}}},
        pyhf.exceptions.InvalidModifier,
        "magic not among ['histosys', 'lumi', 'normfactor', 'normsys', 'shapefactor', "
        "'shapesys', 'staterror'] (at /modifier_settings/magic)",
    ),
    "channel name twice (pyhf: merged)": (
        _hand_built(lambda s: s["channels"][1].update(name="SR")),
        {},
        DuplicateNameError,
        "duplicate channel name 'SR' at /channels/1 (first at /channels/0)",
    ),
    "sample name twice in a channel (pyhf: AssertionError)": (
        _hand_built(lambda s: _sample(s, 1, 1).update(name="bkg1")),
        {},
        DuplicateNameError,
        "duplicate sample name 'bkg1' in channel 'CR' at /channels/1/samples/1 "
        "(first at /channels/1/samples/0)",
    ),
    "modifier twice on a sample (pyhf: builds it, read_model refuses)": (
        _hand_built(
            lambda s: _sample(s, 0, 0)["modifiers"].append(
                {"name": "sig_norm", "type": "normsys", "data": {"hi": 1.2, "lo": 0.8}}
            )
        ),
        {},
        DuplicateNameError,
        "duplicate modifier 'sig_norm' (normsys) on sample 'signal' in channel 'SR' at "
        "/channels/0/samples/0/modifiers/3 (first at /channels/0/samples/0/modifiers/2)",
    ),
    "shapesys twice on a sample (pyhf: InvalidModel without the path)": (
        _hand_built(
            lambda s: _sample(s, 0, 2)["modifiers"].append(
                {"name": "bkg2_shape", "type": "shapesys", "data": [1.0, 1.0, 1.0]}
            )
        ),
        {},
        DuplicateNameError,
        "at /channels/0/samples/2/modifiers/5 (first at /channels/0/samples/2/modifiers/3)",
    ),
    "measurement name twice (pyhf: the first)": (
        _hand_built(lambda s: s["measurements"][1].update(name="meas")),
        {},
        DuplicateNameError,
        "duplicate measurement name 'meas' at /measurements/1 (first at /measurements/0)",
    ),
    "observation name twice (pyhf: the last)": (
        _hand_built(lambda s: s["observations"].append({"name": "SR", "data": [1.0, 2.0, 3.0]})),
        {},
        DuplicateNameError,
        "duplicate observation name 'SR' at /observations/2 (first at /observations/0)",
    ),
    "bounds that are not a pair (pyhf: builds them)": (
        _hand_built(lambda s: _parameter(s, 1).update(bounds=[[0.0, 8.0, 5.0]])),
        {},
        InvalidWorkspaceError,
        f"parameter 'mu' at {SETTINGS_PATH}/1/bounds/0: bounds [0.0, 8.0, 5.0] are not a "
        "[low, high] pair",
    ),
    "inverted bounds (pyhf: builds them)": (
        _hand_built(lambda s: _parameter(s, 1).update(bounds=[[8.0, 0.0]])),
        {},
        InvalidWorkspaceError,
        f"parameter 'mu' at {SETTINGS_PATH}/1/bounds/0: bounds [8.0, 0.0] are inverted",
    ),
    "zero-width bounds (pyhf: builds them)": (
        _hand_built(lambda s: _parameter(s, 2).update(bounds=[[0.3, 0.3]])),
        {},
        InvalidWorkspaceError,
        f"parameter 'jes' at {SETTINGS_PATH}/2/bounds/0: bounds [0.3, 0.3] are zero-width",
    ),
    "init outside its bounds (pyhf: builds it)": (
        _hand_built(lambda s: _parameter(s, 1).update(inits=[9.0])),
        {},
        InvalidWorkspaceError,
        f"parameter 'mu' at {SETTINGS_PATH}/1/inits/0: init 9.0 lies outside its bounds [0.0, 8.0]",
    ),
    "default init outside the set bounds (pyhf: builds it)": (
        _hand_built(lambda s: _parameter(s, 4).update(bounds=[[1.5, 2.0]])),
        {},
        InvalidWorkspaceError,
        f"parameter 'bkg1_norm' at {SETTINGS_PATH}/4/bounds/0: init 1.0 lies outside",
    ),
    "shapefactor over channels of other sizes (pyhf: sized by the first)": (
        _hand_built(
            lambda s: _sample(s, 1, 1)["modifiers"].append(
                {"name": "shape_free", "type": "shapefactor", "data": None}
            )
        ),
        {},
        UnsupportedModelError,
        "shapefactor 'shape_free'",
    ),
}


@pytest.mark.parametrize("case", DEVIATIONS, ids=list(DEVIATIONS))
def test_documented_deviations_raise_pyhf_or_engine_errors(case):
    spec, options, error, text = DEVIATIONS[case]
    with pytest.raises(error) as raised:
        translate.translate(spec, validate=False, **options)
    assert text in str(raised.value)


def test_warm_patches_that_break_names_or_settings_say_where(translators):
    """A patch gets its own located error; the warm background is unharmed."""
    name = WORKSPACE_NAMES[0]
    last = len(background(name)["channels"])
    without_poi = {"op": "replace", "path": "/measurements/0/config/poi", "value": ""}
    copied = [without_poi, {"op": "copy", "from": "/channels/0", "path": "/channels/-"}]
    with pytest.raises(DuplicateNameError) as duplicate:
        translators[name].element(copied, "copied")
    assert f"at /channels/{last} (first at /channels/0)" in str(duplicate.value)
    lumi = "/measurements/0/config/parameters/0"
    inverted = [without_poi, {"op": "replace", "path": f"{lumi}/bounds/0/0", "value": 2.0}]
    with pytest.raises(InvalidWorkspaceError) as bounds:
        translators[name].element(inverted, "inverted")
    assert f"parameter 'lumi' at {lumi}/bounds/0: bounds [2.0, 1.085] are inverted" in str(
        bounds.value
    )
    assert translators[name].element([without_poi], "fine").poi_name is None


def test_invalid_patched_workspaces_raise_pyhfs_schema_error(translators):
    name = WORKSPACE_NAMES[0]
    bad_sample = {
        "name": "signal",
        "data": [1.0],
        "modifiers": [{"name": "mu", "type": "normfactor"}],
    }
    ops = [{"op": "add", "path": "/channels/0/samples/-", "value": bad_sample}]
    patched = jsonpatch.apply_patch(background(name), ops)
    with pytest.raises(pyhf.exceptions.InvalidSpecification) as expected:
        pyhf.schema.validate(patched, "workspace.json")
    with pytest.raises(pyhf.exceptions.InvalidSpecification) as actual:
        translators[name].element(ops, "bad")
    assert (actual.value.path, str(actual.value)) == (expected.value.path, str(expected.value))
    removed = [{"op": "remove", "path": "/observations"}]
    with pytest.raises(pyhf.exceptions.InvalidSpecification, match="'observations'"):
        translators[name].element(removed, "bad")


# ---------------------------------------------------------------------------- JSON patches
DOCUMENT = {"a": {"b": [1, 2, {"c": "d"}], "e": {}}, "f": [[0], [1, [2]]], "g": "text"}
PATCHES = [
    [{"op": "add", "path": "/a/b/-", "value": {"new": [1]}}],
    [{"op": "add", "path": "/a/b/1", "value": 7}, {"op": "replace", "path": "/a/b/0", "value": 0}],
    [{"op": "remove", "path": "/f/1/1/0"}, {"op": "test", "path": "/f/1", "value": [1, []]}],
    [{"op": "move", "from": "/f/0", "path": "/f/0/0"}],
    [{"op": "move", "from": "/f/0", "path": "/f/1/1/-"}],
    [{"op": "move", "from": "/f/0", "path": "/f/0/1"}],
    [
        {"op": "move", "from": "/a/b", "path": "/a/e/moved"},
        {"op": "add", "path": "/a/e/moved/0", "value": 9},
    ],
    [
        {"op": "copy", "from": "/a/b/2", "path": "/a/e/c"},
        {"op": "add", "path": "/a/e/c/x", "value": 1},
    ],
    [{"op": "copy", "from": "/f", "path": "/f/0/-"}, {"op": "remove", "path": "/f/0/1/0"}],
    [
        {"op": "replace", "path": "", "value": {"all": "new"}},
        {"op": "add", "path": "/x", "value": 1},
    ],
    [{"op": "add", "path": "/a/b/9", "value": 1}],
    [{"op": "remove", "path": "/a/zz"}],
    [{"op": "replace", "path": "/f/5", "value": 1}],
    [{"op": "test", "path": "/g", "value": "other"}],
    [{"op": "move", "from": "/a", "path": "/a/b/0"}],
    [{"op": "move", "from": "/nope", "path": "/x"}],
    [{"op": "copy", "from": "/f/-", "path": "/x"}],
    [{"op": "add", "path": "/g/0", "value": 1}],
    [{"op": "add", "path": "a/b", "value": 1}],
    [{"op": "launch", "path": "/a"}],
    [{"op": "add", "path": "/a/b/01", "value": 1}],
    [{"op": "remove", "path": ""}],
]


@pytest.mark.parametrize("ops", PATCHES, ids=[json.dumps(p)[:60] for p in PATCHES])
def test_patches_apply_as_jsonpatch_does_without_copying(ops):
    document = copy.deepcopy(DOCUMENT)
    before = digest([document, ops])
    expected = outcome(jsonpatch.apply_patch, document, ops)
    actual = outcome(patching.apply_patch, document, ops)
    if isinstance(expected, Exception):
        assert isinstance(expected, jsonpatch.JsonPatchException | jsonpointer.JsonPointerException)
        assert (type(actual), str(actual)) == (type(expected), str(expected))
    else:
        assert actual == expected
    assert digest([document, ops]) == before


json_values = st.recursive(
    st.none() | st.integers(-3, 3) | st.text("ab", max_size=2),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text("ab", max_size=2), inner, max_size=3)
    ),
    max_leaves=8,
)
pointers = st.lists(st.sampled_from(["a", "b", "0", "1", "2", "-", "f"]), max_size=3).map(
    lambda parts: "".join("/" + p for p in parts)
)
operations = st.one_of(
    st.builds(
        lambda o, p, v: {"op": o, "path": p, "value": v},
        st.sampled_from(["add", "replace", "test"]),
        pointers,
        json_values,
    ),
    st.builds(lambda p: {"op": "remove", "path": p}, pointers),
    st.builds(
        lambda o, f, p: {"op": o, "from": f, "path": p},
        st.sampled_from(["move", "copy"]),
        pointers,
        pointers,
    ),
)


@settings(settings.get_profile("translator"), max_examples=300)
@given(document=json_values, ops=st.lists(operations, max_size=4))
def test_random_patches_apply_as_jsonpatch_does(document, ops):
    before = digest([document, ops])
    expected = outcome(jsonpatch.apply_patch, document, ops)
    actual = outcome(patching.apply_patch, document, ops)
    if isinstance(expected, Exception):
        assert (type(actual), str(actual)) == (type(expected), str(expected))
    else:
        assert actual == expected
    assert digest([document, ops]) == before


# ------------------------------------------------------------------------------ docstrings
@pytest.mark.parametrize("module", [translate, patching, reading], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    failures, _ = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert failures == 0
