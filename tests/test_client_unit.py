"""Unit tests of the thin client: the sans-IO layer, both clients (MockTransport) and the CLI."""

from __future__ import annotations

import asyncio
import csv
import gzip
import io
import json
import math
import os
import time
from pathlib import Path

import click
import httpx
import pytest
from click.testing import CliRunner
from client_support import (
    CLS_ANSWER,
    FakeService,
    body_of,
    mock_client_factory,
    simple_workspace,
)
from workspaces import WORKSPACES_DIR, read_json

import pyhf_gpu_client as pgc
from pyhf_gpu_client import cli, protocol
from pyhf_gpu_client.results import CLsResult, FitResult, Job, parse_result, result_to_json

SHARED = WORKSPACES_DIR / "atlas-susy-2018-31-sbottom-B"


def make_client(service: FakeService, **kwargs) -> pgc.Client:
    return pgc.Client("http://fake", transport=httpx.MockTransport(service), backoff=0.0, **kwargs)


# ---------------------------------------------------------------------- digest & inputs


def test_digest_is_pyhfs_without_pyhf():
    pyhf = pytest.importorskip("pyhf")
    ws = simple_workspace()
    assert pgc.digest(ws) == pyhf.utils.digest(ws)
    assert pgc.digest({"a": 2.0, "b": 3.0, "c": 1.0}) == (
        "a38f6093800189b79bc22ef677baf90c75705af2cfc7ff594159eca54eaa7928"
    )


@pytest.mark.skipif(not SHARED.exists(), reason="shared workspaces not present")
def test_digest_matches_patchset_record():
    ws = read_json(SHARED / "BkgOnly.json")
    ps = read_json(SHARED / "patchset.json")
    assert pgc.digest(ws) == ps["metadata"]["digests"]["sha256"]


def test_load_json_sources(tmp_path, monkeypatch):
    ws = simple_workspace()
    path = tmp_path / "ws.json"
    path.write_text(json.dumps(ws))
    assert pgc.load_json(path) == ws
    assert pgc.load_json(str(path)) == ws
    assert pgc.load_json(json.dumps(ws)) == ws
    assert pgc.load_json(io.StringIO(json.dumps(ws))) == ws
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps(ws)))
    assert pgc.load_json("-") == ws
    with pytest.raises(pgc.WorkspaceError, match="not found"):
        pgc.load_json(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(pgc.WorkspaceError, match="not valid JSON"):
        pgc.load_json(tmp_path / "bad.json")


def test_pyhf_workspace_object_is_accepted():
    pyhf = pytest.importorskip("pyhf")
    model = pyhf.simplemodels.uncorrelated_background([5.0], [50.0], [7.0])
    spec = {
        "channels": model.spec["channels"],
        "observations": [{"name": "singlechannel", "data": [52.0]}],
        "measurements": [{"name": "m", "config": {"poi": "mu", "parameters": []}}],
        "version": "1.0.0",
    }
    ws = pyhf.Workspace(spec)
    service = FakeService()
    with make_client(service) as client:
        client.cls(ws)
    assert body_of(service.requests[0])["workspace"] == json.loads(json.dumps(spec))


# ------------------------------------------------------------------------- sans-IO flows


def drive(flow, answers):
    """Run a flow by hand: feed ``answers`` to its requests, record sleeps."""
    sleeps, sent = [], []
    answers = list(answers)
    outcome = None
    while True:
        try:
            command = flow.send(outcome)
        except StopIteration as stop:
            return stop.value, sent, sleeps
        outcome = None
        if isinstance(command, protocol.Sleep):
            sleeps.append(command.seconds)
        else:
            sent.append(command)
            outcome = answers.pop(0)


def test_call_honours_retry_after_and_is_bounded():
    policy = protocol.RetryPolicy(max_attempts=3, backoff=0.01)
    req = protocol.Request("GET", "/info")
    ok = httpx.Response(200, json={"x": 1}, request=httpx.Request("GET", "http://h/info"))
    busy = httpx.Response(429, headers={"Retry-After": "7"}, json={"detail": "queue full"})
    down = httpx.Response(503, headers={"Retry-After": "2"}, json={"detail": "busy"})
    result, sent, sleeps = drive(protocol.call(req, policy), [busy, down, ok])
    assert result.json() == {"x": 1}
    assert len(sent) == 3 and sleeps == [7.0, 2.0]
    with pytest.raises(pgc.RateLimitedError) as info:
        drive(protocol.call(req, policy), [busy, busy, busy])
    assert info.value.status == 429 and info.value.retry_after == 7.0


def test_retry_after_http_date_and_backoff():
    assert protocol.parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412470.0) == 10.0
    assert protocol.parse_retry_after("soon") is None
    policy = protocol.RetryPolicy(backoff=1.0, max_backoff=4.0, max_retry_after=60)
    assert 0.5 <= policy.delay(1) <= 1.0
    assert 2.0 <= policy.delay(5) <= 4.0
    assert policy.delay(1, retry_after=600) == 60


def test_transport_errors_are_retried_then_raised():
    service = FakeService(
        script={
            "GET /info": [
                httpx.ConnectError("refused"),
                httpx.ConnectError("refused"),
                httpx.Response(200, json={"version": "x"}),
            ]
        }
    )
    with make_client(service) as client:
        assert client.info() == {"version": "x"}
    assert len(service.requests) == 3
    service = FakeService(script={"GET /info": [httpx.ConnectError("refused")]})
    with make_client(service, retries=2) as client, pytest.raises(pgc.TransportError):
        client.info()
    assert len(service.requests) == 3
    # a read timeout may have reached the server: not retried, reported as a timeout
    service = FakeService(script={"POST /cls": [httpx.ReadTimeout("slow")]})
    with make_client(service) as client, pytest.raises(pgc.TimeoutError, match="--timeout"):
        client.cls(simple_workspace())
    assert len(service.requests) == 1


def test_error_mapping_and_detail():
    detail = [{"loc": ["body", "test_stat"], "msg": "Input should be 'q' or 'qtilde'"}]
    cases = {
        400: pgc.BadRequestError,
        401: pgc.AuthenticationError,
        404: pgc.NotFoundError,
        422: pgc.BadRequestError,
        500: pgc.ServerError,
    }
    for status, exc_type in cases.items():
        service = FakeService(
            script={"POST /cls": [httpx.Response(status, json={"detail": detail})]}
        )
        with make_client(service) as client, pytest.raises(exc_type) as info:
            client.cls(simple_workspace())
        assert info.value.status == status
        assert info.value.message == "test_stat: Input should be 'q' or 'qtilde'"
    with make_client(FakeService()) as client, pytest.raises(pgc.WorkspaceError, match="finite"):
        client.cls({**simple_workspace(), "nan": float("nan")})
    service = FakeService(script={"GET /info": [httpx.Response(502, text="bad gateway")]})
    with make_client(service) as client, pytest.raises(pgc.ServerError, match="bad gateway"):
        client.info()


# ------------------------------------------------------------------------ request shape


def test_envelope_auth_and_gzip():
    service = FakeService()
    with make_client(service, token="s3cret") as client:
        client.config.compress_min_bytes = 100
        result = client.cls(simple_workspace(), test_poi=1.5, test_stat="q", ntoys=None)
    assert isinstance(result, CLsResult)
    assert result.cls_obs == CLS_ANSWER["CLs_obs"] and result.meta == {"device": "cpu"}
    assert result.to_pyhf_json() == CLS_ANSWER
    request = service.requests[0]
    assert request.headers["authorization"] == "Bearer s3cret"
    assert request.headers["content-encoding"] == "gzip"
    body = json.loads(gzip.decompress(request.content))
    assert body["workspace"] == simple_workspace()
    assert body["test_poi"] == 1.5 and body["test_stat"] == "q"
    assert "ntoys" not in body and "patches" not in body
    with make_client(service) as client:
        client.health()
    assert "authorization" not in service.requests[-1].headers
    assert "content-encoding" not in service.requests[-1].headers


@pytest.mark.parametrize("compressed", [True, False], ids=["json.gz", "json"])
def test_a_patchset_file_is_sent_as_read(tmp_path: Path, compressed: bool):
    ws = simple_workspace()
    patchset = {
        "metadata": {"name": "p", "digests": {"sha256": pgc.digest(ws)}, "labels": ["m"]},
        "patches": [{"metadata": {"name": "a", "values": [1]}, "patch": []}],
        "version": "1.0.0",
    }
    text = json.dumps(patchset, indent=1).encode()  # not the client's own spelling
    path = tmp_path / ("ps.json.gz" if compressed else "ps.json")
    path.write_bytes(gzip.compress(text) if compressed else text)
    service = FakeService()
    with make_client(service) as client:
        client.config.compress_min_bytes = 10
        client.cls(ws, patchset=path, test_poi=0.5)
    request = service.requests[0]
    assert request.headers["content-encoding"] == "gzip"
    assert (path.read_bytes() in request.content) is compressed  # the file's own gzip member
    body = json.loads(gzip.decompress(request.content))  # every member, one JSON document
    assert body["patchset"] == patchset and body["workspace"] == ws and body["test_poi"] == 0.5
    assert text in gzip.decompress(request.content)  # not parsed and written again
    plain = FakeService()
    with make_client(plain) as client:  # small bodies go uncompressed, as they are
        client.config.compress_min_bytes = 1 << 20
        client.cls(ws, patchset=path)
    assert "content-encoding" not in plain.requests[0].headers
    assert text in plain.requests[0].content


def test_a_malformed_patchset_file_is_named_when_the_server_refuses_the_body(tmp_path: Path):
    path = tmp_path / "ps.json.gz"
    path.write_bytes(gzip.compress(b'{"patches": ['))
    refused = httpx.Response(400, json={"detail": "malformed JSON: Expecting value"})
    service = FakeService(script={"POST /cls": [refused]})
    with make_client(service) as client, pytest.raises(pgc.WorkspaceError) as info:
        client.cls(simple_workspace(), patchset=path)
    assert str(path) in str(info.value) and "not valid JSON" in str(info.value)
    path.write_bytes(b"\x1f\x8b broken")
    with make_client(FakeService()) as client, pytest.raises(pgc.WorkspaceError, match="cannot"):
        client.cls(simple_workspace(), patchset=path)


def test_large_workspace_uploaded_once_and_patches_sent_alone():
    service = FakeService()
    ws = simple_workspace()
    patch = [{"op": "replace", "path": "/channels/0/samples/0/data", "value": [6.0]}]
    with make_client(service, upload_threshold=100) as client:
        client.cls(ws, patches=[patch])
        client.cls(ws, test_poi=[0.5, 1.0])
    wid = pgc.digest(ws)
    assert service.paths() == [
        f"GET /workspaces/{wid}",
        "POST /workspaces",
        "POST /cls",
        "POST /cls",
    ]
    body = body_of(service.requests[2])
    assert body == {
        "workspace_id": wid,
        "patches": [patch],
        "test_poi": 1.0,
        "test_stat": "qtilde",
        "calctype": "asymptotics",
    }
    # a new client asks first, and does not upload what the server already has
    with make_client(service, upload_threshold=100) as client:
        scan = client.cls(ws, test_poi=[0.5, 1.0])
    assert service.paths()[4:] == [f"GET /workspaces/{wid}", "POST /cls"]
    assert [r.test_poi for r in scan] == [0.5, 1.0]


def test_patches_are_sent_as_json_whatever_they_hold():
    """Plain JSON patches go as they are; numpy values, tuples and other mappings become
    their JSON form on the way; what has none is a WorkspaceError before anything is sent."""
    np = pytest.importorskip("numpy")
    service = FakeService()
    ws = simple_workspace()
    value = {"name": "signal", "data": np.array([6.0]), "modifiers": ()}
    patch = [{"op": "add", "path": "/channels/0/samples/0", "value": value}]
    with make_client(service, upload_threshold=100) as client:
        client.cls(ws, patches=[patch, [{"op": "remove", "path": np.str_("/x")}]])
        sent = body_of(service.requests[-1])["patches"]
        assert sent[0][0]["value"] == {"name": "signal", "data": [6.0], "modifiers": []}
        assert sent[1] == [{"op": "remove", "path": "/x"}]
        assert value["data"].dtype == np.float64  # the caller's patch is left as it was
        sent_before = len(service.requests)
        with pytest.raises(pgc.WorkspaceError, match="not JSON: cannot convert object"):
            client.cls(ws, patches=[[{"op": "remove", "path": object()}]])
        assert len(service.requests) == sent_before


def test_forgotten_workspace_is_uploaded_again():
    service = FakeService()
    ws = simple_workspace()
    with make_client(service, upload_threshold=100) as client:
        client.cls(ws)
        service.workspaces.clear()  # the server lost it (restart, eviction)
        client.cls(ws)
    assert service.paths()[3:] == [
        "POST /cls",
        f"GET /workspaces/{pgc.digest(ws)}",
        "POST /workspaces",
        "POST /cls",
    ]


def test_workspace_id_names_an_uploaded_workspace():
    """``upload_workspace`` gives a WorkspaceId; passed as the workspace, requests carry only
    the id (no hashing, no lookup, no upload); a server that forgot it answers 404, which the
    client cannot mend by uploading."""
    service = FakeService()
    ws = simple_workspace()
    patch = [{"op": "replace", "path": "/channels/0/samples/0/data", "value": [6.0]}]
    with make_client(service) as client:
        wid = client.upload_workspace(ws)
        assert isinstance(wid, pgc.WorkspaceId) and wid == pgc.digest(ws)
        client.cls(wid, patches=[patch])
        client.cls(wid, test_poi=0.5)
        service.workspaces.clear()
        with pytest.raises(pgc.NotFoundError):
            client.cls(wid)
    assert service.paths() == [
        f"GET /workspaces/{wid}",
        "POST /workspaces",
        "POST /cls",
        "POST /cls",
        "POST /cls",
    ]
    assert body_of(service.requests[2])["workspace_id"] == wid
    assert body_of(service.requests[2])["patches"] == [patch]
    assert body_of(service.requests[3]) == {
        "workspace_id": wid,
        "test_poi": 0.5,
        "test_stat": "qtilde",
        "calctype": "asymptotics",
    }


def test_patchset_batch_shape(tmp_path):
    service = FakeService()
    patchset = {
        "metadata": {
            "name": "ps",
            "digests": {},
            "labels": [],
            "description": "",
            "references": {},
        },
        "version": "1.0.0",
        "patches": [{"metadata": {"name": n, "values": []}, "patch": []} for n in ("a", "b", "c")],
    }
    path = tmp_path / "ps.json"
    path.write_text(json.dumps(patchset))
    with make_client(service) as client:
        results = client.run_patchset(simple_workspace(), path, patch_names=["a", "c"])
    assert set(results) == {"a", "c"} and all(isinstance(r, CLsResult) for r in results.values())
    assert body_of(service.requests[0])["patch_names"] == ["a", "c"]


def test_parse_result_shapes():
    fit = {
        "mle_parameters": {"mu": [0.5], "b": [1.0, 1.1]},
        "twice_nll": 23.2,
        "uncertainties": {"mu": [0.1], "b": [0.2, 0.2]},
        "corr_mat": [[1, 0, 0], [0, 1, 0], [0, 0, 1]],
        "meta": {"device": "cpu"},
    }
    parsed = parse_result("fit", fit)
    assert isinstance(parsed, FitResult)
    assert parsed.to_pyhf_json(value=False) == {"mle_parameters": fit["mle_parameters"]}
    assert parsed.to_pyhf_json() == {"mle_parameters": fit["mle_parameters"], "twice_nll": 23.2}
    assert "corr_mat" in parsed.to_pyhf_json(uncertainties=True)
    batch = parse_result("fit", {"p1": fit, "p2": fit})
    assert result_to_json(batch, value=False) == {
        "p1": {"mle_parameters": fit["mle_parameters"]},
        "p2": {"mle_parameters": fit["mle_parameters"]},
    }
    ul = parse_result(
        "upper-limit",
        {"upper_limit_obs": 1.2, "upper_limit_exp": [1] * 5, "level": 0.05, "meta": {}},
    )
    assert result_to_json(ul) == {
        "upper_limit_obs": 1.2,
        "upper_limit_exp": [1.0] * 5,
        "level": 0.05,
    }
    answer = {
        "p0_obs": 0.1,
        "p0_exp": 0.2,
        "z_obs": 1.28,
        "z_exp": 0.84,
        "p0_exp_set": [0.01, 0.05, 0.2, 0.4, 0.5],
    }
    sig = parse_result("significance", {**answer, "meta": {}})
    assert sig.z_obs == 1.28 and sig.p0_exp == 0.2 and result_to_json(sig) == answer
    other = parse_result("significance", {"p0": 0.1, "p0_exp": 0.2, "Z": 1.28, "Z_exp": 0.8})
    assert other.z_obs == 1.28 and set(result_to_json(other)) == {"p0", "p0_exp", "Z", "Z_exp"}
    with pytest.raises(ValueError):
        parse_result("cls", 3)


# ---------------------------------------------------------------------------------- jobs


def _job(status, done=0, result=None, error=None):
    return httpx.Response(
        200,
        json={
            "id": "j1",
            "operation": "cls",
            "status": status,
            "progress": {"done": done, "total": 4},
            "result": result,
            "error": error,
        },
    )


CLS_DONE = {**CLS_ANSWER, "meta": {}}


def _submitted(*views: httpx.Response) -> FakeService:
    """A service that queues a submitted job ``j1`` and answers its polls with ``views``."""
    queued = httpx.Response(202, json={"id": "j1", "status": "queued", "url": "/jobs/j1"})
    return FakeService(script={"POST /jobs": [queued], "GET /jobs/j1": list(views)})


def test_a_request_the_server_made_a_job_is_followed_and_fails_as_its_answer_would():
    """202 (``Prefer: respond-async``, sent with ``job_after``): the job is polled to its end;
    its result parses as the synchronous answer, its stored 422 raises what a 422 answer
    raises; ``job_after=None`` sends no preference."""
    accepted = httpx.Response(202, json={"id": "j1", "status": "running", "url": "/jobs/j1"})
    service = FakeService(
        script={
            "POST /cls": [accepted],
            "GET /jobs/j1": [_job("running", 2), _job("succeeded", 4, CLS_DONE)],
        }
    )
    seen: list[Job] = []
    with make_client(service, job_after=2.5, on_job_update=seen.append) as client:
        result = client.cls(simple_workspace(), 1.0)
    assert isinstance(result, CLsResult) and result.cls_obs == CLS_ANSWER["CLs_obs"]
    assert service.requests[0].headers["Prefer"] == "respond-async, wait=2.5"
    assert [job.status for job in seen] == ["running", "running", "succeeded"]

    failed = _job("failed", error={"status": 422, "detail": "no patch could be tested"})
    service = FakeService(script={"POST /cls": [accepted], "GET /jobs/j1": [failed]})
    with make_client(service) as client, pytest.raises(pgc.BadRequestError) as raised:
        client.cls(simple_workspace(), 1.0)
    assert raised.value.status == 422 and "no patch could be tested" in str(raised.value)

    service = FakeService()
    with make_client(service, job_after=None) as client:
        client.cls(simple_workspace(), 1.0)
    assert "Prefer" not in service.requests[-1].headers


def test_submit_wait_with_progress():
    service = _submitted(_job("queued"), _job("running", 2), _job("succeeded", 4, CLS_DONE))
    seen = []
    with make_client(service) as client:
        job = client.submit("cls", simple_workspace(), test_poi=[1.0])
        assert job.id == "j1" and job.status == "queued"
        done = client.wait(job, poll_interval=0.001, on_update=seen.append)
    assert body_of(service.requests[0])["operation"] == "cls"
    assert [j.progress for j in seen] == [0.0, 0.5, 1.0]
    assert isinstance(done.result, CLsResult) and done.done


def test_wait_failures():
    service = FakeService(script={"GET /jobs/j1": [_job("failed", error="no POI")]})
    with make_client(service) as client, pytest.raises(pgc.JobFailedError, match="no POI"):
        client.wait("j1")
    service = FakeService(script={"GET /jobs/j1": [_job("cancelled")]})
    with make_client(service) as client, pytest.raises(pgc.JobCancelledError):
        client.wait("j1")
    service = FakeService(script={"GET /jobs/j1": [_job("running", 1)]})
    with make_client(service) as client, pytest.raises(pgc.WaitTimeoutError) as info:
        client.wait("j1", timeout=0.05, poll_interval=0.01)
    assert info.value.job.status == "running"


def test_jobs_list_cancel_and_sse():
    service = FakeService(
        script={
            "GET /jobs": [httpx.Response(200, json={"jobs": [_job("running").json()]})],
            "DELETE /jobs/j1": [_job("cancelled")],
        }
    )
    with make_client(service) as client:
        assert [j.status for j in client.jobs()] == ["running"]
        assert client.cancel("j1").status == "cancelled"
    parser = protocol.SSEParser()
    events = parser.feed_lines(
        ["event: progress", 'data: {"done": 1, "total": 2}', "", ": ping", "data: plain", ""]
    )
    assert events == [
        {"event": "progress", "data": {"done": 1, "total": 2}, "id": None},
        {"event": "message", "data": "plain", "id": None},
    ]


def test_async_client_same_api():
    service = FakeService(
        script={
            "POST /cls": [
                httpx.Response(503, headers={"Retry-After": "0"}, json={"detail": "x"}),
                httpx.Response(200, json=CLS_DONE),
            ],
        }
    )

    async def main():
        async with pgc.AsyncClient("http://fake", transport=httpx.MockTransport(service)) as c:
            one = await c.cls(simple_workspace())
            health = await c.health()
            return one, health

    one, health = asyncio.run(main())
    assert one.to_pyhf_json() == CLS_ANSWER and health == {"status": "ok"}
    assert service.paths() == ["POST /cls", "POST /cls", "GET /healthz"]
    assert pgc.AsyncClient.cls.__doc__ == pgc.Client.cls.__doc__


def test_env_configuration(monkeypatch):
    monkeypatch.setenv("PYHF_GPU_SERVER", "gpu-node:9000/")
    monkeypatch.setenv("PYHF_GPU_API_TOKEN", "tok")
    client = pgc.Client()
    assert client.config.server == "http://gpu-node:9000"
    assert client.config.headers()["Authorization"] == "Bearer tok"
    client.close()


# ----------------------------------------------------------------------------------- CLI


def test_parse_test_poi():
    assert cli.parse_test_poi(["1.0"]) == 1.0
    assert cli.parse_test_poi(["1", "2"]) == [1.0, 2.0]
    assert cli.parse_test_poi(["0.5,1.5"]) == [0.5, 1.5]
    assert cli.parse_test_poi(["0:2:5"]) == [0.0, 0.5, 1.0, 1.5, 2.0]
    assert cli.parse_test_poi(["3:3:1"]) == [3.0]
    for bad in (["x"], ["0:1"], ["0:1:0"]):
        with pytest.raises(click.BadParameter) as info:
            cli.parse_test_poi(bad)
        assert "--test-poi" in info.value.format_message()


@pytest.fixture
def fake_cli(monkeypatch):
    service = FakeService()
    monkeypatch.setattr(cli, "_client", mock_client_factory(service))
    return service


def test_cli_prints_pyhf_json(fake_cli, tmp_path):
    ws = tmp_path / "ws.json"
    ws.write_text(json.dumps(simple_workspace()))
    runner = CliRunner()
    res = runner.invoke(cli.main, ["cls", str(ws), "--backend", "jax", "--optimizer", "minuit"])
    assert res.exit_code == 0, res.output
    assert res.output == json.dumps(CLS_ANSWER, indent=4, sort_keys=True) + "\n"
    res = runner.invoke(cli.main, ["cls", "--test-poi", "0:1:3"], input=ws.read_text())
    assert res.exit_code == 0, res.output
    assert [e["test_poi"] for e in json.loads(res.output)] == [0.0, 0.5, 1.0]
    out = tmp_path / "out.json"
    res = runner.invoke(cli.main, ["cls", str(ws), "--output-file", str(out)])
    assert res.exit_code == 0 and res.output == ""
    assert out.read_text() == json.dumps(CLS_ANSWER, indent=4, sort_keys=True)


def test_flagged_results_are_said_on_stderr_and_warned_in_python(fake_cli, tmp_path):
    """A result whose fits the server flagged (meta.converged / starts_agreed false): the CLI
    prints pyhf's JSON and a warning on stderr naming the tested POI (exit 1 with --strict);
    the Python client returns it with a DoubtfulResultWarning."""
    flagged = {**CLS_ANSWER, "meta": {"converged": False, "starts_agreed": False, "test_poi": 1.0}}
    fake_cli.script["POST /cls"] = [httpx.Response(200, json=flagged) for _ in range(3)]
    ws = tmp_path / "ws.json"
    ws.write_text(json.dumps(simple_workspace()))
    runner = CliRunner()
    res = runner.invoke(cli.main, ["cls", str(ws)])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout) == CLS_ANSWER
    assert "Warning: test_poi 1.0: its fits did not converge (meta.converged false)" in res.stderr
    assert "reached different minima (meta.starts_agreed false)" in res.stderr
    strict = runner.invoke(cli.main, ["cls", str(ws), "--strict"])
    assert strict.exit_code == 1 and "2 flags on the results" in strict.stderr
    with make_client(fake_cli) as client, pytest.warns(pgc.DoubtfulResultWarning, match="converge"):
        result = client.cls(simple_workspace())
    assert result.meta["converged"] is False


def test_cli_errors_are_one_line(fake_cli, tmp_path):
    fake_cli.script["POST /cls"] = [
        httpx.Response(422, json={"detail": "invalid workspace at channels: [] is too short"})
    ]
    ws = tmp_path / "ws.json"
    ws.write_text(json.dumps(simple_workspace()))
    runner = CliRunner()
    res = runner.invoke(cli.main, ["cls", str(ws)])
    assert res.exit_code == 1
    assert "422: invalid workspace at channels" in res.output
    assert "Traceback" not in res.output and res.exception.__class__ is SystemExit
    res = runner.invoke(cli.main, ["cls", str(tmp_path / "nope.json")])
    assert res.exit_code == 1 and "not found" in res.output
    res = runner.invoke(cli.main, ["fit", str(ws), "--patch-name", "x"])
    assert res.exit_code == 2 and "--patchset" in res.output


def test_cli_unreachable_exit_code(tmp_path):
    ws = tmp_path / "ws.json"
    ws.write_text(json.dumps(simple_workspace()))
    res = CliRunner().invoke(
        cli.main, ["--server", "http://127.0.0.1:9", "--retries", "0", "cls", str(ws)]
    )
    assert res.exit_code == 3 and "cannot connect" in res.output


def test_cli_jobs_plain_progress(monkeypatch, tmp_path):
    running = [_job("running", 1), _job("running", 1), _job("running", 3)]
    service = _submitted(*running, _job("succeeded", 4, CLS_DONE))
    monkeypatch.setattr(cli, "_client", mock_client_factory(service))
    ws = tmp_path / "ws.json"
    ws.write_text(json.dumps(simple_workspace()))
    runner = CliRunner()
    res = runner.invoke(cli.main, ["jobs", "submit", "cls", str(ws)])
    assert res.exit_code == 0 and res.output == "j1\n"
    res = runner.invoke(cli.main, ["jobs", "wait", "j1"])
    assert res.exit_code == 0, res.output
    lines = res.stderr.splitlines()
    assert lines == ["job j1: running 25%", "job j1: running 75%", "job j1: succeeded 100%"]
    assert json.loads(res.stdout) == CLS_ANSWER


def test_progress_bar_on_terminal():
    stream = io.StringIO()
    bar = cli.Progress(stream, tty=True)
    bar(Job(id="abc", status="running", progress=0.5))
    bar.close()
    assert stream.getvalue().startswith("\rabc [" + "#" * 15 + "-" * 15 + "]  50% running")
    assert stream.getvalue().endswith("\n")


def test_waiting_for_an_answer_shows_the_seconds_on_a_terminal(monkeypatch):
    """On a terminal a request waiting for its answer redraws the seconds it has waited, from
    the first one, and erases the line when the answer comes (or the job's bar takes over);
    elsewhere it writes nothing."""
    monkeypatch.setattr(cli.Progress, "TICK_S", 0.05)
    stream = io.StringIO()
    bar = cli.Progress(stream, tty=True)
    with bar.waiting():
        time.sleep(1.3)
    shown = stream.getvalue()
    assert "\rwaiting for the server: 1 s" in shown
    assert shown.endswith("\r" + " " * len("waiting for the server: 1 s") + "\r")
    stream = io.StringIO()
    bar = cli.Progress(stream, tty=True)
    with bar.waiting():
        time.sleep(1.2)
        bar(Job(id="abc", status="running", progress=0.5))  # became a job: its bar
        time.sleep(0.3)
    bar.close()
    assert stream.getvalue().rsplit("waiting for the server: 1 s", 1)[1].startswith("\rabc [")
    assert stream.getvalue().endswith("running   \n")
    stream = io.StringIO()
    with cli.Progress(stream, tty=False).waiting():
        time.sleep(1.2)
    assert stream.getvalue() == ""


def test_dropped_connection_retried_only_when_idempotent():
    dropped = httpx.RemoteProtocolError("server disconnected")
    ok = httpx.Response(200, json=CLS_DONE)
    service = FakeService(script={"POST /cls": [dropped, ok]})
    with make_client(service) as client:
        assert client.cls(simple_workspace()).to_pyhf_json() == CLS_ANSWER
    assert len(service.requests) == 2
    # a job submission may have reached the server: not sent twice (no duplicate jobs)
    service = FakeService(script={"POST /jobs": [dropped]})
    with make_client(service) as client, pytest.raises(pgc.TransportError):
        client.submit("cls", simple_workspace())
    assert len(service.requests) == 1


# ------------------------------------------------------- ranking, scan, yields, goodness of fit

META = {"device": "cpu", "converged": True}
RANKING_ANSWER = {
    "labels": ["lumi", "bkg_norm", "mu_bkg"],
    "bestfit": [1.01, 0.2, 0.96],
    "uncertainty": [0.02, 0.9, 0.13],
    "prefit_uncertainty": [0.017, 1.0, 0.0],
    "prefit_up": [0.05, -0.3, 0.0],
    "prefit_down": [-0.04, 0.25, 0.0],
    "postfit_up": [0.06, -0.2, None],
    "postfit_down": [-0.05, 0.1, None],
    "pull": [0.6, 0.2, None],
    "constraint": [1.2, 0.9, None],
    "fits_converged": [True, True, False],
    "poi": {"name": "mu", "bestfit": 0.8, "uncertainty": 0.3},
    "meta": META,
}
SCAN_ANSWER = {
    "name": "mu",
    "bestfit": 1.0,
    "uncertainty": 0.5,
    "parameter_values": [0.0, 1.0, 2.0],
    "delta_nlls": [4.0, 0.0, 4.1],
    "meta": META,
}
SCAN2D_ANSWER = {
    "names": ["mu", "lumi"],
    "bestfit": [1.0, 1.0],
    "uncertainty": [0.5, 0.02],
    "correlation": -0.1,
    "parameter_values": [[0.0, 1.0], [0.98, 1.0, 1.02]],
    "delta_nlls": [[5.0, 4.0, 5.1], [1.0, 0.0, None]],
    "meta": META,
}


def _sample(yields, stdev):
    return {
        "yields": yields,
        "stdev": stdev,
        "channel_yield": sum(yields),
        "channel_stdev": sum(stdev),
    }


def _channel(scale):
    return {
        "bins": 2,
        "samples": {
            "signal": _sample([1.0 * scale, 2.0 * scale], [0.1, 0.2]),
            "background": _sample([10.0, 20.0], [1.0, 2.0]),
        },
        "total": _sample([10.0 + scale, 20.0 + 2 * scale], [1.1, 2.2]),
        "data": [12.0, 21.0],
        "channel_data": 33.0,
    }


YIELDS_ANSWER = {
    "prefit": {"SR": _channel(1.0), "CR": _channel(0.0)},
    "postfit": {"SR": _channel(0.5), "CR": _channel(0.0)},
    "meta": META,
}
GOF = {"p_value": 0.25, "delta_twice_nll": 1.3, "ndof": 1}


def _answering(**answers):
    """A FakeService answering ``POST /<name>`` with ``answers[name]``."""
    return FakeService(
        script={f"POST /{name}": [httpx.Response(200, json=a)] for name, a in answers.items()}
    )


def test_ranking_scan_yields_request_bodies():
    fit_answer = {"mle_parameters": {"mu": [0.5]}, "twice_nll": 3.0, "goodness_of_fit": GOF}
    service = _answering(
        ranking=RANKING_ANSWER, scan=SCAN_ANSWER, yields=YIELDS_ANSWER, fit=fit_answer
    )
    ws = simple_workspace()
    with make_client(service) as client:
        ranking = client.ranking(ws, parameters="lumi", top=2, measurement="m")
        client.ranking(ws)
        scan = client.scan(ws, range=(0, 2), steps=3)
        client.scan(ws, "mu", values=[0, 1], parameter_y="lumi", range_y=[0.9, 1.1])
        yields = client.yields(ws, patches=[[]])
        fit = client.fit(ws, goodness_of_fit=True)
        client.fit(ws)
    bodies = [body_of(r) for r in service.requests]
    assert service.paths() == ["POST /ranking"] * 2 + ["POST /scan"] * 2 + [
        "POST /yields",
        "POST /fit",
        "POST /fit",
    ]
    assert {k: v for k, v in bodies[0].items() if k != "workspace"} == {
        "parameters": ["lumi"],
        "top": 2,
        "measurement": "m",
    }
    assert set(bodies[1]) == {"workspace"}
    assert bodies[2]["x"] == {"range": [0.0, 2.0], "steps": 3} and "y" not in bodies[2]
    assert bodies[3]["x"] == {"parameter": "mu", "values": [0.0, 1.0]}  # no steps with values
    assert bodies[3]["y"] == {"parameter": "lumi", "range": [0.9, 1.1], "steps": 11}
    assert set(bodies[4]) == {"workspace", "patches"}
    assert bodies[5]["goodness_of_fit"] is True
    assert "goodness_of_fit" not in bodies[6]  # not sent unless asked for
    assert isinstance(ranking, pgc.RankingResult) and ranking.to_json() == RANKING_ANSWER
    assert isinstance(scan, pgc.ScanResult) and scan.to_json() == SCAN_ANSWER
    assert isinstance(yields, pgc.YieldsResult) and yields.to_json() == YIELDS_ANSWER
    assert fit.goodness_of_fit == pgc.GoodnessOfFit(p_value=0.25, delta_twice_nll=1.3, ndof=1)
    assert fit.to_pyhf_json(value=False) == {
        "mle_parameters": {"mu": [0.5]},
        "goodness_of_fit": GOF,
    }


def test_scan_axes_are_checked_before_sending():
    assert protocol.scan_options({"values": [0, 1], "steps": 11}) == {"x": {"values": [0.0, 1.0]}}
    assert protocol.scan_options({"x": {"values": [0, 1]}, "steps_y": 11}) == {
        "x": {"values": [0, 1]}
    }
    # no grid: the server's automatic one (cabinetry's default), for either axis
    assert protocol.scan_options({}) == {"x": {}}
    assert protocol.scan_options({"steps": 5}) == {"x": {"steps": 5}}
    assert protocol.scan_options({"parameter": "mu", "steps_y": 11}) == {"x": {"parameter": "mu"}}
    assert protocol.scan_options({"values": [0, 1], "parameter_y": "lumi", "steps_y": 7}) == {
        "x": {"values": [0.0, 1.0]},
        "y": {"parameter": "lumi", "steps": 7},
    }
    bad = [
        {"values": [0, 1], "range": [0, 1]},
        {"range": [0, 1, 2]},
        {"x": {"values": [0, 1]}, "values": [0, 1]},
    ]
    service = FakeService()
    with make_client(service) as client:
        for options in bad:
            with pytest.raises(ValueError):
                client.scan(simple_workspace(), **options)
    assert service.requests == []


def test_ranking_accessors():
    ranking = parse_result("ranking", RANKING_ANSWER)
    assert ranking.poi == pgc.PoiEstimate("mu", 0.8, 0.3) and len(ranking) == 3
    assert ranking.impacts()[:2] == [0.06, 0.2] and math.isnan(ranking.impacts()[2])
    assert ranking.impacts("prefit") == [0.05, 0.3, 0.0]
    assert ranking.sorted().labels == ["bkg_norm", "lumi", "mu_bkg"]  # NaN impacts last
    top = ranking.top(1, by="prefit")
    assert top.labels == ["bkg_norm"] and top.postfit_down == [0.1] and top.poi == ranking.poi
    assert ranking.top(10).labels == ranking.sorted().labels
    assert ranking.parameter("lumi")["pull"] == 0.6 and ranking.rows()[2]["fits_converged"] is False
    with pytest.raises(KeyError):
        ranking.parameter("nope")
    # NaN back to null; no meta where pyhf-like output is wanted
    assert result_to_json(ranking) == {k: v for k, v in RANKING_ANSWER.items() if k != "meta"}


def test_scan_results_1d_and_2d():
    one = parse_result("scan", SCAN_ANSWER)
    assert one.minimum() == (1.0, 0.0) and one.points()[0] == (0.0, 4.0)
    two = parse_result("scan", SCAN2D_ANSWER)
    assert isinstance(two, pgc.Scan2DResult) and two.to_json() == SCAN2D_ANSWER
    assert two.minimum() == (1.0, 1.0, 0.0) and len(two.points()) == 6
    assert two.points()[2] == (0.0, 1.02, 5.1) and math.isnan(two.points()[5][2])
    batch = parse_result(
        "scan",
        {"a": SCAN_ANSWER, "b": SCAN2D_ANSWER, "c": {"error": {"status": 422, "detail": "x"}}},
    )
    assert isinstance(batch["a"], pgc.ScanResult) and isinstance(batch["b"], pgc.Scan2DResult)
    assert batch["c"] == pgc.PatchError(422, "x")


def test_yields_result_rows_and_table():
    yields = parse_result("yields", YIELDS_ANSWER)
    assert yields.channels == ["SR", "CR"]
    assert yields.channel("SR", "prefit").samples["signal"].yields == [1.0, 2.0]
    rows = yields.rows()
    # 2 fits x 2 channels x (2 samples + total + data) x 2 bins
    assert len(rows) == 2 * 2 * 4 * 2
    assert rows[0] == {
        "fit": "prefit",
        "channel": "SR",
        "sample": "signal",
        "bin": 0,
        "yield": 1.0,
        "stdev": 0.1,
    }
    assert rows[7] == {
        "fit": "prefit",
        "channel": "SR",
        "sample": "data",
        "bin": 1,
        "yield": 21.0,
        "stdev": None,
    }
    table = yields.table("postfit")
    assert list(table) == ["SR", "CR"]
    assert table["SR"][0] == {
        "sample": "signal",
        "bin 1": "0.50 ± 0.10",
        "bin 2": "1.00 ± 0.20",
        "sum": "1.50 ± 0.30",
    }
    assert table["SR"][-1] == {"sample": "data", "bin 1": "12.00", "bin 2": "21.00", "sum": "33.00"}
    assert [r["sample"] for r in table["CR"]] == ["signal", "background", "total", "data"]
    with pytest.raises(ValueError):
        yields.table("fitted")


def test_yields_csv_and_table_formatting():
    yields = parse_result("yields", YIELDS_ANSWER)
    text = cli.format_yields_csv(yields)
    parsed = list(csv.DictReader(io.StringIO(text)))
    assert len(parsed) == 32 and list(parsed[0]) == list(pgc.YieldsResult.COLUMNS)
    assert parsed[7]["sample"] == "data" and parsed[7]["stdev"] == ""
    assert float(parsed[0]["yield"]) == 1.0
    batch = parse_result("yields", {"p1": YIELDS_ANSWER, "p2": YIELDS_ANSWER})
    parsed = list(csv.DictReader(io.StringIO(cli.format_yields_csv(batch))))
    assert len(parsed) == 64 and {r["patch"] for r in parsed} == {"p1", "p2"}
    table = cli.format_yields_table(yields)
    assert table.count("yields, channel") == 4
    assert "prefit yields, channel SR:" in table and "postfit yields, channel CR:" in table
    block = table.split("\n\n")[0].splitlines()
    assert block[1].split() == ["sample", "bin", "1", "bin", "2", "sum"]
    assert set(block[2]) == {"-", " "}
    assert block[3].split() == [
        "signal",
        "1.00",
        "±",
        "0.10",
        "2.00",
        "±",
        "0.20",
        "3.00",
        "±",
        "0.30",
    ]
    assert len({len(line) for line in block[1:4]}) == 1  # aligned
    assert "=== patch p2 ===" in cli.format_yields_table(batch)


def test_new_jobs_parse_their_results():
    job = Job.from_json(
        {"id": "j", "status": "succeeded", "operation": "ranking", "result": RANKING_ANSWER}
    )
    assert isinstance(job.result, pgc.RankingResult)
    job = Job.from_json(
        {"id": "j", "status": "succeeded", "operation": "yields", "result": {"p": YIELDS_ANSWER}}
    )
    assert isinstance(job.result["p"], pgc.YieldsResult)
    service = FakeService(
        script={
            "POST /jobs": [httpx.Response(202, json={"id": "j1", "status": "queued", "url": "/j"})]
        }
    )
    with make_client(service) as client:
        client.submit("scan", simple_workspace(), parameter="mu", range=[0, 2], steps=5)
        client.submit("ranking", simple_workspace(), top=3)
        client.submit("fit", simple_workspace(), goodness_of_fit=True)
    bodies = [body_of(r) for r in service.requests]
    assert bodies[0]["operation"] == "scan"
    assert bodies[0]["x"] == {"parameter": "mu", "range": [0.0, 2.0], "steps": 5}
    assert bodies[1]["top"] == 3 and bodies[2]["goodness_of_fit"] is True


def test_async_client_has_the_new_operations():
    service = _answering(ranking=RANKING_ANSWER, scan=SCAN2D_ANSWER, yields=YIELDS_ANSWER)

    async def main():
        async with pgc.AsyncClient("http://fake", transport=httpx.MockTransport(service)) as c:
            return (
                await c.ranking(simple_workspace(), parameters=["lumi", "bkg_norm"]),
                await c.scan(simple_workspace(), values=[0, 1], values_y=[0, 1]),
                await c.yields(simple_workspace()),
            )

    ranking, scan, yields = asyncio.run(main())
    assert ranking.labels == RANKING_ANSWER["labels"] and scan.names == ["mu", "lumi"]
    assert yields.to_json(meta=False) == {k: YIELDS_ANSWER[k] for k in ("prefit", "postfit")}
    assert body_of(service.requests[1])["y"] == {"values": [0.0, 1.0]}
    for name in ("ranking", "scan", "yields", "fit"):
        assert getattr(pgc.AsyncClient, name).__doc__ == getattr(pgc.Client, name).__doc__
    signature = pgc.AsyncClient.scan.signature  # the public one: no self, steps default 11
    assert list(signature.parameters)[:5] == ["workspace", "parameter", "values", "range", "steps"]
    assert signature.parameters["steps_y"].default == 11


def test_cli_ranking_scan_yields_fit(monkeypatch, tmp_path):
    fit_answer = {"mle_parameters": {"mu": [0.5]}, "twice_nll": 3.0, "goodness_of_fit": GOF}
    service = _answering(
        ranking=RANKING_ANSWER, scan=SCAN_ANSWER, yields=YIELDS_ANSWER, fit=fit_answer
    )
    monkeypatch.setattr(cli, "_client", mock_client_factory(service))
    ws = tmp_path / "ws.json"
    ws.write_text(json.dumps(simple_workspace()))
    runner = CliRunner()

    def run(*args):
        res = runner.invoke(cli.main, [*args[:1], str(ws), *args[1:]])
        assert res.exit_code == 0, res.output
        return res.stdout

    out = json.loads(run("ranking", "--parameter", "lumi", "--parameter", "bkg_norm", "--top", "2"))
    assert out == {k: v for k, v in RANKING_ANSWER.items() if k != "meta"}
    body = body_of(service.requests[-1])
    assert body["parameters"] == ["lumi", "bkg_norm"] and body["top"] == 2
    assert json.loads(run("scan", "--range", "0", "2", "--steps", "3"))["name"] == "mu"
    assert body_of(service.requests[-1])["x"] == {"range": [0.0, 2.0], "steps": 3}
    run(
        "scan",
        "--parameter",
        "mu",
        "--values",
        "0:1:3",
        "--parameter-y",
        "lumi",
        "--values-y",
        "0.9,1.1",
    )
    body = body_of(service.requests[-1])
    assert body["x"] == {"parameter": "mu", "values": [0.0, 0.5, 1.0]}
    assert body["y"] == {"parameter": "lumi", "values": [0.9, 1.1]}
    assert json.loads(run("yields")) == {k: YIELDS_ANSWER[k] for k in ("prefit", "postfit")}
    assert run("yields", "--format", "table") == cli.format_yields_table(
        parse_result("yields", YIELDS_ANSWER)
    )
    out = tmp_path / "yields.csv"
    assert run("yields", "--format", "csv", "--output-file", str(out)) == ""
    assert len(list(csv.DictReader(out.open(newline="")))) == 32
    fit = json.loads(run("fit", "--goodness-of-fit"))
    assert fit["goodness_of_fit"] == GOF and body_of(service.requests[-1])["goodness_of_fit"]
    # no grid: the server's automatic one (cabinetry's default), on either axis
    assert json.loads(run("scan", "--steps", "5"))["name"] == "mu"
    assert body_of(service.requests[-1])["x"] == {"steps": 5}
    run("scan", "--values", "0,1", "--parameter-y", "lumi")
    assert body_of(service.requests[-1])["y"] == {"parameter": "lumi"}
    for args, message in [
        (["scan", "--values", "0,1", "--range", "0", "1"], "not both"),
        (["scan", "--values", "0,1", "--steps", "3"], "--steps goes with --range or no grid"),
        (["ranking", "--top", "0"], "--top"),
        (["yields", "--format", "xml"], "--format"),
    ]:
        res = runner.invoke(cli.main, [args[0], str(ws), *args[1:]])
        assert res.exit_code == 2 and message in res.output, res.output
    submitted = {
        "POST /jobs": [httpx.Response(202, json={"id": "j1", "status": "queued", "url": "/j"})]
    }
    service.script.update(submitted)
    res = runner.invoke(cli.main, ["jobs", "submit", "scan", str(ws), "--values", "0,1"])
    assert res.exit_code == 0 and res.output == "j1\n"
    assert body_of(service.requests[-1]) == {
        "operation": "scan",
        "workspace": simple_workspace(),
        "x": {"values": [0.0, 1.0]},
    }


# ------------------------------------------------------------------------------------ plots

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00\x00\x00\rIHDR" + b"\x00\x00\x01,\x00\x00\x00\xc8" + b"rest"
SVG = b'<?xml version="1.0"?>\n<svg xmlns="http://www.w3.org/2000/svg"></svg>\n'


def _image(data: bytes = PNG, media: str = "image/png") -> httpx.Response:
    return httpx.Response(200, content=data, headers={"Content-Type": media})


def test_plot_helpers():
    assert protocol.plot_format("out/brazil.PNG") == "png"
    assert protocol.plot_format(Path("a.b/x.svg")) == "svg"
    for bad in ("x.pdf", "x", "dir.png/x"):
        with pytest.raises(ValueError, match=r"\.png or \.svg"):
            protocol.plot_format(bad)
    assert protocol.plot_option("top=5") == ("top", 5)
    assert protocol.plot_option("dpi=80") == ("dpi", 80.0)
    assert protocol.plot_option("log-y=yes") == ("log_y", True)
    assert protocol.plot_option("channels=SR, CR") == ("channels", ["SR", "CR"])
    assert protocol.plot_option("axes=0,1") == ("axes", [0, 1])
    assert protocol.plot_option("figsize=8,6") == ("figsize", [8.0, 6.0])
    assert protocol.plot_option("label=ATLAS Internal, x=1") == ("label", "ATLAS Internal, x=1")
    assert protocol.plot_option("other=[1, 2]") == ("other", [1, 2])  # JSON, else text
    assert protocol.plot_option("other=a b") == ("other", "a b")
    for bad, message in [
        ("top", "KEY=VALUE"),
        ("=5", "KEY=VALUE"),
        ("top=x", "an integer"),
        ("log_y=maybe", "true or false"),
        ("figsize=8,x", "numbers"),
    ]:
        with pytest.raises(ValueError, match=message):
            protocol.plot_option(bad)
    kinds, default = protocol.plot_kinds_for, protocol.default_plot_kind
    assert kinds("cls", {"test_poi": 1.0}) == () and default("cls", {"test_poi": 1.0}) is None
    assert kinds("cls", {"test_poi": [0.0, 1.0]}) == ("brazil",)
    both = {"test_poi": [0.0, 1.0], "patchset": "ps.json"}
    assert kinds("cls", both) == ("brazil", "exclusion") and default("cls", both) == "exclusion"
    assert default("fit", {}) == "pulls" and default("upper-limit", {}) == "brazil"
    assert default("significance", {}) is None and default("scan", {}) == "scan"


def test_plot_of_a_job_request():
    service = FakeService(
        script={
            "GET /jobs/j1/plots/brazil.png": [_image()],
            "GET /jobs/j1/plots/exclusion.svg": [_image(SVG, "image/svg+xml; charset=utf-8")],
            "GET /jobs/j1/plots": [
                httpx.Response(
                    200,
                    json={
                        "id": "j1",
                        "operation": "cls",
                        "status": "succeeded",
                        "plots": [{"kind": "brazil", "png": "/p.png"}, {"kind": "exclusion"}],
                    },
                )
            ],
            "GET /jobs/j2/plots/pulls.png": [
                httpx.Response(409, json={"detail": "job 'j2' is running"})
            ],
            "GET /jobs/j3/plots/pulls.png": [httpx.Response(200, json={"not": "an image"})],
        }
    )
    with make_client(service, token="tok") as client:
        data = client.plot(
            "j1",
            "brazil",
            dpi=80,
            figsize=(6, 4),
            channels=["SR", "CR"],
            log_y=True,
            label="ATLAS Internal",
            title=None,
        )
        assert data == PNG
        request = service.requests[-1]
        assert request.method == "GET" and request.headers["accept"] == "image/png"
        assert request.headers["authorization"] == "Bearer tok"
        query = request.url.params
        assert query.get_list("figsize") == ["6", "4"] and query["dpi"] == "80"
        assert query.get_list("channels") == ["SR", "CR"] and query["log_y"] == "true"
        assert query["label"] == "ATLAS Internal" and "title" not in query
        job = Job(id="j1", status="succeeded", operation="cls")
        assert client.plot(job, "exclusion", "svg") == SVG
        assert service.requests[-1].headers["accept"] == "image/svg+xml"
        assert client.plot_kinds(job) == ["brazil", "exclusion"]
        with pytest.raises(pgc.BadRequestError) as info:
            client.plot("j2", "pulls")
        assert info.value.status == 409 and "running" in info.value.message
        with pytest.raises(pgc.ServerError, match="application/json, not the png image"):
            client.plot("j3", "pulls")
        sent = len(service.requests)
        with pytest.raises(ValueError, match="svg, png"):
            client.plot("j1", "brazil", "pdf")
        with pytest.raises(ValueError, match="a value or a list"):
            client.plot("j1", "brazil", figsize={"w": 6})
        assert len(service.requests) == sent  # nothing sent


def test_render_sends_the_operation_with_its_plot():
    service = FakeService(
        script={
            "POST /cls": [_image(SVG, "image/svg+xml")],
            "POST /scan": [_image()],
            "POST /ranking": [httpx.Response(200, json=RANKING_ANSWER)],
        }
    )
    with make_client(service) as client:
        svg = client.render(
            "cls",
            simple_workspace(),
            "brazil",
            "svg",
            {"label": "ATLAS Internal", "level": 0.1, "title": None},
            test_poi=(0, 1),
            test_stat="q",
        )
        assert svg == SVG
        request = service.requests[-1]
        assert request.headers["accept"] == "image/svg+xml"
        assert body_of(request) == {
            "workspace": simple_workspace(),
            "test_poi": [0.0, 1.0],
            "test_stat": "q",
            "plot": {"kind": "brazil", "format": "svg", "label": "ATLAS Internal", "level": 0.1},
        }
        assert client.render("scan", simple_workspace(), "scan", range=(0, 2), steps=5) == PNG
        body = body_of(service.requests[-1])
        assert body["x"] == {"range": [0.0, 2.0], "steps": 5}
        assert body["plot"] == {"kind": "scan", "format": "png"}
        with pytest.raises(pgc.ServerError, match="not the png image"):
            client.render("ranking", simple_workspace(), "ranking", parameters="lumi")
        assert body_of(service.requests[-1])["parameters"] == ["lumi"]
        for bad, message in [({"kind": "x"}, "as arguments"), (None, "svg, png")]:
            with pytest.raises(ValueError, match=message):
                client.render(
                    "cls", simple_workspace(), "brazil", "eps" if bad is None else "png", bad
                )


def test_async_client_plots():
    service = FakeService(
        script={
            "GET /jobs/j1/plots/ranking.png": [_image()],
            "GET /jobs/j1/plots": [httpx.Response(200, json={"plots": [{"kind": "ranking"}]})],
            "POST /yields": [_image(SVG, "image/svg+xml")],
        }
    )

    async def main():
        async with pgc.AsyncClient("http://fake", transport=httpx.MockTransport(service)) as c:
            return (
                await c.plot("j1", "ranking", top=10),
                await c.plot_kinds("j1"),
                await c.render("yields", simple_workspace(), "yields", "svg", {"stage": "prefit"}),
            )

    png, kinds, svg = asyncio.run(main())
    assert (png, kinds, svg) == (PNG, ["ranking"], SVG)
    assert service.requests[0].url.params["top"] == "10"
    assert body_of(service.requests[-1])["plot"] == {
        "kind": "yields",
        "format": "svg",
        "stage": "prefit",
    }
    for name in ("plot", "plot_kinds", "render"):
        assert getattr(pgc.AsyncClient, name).__doc__ == getattr(pgc.Client, name).__doc__
    assert list(pgc.Client.plot.signature.parameters) == ["job", "kind", "format", "options"]


def test_cli_plot_command(monkeypatch, tmp_path):
    service = FakeService(
        script={"POST /cls": [_image()], "POST /upper-limit": [_image(SVG, "image/svg+xml")]}
    )
    monkeypatch.setattr(cli, "_client", mock_client_factory(service))
    ws = tmp_path / "ws.json"
    ws.write_text(json.dumps(simple_workspace()))
    runner = CliRunner()

    def plot(*args, code=0):
        res = runner.invoke(cli.main, ["plot", *args[:1], str(ws), *args[1:]])
        assert res.exit_code == code, res.output
        return res

    out = tmp_path / "b.png"
    res = plot(
        "brazil",
        "--test-poi",
        "0:1:3",
        "-o",
        str(out),
        "--label",
        "ATLAS Internal",
        "--dpi",
        "80",
        "--level",
        "0.1",
        "--option",
        "log_y=true",
        "--option",
        "figsize=6,4",
    )
    assert res.output == "" and out.read_bytes() == PNG
    body = body_of(service.requests[-1])
    assert service.paths()[-1] == "POST /cls" and body["test_poi"] == [0.0, 0.5, 1.0]
    assert "level" not in body  # the line of the plot, not a cls option
    assert body["plot"] == {
        "kind": "brazil",
        "format": "png",
        "label": "ATLAS Internal",
        "dpi": 80.0,
        "level": 0.1,
        "log_y": True,
        "figsize": [6.0, 4.0],
    }
    out = tmp_path / "ul.SVG"
    plot("brazil", "--level", "0.1", "--scan", "0:2:3", "-o", str(out))  # no --test-poi
    assert out.read_bytes() == SVG and service.paths()[-1] == "POST /upper-limit"
    body = body_of(service.requests[-1])
    assert body["level"] == 0.1 and body["scan"] == [0.0, 1.0, 2.0]
    assert body["plot"] == {"kind": "brazil", "format": "svg"}
    sent = len(service.requests)
    for args, message in [
        (["brazil", "--test-poi", "0:1:3", "-o", "x.pdf"], ".png or .svg"),
        (["brazil", "--test-poi", "0:1:3"], "Missing option '-o'"),
        (["brazil", "--test-poi", "1", "-o", "x.png"], "several --test-poi"),
        (["brazil", "--test-poi", "0,1", "--scan", "0:1:3", "-o", "x.png"], "--scan"),
        (["brazil", "--calctype", "toybased", "-o", "x.png"], "give --test-poi"),
        (["exclusion", "-o", "x.png"], "needs --patchset"),
        (["ranking", "--option", "top", "-o", "x.png"], "KEY=VALUE"),
        (["ranking", "--option", "top=many", "-o", "x.png"], "an integer"),
        (["scan", "--values", "0,1", "--range", "0", "1", "-o", "x.png"], "not both"),
    ]:
        res = plot(*args, code=2)
        assert message in res.output, (args, res.output)
    assert len(service.requests) == sent  # usage errors send nothing
    service.script["POST /cls"] = [
        httpx.Response(422, json={"detail": "a brazil plot does not fit this cls answer"})
    ]
    res = plot("brazil", "--test-poi", "0,1", "-o", str(tmp_path / "no.png"), code=1)
    assert "422: a brazil plot does not fit" in res.output
    assert not (tmp_path / "no.png").exists()


def test_cli_plot_flag_runs_a_job(monkeypatch, tmp_path):
    fit_answer = {"mle_parameters": {"mu": [0.5]}, "twice_nll": 3.0, "meta": META}
    done = {**_job("succeeded", 4, fit_answer).json(), "operation": "fit"}
    service = FakeService(
        script={
            "POST /jobs": [httpx.Response(202, json={"id": "j1", "status": "queued"})],
            "GET /jobs/j1": [_job("running", 2), httpx.Response(200, json=done)],
            "GET /jobs/j1/plots/pulls.png": [_image()],
            "GET /jobs/j1/plots/correlation.svg": [_image(SVG, "image/svg+xml")],
        }
    )
    monkeypatch.setattr(cli, "_client", mock_client_factory(service))
    ws = tmp_path / "ws.json"
    ws.write_text(json.dumps(simple_workspace()))
    runner = CliRunner()
    out = tmp_path / "pulls.png"
    args = ["fit", str(ws), "--plot", str(out), "--plot-option", "label=ATLAS Internal"]
    res = runner.invoke(cli.main, args)
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout) == {"mle_parameters": {"mu": [0.5]}}  # fit's usual output
    assert "submitted job j1" in res.stderr and out.read_bytes() == PNG
    assert service.paths() == [
        "POST /jobs",
        "GET /jobs/j1",
        "GET /jobs/j1",
        "GET /jobs/j1/plots/pulls.png",
    ]
    assert body_of(service.requests[0]) == {"operation": "fit", "workspace": simple_workspace()}
    assert service.requests[-1].url.params["label"] == "ATLAS Internal"
    out = tmp_path / "corr.svg"
    res = runner.invoke(
        cli.main, ["fit", str(ws), "--plot", str(out), "--plot-kind", "correlation"]
    )
    assert res.exit_code == 0, res.output
    assert out.read_bytes() == SVG
    sent = len(service.requests)
    for args, message in [
        (["cls", str(ws), "--plot", "x.png"], "several --test-poi values"),
        (["cls", str(ws), "--test-poi", "0,1", "--plot", "x.gif"], ".png or .svg"),
        (["cls", str(ws), "--plot-kind", "brazil"], "need --plot FILE"),
        (["fit", str(ws), "--plot", "x.png", "--plot-kind", "brazil"], "the kinds that do: pulls"),
        (
            ["cls", str(ws), "--test-poi", "0,1", "--plot", "x.png", "--plot-kind", "exclusion"],
            "needs --patchset",
        ),
        (["ranking", str(ws), "--plot", "x.png", "--plot-option", "dpi=hi"], "a number"),
    ]:
        res = runner.invoke(cli.main, args)
        assert res.exit_code == 2 and message in res.output, (args, res.output)
    assert len(service.requests) == sent
    assert "--plot" not in runner.invoke(cli.main, ["significance", "--help"]).output
    assert "--plot" not in runner.invoke(cli.main, ["jobs", "submit", "cls", "--help"]).output


def test_a_command_starts_without_what_it_does_not_use(monkeypatch):
    """Every command pays its imports: httpx (a plain-http server is spoken to over
    ``http.client``), asyncio (only AsyncClient sleeps), importlib.metadata (only --version
    and ``__version__`` read it) and the CA certificates (a plain-http server never speaks
    TLS) are not loaded by the command line (BENCHMARKS.md: ~80 ms in all)."""
    import subprocess
    import sys

    code = (
        "import sys; import pyhf_gpu_client.cli as cli\n"
        "try: cli.main(['--server', 'http://127.0.0.1:1', '--retries', '0', 'info'])\n"
        "except SystemExit as exit: code = exit.code\n"
        "print(code, sorted(m for m in ('httpx', 'asyncio', 'importlib.metadata') "
        "if m in sys.modules))"
    )
    env = {k: v for k, v in os.environ.items() if k not in protocol.PROXY_VARIABLES}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.strip() == f"{cli.EXIT_UNREACHABLE} []", out.stdout + out.stderr
    for variable in protocol.PROXY_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    plain = protocol.ClientConfig(server="http://gpu-node:8000").tls_verify()
    assert plain.cert_store_stats()["x509_ca"] == 0  # no certificates loaded
    assert protocol.ClientConfig(server="https://gpu-node").tls_verify() is True
    monkeypatch.setenv("HTTP_PROXY", "https://proxy.example:3128")  # TLS to the proxy
    assert protocol.ClientConfig(server="http://gpu-node:8000").tls_verify() is True
    assert pgc.__version__  # still there, read when asked
