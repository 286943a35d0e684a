"""The HTTP app: its routes (Ollama's REST API, /api/*, answered through the models' llama-servers in
store_routes.py and generate_routes.py; OpenAI's, /v1/*, passed through to them with store names as model ids in
openai_routes.py) and the server's safety rules: browser origins from an allowlist (`--origins`), errors in
Ollama's shape ({"error": "..."}; OpenAI's under /v1).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import aiohttp
from aiohttp import web

from ..errors import ZipmoeError
from ..models.name import InvalidNameError, ModelNotFoundError
from . import ollama as O
from .children import Models
from .generate_routes import api_chat, api_embed, api_generate
from .openai_routes import v1_model, v1_models, v1_proxy
from .request import MODELS_KEY
from .store_routes import api_copy, api_create, api_delete, api_ps, api_pull, api_push, api_show, api_tags

# Origins a browser page may call from, as Ollama's defaults: pages served from this machine, and apps' schemes.
DEFAULT_ORIGINS = tuple(f"{scheme}://{host}{port}" for scheme in ("http", "https")
                        for host in ("localhost", "127.0.0.1", "0.0.0.0") for port in ("", ":*")) + (
    "app://*", "file://*", "tauri://*", "vscode-webview://*")
ORIGINS_KEY = web.AppKey("origins", tuple)


def version() -> str:
    from importlib import metadata

    try:
        return metadata.version("pyzipmoe")
    except metadata.PackageNotFoundError:
        return "0.0.0"


# ------------------------------------------------------------------------------------------ middlewares


def origin_allowed(origin: str, allowed: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(origin, pattern) for pattern in allowed)


@web.middleware
async def cors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
               ) -> web.StreamResponse:
    """Browser pages from an allowed origin get CORS headers; any other origin is refused (403) instead of echoed."""
    origin = request.headers.get("Origin")
    if origin is None:
        return await handler(request)
    if not origin_allowed(origin, request.app[ORIGINS_KEY]):
        return _error(request, 403, f"origin {origin} is not allowed (zipmoe serve --origins adds origins)")
    if request.method == "OPTIONS":
        response: web.StreamResponse = web.Response(status=204)
    else:
        response = await handler(request)
    if not response.prepared:
        response.headers.update({
            "Access-Control-Allow-Origin": origin, "Vary": "Origin",
            "Access-Control-Allow-Methods": "GET, POST, DELETE, OPTIONS, HEAD",
            "Access-Control-Allow-Headers": "Authorization, Content-Type, User-Agent, Accept, X-Requested-With"})
    return response


@web.middleware
async def errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                 ) -> web.StreamResponse:
    try:
        return await handler(request)
    except O.ApiError as e:
        return _error(request, e.status, e.message)
    except ModelNotFoundError as e:
        return _error(request, 404, str(e))
    except InvalidNameError as e:
        return _error(request, 400, str(e))
    except ZipmoeError as e:
        return _error(request, 500, str(e))
    except aiohttp.ClientError as e:
        return _error(request, 502, f"the model's process did not answer: {e}")


def _error(request: web.Request, status: int, message: str) -> web.Response:
    """Ollama's error shape; OpenAI's under /v1."""
    if request.path.startswith("/v1/"):
        kind = "not_found_error" if status == 404 else "invalid_request_error" if status < 500 else "api_error"
        body: dict[str, Any] = {"error": {"message": message, "type": kind, "code": status}}
    else:
        body = {"error": message}
    return web.json_response(body, status=status)


async def root(request: web.Request) -> web.Response:
    return web.Response(text="zipmoe is running")


async def api_version(request: web.Request) -> web.Response:
    return web.json_response({"version": version()})


# ------------------------------------------------------------------------------------------ the app


def make_app(models: Models, origins: Iterable[str] = ()) -> web.Application:
    app = web.Application(middlewares=[cors, errors], client_max_size=64 * 2**20)
    app[MODELS_KEY] = models
    app[ORIGINS_KEY] = (*DEFAULT_ORIGINS, *origins)
    r = app.router
    r.add_get("/", root)
    r.add_get("/api/version", api_version)
    r.add_get("/api/tags", api_tags)
    r.add_post("/api/show", api_show)
    r.add_get("/api/ps", api_ps)
    r.add_post("/api/generate", api_generate)
    r.add_post("/api/chat", api_chat)
    r.add_post("/api/embed", api_embed)
    r.add_post("/api/embeddings", api_embed)
    r.add_post("/api/copy", api_copy)
    r.add_delete("/api/delete", api_delete)
    r.add_post("/api/create", api_create)
    r.add_post("/api/pull", api_pull)
    r.add_post("/api/push", api_push)
    r.add_get("/v1/models", v1_models)
    r.add_get("/v1/models/{model:.+}", v1_model)
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
        r.add_post(path, v1_proxy)
    r.add_route("OPTIONS", "/{tail:.*}", root)

    async def startup(app: web.Application) -> None:
        await models.start()

    async def cleanup(app: web.Application) -> None:
        await models.close()

    app.on_startup.append(startup)
    app.on_cleanup.append(cleanup)
    return app
