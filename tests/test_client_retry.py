"""Retries against a real HTTP stub on 127.0.0.1: 429 / 503 with Retry-After, then 200."""

from __future__ import annotations

import asyncio
import itertools
import json

from click.testing import CliRunner
from client_support import CLS_ANSWER, StubReply, simple_workspace, stub_server

import pyhf_gpu_client as pgc
from pyhf_gpu_client import cli

OK = StubReply(200, {**CLS_ANSWER, "meta": {"device": "stub"}})


def test_cli_retries_429_and_503_honouring_retry_after(tmp_path):
    ws = tmp_path / "ws.json"
    ws.write_text(json.dumps(simple_workspace()))
    replies = [
        StubReply(429, {"detail": "queue full"}, {"Retry-After": "1"}),
        StubReply(503, {"detail": "device busy"}, {"Retry-After": "1"}),
        OK,
    ]
    with stub_server(replies) as (url, log):
        res = CliRunner().invoke(cli.main, ["cls", str(ws), "--server", url])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout) == CLS_ANSWER
    assert [entry["path"] for entry in log] == ["/cls"] * 3
    gaps = [b["time"] - a["time"] for a, b in itertools.pairwise(log)]
    assert all(0.9 <= gap < 5 for gap in gaps), gaps  # waited as told, not longer


def test_cli_gives_up_after_bounded_attempts(tmp_path):
    ws = tmp_path / "ws.json"
    ws.write_text(json.dumps(simple_workspace()))
    replies = [StubReply(503, {"detail": "device busy"}, {"Retry-After": "0"})]
    with stub_server(replies) as (url, log):
        res = CliRunner().invoke(cli.main, ["--retries", "2", "cls", str(ws), "--server", url])
    assert res.exit_code == 1
    assert "503: device busy" in res.output and "Traceback" not in res.output
    assert len(log) == 3


def test_async_client_retries_too():
    replies = [StubReply(429, {"detail": "queue full"}, {"Retry-After": "0"}), OK]

    async def run(url: str) -> pgc.CLsResult:
        async with pgc.AsyncClient(url) as client:
            return await client.cls(simple_workspace(), test_poi=2.0)

    with stub_server(replies) as (url, log):
        result = asyncio.run(run(url))
    assert result.to_pyhf_json() == CLS_ANSWER and len(log) == 2


def test_other_4xx_is_not_retried(tmp_path):
    ws = tmp_path / "ws.json"
    ws.write_text(json.dumps(simple_workspace()))
    replies = [StubReply(401, {"detail": "missing or wrong Bearer token"})]
    with stub_server(replies) as (url, log):
        res = CliRunner().invoke(cli.main, ["cls", str(ws), "--server", url, "--token", "t"])
    assert res.exit_code == 1 and "401: missing or wrong Bearer token" in res.output
    assert len(log) == 1 and log[0]["headers"]["Authorization"] == "Bearer t"


def test_timeout_option(tmp_path):
    ws = tmp_path / "ws.json"
    ws.write_text(json.dumps(simple_workspace()))
    with stub_server([StubReply(200, CLS_ANSWER, delay_s=2.0)]) as (url, log):
        res = CliRunner().invoke(cli.main, ["cls", str(ws), "--server", url, "--timeout", "0.3"])
    assert res.exit_code == 3 and "did not answer in time" in res.output
    assert len(log) == 1  # a read timeout is not retried: the server may still be computing
