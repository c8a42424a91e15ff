"""Property-based tests of the HTTP API: schemathesis against a real server subprocess.

The OpenAPI document is the app's own, generated here at import so that pytest can make one
test per route (schemathesis' fixture-based loader, ``from_fixture``, fails under pytest 9);
the first test checks that the server serves exactly it at /openapi.json.
Every route gets generated requests, valid and invalid (schemathesis' examples, coverage and
fuzzing phases, a few dozen per route), and every answer must be as the OpenAPI document
declares it: no 5xx, a documented status, and a body that matches the declared schema of that
status (results, lists over ``test_poi``, ``{patch: result | error}``, errors).

Answers that random requests seldom reach (patchsets where a patch cannot be tested, lists over
``test_poi``, toy-based significance, jobs and their results) are asked for explicitly and
checked against the same document.

Generated envelopes name random ``workspace_id``s; half of them (those ending in an even hex
digit) are replaced by the id of a small uploaded workspace, so that generated options reach
the engine while unknown ids still get their 404. Toy counts are capped at ``MAX_TOYS`` to keep
the run short.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

import pyhf
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    response_schema_conformance,
    status_code_conformance,
)
from service_support import ServerProcess, simple_workspace, wait_for_job

from pyhf_gpu_server.service.app import create_app
from pyhf_gpu_server.service.settings import Settings

# one_process: the route tests below share one node id, which pytest-xdist would run once
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.one_process]

MAX_TOYS = 20
MEASUREMENT = simple_workspace()["measurements"][0]["name"]
CHECKS = [not_a_server_error, status_code_conformance, response_schema_conformance]
OPENAPI = create_app(Settings()).openapi()
schema = schemathesis.openapi.from_dict(OPENAPI)


@pytest.fixture(scope="module")
def workspace_id(server: ServerProcess) -> str:
    """The id of a small uploaded workspace."""
    with server.client() as client:
        response = client.post("/workspaces", json=simple_workspace())
    assert response.status_code == 201, response.text
    return response.json()["workspace_id"]


def stored_or_unknown(generated: Any, workspace_id: str) -> Any:
    """``workspace_id`` in place of a generated id that ends in an even hex digit."""
    if isinstance(generated, str) and generated[-1:] in "02468ace":
        return workspace_id
    return generated


def capped_toys(ntoys: Any) -> Any:
    """``ntoys`` capped at ``MAX_TOYS`` where it is a count (an int, or its ASCII digits)."""
    text = str(ntoys)
    return min(int(text), MAX_TOYS) if text.isascii() and text.isdigit() else ntoys


QUERY_BYTES = 8192  # uvicorn (h11) reads request heads of up to 16 KiB
# headers that frame the HTTP message itself: a generated value there (content-length: UQugw)
# is answered 400 by uvicorn's HTTP parser, before the app sees the request
FRAMING_HEADERS = {"connection", "content-length", "expect", "host", "te", "transfer-encoding"}


def reach_the_engine(case: schemathesis.Case, workspace_id: str) -> None:
    """Point half the generated ids at the stored workspace (and its measurement), cap the
    toys (options come in the body and, as envelope defaults, in the query), and keep the
    query within a request head uvicorn reads: it answers a longer one 400 and closes the
    connection while the client still sends, which the client sees as a reset. Generated
    :data:`FRAMING_HEADERS` are dropped."""
    for name in [h for h in case.headers or {} if h.lower() in FRAMING_HEADERS]:
        del case.headers[name]
    query = case.query or {}
    while len(urlencode(query, doseq=True)) > QUERY_BYTES:
        name = max(query, key=lambda key: len(urlencode({key: query[key]}, doseq=True)))
        if isinstance(query[name], list) and len(query[name]) > 1:
            query[name] = query[name][: len(query[name]) // 2]
        else:
            del query[name]
    if case.path_parameters and "workspace_id" in case.path_parameters:
        generated = case.path_parameters["workspace_id"]
        case.path_parameters["workspace_id"] = stored_or_unknown(generated, workspace_id)
    if not isinstance(case.body, dict):
        return
    if "workspace_id" in case.body:
        case.body["workspace_id"] = stored_or_unknown(case.body["workspace_id"], workspace_id)
    stored = case.body.get("workspace_id") == workspace_id
    for options in (case.body, case.query or {}):
        if stored and "measurement" in options:
            options["measurement"] = MEASUREMENT
        if "ntoys" in options:
            options["ntoys"] = capped_toys(options["ntoys"])


def test_the_server_serves_the_tested_document(server: ServerProcess) -> None:
    with server.client() as client:
        assert client.get("/openapi.json").json() == OPENAPI


@schema.parametrize()
@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
def test_every_route_answers_as_declared(
    case: schemathesis.Case, server: ServerProcess, workspace_id: str
) -> None:
    reach_the_engine(case, workspace_id)
    case.call_and_validate(base_url=server.url, checks=CHECKS)


def patchset_for(workspace: dict[str, Any]) -> dict[str, Any]:
    """A patchset for ``workspace``: a patch that changes the signal, one that cannot apply."""
    return {
        "metadata": {
            "references": {"hepdata": "ins0000000"},
            "digests": {"sha256": pyhf.utils.digest(workspace)},
            "labels": ["signal"],
            "description": "one testable patch, one that removes a channel it does not have",
        },
        "version": "1.0.0",
        "patches": [
            {
                "metadata": {"name": "more_signal", "values": [1]},
                "patch": [
                    {"op": "replace", "path": "/channels/0/samples/0/data", "value": [8.0, 12.0]}
                ],
            },
            {
                "metadata": {"name": "no_such_channel", "values": [2]},
                "patch": [{"op": "remove", "path": "/channels/7"}],
            },
        ],
    }


PATCHSET = patchset_for(simple_workspace())
REQUESTS = {
    "cls, a list of test_poi": ("cls", {"test_poi": [0.5, 1.0]}),
    "cls, a patchset and a list": ("cls", {"test_poi": [0.5, 1.0], "patchset": PATCHSET}),
    "fit, a patchset": ("fit", {"patchset": PATCHSET}),
    "upper-limit, a patchset": ("upper-limit", {"patchset": PATCHSET, "scan": [0.0, 2.0, 5.0]}),
    "significance, toys, a patchset": (
        "significance",
        {"patchset": PATCHSET, "calctype": "toybased", "ntoys": MAX_TOYS, "seed": 1},
    ),
}


def has_patch_errors(answer: Any) -> bool:
    """Whether a patchset answer holds the untestable patch's error (one entry, also for a
    list of test_poi)."""
    if not isinstance(answer, dict) or "no_such_channel" not in answer:
        return False
    entry = answer["no_such_channel"]
    return isinstance(entry, dict) and entry["error"]["status"] == 422


@pytest.mark.parametrize("request_name", REQUESTS)
def test_seldom_generated_answers_are_as_declared(
    server: ServerProcess, workspace_id: str, request_name: str
) -> None:
    operation, options = REQUESTS[request_name]
    with server.client() as client:
        response = client.post(f"/{operation}", json={"workspace_id": workspace_id, **options})
    assert response.status_code == 200, response.text
    schema[f"/{operation}"]["POST"].validate_response(response)
    answer = response.json()
    assert has_patch_errors(answer) == ("patchset" in options)
    per_patch = (
        [v for k, v in answer.items() if k != "no_such_channel"]
        if "patchset" in options
        else [answer]
    )
    listed = isinstance(options.get("test_poi"), list)
    assert all(isinstance(entry, list) == listed for entry in per_patch)


def test_jobs_and_their_results_are_as_declared(server: ServerProcess, workspace_id: str) -> None:
    with server.client() as client:
        job_ids = []
        for operation, options in REQUESTS.values():
            body = {"operation": operation, "workspace_id": workspace_id, **options}
            response = client.post("/jobs", json=body)
            assert response.status_code == 202, response.text
            schema["/jobs"]["POST"].validate_response(response)
            job_ids.append(response.json()["id"])
        for job_id in job_ids:
            assert wait_for_job(client, job_id)["status"] == "succeeded"
            response = client.get(f"/jobs/{job_id}")
            schema["/jobs/{job_id}"]["GET"].validate_response(response)
            assert has_patch_errors(response.json()["result"]) or job_id == job_ids[0]
        schema["/jobs"]["GET"].validate_response(client.get("/jobs"))
        finished = client.delete(f"/jobs/{job_ids[0]}")
        assert finished.status_code == 409
        schema["/jobs/{job_id}"]["DELETE"].validate_response(finished)
