"""The HTTP routes: Ollama's REST API (/api/*) answered through the models' llama-servers, OpenAI's (/v1/*) passed
through to them with store names as model ids, and the server's safety rules: browser origins from an allowlist
(`--origins`), errors in Ollama's shape ({"error": "..."}; OpenAI's under /v1), a model named only by its store
name (never a file path).
"""

from __future__ import annotations

import asyncio
import fnmatch
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from datetime import datetime, timezone
from typing import Any

import aiohttp
from aiohttp import web

from ..errors import ZipmoeError
from ..models.name import InvalidNameError, ModelName, ModelNotFoundError
from ..models.package import ModelPackage
from ..runtime.completion import is_chat_turn
from . import ollama as O
from .children import Child, Models

# Origins a browser page may call from, as Ollama's defaults: pages served from this machine, and apps' schemes.
DEFAULT_ORIGINS = tuple(f"{scheme}://{host}{port}" for scheme in ("http", "https")
                        for host in ("localhost", "127.0.0.1", "0.0.0.0") for port in ("", ":*")) + (
    "app://*", "file://*", "tauri://*", "vscode-webview://*")
MODELS_KEY = web.AppKey("models", Models)
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


# ------------------------------------------------------------------------------------------ helpers


async def _body(request: web.Request) -> dict[str, Any]:
    return O.parse_json_object(await request.read())


def _keep_alive(request: web.Request, body: Mapping[str, Any]) -> float | None:
    if body.get("keep_alive") is not None:
        return O.parse_keep_alive(body["keep_alive"])
    return request.app[MODELS_KEY].settings.keep_alive


def _string(body: Mapping[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise O.bad_request(f"{key} must be a string")
    return value


async def _upstream_error(r: aiohttp.ClientResponse) -> O.ApiError:
    """llama-server's error answer ({"error": {"message": ...}}) as ours, with its status."""
    text = await r.text()
    try:
        err = json.loads(text).get("error")
        message = err.get("message") if isinstance(err, dict) else str(err)
    except (ValueError, AttributeError):
        message = text.strip() or r.reason or "error"
    return O.ApiError(r.status, message or "error")


async def _sse(r: aiohttp.ClientResponse) -> AsyncIterator[list[dict[str, Any]]]:
    """The events of llama-server's server-sent stream, decoded, in lists: the events of each read (one a read while
    a token takes longer to compute than to pass on; several when the front falls behind, which it then answers
    with one write). Ends at `[DONE]` or the stream's end; an `error` event raises ApiError."""
    rest = b""
    async for data in r.content.iter_any():
        *lines, rest = (rest + data).split(b"\n")
        events, done = _events(lines)
        if events:
            yield events
        if done:
            return
    if rest.strip():
        events, _ = _events([rest])
        if events:
            yield events


def _events(lines: list[bytes]) -> tuple[list[dict[str, Any]], bool]:
    """The events in whole lines of a server-sent stream, and whether `[DONE]` ended it."""
    events = []
    for raw in lines:
        line = raw.strip()
        if line.startswith(b"data:"):
            data = line[5:].strip()
            if data == b"[DONE]":
                return events, True
            event = json.loads(data)
            if isinstance(event, dict) and "error" in event and not event.get("choices"):
                err = event["error"]
                raise O.ApiError(500, err.get("message", str(err)) if isinstance(err, dict) else str(err))
            events.append(event)
        elif line.startswith(b"error:"):
            err = json.loads(line[6:].strip())
            raise O.ApiError(500, err.get("message", str(err)) if isinstance(err, dict) else str(err))
    return events, False


class _Ndjson:
    """A streamed answer: one JSON object a line (application/x-ndjson), as Ollama streams. The lines of one model
    are written from a template with only the text and the time in it: a token costs one string's JSON escaping
    rather than a dictionary's building and encoding (the server's CPU per token is taken from the model's)."""

    def __init__(self, request: web.Request, model: str, field: str = "response") -> None:
        self.request = request
        self.response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        head = json.dumps({"model": model}, ensure_ascii=False)[:-1]
        # generate: {"model": M, "created_at": T, "response": TEXT, "done": false}
        # chat: {"model": M, "created_at": T, "message": {"role": "assistant", "content": TEXT}, "done": false}
        self._head = f'{head}, "created_at": "'
        self._middle, self._tail = (('", "response": ', ', "done": false}\n') if field == "response" else
                                    ('", "message": {"role": "assistant", "content": ', '}, "done": false}\n'))

    def text(self, text: str) -> bytes:
        """A line with one piece of generated text."""
        return (self._head + O.now() + self._middle + json.dumps(text, ensure_ascii=False) + self._tail).encode()

    @staticmethod
    def line(obj: Mapping[str, Any]) -> bytes:
        return json.dumps(obj, ensure_ascii=False).encode() + b"\n"

    async def write(self, data: bytes) -> None:
        if not self.response.prepared:
            await self.response.prepare(self.request)
        if data:
            await self.response.write(data)

    async def send(self, obj: Mapping[str, Any]) -> None:
        await self.write(self.line(obj))


# ------------------------------------------------------------------------------------------ the store


async def root(request: web.Request) -> web.Response:
    return web.Response(text="zipmoe is running")


async def api_version(request: web.Request) -> web.Response:
    return web.json_response({"version": version()})


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
    body = await _body(request)
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
    body = await _body(request)
    models = request.app[MODELS_KEY]
    source, destination = _string(body, "source"), _string(body, "destination")
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
    body = await _body(request)
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

    body = await _body(request)
    models = request.app[MODELS_KEY]
    name = _string(body, "model") or _string(body, "name")
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
        out = _Ndjson(request, name)
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
    return mfile.Modelfile(from_, mfile.check_parameters(dict(params), "parameters"), _string(body, "template"),
                           _string(body, "system"), (licence,) if isinstance(licence, str) else tuple(licence),
                           tuple(mfile.Message(m["role"], m["content"]) for m in messages))


async def api_pull(request: web.Request) -> web.Response:
    raise O.ApiError(501, "zipmoe has no registry to pull from: add a model with `zipmoe create NAME -f Modelfile`, "
                          "or `zipmoe import ARCHIVE` one that `zipmoe export` wrote")


async def api_push(request: web.Request) -> web.Response:
    raise O.ApiError(501, "zipmoe has no registry to push to: `zipmoe export NAME ARCHIVE` writes a model to a file "
                          "that `zipmoe import` adds to another store")


# ------------------------------------------------------------------------------------------ generation


async def api_generate(request: web.Request) -> web.StreamResponse:
    t0 = time.monotonic_ns()
    body = await _body(request)
    models = request.app[MODELS_KEY]
    keep_alive = _keep_alive(request, body)
    options = O.check_options(body.get("options"))
    prompt, system, template = _string(body, "prompt") or "", _string(body, "system"), _string(body, "template")
    if body.get("images"):
        raise O.bad_request("this model does not take images")
    if body.get("context"):
        raise O.bad_request("context (the tokens of an earlier answer) is not supported: send the conversation "
                            "to /api/chat instead")
    package = await models.package(body.get("model"))
    if not prompt and keep_alive == 0:  # Ollama's way to unload a model (`ollama stop`)
        await models.stop(package)
        return web.json_response({"model": package.name.display, "created_at": O.now(), "response": "",
                                  "done": True, "done_reason": "unload"})
    t1 = time.monotonic_ns()
    child = await models.acquire(package, num_ctx=options.get("num_ctx"))
    load_ns = time.monotonic_ns() - t1  # waiting for the model (Ollama's load_duration)
    try:
        if not prompt:  # load only
            return web.json_response({"model": child.name, "created_at": O.now(), "response": "", "done": True,
                                      "done_reason": "load"})
        raw = body.get("raw") or not (system or template or is_chat_turn(package))
        text = prompt if raw else await _chat_prompt(models, child, prompt, system, template)
        fields = {"prompt": text, "stream": bool(body.get("stream", True)), "cache_prompt": True,
                  **O.sampling_fields(package.parameters, options), **O.format_fields(body.get("format"), chat=False)}
        return await _complete(request, child, fields, t0, load_ns)
    finally:
        models.release(child, keep_alive)


async def _chat_prompt(models: Models, child: Child, prompt: str, system: str | None, template: str | None) -> str:
    """The prompt as one user turn after the model's SYSTEM (or the request's `system`) and MESSAGE history, in
    the model's chat template (llama-server's own rendering), or in the request's `template` (Jinja)."""
    turn = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    messages = child.package.chat_messages(turn)
    if template is not None:
        return _render(template, messages)
    async with models.session.post(f"{child.url}/apply-template", json={"messages": messages},
                                   headers=child.headers) as r:
        if r.status != 200:
            raise await _upstream_error(r)
        return str((await r.json())["prompt"])


def _render(template: str, messages: list[Any]) -> str:
    """A request's own chat template (Jinja, as a Modelfile's TEMPLATE), in a sandbox: a template cannot reach
    Python objects or files."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(template).render(
            messages=messages, add_generation_prompt=True, bos_token="", eos_token="")
    except TemplateError as e:
        raise O.bad_request(f"template: {e}") from None


async def _complete(request: web.Request, child: Child, fields: dict[str, Any], t0: int, load_ns: int
                    ) -> web.StreamResponse:
    models = request.app[MODELS_KEY]
    head = {"model": child.name}
    async with models.session.post(f"{child.url}/completion", json=fields, headers=child.headers) as r:
        if r.status != 200:
            raise await _upstream_error(r)
        if not fields["stream"]:
            data = await r.json()
            return web.json_response({**head, "created_at": O.now(), "response": data.get("content", ""),
                                      "done": True, "done_reason": O.done_reason(data.get("stop_type")),
                                      **O.durations(data.get("timings"), time.monotonic_ns() - t0, load_ns)})
        out = _Ndjson(request, child.name)
        try:
            async for events in _sse(r):
                lines, stop = [], None
                for event in events:
                    if event.get("content"):
                        lines.append(out.text(event["content"]))
                    if event.get("stop"):
                        stop = event
                        break
                if stop is not None:
                    lines.append(out.line({**head, "created_at": O.now(), "response": "", "done": True,
                                           "done_reason": O.done_reason(stop.get("stop_type")),
                                           **O.durations(stop.get("timings"), time.monotonic_ns() - t0, load_ns)}))
                await out.write(b"".join(lines))
                if stop is not None:
                    break
        except O.ApiError as e:
            await out.send({"error": e.message})
        await out.response.write_eof()
        return out.response


async def api_chat(request: web.Request) -> web.StreamResponse:
    t0 = time.monotonic_ns()
    body = await _body(request)
    models = request.app[MODELS_KEY]
    keep_alive = _keep_alive(request, body)
    options = O.check_options(body.get("options"))
    messages = O.openai_messages(body.get("messages") or [])
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise O.bad_request("tools must be a list")
    package = await models.package(body.get("model"))
    if not messages and keep_alive == 0:
        await models.stop(package)
        return web.json_response({"model": package.name.display, "created_at": O.now(),
                                  "message": {"role": "assistant", "content": ""}, "done": True,
                                  "done_reason": "unload"})
    t1 = time.monotonic_ns()
    child = await models.acquire(package, num_ctx=options.get("num_ctx"))
    load_ns = time.monotonic_ns() - t1
    try:
        if not messages:
            return web.json_response({"model": child.name, "created_at": O.now(),
                                      "message": {"role": "assistant", "content": ""}, "done": True,
                                      "done_reason": "load"})
        stream = bool(body.get("stream", True))
        fields: dict[str, Any] = {"messages": package.chat_messages(messages), "stream": stream and not tools,
                                  **O.sampling_fields(package.parameters, options),
                                  **O.format_fields(body.get("format"), chat=True)}
        if tools:
            fields["tools"] = tools
        if fields["stream"]:
            fields["stream_options"] = {"include_usage": True}
        return await _chat(request, child, fields, stream, t0, load_ns)
    finally:
        models.release(child, keep_alive)


def _message(msg: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "assistant", "content": msg.get("content") or ""}
    if msg.get("reasoning_content"):
        out["thinking"] = msg["reasoning_content"]
    if msg.get("tool_calls"):
        out["tool_calls"] = O.ollama_tool_calls(msg["tool_calls"])
    return out


async def _chat(request: web.Request, child: Child, fields: dict[str, Any], stream: bool, t0: int, load_ns: int
                ) -> web.StreamResponse:
    models = request.app[MODELS_KEY]
    head = {"model": child.name}
    async with models.session.post(f"{child.url}/v1/chat/completions", json=fields, headers=child.headers) as r:
        if r.status != 200:
            raise await _upstream_error(r)
        if not fields["stream"]:
            data = await r.json()
            choice = data["choices"][0]
            answer = {**head, "created_at": O.now(), "message": _message(choice.get("message") or {}), "done": True,
                      "done_reason": O.done_reason(None, choice.get("finish_reason")),
                      **O.durations(data.get("timings"), time.monotonic_ns() - t0, load_ns)}
            if not stream:
                return web.json_response(answer)
            out = _Ndjson(request, child.name)  # tools: the answer as one chunk, then the end
            await out.send({**answer, "done": False})
            await out.send({**head, "created_at": O.now(), "message": {"role": "assistant", "content": ""},
                            "done": True, "done_reason": answer["done_reason"],
                            **{k: answer[k] for k in answer if k.endswith(("duration", "count"))}})
            await out.response.write_eof()
            return out.response
        out = _Ndjson(request, child.name, "message")
        reason, timings = "stop", None
        try:
            async for events in _sse(r):
                lines = []
                for event in events:
                    timings = event.get("timings") or timings
                    for choice in event.get("choices") or ():
                        delta = choice.get("delta") or {}
                        if delta.get("reasoning_content") or delta.get("tool_calls"):
                            lines.append(out.line({**head, "created_at": O.now(), "message": _message(delta),
                                                   "done": False}))
                        elif delta.get("content"):
                            lines.append(out.text(delta["content"]))
                        if choice.get("finish_reason"):
                            reason = O.done_reason(None, choice["finish_reason"])
                await out.write(b"".join(lines))
            await out.send({**head, "created_at": O.now(), "message": {"role": "assistant", "content": ""},
                            "done": True, "done_reason": reason,
                            **O.durations(timings, time.monotonic_ns() - t0, load_ns)})
        except O.ApiError as e:
            await out.send({"error": e.message})
        await out.response.write_eof()
        return out.response


async def api_embed(request: web.Request) -> web.Response:
    """Embeddings of one text or several (/api/embed: L2-normalised, as Ollama's; the older /api/embeddings: one
    text's, as the model makes it), from llama-server's /v1/embeddings in a process started with --embeddings."""
    t0 = time.monotonic_ns()
    body = await _body(request)
    models = request.app[MODELS_KEY]
    keep_alive = _keep_alive(request, body)
    legacy = request.path == "/api/embeddings"
    texts = O.embed_inputs(body.get("prompt"), "prompt") if legacy else O.embed_inputs(body.get("input"))
    dimensions = None if legacy else O.embed_dimensions(body.get("dimensions"))
    options = O.check_options(body.get("options"))
    package = await models.package(body.get("model"))
    t1 = time.monotonic_ns()
    child = await models.acquire(package, num_ctx=options.get("num_ctx"), embeddings=True)
    load_ns = time.monotonic_ns() - t1
    try:
        if not texts:  # load only
            return web.json_response({"embedding": []} if legacy else {"model": child.name, "embeddings": []})
        fields: dict[str, Any] = {"input": texts, "model": child.name}
        if legacy:
            fields["embd_normalize"] = -1  # (llama-server's: none)
        async with models.session.post(f"{child.url}/v1/embeddings", json=fields, headers=child.headers) as r:
            if r.status != 200:
                raise await _upstream_error(r)
            data = await r.json()
    finally:
        models.release(child, keep_alive)
    vectors = [O.shorten(d["embedding"], dimensions) for d in sorted(data["data"], key=lambda d: d["index"])]
    if legacy:
        return web.json_response({"embedding": vectors[0]})
    return web.json_response({"model": child.name, "embeddings": vectors,
                              "total_duration": time.monotonic_ns() - t0, "load_duration": load_ns,
                              "prompt_eval_count": int((data.get("usage") or {}).get("prompt_tokens", 0))})


# ------------------------------------------------------------------------------------------ OpenAI's API


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
    body = await _body(request)
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
        async with models.session.post(f"{child.url}{request.path}", json=body, headers=child.headers) as r:
            response = web.StreamResponse(status=r.status, headers={
                "Content-Type": r.headers.get("Content-Type", "application/json")})
            await response.prepare(request)
            async for chunk in r.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response
    finally:
        models.release(child, models.settings.keep_alive)


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
