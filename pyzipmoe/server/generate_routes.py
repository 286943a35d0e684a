"""Ollama's model routes (/api/generate, /api/chat, /api/embed and /api/embeddings): the request translated to
llama-server's (ollama.py), sent to the model's process, and its answer, streamed or whole, translated back.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from ..runtime.completion import is_chat_turn
from . import ollama as O
from .children import Child, Models
from .request import MODELS_KEY, keep_alive_of, read_body, string_field
from .stream import Ndjson, sse, upstream_error


async def api_generate(request: web.Request) -> web.StreamResponse:
    t0 = time.monotonic_ns()
    body = await read_body(request)
    models = request.app[MODELS_KEY]
    keep_alive = keep_alive_of(request, body)
    options = O.check_options(body.get("options"))
    prompt = string_field(body, "prompt") or ""
    system, template = string_field(body, "system"), string_field(body, "template")
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
    async with models.http.post(f"{child.url}/apply-template", json={"messages": messages},
                                   headers=child.headers) as r:
        if r.status != 200:
            raise await upstream_error(r)
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
    async with models.http.post(f"{child.url}/completion", json=fields, headers=child.headers) as r:
        if r.status != 200:
            raise await upstream_error(r)
        if not fields["stream"]:
            data = await r.json()
            return web.json_response({**head, "created_at": O.now(), "response": data.get("content", ""),
                                      "done": True, "done_reason": O.done_reason(data.get("stop_type")),
                                      **O.durations(data.get("timings"), time.monotonic_ns() - t0, load_ns)})
        out = Ndjson(request, child.name)
        try:
            async for events in sse(r):
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
    body = await read_body(request)
    models = request.app[MODELS_KEY]
    keep_alive = keep_alive_of(request, body)
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
    async with models.http.post(f"{child.url}/v1/chat/completions", json=fields, headers=child.headers) as r:
        if r.status != 200:
            raise await upstream_error(r)
        if not fields["stream"]:
            data = await r.json()
            choice = data["choices"][0]
            answer = {**head, "created_at": O.now(), "message": _message(choice.get("message") or {}), "done": True,
                      "done_reason": O.done_reason(None, choice.get("finish_reason")),
                      **O.durations(data.get("timings"), time.monotonic_ns() - t0, load_ns)}
            if not stream:
                return web.json_response(answer)
            out = Ndjson(request, child.name)  # tools: the answer as one chunk, then the end
            await out.send({**answer, "done": False})
            await out.send({**head, "created_at": O.now(), "message": {"role": "assistant", "content": ""},
                            "done": True, "done_reason": answer["done_reason"],
                            **{k: answer[k] for k in answer if k.endswith(("duration", "count"))}})
            await out.response.write_eof()
            return out.response
        out = Ndjson(request, child.name, "message")
        reason, timings = "stop", None
        try:
            async for events in sse(r):
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
    body = await read_body(request)
    models = request.app[MODELS_KEY]
    keep_alive = keep_alive_of(request, body)
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
        async with models.http.post(f"{child.url}/v1/embeddings", json=fields, headers=child.headers) as r:
            if r.status != 200:
                raise await upstream_error(r)
            data = await r.json()
    finally:
        models.release(child, keep_alive)
    vectors = [O.shorten(d["embedding"], dimensions) for d in sorted(data["data"], key=lambda d: d["index"])]
    if legacy:
        return web.json_response({"embedding": vectors[0]})
    return web.json_response({"model": child.name, "embeddings": vectors,
                              "total_duration": time.monotonic_ns() - t0, "load_duration": load_ns,
                              "prompt_eval_count": int((data.get("usage") or {}).get("prompt_tokens", 0))})
