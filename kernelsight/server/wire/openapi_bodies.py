"""Request bodies in ``/openapi.json``, as vLLM's schema has them.

The handlers read their bodies themselves (``body.parse_body``: faster than FastAPI's parameter binding, with vLLM's
error bodies), so FastAPI sees no body parameter and would document none. vLLM's handlers take the request model
as a parameter, so its schema names each route's body (``#/components/schemas/CompletionRequest``, ...): a client
generator or an API fuzzer reading our schema sees the same bodies. ``request_body`` is a route's ``openapi_extra``;
``add_request_schemas`` puts the models' JSON schemas under ``components/schemas``."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

_REF = "#/components/schemas/{model}"


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` for a route whose JSON body is ``model``."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": _REF.format(model=model.__name__)}}}}}


def add_request_schemas(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Wrap ``app.openapi`` so the generated schema also holds ``models`` (and the models they use)."""
    base = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = base()                     # FastAPI caches it in app.openapi_schema: extended in place once
        _, defs = models_json_schema([(m, "validation") for m in models], ref_template=_REF)
        schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
