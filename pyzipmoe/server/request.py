"""What the routes read of a request: the app's models, the JSON body, keep_alive, string fields."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aiohttp import web

from . import ollama as O
from .children import Models

MODELS_KEY = web.AppKey("models", Models)


async def read_body(request: web.Request) -> dict[str, Any]:
    return O.parse_json_object(await request.read())


def keep_alive_of(request: web.Request, body: Mapping[str, Any]) -> float | None:
    if body.get("keep_alive") is not None:
        return O.parse_keep_alive(body["keep_alive"])
    return request.app[MODELS_KEY].settings.keep_alive


def string_field(body: Mapping[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise O.bad_request(f"{key} must be a string")
    return value
