"""OpenAI's routes (/v1/*): the store's models listed with their store names as ids, and the rest passed through to
the model's llama-server.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from . import ollama as O
from .request import MODELS_KEY, read_body


async def v1_models(request: web.Request) -> web.Response:
    models = request.app[MODELS_KEY]
    data = [{"id": e.name.display, "object": "model", "created": int(e.modified), "owned_by": "zipmoe"}
            for e in await asyncio.to_thread(models.store.list_models) if e.problem is None]
    return web.json_response({"object": "list", "data": data})


async def v1_model(request: web.Request) -> web.Response:
    models = request.app[MODELS_KEY]
    package = await asyncio.to_thread(models.open, request.match_info["model"])
    return web.json_response({"id": package.name.display, "object": "model", "created": int(package.modified),
                              "owned_by": "zipmoe"})


async def v1_proxy(request: web.Request) -> web.StreamResponse:
    """/v1/chat/completions, /v1/completions, /v1/embeddings: passed to the model's llama-server as they are, but
    for the model's SYSTEM and MESSAGE lines in front of a chat and its PARAMETERs as defaults."""
    body = await read_body(request)
    models = request.app[MODELS_KEY]
    package = await models.package(body.get("model"))
    child = await models.acquire(package, embeddings=request.path == "/v1/embeddings")
    try:
        body["model"] = child.name
        if isinstance(body.get("messages"), list):
            body["messages"] = package.chat_messages(body["messages"])
        for key, value in O.sampling_fields(package.parameters, {}).items():
            if key == "n_predict" and ("max_tokens" in body or "max_completion_tokens" in body):
                continue
            body.setdefault(key, value)
        async with models.http.post(f"{child.url}{request.path}", json=body, headers=child.headers) as r:
            response = web.StreamResponse(status=r.status, headers={
                "Content-Type": r.headers.get("Content-Type", "application/json")})
            await response.prepare(request)
            async for chunk in r.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response
    finally:
        models.release(child, models.settings.keep_alive)
