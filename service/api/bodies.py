"""Request bodies read as a pydantic model with a 422 for anything that is not one (FastAPI's
own body parsing answers an undocumented 400 to bytes that are not UTF-8 JSON)."""

from __future__ import annotations

from typing import Any, TypeVar

from fastapi import Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from service.core.spec.errors import pydantic_errors

BodyT = TypeVar("BodyT", bound=BaseModel)
# Bodies up to this size (bytes) are parsed on the event loop: a thread costs more than that.
INLINE_PARSE_BYTES = 256 * 1024


def json_body(model: type[BodyT]) -> Any:
    """A dependency that reads the request body as ``model``: invalid JSON, undecodable
    bytes or a wrong shape are all a 422 naming the field (an unknown one with the closest
    valid name). Pair it with ``body_doc(model)`` in the route's ``openapi_extra``."""

    async def parse(request: Request) -> BodyT:
        body = await request.body()
        try:
            if len(body) <= INLINE_PARSE_BYTES:
                return model.model_validate_json(body)
            # A workspace manifest may be megabytes: parsed off the event loop, which would
            # otherwise stall every other request for as long (~0.2 s per 10 MB).
            return await run_in_threadpool(model.model_validate_json, body)
        except ValidationError as exc:
            # Under ``body``; an unknown field with the closest valid name (a sweep's
            # ``max_concurent`` → ``did you mean 'max_concurrent'?``), as a job spec's.
            raise RequestValidationError(pydantic_errors(exc, model)) from None

    return Depends(parse)


def body_doc(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI ``requestBody`` of a route whose body ``json_body(model)`` reads."""
    schema = model.model_json_schema()
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
