"""What every resource's routes share: id path parameters, the common error docs, JSON and
ETag responses."""

from __future__ import annotations

import hashlib
from typing import Annotated, Any

from fastapi import Path, Request, Response
from pydantic import BaseModel

from service.api.schemas import dump_json
from service.core.errors import JobNotFoundError

# Largest id/step/offset a query may name (SQLite's INTEGER is 64-bit signed).
MAX_INT64 = 2**63 - 1
JobIdPath = Annotated[int, Path(ge=1, le=MAX_INT64, description="Job id.")]

# Every error body is {"detail", "code"} (service.api.errors); clients branch on `code`.
ERRORS: dict[int | str, dict[str, Any]] = {
    404: {"description": f"No such job (`code`: {JobNotFoundError.code})"},
    422: {"description": "Invalid input: `detail` lists {loc, msg, type} per bad field"},
}


def etag_response(request: Request, model: BaseModel) -> Response:
    """``model`` as JSON with a weak ETag of its bytes; 304 when ``If-None-Match`` matches."""
    body = dump_json(model)
    etag = f'W/"{hashlib.sha256(body).hexdigest()[:32]}"'
    headers = {"ETag": etag, "Cache-Control": "no-cache"}
    if_none_match = request.headers.get("if-none-match", "")
    candidates = {c.strip().removeprefix("W/") for c in if_none_match.split(",")}
    if "*" in candidates or etag.removeprefix("W/") in candidates:
        return Response(status_code=304, headers=headers)
    return Response(body, media_type="application/json", headers=headers)


def json_response(
    model: BaseModel, status_code: int, headers: dict[str, str] | None = None
) -> Response:
    """``model`` as a JSON response with ``status_code`` (and extra ``headers``)."""
    return Response(
        dump_json(model), status_code=status_code, media_type="application/json", headers=headers
    )
