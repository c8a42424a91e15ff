"""Every bad input gets a 4xx with a JSON detail (no traceback), and the server stays healthy.

Runs against a real server subprocess (uvicorn), talked to over HTTP.
"""

from __future__ import annotations

import copy
import gzip
import json
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from service_support import (
    SMALL,
    ServerProcess,
    load,
    patchset_of,
    running_server,
    simple_workspace,
)

pytestmark = pytest.mark.timeout(300)

TRACEBACK_MARKERS = ("Traceback", 'File "', "site-packages")
SETTINGS = "/measurements/0/config/parameters/0"  # the simple workspace's first setting


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    data_dir = tmp_path_factory.mktemp("bad-inputs")
    # a one-request queue that waits 1.5 s to fill a batch: back-pressure is easy to provoke
    # a request waits out the whole delay (no early close): the queue-full test holds one
    args = ["--max-body-mb", "1", "--max-queue", "1", "--max-batch-delay-ms", "1500"]
    args += ["--batch-gap-ms", "1500"]
    with running_server(data_dir, args) as started:
        yield started


@pytest.fixture(scope="module")
def uploaded(client: httpx.Client) -> str:
    """The small shared workspace's id (uploaded once)."""
    response = client.post("/workspaces", json=load(SMALL, "BkgOnly.json"))
    assert response.status_code == 201, response.text
    return response.json()["workspace_id"]


def mutated(change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """A copy of the simple workspace, changed by ``change``."""
    spec = simple_workspace()
    change(spec)
    return spec


def _poi_fixed() -> dict[str, Any]:
    """The small valid workspace with its POI fixed by the measurement."""
    spec = simple_workspace()
    spec["measurements"][0]["config"]["parameters"] = [{"name": "mu", "fixed": True}]
    return spec


def _raw(spec: dict[str, Any]) -> dict[str, Any]:
    """Request kwargs sending ``spec`` as JSON text with ``\\u`` escapes: lone surrogates and
    400-digit integers survive as they are."""
    return {"content": json.dumps(spec).encode()}


def _with_parameters(*parameters: dict[str, Any]) -> dict[str, Any]:
    """The simple workspace with these measurement parameter settings."""
    return mutated(lambda s: s["measurements"][0]["config"].update(parameters=list(parameters)))


def _doubled(array: Callable[[dict[str, Any]], list]) -> Callable[[dict[str, Any]], None]:
    """A change that appends a copy of the first item of ``array(spec)``."""
    return lambda spec: array(spec).append(copy.deepcopy(array(spec)[0]))


def _patched(*operations: dict[str, Any]) -> dict[str, Any]:
    """A request envelope: the simple workspace with one inline patch."""
    return {"json": {"workspace": simple_workspace(), "patches": [list(operations)]}}


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def _gzip_bomb() -> bytes:
    return gzip.compress(b'{"channels": [' + b" " * (3 * 1024 * 1024) + b"]}")


# (name, method, path, request kwargs, expected status, text the detail must contain)
def _no_rate_in_bin_one(spec: dict) -> None:
    """Both samples predict nothing in bin 1 (no shapesys there), where 53 events are seen."""
    for sample in spec["channels"][0]["samples"]:
        sample["data"][1] = 0.0
    spec["channels"][0]["samples"][1]["modifiers"] = []


CASES: list[tuple[str, str, str, dict[str, Any], int, str]] = [
    *(
        (
            f"measurement fixes the POI ({route})",
            "POST",
            route,
            {"json": _poi_fixed()},
            422,
            "'mu' is fixed",
        )
        for route in ("/cls", "/upper-limit", "/significance")
    ),
    *(
        (f"duplicate {what}", "POST", "/cls", {"json": mutated(_doubled(array))}, 422, detail)
        for what, array, detail in (
            (
                "channel",
                lambda s: s["channels"],
                "duplicate channel name 'singlechannel' at /channels/1 (first at /channels/0)",
            ),
            (
                "sample",
                lambda s: s["channels"][0]["samples"],
                "duplicate sample name 'signal' in channel 'singlechannel' at "
                "/channels/0/samples/2 (first at /channels/0/samples/0)",
            ),
            (
                "modifier",
                lambda s: s["channels"][0]["samples"][1]["modifiers"],
                "duplicate modifier 'uncorr_bkguncrt' (shapesys) on sample 'background' in "
                "channel 'singlechannel' at /channels/0/samples/1/modifiers/1 "
                "(first at /channels/0/samples/1/modifiers/0)",
            ),
            (
                "measurement",
                lambda s: s["measurements"],
                "duplicate measurement name 'meas' at /measurements/1 (first at /measurements/0)",
            ),
            (
                "observation",
                lambda s: s["observations"],
                "duplicate observation name 'singlechannel' at /observations/1 "
                "(first at /observations/0)",
            ),
        )
    ),
    (
        "patch that duplicates a channel",
        "POST",
        "/cls",
        _patched({"op": "copy", "from": "/channels/0", "path": "/channels/-"}),
        422,
        "duplicate channel name 'singlechannel' at /channels/1 (first at /channels/0)",
    ),
    (
        "patch that makes an observed count negative",
        "POST",
        "/cls",
        _patched({"op": "replace", "path": "/observations/0/data/1", "value": -3.0}),
        422,
        "negative counts at /observations/0/data/1",
    ),
    *(
        (
            f"unknown {mtype} interpcode",
            "POST",
            "/cls",
            {
                "json": {
                    "workspace": simple_workspace(),
                    "modifier_settings": {mtype: {"interpcode": "code9"}},
                }
            },
            422,
            f"{mtype} interpolation code 'code9' at /modifier_settings/{mtype}/interpcode is "
            f"not one of {codes}",
        )
        for mtype, codes in (
            ("histosys", "('code0', 'code2', 'code4p')"),
            ("normsys", "('code1', 'code4')"),
        )
    ),
    (
        "unknown modifier type in modifier_settings",
        "POST",
        "/fit",
        {
            "json": {
                "workspace": simple_workspace(),
                "modifier_settings": {"magic": {"interpcode": "code1"}},
            }
        },
        422,
        "magic not among ['histosys', 'lumi', 'normfactor', 'normsys', 'shapefactor', "
        "'shapesys', 'staterror'] (at /modifier_settings/magic)",
    ),
    *(
        (
            f"lone surrogate in a {what} name",
            "POST",
            "/cls",
            _raw(mutated(lambda s, name=name: name(s).update(name="\ud800"))),
            422,
            f"the text at {path}/name holds an unpaired UTF-16 surrogate",
        )
        for what, name, path in (
            ("channel", lambda s: s["channels"][0], "/channels/0"),
            ("sample", lambda s: s["channels"][0]["samples"][1], "/channels/0/samples/1"),
            (
                "modifier",
                lambda s: s["channels"][0]["samples"][0]["modifiers"][0],
                "/channels/0/samples/0/modifiers/0",
            ),
            ("measurement", lambda s: s["measurements"][0], "/measurements/0"),
        )
    ),
    (
        "lone surrogate in an uploaded workspace",
        "POST",
        "/workspaces",
        _raw(mutated(lambda s: s["observations"][0].update(name="SR\udc00"))),
        422,
        "the text at /observations/0/name holds an unpaired UTF-16 surrogate",
    ),
    (
        "400-digit observed count",
        "POST",
        "/cls",
        _raw(mutated(lambda s: s["observations"][0]["data"].__setitem__(1, 10**399))),
        422,
        "the number at /observations/0/data/1 is out of range",
    ),
    (
        "400-digit sample count",
        "POST",
        "/jobs",
        {
            "content": json.dumps(
                {"operation": "fit", "workspace": simple_workspace((10**399, 1.0))}
            ).encode()
        },
        422,
        "the number at /workspace/channels/0/samples/0/data/0 is out of range",
    ),
    (
        "POI bounds of three numbers",
        "POST",
        "/cls",
        {"json": _with_parameters({"name": "mu", "bounds": [[0, 10, 5]]})},
        422,
        f"parameter 'mu' at {SETTINGS}/bounds/0: bounds [0, 10, 5] are not a [low, high] pair",
    ),
    (
        "inverted bounds",
        "POST",
        "/cls",
        {"json": _with_parameters({"name": "mu", "bounds": [[10, 0]]})},
        422,
        f"parameter 'mu' at {SETTINGS}/bounds/0: bounds [10, 0] are inverted",
    ),
    (
        "zero-width bounds",
        "POST",
        "/fit",
        {"json": _with_parameters({"name": "mu", "bounds": [[5, 5]], "inits": [5.0]})},
        422,
        f"parameter 'mu' at {SETTINGS}/bounds/0: bounds [5, 5] are zero-width",
    ),
    (
        "init outside its bounds",
        "POST",
        "/cls",
        {"json": _with_parameters({"name": "mu", "inits": [20.0]})},
        422,
        f"parameter 'mu' at {SETTINGS}/inits/0: init 20.0 lies outside its bounds",
    ),
    ("malformed JSON", "POST", "/cls", {"content": b'{"channels": ['}, 400, "malformed JSON"),
    ("empty body", "POST", "/cls", {"content": b""}, 400, "empty"),
    ("JSON array", "POST", "/cls", {"json": [1, 2]}, 422, "JSON list"),
    ("not a workspace", "POST", "/fit", {"json": {"foo": 1}}, 422, "neither"),
    (
        "schema violation",
        "POST",
        "/cls",
        {"json": mutated(lambda s: s["channels"][0]["samples"][0].pop("data"))},
        422,
        "channels[0].samples[0]",
    ),
    (
        "unknown modifier type",
        "POST",
        "/cls",
        {
            "json": mutated(
                lambda s: s["channels"][0]["samples"][0]["modifiers"][0].update(type="magic")
            )
        },
        422,
        "invalid workspace",
    ),
    (
        "NaN count",
        "POST",
        "/cls",
        {"content": json.dumps(simple_workspace((float("nan"), 1.0))).encode()},
        422,
        "NaN",
    ),
    (
        "infinite count",
        "POST",
        "/cls",
        {"content": json.dumps(simple_workspace((float("inf"), 1.0))).encode()},
        422,
        "Infinity",
    ),
    (
        "overflowing number",
        "POST",
        "/cls",
        {"content": json.dumps(simple_workspace()).replace("5.0", "1e999", 1).encode()},
        422,
        "out of range",
    ),
    (
        "negative observed count",
        "POST",
        "/cls",
        {"json": mutated(lambda s: s["observations"][0]["data"].__setitem__(1, -3.0))},
        422,
        "negative counts at /observations/0/data/1",  # the same words as through a patch
    ),
    (
        "sample bin-count mismatch",
        "POST",
        "/cls",
        {"json": mutated(lambda s: s["channels"][0]["samples"][0]["data"].append(1.0))},
        422,
        "bins",
    ),
    (
        "observation bin-count mismatch",
        "POST",
        "/cls",
        {"json": mutated(lambda s: s["observations"][0]["data"].pop())},
        422,
        "observations[0].data has 1 bins",
    ),
    (
        "workspace without its POI",
        "POST",
        "/cls",
        {"json": load(SMALL, "BkgOnly.json")},
        422,
        "mu_SIG",
    ),
    (
        "unknown measurement",
        "POST",
        "/cls?measurement=nope",
        {"json": simple_workspace()},
        422,
        "'nope'",
    ),
    ("bad test_stat", "POST", "/cls?test_stat=foo", {"json": simple_workspace()}, 422, "test_stat"),
    ("zero ntoys", "POST", "/cls?ntoys=0", {"json": simple_workspace()}, 422, "ntoys"),
    ("absurd ntoys", "POST", "/cls?ntoys=1000000000", {"json": simple_workspace()}, 422, "ntoys"),
    ("NaN test_poi", "POST", "/cls?test_poi=nan", {"json": simple_workspace()}, 422, "test_poi"),
    (
        "unknown query option",
        "POST",
        "/cls?tset_poi=1",
        {"json": simple_workspace()},
        422,
        "tset_poi",
    ),
    (
        "typo in envelope",
        "POST",
        "/cls",
        {"json": {"workspace": simple_workspace(), "test_pio": 1}},
        422,
        "test_pio",
    ),
    (
        "workspace and workspace_id",
        "POST",
        "/cls",
        {"json": {"workspace": simple_workspace(), "workspace_id": "a" * 64}},
        422,
        "exactly one",
    ),
    (
        "unknown workspace id",
        "POST",
        "/cls",
        {"json": {"workspace_id": "0" * 64}},
        404,
        "POST /workspaces",
    ),
    (
        "invalid patch operation",
        "POST",
        "/cls",
        {
            "json": {
                "workspace": simple_workspace(),
                "patches": [[{"op": "frobnicate", "path": "/x"}]],
            }
        },
        422,
        "patches[0]",
    ),
    (
        "patch that does not apply",
        "POST",
        "/cls",
        {
            "json": {
                "workspace": simple_workspace(),
                "patches": [[{"op": "remove", "path": "/channels/7"}]],
            }
        },
        422,
        "patch",
    ),
    (
        "patchset of another workspace",
        "POST",
        "/cls",
        {"json": {"workspace": simple_workspace(), "patchset": load(SMALL, "patchset.json")}},
        422,
        "patchset was made for",
    ),
    (
        "invalid patchset",
        "POST",
        "/cls",
        {"json": {"workspace": simple_workspace(), "patchset": {"metadata": {}}}},
        422,
        "patchset",
    ),
    (
        "upper-limit level out of range",
        "POST",
        "/upper-limit",
        {"json": {"workspace": simple_workspace(), "level": 2}},
        422,
        "level",
    ),
    (
        "decreasing scan",
        "POST",
        "/upper-limit",
        {"json": {"workspace": simple_workspace(), "scan": [3, 2, 1]}},
        422,
        "increase",
    ),
    ("nested 100 deep", "POST", "/cls", {"content": _nested(100)}, 422, "nested deeper than 64"),
    ("nested 100000 deep", "POST", "/fit", {"content": _nested(100_000)}, 422, "nested deeper"),
    (
        "declared body too large",
        "POST",
        "/cls",
        {"content": b" " * (2 * 1024 * 1024)},
        413,
        "--max-body-mb",
    ),
    (
        "gzip bomb",
        "POST",
        "/cls",
        {"content": _gzip_bomb(), "headers": {"Content-Encoding": "gzip"}},
        413,
        "decompressed body",
    ),
    (
        "invalid gzip",
        "POST",
        "/cls",
        {"content": b"not gzip at all", "headers": {"Content-Encoding": "gzip"}},
        400,
        "gzip",
    ),
    (
        "unsupported encoding",
        "POST",
        "/cls",
        {"content": b"{}", "headers": {"Content-Encoding": "br"}},
        415,
        "br",
    ),
    (
        "observed counts of 1e308 (cls)",
        "POST",
        "/cls",
        {
            "json": {
                "workspace": mutated(lambda s: s["observations"][0]["data"].__setitem__(0, 1e308))
            }
        },
        422,
        "observed count 1e+308 in channel 'singlechannel' bin 0: above 2^53",
    ),
    (
        "observed counts of 1e308 (fit)",
        "POST",
        "/fit",
        {
            "json": {
                "workspace": mutated(lambda s: s["observations"][0]["data"].__setitem__(1, 1e308))
            }
        },
        422,
        "channel 'singlechannel' bin 1",
    ),
    (
        "events where no sample predicts any (upper-limit)",
        "POST",
        "/upper-limit",
        {"json": {"workspace": mutated(_no_rate_in_bin_one)}},
        422,
        "channel 'singlechannel' bin 1: the samples' nominal rates sum to 0 against 53 observed",
    ),
    (
        "a negative background",
        "POST",
        "/cls",
        {
            "json": {
                "workspace": mutated(
                    lambda s: s["channels"][0]["samples"][1]["data"].__setitem__(0, -100.0)
                )
            }
        },
        422,
        "sum to -95 against 52 observed",
    ),
    (
        "job without operation",
        "POST",
        "/jobs",
        {"json": {"workspace": simple_workspace()}},
        422,
        "operation",
    ),
    (
        "job with unknown operation",
        "POST",
        "/jobs",
        {"json": {"operation": "plot", "workspace": simple_workspace()}},
        422,
        "plot",
    ),
    (
        "job with invalid workspace",
        "POST",
        "/jobs",
        {"json": {"operation": "fit", "workspace": mutated(lambda s: s.pop("observations"))}},
        422,
        "observations",
    ),
    ("unknown job", "GET", "/jobs/doesnotexist", {}, 404, "doesnotexist"),
    ("cancel unknown job", "DELETE", "/jobs/doesnotexist", {}, 404, "doesnotexist"),
    ("events of unknown job", "GET", "/jobs/doesnotexist/events", {}, 404, "doesnotexist"),
    ("bad job list limit", "GET", "/jobs?limit=0", {}, 422, "limit"),
    ("malformed workspace id", "GET", "/workspaces/xyz", {}, 422, "workspace_id"),
    ("unknown route", "GET", "/nope", {}, 404, "Not Found"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_a_located_4xx(client: httpx.Client, case: tuple) -> None:
    _, method, path, kwargs, status, needle = case
    response = client.request(method, path, **kwargs)
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"detail"}
    assert needle in json.dumps(body["detail"]), body
    assert not any(marker in response.text for marker in TRACEBACK_MARKERS)


def test_unknown_patch_name_is_named(client: httpx.Client, uploaded: str) -> None:
    response = client.post(
        "/cls",
        json={
            "workspace_id": uploaded,
            "patchset": load(SMALL, "patchset.json"),
            "patch_names": ["sig_s1_x1", "no_such_patch"],
        },
    )
    assert response.status_code == 422
    assert "no_such_patch" in response.json()["detail"]


# (patch name, operations, text its error detail must contain)
BROKEN_PATCHES = [
    (
        "copied_channel",
        [{"op": "copy", "from": "/channels/0", "path": "/channels/-"}],
        "duplicate channel name 'singlechannel' at /channels/1 (first at /channels/0)",
    ),
    (
        "copied_sample",
        [{"op": "copy", "from": "/channels/0/samples/1", "path": "/channels/0/samples/-"}],
        "duplicate sample name 'background' in channel 'singlechannel' at "
        "/channels/0/samples/2 (first at /channels/0/samples/1)",
    ),
    (
        "copied_modifier",
        [
            {
                "op": "copy",
                "from": "/channels/0/samples/0/modifiers/0",
                "path": "/channels/0/samples/0/modifiers/-",
            }
        ],
        "duplicate modifier 'mu' (normfactor) on sample 'signal' in channel 'singlechannel' at "
        "/channels/0/samples/0/modifiers/1 (first at /channels/0/samples/0/modifiers/0)",
    ),
    (
        "copied_measurement",
        [{"op": "copy", "from": "/measurements/0", "path": "/measurements/-"}],
        "duplicate measurement name 'meas' at /measurements/1 (first at /measurements/0)",
    ),
    (
        "copied_observation",
        [{"op": "copy", "from": "/observations/0", "path": "/observations/-"}],
        "duplicate observation name 'singlechannel' at /observations/1 (first at /observations/0)",
    ),
    (
        "negative_count",
        [{"op": "replace", "path": "/observations/0/data/0", "value": -1.0}],
        "negative counts at /observations/0/data/0",
    ),
    (
        "inverted_bounds",
        [
            {
                "op": "add",
                "path": "/measurements/0/config/parameters/-",
                "value": {"name": "mu", "bounds": [[10.0, 0.0]]},
            }
        ],
        f"parameter 'mu' at {SETTINGS}/bounds/0: bounds [10.0, 0.0] are inverted",
    ),
]


def test_patches_that_break_names_or_bounds_answer_their_own_located_422(
    client: httpx.Client,
) -> None:
    patches = [("fine", []), *((name, operations) for name, operations, _ in BROKEN_PATCHES)]
    patchset = patchset_of(simple_workspace(), patches, "patches that break unique names or bounds")
    response = client.post("/cls", json={"workspace": simple_workspace(), "patchset": patchset})
    assert response.status_code == 200, response.text
    answer = response.json()
    assert "CLs_obs" in answer["fine"]
    for name, _, detail in BROKEN_PATCHES:
        assert answer[name]["error"]["status"] == 422, answer[name]
        assert detail in answer[name]["error"]["detail"], answer[name]
    assert not any(marker in response.text for marker in TRACEBACK_MARKERS)


def test_streamed_body_over_the_limit(client: httpx.Client) -> None:
    def chunks() -> Iterator[bytes]:
        for _ in range(40):
            yield b" " * 65536

    response = client.post("/cls", content=chunks())  # chunked: no Content-Length
    assert response.status_code == 413
    assert "--max-body-mb" in response.json()["detail"]


def test_still_healthy_after_bad_inputs(
    client: httpx.Client, server: ServerProcess, uploaded: str
) -> None:
    for case in CASES:
        _, method, path, kwargs, _, _ = case
        client.request(method, path, **copy.deepcopy(kwargs))
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").status_code == 200
    assert server.process is not None and server.process.poll() is None
    assert "Traceback" not in server.log()


def test_data_dir_holds_real_files(server: ServerProcess, uploaded: str) -> None:
    assert (Path(server.data_dir) / "workspaces" / f"{uploaded}.json").is_file()
    assert (Path(server.data_dir) / "jobs.sqlite3").is_file()


def test_full_queue_answers_429_and_readyz_503(client: httpx.Client, server: ServerProcess) -> None:
    body = {"workspace": simple_workspace((2.0, 3.0)), "test_poi": 1.0}
    assert client.post("/cls", json=body).status_code == 200  # builds the model
    with ThreadPoolExecutor(max_workers=1) as pool:
        waiting = pool.submit(client.post, "/cls", json=body)
        deadline = time.monotonic() + 10
        while httpx.get(server.url + "/readyz").status_code != 503:
            assert time.monotonic() < deadline, "the queue never filled"
            time.sleep(0.05)
        refused = client.post("/cls", json=body)
        assert refused.status_code == 429, refused.text
        assert int(refused.headers["Retry-After"]) >= 1
        assert "--max-queue" in refused.json()["detail"]
        assert waiting.result().status_code == 200
    assert httpx.get(server.url + "/readyz").status_code == 200


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/", 200),
        ("GET", "/static/app.js", 200),
        ("GET", "/jobs/doesnotexist/report", 200),
        ("POST", "/cls", 422),
        ("GET", "/nope", 404),
    ],
)
def test_every_answer_carries_the_security_headers(
    client: httpx.Client, method: str, path: str, status: int
) -> None:
    """The page, its files, reports, JSON answers and errors: never sniffed into another
    type, never framed, and a Content-Security-Policy that allows only the page's own files."""
    response = client.request(method, path, json={} if method == "POST" else None)
    assert response.status_code == status
    assert response.headers["x-content-type-options"] == "nosniff"
    assert response.headers["x-frame-options"] == "DENY"
    policy = response.headers["content-security-policy"]
    assert "default-src 'self'" in policy and "frame-ancestors 'none'" in policy
