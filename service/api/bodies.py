"""Request bodies read as a pydantic model with a 422 for anything that is not one (FastAPI's
own body parsing answers an undocumented 400 to bytes that are not UTF-8 JSON)."""

from __future__ import annotations

from typing import Any, TypeVar

from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

BodyT = TypeVar("BodyT", bound=BaseModel)


def json_body(model: type[BodyT]) -> Any:
    """A dependency that reads the request body as ``model``: invalid JSON, undecodable
    bytes or a wrong shape are all a 422 naming the field. Pair it with ``body_doc(model)``
    in the route's ``openapi_extra``."""

    async def parse(request: Request) -> BodyT:
        try:
            return model.model_validate_json(await request.body())
        except ValidationError as exc:
            errors = exc.errors(include_url=False, include_context=False, include_input=False)
            raise RequestValidationError(
                [{**e, "loc": ("body", *e["loc"])} for e in errors]
            ) from None

    return Depends(parse)


def body_doc(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI ``requestBody`` of a route whose body ``json_body(model)`` reads."""
    schema = model.model_json_schema()
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
