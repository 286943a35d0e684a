"""Ollama's routes about the store (/api/tags, show, ps, copy, delete, create; pull and push refused): a model is
named only by its store name, never a file path.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from aiohttp import web

from ..errors import ZipmoeError
from ..models.name import InvalidNameError, ModelName, ModelNotFoundError
from ..models.package import ModelPackage
from . import ollama as O
from .request import MODELS_KEY, read_body, string_field
from .stream import Ndjson


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat().replace("+00:00", "Z")


async def api_tags(request: web.Request) -> web.Response:
    models = request.app[MODELS_KEY]
    out = []
    for entry in await asyncio.to_thread(models.store.list_models):
        if entry.problem is not None:
            continue
        try:
            package = await asyncio.to_thread(models.store.open, entry.name)
        except ZipmoeError:
            continue
        out.append({"name": entry.name.display, "model": entry.name.display, "modified_at": _iso(entry.modified),
                    "size": entry.size, "digest": entry.digest, "details": O.details(package.config)})
    return web.json_response({"models": out})


def _parameters_text(package: ModelPackage) -> str:
    from ..models.modelfile import format_parameter

    lines = []
    for key, value in package.parameters.items():
        for v in (value if isinstance(value, (list, tuple)) else [value]):
            lines.append(f"{key:<30} {format_parameter(v, key)}")
    return "\n".join(lines)


async def api_show(request: web.Request) -> web.Response:
    body = await read_body(request)
    models = request.app[MODELS_KEY]
    package = await asyncio.to_thread(models.open, body.get("model") or body.get("name"))
    config = dict(package.config)
    arch = config.get("architecture") or ""
    info = {"general.architecture": arch, "general.parameter_count": config.get("parameters"),
            **{f"{arch}.{k}": config[k] for k in ("context_length", "embedding_length", "block_count",
                                                 "expert_count", "expert_used_count") if config.get(k) is not None}}
    return web.json_response({
        "modelfile": package.modelfile_text(), "parameters": _parameters_text(package),
        "template": package.template or "", "system": package.system or "", "license": "\n".join(package.license),
        "details": O.details(config), "model_info": info, "capabilities": ["completion", "tools"],
        "modified_at": _iso(package.modified), "messages": [m.to_dict() for m in package.messages],
        "zipmoe": config.get("zipmoe")})


async def api_ps(request: web.Request) -> web.Response:
    models = request.app[MODELS_KEY]
    out = []
    for r in models.running():
        package: ModelPackage = r["package"]
        expires = r["expires"]
        out.append({"name": r["name"], "model": r["name"], "size": r["share"], "digest": package.digest,
                    "details": O.details(package.config), "size_vram": 0, "context_length": r["num_ctx"],
                    "expires_at": _iso(expires) if expires is not None else "0001-01-01T00:00:00Z",
                    "zipmoe": {"budget": r["share"], "resident": r["resident"], "active": r["active"],
                               "pid": r["pid"]}})
    return web.json_response({"models": out, "zipmoe": {"memory_budget": models.budget.total}})


async def api_copy(request: web.Request) -> web.Response:
    body = await read_body(request)
    models = request.app[MODELS_KEY]
    source, destination = string_field(body, "source"), string_field(body, "destination")
    if not source or not destination:
        raise O.bad_request("source and destination are required")
    await asyncio.to_thread(models.open, source)
    try:
        ModelName.parse(destination)
    except InvalidNameError as e:
        raise O.bad_request(str(e)) from None
    await asyncio.to_thread(models.store.copy, source, destination)
    return web.Response(status=200)


async def api_delete(request: web.Request) -> web.Response:
    body = await read_body(request)
    models = request.app[MODELS_KEY]
    package = await asyncio.to_thread(models.open, body.get("model") or body.get("name"))
    await models.stop(package)
    await asyncio.to_thread(models.store.remove, package.name)
    return web.Response(status=200)


async def api_create(request: web.Request) -> web.StreamResponse:
    """A model from a stored one with other SYSTEM, TEMPLATE, PARAMETER, MESSAGE or LICENSE lines (Ollama's
    `from` and fields, or a Modelfile's text); FROM must name a stored model: a request cannot name a file
    (`zipmoe create NAME -f Modelfile` adds a GGUF)."""
    import tempfile

    from ..models import modelfile as mfile

    body = await read_body(request)
    models = request.app[MODELS_KEY]
    name = string_field(body, "model") or string_field(body, "name")
    if not name:
        raise O.bad_request("model (the name of the model to create) is required")
    try:
        ModelName.parse(name)
    except InvalidNameError as e:
        raise O.bad_request(str(e)) from None
    if body.get("files") or body.get("adapters") or body.get("quantize"):
        raise O.bad_request("files, adapters and quantize are not taken over HTTP: add a GGUF with `zipmoe create "
                            "NAME -f Modelfile` on the server's machine, then create from its name")
    try:
        mf = await asyncio.to_thread(_modelfile_of, body, mfile)
    except ZipmoeError as e:
        raise O.bad_request(str(e)) from None
    try:
        ModelName.parse(mf.from_)
    except InvalidNameError:
        raise O.bad_request(f"FROM {mf.from_!r} is not a stored model's name: a request cannot name a file "
                            "(`zipmoe create NAME -f Modelfile` adds a GGUF)") from None
    await asyncio.to_thread(models.open, mf.from_)  # 404 for a name not in the store
    with tempfile.TemporaryDirectory(prefix="zipmoe-create-") as empty:  # FROM resolves to no file
        try:
            await asyncio.to_thread(models.store.create, name, mf, base_dir=empty)
        except ModelNotFoundError:
            raise
        except ZipmoeError as e:
            raise O.bad_request(str(e)) from None
    if body.get("stream", True):
        out = Ndjson(request, name)
        await out.send({"status": "success"})
        await out.response.write_eof()
        return out.response
    return web.json_response({"status": "success"})


def _modelfile_of(body: Mapping[str, Any], mfile: Any) -> Any:
    if isinstance(body.get("modelfile"), str):
        return mfile.parse(body["modelfile"], "the request's modelfile")
    from_ = body.get("from")
    if not isinstance(from_, str) or not from_:
        raise O.bad_request("from (a stored model's name) or modelfile is required")
    params = body.get("parameters") or {}
    if not isinstance(params, Mapping):
        raise O.bad_request("parameters must be an object")
    licence = body.get("license") or ()
    messages = body.get("messages") or []
    if not isinstance(messages, list) or not all(isinstance(m, Mapping) and isinstance(m.get("role"), str) and
                                                 isinstance(m.get("content"), str) for m in messages):
        raise O.bad_request("messages must be a list of objects with a role and a content")
    return mfile.Modelfile(from_, mfile.check_parameters(dict(params), "parameters"), string_field(body, "template"),
                           string_field(body, "system"), (licence,) if isinstance(licence, str) else tuple(licence),
                           tuple(mfile.Message(m["role"], m["content"]) for m in messages))


async def api_pull(request: web.Request) -> web.Response:
    raise O.ApiError(501, "zipmoe has no registry to pull from: add a model with `zipmoe create NAME -f Modelfile`, "
                          "or `zipmoe import ARCHIVE` one that `zipmoe export` wrote")


async def api_push(request: web.Request) -> web.Response:
    raise O.ApiError(501, "zipmoe has no registry to push to: `zipmoe export NAME ARCHIVE` writes a model to a file "
                          "that `zipmoe import` adds to another store")
