"""The compiled schema checks accept what pyhf accepts and raise pyhf's own errors (message,
JSON path, schema) for what it refuses; the orjson loader refuses non-finite numbers."""

from __future__ import annotations

import copy
import doctest
import gzip
import json

import numpy as np
import pyhf
import pytest
from conftest import WORKSPACE_NAMES, WORKSPACES_DIR, load_json
from hand_built import all_modifiers_workspace
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyhf_gpu_server.engine import schema
from pyhf_gpu_server.engine.errors import UnrepresentableValueError
from pyhf_gpu_server.service.errors import describe_invalid_specification


def outcome(function, *args):
    try:
        function(*args)
    except pyhf.exceptions.InvalidSpecification as error:
        return error
    return None


def assert_same_verdict(instance, schema_name: str) -> None:
    """schema.validate raises exactly when pyhf does, the same message at the same path."""
    expected = outcome(pyhf.schema.validate, instance, schema_name)
    actual = outcome(schema.validate, instance, schema_name)
    if expected is None:
        assert actual is None
        return
    assert actual is not None
    assert (actual.path, actual.schema, str(actual)) == (
        expected.path,
        expected.schema,
        str(expected),
    )
    assert describe_invalid_specification(actual, "workspace") == describe_invalid_specification(
        expected, "workspace"
    )


# ------------------------------------------------------------------------------ valid inputs
@pytest.mark.parametrize("name", WORKSPACE_NAMES)
def test_shared_workspaces_and_patchsets_pass_the_compiled_check(name):
    folder = WORKSPACES_DIR / name
    assert schema.conforms(load_json(folder / "BkgOnly.json"), "workspace.json")
    schema.validate(load_json(folder / "BkgOnly.json"), "workspace.json")
    for path in folder.glob("patchset*.json*"):
        document = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        patchset = schema.loads(document)
        assert schema.conforms(patchset, "patchset.json"), path.name
        assert schema.conforms(patchset["patches"][0]["patch"], "jsonpatch.json")


def test_what_pyhf_accepts_beyond_json_is_accepted():
    """pyhf takes booleans as numbers and numpy arrays as arrays; the compiled check does not,
    so pyhf's own check decides."""
    spec = all_modifiers_workspace()
    spec["observations"][0]["data"] = [True, 2.0, 3.0]
    spec["channels"][0]["samples"][0]["data"] = np.array([3.0, 5.0, 2.0])
    assert not schema.conforms(spec, "workspace.json")
    schema.validate(spec, "workspace.json")


# ---------------------------------------------------------------------------- invalid inputs
def _edited(edit, base=all_modifiers_workspace):
    spec = base()
    edit(spec)
    return spec


def _sample(spec):
    return spec["channels"][0]["samples"][1]


INVALID_WORKSPACES = {
    "missing key": _edited(lambda s: s.pop("version")),
    "wrong version": _edited(lambda s: s.update(version="1.0.1")),
    "extra key": _edited(lambda s: s.update(extra=1)),
    "channels not a list": _edited(lambda s: s.update(channels={})),
    "empty channels": _edited(lambda s: s.update(channels=[])),
    "empty samples": _edited(lambda s: s["channels"][1].update(samples=[])),
    "string in sample data": _edited(lambda s: _sample(s)["data"].append("1")),
    "empty sample data": _edited(lambda s: _sample(s).update(data=[])),
    "modifier without data": _edited(lambda s: _sample(s)["modifiers"][0].pop("data")),
    "unknown modifier type": _edited(lambda s: _sample(s)["modifiers"][0].update(type="gamma")),
    "lumi of another name": _edited(lambda s: _sample(s)["modifiers"][0].update(name="lumi2")),
    "normsys without hi": _edited(lambda s: _sample(s)["modifiers"][2]["data"].pop("hi")),
    "histosys data not a list": _edited(
        lambda s: _sample(s)["modifiers"][1]["data"].update(lo_data=1.0)
    ),
    "null observation data": _edited(lambda s: s["observations"][0].update(data=None)),
    "measurement without poi": _edited(lambda s: s["measurements"][0]["config"].pop("poi")),
    "bounds not nested": _edited(
        lambda s: s["measurements"][0]["config"]["parameters"][1].update(bounds=[0.0, 8.0])
    ),
    "fixed not a boolean": _edited(
        lambda s: s["measurements"][0]["config"]["parameters"][3].update(fixed="yes")
    ),
    "empty measurements": _edited(lambda s: s.update(measurements=[])),
    "not an object": [1, 2],
}


@pytest.mark.parametrize("case", INVALID_WORKSPACES, ids=list(INVALID_WORKSPACES))
def test_invalid_workspaces_raise_pyhfs_error(case):
    spec = INVALID_WORKSPACES[case]
    assert not schema.conforms(spec, "workspace.json")
    with pytest.raises(pyhf.exceptions.InvalidSpecification):
        schema.validate(spec, "workspace.json")
    assert_same_verdict(spec, "workspace.json")


def test_invalid_shared_workspace_raises_pyhfs_error():
    spec = copy.deepcopy(load_json(WORKSPACES_DIR / WORKSPACE_NAMES[-1] / "BkgOnly.json"))
    spec["channels"][-1]["samples"][-1]["modifiers"][-1]["data"] = "none"
    assert_same_verdict(spec, "workspace.json")


def _patchset(edit):
    patchset = copy.deepcopy(load_json(WORKSPACES_DIR / WORKSPACE_NAMES[0] / "patchset.json"))
    edit(patchset)
    return patchset


@pytest.mark.parametrize(
    ("instance", "schema_name"),
    [
        (
            _patchset(lambda p: p["patches"][0]["metadata"].update(name="not valid!")),
            "patchset.json",
        ),
        (_patchset(lambda p: p["metadata"].pop("digests")), "patchset.json"),
        (_patchset(lambda p: p["metadata"]["references"].update(hepdata="ins12")), "patchset.json"),
        (_patchset(lambda p: p.update(patches=[])), "patchset.json"),
        ([{"op": "add", "path": "/a"}], "jsonpatch.json"),
        ([{"op": "launch", "path": "/a", "value": 1}], "jsonpatch.json"),
        ([{"op": "move", "path": "/a"}], "jsonpatch.json"),
        ({"channels": []}, "model.json"),
        ({"name": "m", "config": {"poi": 1, "parameters": []}}, "measurement.json"),
    ],
)
def test_invalid_patchsets_patches_models_measurements(instance, schema_name):
    assert_same_verdict(instance, schema_name)


# ------------------------------------------------------------- random damage (hypothesis)
def _locations(node, path=()):
    """Every (container path, key) in a JSON document."""
    items = node.items() if isinstance(node, dict) else enumerate(node)
    for key, child in items:
        yield path, key
        if isinstance(child, dict | list):
            yield from _locations(child, (*path, key))


BASE = all_modifiers_workspace()
LOCATIONS = list(_locations(BASE))
replacements = st.sampled_from(
    [None, True, 0, -1.5, "", "lumi", "histosys", [], [1.0], {}, {"hi": 1.0, "lo": 1.0}, "1.0.0"]
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    location=st.sampled_from(LOCATIONS),
    action=st.sampled_from(["replace", "delete", "add"]),
    value=replacements,
)
def test_damaged_workspaces_get_pyhfs_verdict(location, action, value):
    spec = copy.deepcopy(BASE)
    path, key = location
    container = spec
    for part in path:
        container = container[part]
    if action == "replace":
        container[key] = value
    elif action == "delete":
        del container[key]
    elif isinstance(container, dict):
        container["unexpected"] = value
    else:
        container.append(value)
    assert_same_verdict(spec, "workspace.json")
    if schema.conforms(spec, "workspace.json"):
        pyhf.schema.validate(spec, "workspace.json")  # never more lenient than pyhf


# ------------------------------------------------------------------------------------ loads
@pytest.mark.parametrize("text", ["NaN", "[Infinity]", "[-Infinity]", '{"a": [1.0, NaN]}'])
def test_loads_refuses_non_finite_numbers(text):
    with pytest.raises(ValueError):
        schema.loads(text)
    with pytest.raises(json.JSONDecodeError):
        schema.loads(text.encode())


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '{"channels": [{"name": "SR", "samples": [{"name": "\\ud800"}]}]}',
            "the text at /channels/0/samples/0/name holds an unpaired UTF-16 surrogate ('\\ud800')",
        ),
        ('{"measurements": [{"name": "m\\udc00"}]}', "the text at /measurements/0/name holds"),
        ('{"ok": 1, "a/b~\\ud800": 1}', "the text at /a~1b~0\\ud800 holds"),
        ('"\\ud800"', "the text at (top level) holds"),
        (
            '{"observations": [{"name": "SR", "data": [1, 1' + "0" * 399 + "]}]}",
            "the number at /observations/0/data/1 is out of range",
        ),
        ('{"data": [-1' + "0" * 400 + "]}", "the number at /data/0 is out of range"),
        ('{"a": 1e999}', "the number at /a is out of range"),
        ("[-1e400]", "the number at /0 is out of range"),
    ],
)
def test_loads_names_the_path_of_values_no_model_can_hold(text, message):
    """What orjson refuses and json would read into a value that no model can hold (an
    unpaired surrogate, a number beyond a 64-bit float) is refused with its JSON path."""
    for document in (text, text.encode(), memoryview(text.encode())):
        with pytest.raises(UnrepresentableValueError) as error:
            schema.loads(document)
        assert message in str(error.value)
        assert str(error.value).encode("utf-8")  # the message is text any answer can carry


@pytest.mark.parametrize("text", ["[1, 2", '{"a": "\\ud800"', "[" * 5000 + "]" * 5000])
def test_loads_leaves_malformed_json_to_its_own_error(text):
    with pytest.raises(json.JSONDecodeError):
        schema.loads(text.encode())


def test_loads_reads_json_like_json():
    text = '{"a": [1, 2.5, -3e-7, true, null, "x\\u00e9"], "b": {"c": []}}'
    assert schema.loads(text) == json.loads(text)
    assert schema.loads(text.encode()) == json.loads(text)


def test_docstring_examples():
    failures, attempted = doctest.testmod(schema, optionflags=doctest.ELLIPSIS)
    assert attempted > 0 and failures == 0
