"""Settings from flags and PYHF_GPU_* variables; JSON log lines; the JSON body parser."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyhf_gpu_server.service import requests
from pyhf_gpu_server.service.errors import BadRequest, Unprocessable
from pyhf_gpu_server.service.logs import JsonFormatter
from pyhf_gpu_server.service.operations import OPERATIONS
from pyhf_gpu_server.service.requests import envelope_from, parse_json
from pyhf_gpu_server.service.settings import (
    LIMITS,
    Settings,
    build_parser,
    env_name,
    markdown_table,
    settings_from_args,
)


def test_flags_environment_and_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"PYHF_GPU_DEVICE": "cuda:1", "PYHF_GPU_MAX_BODY_MB": "8", "PYHF_GPU_API_TOKEN": "s3"}
    for name, value in {**env, "PYHF_GPU_HOST": ""}.items():
        monkeypatch.setenv(name, value)
    settings = settings_from_args(["--port", "9000", "--max-body-mb", "16"])
    assert settings.port == 9000
    assert settings.max_body_mb == 16.0  # the flag wins over the environment
    assert settings.device == "cuda:1"
    assert settings.api_token == "s3"
    assert settings.host == "127.0.0.1"  # an empty variable is the default
    assert settings.max_batch_delay_ms == 5.0
    assert "s3" not in repr(settings)
    assert Settings().device == "auto"  # Settings(...) itself reads no variable


def test_every_field_has_a_flag_and_a_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    names = list(Settings.model_fields)
    for name in ("device", "dtype", "data_dir", "max_body_mb", "max_batch_size", "api_token"):
        assert name in names
    assert env_name("data_dir") == "PYHF_GPU_DATA_DIR"
    for name in ("max_queue", "port"):
        monkeypatch.setenv(env_name(name), "7")
    settings = settings_from_args([])
    assert settings.max_queue == 7 and settings.port == 7
    assert isinstance(settings_from_args(["--data-dir", "/tmp/x"]).data_dir, Path)
    assert settings.limits() == {name: getattr(settings, name) for name in LIMITS}
    helped = build_parser().format_help()
    for name, field in Settings.model_fields.items():
        assert f"--{name.replace('_', '-')}" in helped and env_name(name) in helped
        assert field.description, name


@pytest.mark.parametrize(
    "argv",
    [
        ["--device", "tpu"],
        ["--dtype", "float16"],
        ["--max-batch-size", "0"],
        ["--port", "x"],
        ["--local-workers", "-2"],
        ["--dask-scheduler", "nowhere"],
        ["--log-level", "loud"],
    ],
)
def test_bad_settings_exit_with_a_message(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exited:
        settings_from_args(argv)
    assert exited.value.code == 2
    assert f"error: {argv[0]}" in capsys.readouterr().err


def test_the_docs_table_is_the_settings_descriptions() -> None:
    text = (Path(__file__).parents[1] / "docs" / "SERVICE.md").read_text()
    assert markdown_table() in text, (
        "docs/SERVICE.md: paste `python -m pyhf_gpu_server.service.settings` over its table"
    )


def test_auto_device() -> None:
    assert Settings(device="auto").resolve_device(cuda_available=False) == "cpu"
    assert Settings(device="auto").resolve_device(cuda_available=True) == "cuda"
    assert Settings(device="cuda:2").resolve_device(cuda_available=True) == "cuda:2"


def test_json_log_line_keeps_extra_fields() -> None:
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "request", (), None)
    record.request_id = "abc"
    record.duration_ms = 1.5
    line = json.loads(JsonFormatter().format(record))
    assert line["msg"] == "request" and line["request_id"] == "abc" and line["duration_ms"] == 1.5


def test_parser_rejects_non_finite_and_deep_json() -> None:
    assert parse_json(b'{"a": [1, 2.5]}', 64) == {"a": [1, 2.5]}
    for bad in (b"[NaN]", b"[-Infinity]", b"[1e400]"):
        with pytest.raises(Unprocessable):
            parse_json(bad, 64)
    with pytest.raises(Unprocessable, match="deeper than 3"):
        parse_json(b"[[[[1]]]]", 3)
    with pytest.raises(BadRequest):
        parse_json(b"{", 64)


def _depth(node: object) -> int:
    if isinstance(node, dict):
        node = list(node.values())
    if not isinstance(node, list):
        return 0
    return 1 + max(map(_depth, node), default=0)


# texts full of what could fool a byte scan: brackets, quotes, backslashes, escapes, non-ASCII
_TEXTS = st.text(alphabet=st.sampled_from('[]{}"\\/,: aé\u2028\n\x00'), max_size=6)
_JSON = st.recursive(
    st.none() | st.booleans() | st.floats(allow_nan=False, allow_infinity=False) | _TEXTS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXTS, inner, max_size=4),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(
    document=st.lists(_JSON, max_size=3) | st.dictionaries(_TEXTS, _JSON, max_size=3),
    indent=st.booleans(),
)
def test_the_depth_read_off_the_bytes_is_the_documents(document: object, indent: bool) -> None:
    body = json.dumps(document, indent=1 if indent else None, ensure_ascii=False).encode()
    depth = requests.text_depth(body)
    if b"\\" in body:
        assert depth is None
    else:
        assert depth == _depth(document)
    for limit in {0, 1, _depth(document) - 1, _depth(document)}:
        too_deep = requests._too_deep(body, json.loads(body), limit)
        assert too_deep == (_depth(document) > limit) == requests._exceeds_depth(document, limit)


def test_the_depth_scan_carries_strings_and_levels_across_chunks(monkeypatch) -> None:
    monkeypatch.setattr(requests, "_DEPTH_CHUNK", 3)
    body = b'[{"a]": [[1, "x[[[["]], "b": {"c": []}}, "\xc3\xa9]"]'
    assert requests.text_depth(body) == _depth(json.loads(body)) == 4


def test_envelope_from_bare_workspace_and_query() -> None:
    cls, upper_limit = OPERATIONS["cls"], OPERATIONS["upper-limit"]
    envelope = envelope_from({"channels": []}, {"test-poi": ["1", "2"], "ntoys": ["5"]}, cls)
    assert envelope == {"workspace": {"channels": []}, "test_poi": ["1", "2"], "ntoys": "5"}
    scan = envelope_from({"channels": []}, {"scan": ["0", "1", "2"]}, upper_limit)
    assert scan["scan"] == ["0", "1", "2"]  # a list option keeps every repetition
    one = envelope_from({"channels": []}, {"test_poi": ["3"], "test_stat": ["q"]}, cls)
    assert (one["test_poi"], one["test_stat"]) == ("3", "q")  # one value: itself
    given = envelope_from({"workspace_id": "x", "ntoys": 9}, {"ntoys": ["5"]}, cls)
    assert given["ntoys"] == 9  # the body wins
    with pytest.raises(Unprocessable, match="level"):
        envelope_from({"channels": []}, {"level": ["0.1"]}, OPERATIONS["fit"])
