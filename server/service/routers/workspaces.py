"""POST /workspaces (upload once, refer by id), GET /workspaces/{id}."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from ..dependencies import CallerDep, StateDep
from ..errors import Unprocessable
from ..requests import parse_json
from ..schemas import BODY_ERRORS, DIGEST_PATTERN, WorkspaceInfo, error_responses
from ..workspace_store import summarize

router = APIRouter(prefix="/workspaces", tags=["workspaces"])


@router.post(
    "",
    status_code=201,
    response_model=WorkspaceInfo,
    responses=error_responses(*BODY_ERRORS, 401, 422, 503, 507),
    summary="Upload a workspace; its id is pyhf's sha256 digest",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": {"type": "object", "required": ["channels"]}}
            },
        }
    },
)
async def upload_workspace(request: Request, state: StateDep, caller: CallerDep) -> JSONResponse:
    """Validate and store a workspace under ``--data-dir``; later requests send ``workspace_id``.
    With callers, the workspace is the uploading caller's (others' requests answer 404)."""
    body = await request.body()

    def store() -> dict:
        document = parse_json(body, state.settings.max_json_depth)
        if isinstance(document, dict) and set(document) == {"workspace"}:
            document = document["workspace"]
        if not isinstance(document, dict):
            raise Unprocessable("the body must be a HistFactory workspace (a JSON object)")
        digest = state.workspaces.admit(document, persist=True, owner=caller)
        return summarize(digest, document, state.workspaces.size_of(digest))

    info = await run_in_threadpool(store)
    return JSONResponse(
        info, status_code=201, headers={"Location": f"/workspaces/{info['workspace_id']}"}
    )


@router.get(
    "/{workspace_id}",
    response_model=WorkspaceInfo,
    responses=error_responses(401, 404, 422),
    summary="Describe an uploaded workspace",
)
async def get_workspace(
    workspace_id: Annotated[str, Path(pattern=DIGEST_PATTERN)], state: StateDep, caller: CallerDep
) -> dict:
    """404 if the workspace was never uploaded, or (with callers) is another caller's (clients
    check before uploading)."""

    def describe() -> dict:
        spec = state.workspaces.get(workspace_id, caller)
        return summarize(workspace_id, spec, state.workspaces.size_of(workspace_id))

    return await run_in_threadpool(describe)
