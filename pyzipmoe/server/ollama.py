"""Ollama's REST API in terms of llama-server's: requests in, answers out, as pure functions (no I/O), so that each
mapping is tested on its own. The routes (app.py) call them around the HTTP calls to a model's llama-server.

What maps to what (Ollama's docs/api.md; llama-server's tools/server/README.md):
  /api/generate   the prompt in the model's chat template (llama-server's /apply-template, or the request's own
                  `template`), or as it is with `raw`, completed by /completion
  /api/chat       /v1/chat/completions (tool calls and JSON schemas through llama-server's own parsing)
  options         sampling fields of llama-server's requests (SAMPLING); num_ctx is the context the model's process
                  is started with (a different one starts it again, as Ollama reloads)
  format          "json" or a JSON schema: a grammar llama-server derives from the schema
"""

from __future__ import annotations

import functools
import json
import math
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

DEFAULT_KEEP_ALIVE = 300.0  # seconds a model stays loaded after its last request (Ollama's 5m)

# Ollama's option -> llama-server's request field (the same name in /completion and /v1/chat/completions)
SAMPLING = {
    "temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "typical_p": "typical_p",
    "seed": "seed", "num_predict": "n_predict", "stop": "stop", "repeat_penalty": "repeat_penalty",
    "repeat_last_n": "repeat_last_n", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "num_keep": "n_keep", "mirostat": "mirostat",
    "mirostat_tau": "mirostat_tau", "mirostat_eta": "mirostat_eta",
}
# options that set how a model's process starts, not a request: num_ctx is honoured (children.py); the others are
# Ollama's GPU and loader settings, which a CPU build of llama.cpp has no use for, or the server's own flags
LOAD_OPTIONS = ("num_ctx", "num_batch", "num_thread", "num_gpu", "main_gpu", "low_vram", "numa", "use_mmap",
                "use_mlock", "vocab_only", "logits_all", "embedding_only", "f16_kv", "penalize_newline", "tfs_z")
_INTEGER = {"top_k", "seed", "num_predict", "repeat_last_n", "num_keep", "mirostat", "num_ctx"}


class ApiError(Exception):
    """A request the server answers with `status` and Ollama's error shape, {"error": message}."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def bad_request(message: str) -> ApiError:
    return ApiError(400, message)


# ------------------------------------------------------------------------------------------ keep_alive

_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_keep_alive(value: Any) -> float | None:
    """Seconds a model stays loaded after a request, from Ollama's keep_alive: a number of seconds, or a duration
    as Go writes it ("5m", "1h30m", "250ms"; a bare number in a string is seconds). Negative: for ever (None);
    0: unloaded as soon as the request is answered. ApiError for anything else."""
    if isinstance(value, bool) or value is None:
        raise bad_request(f"keep_alive {json.dumps(value)} is not a duration: write e.g. 5m, 30s, 0 or -1")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        seconds = _duration(value.strip())
    else:
        raise bad_request(f"keep_alive {json.dumps(value)} is not a duration: write e.g. 5m, 30s, 0 or -1")
    if math.isnan(seconds):
        raise bad_request("keep_alive is not a number")
    return None if seconds < 0 else seconds


def _duration(text: str) -> float:
    sign, body = (-1.0, text[1:]) if text.startswith("-") else (1.0, text.lstrip("+"))
    try:
        return sign * float(body)
    except ValueError:
        pass
    pos, total = 0, 0.0
    for m in _DURATION_PART.finditer(body):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNIT_SECONDS[m.group(2)]
        pos = m.end()
    if not body or pos != len(body):
        raise bad_request(f"keep_alive {text!r} is not a duration: write e.g. 5m, 30s, 0 or -1")
    return sign * total


# ------------------------------------------------------------------------------------------ options


def check_options(options: Any) -> dict[str, Any]:
    """Ollama's `options` object, its values checked (ApiError for a wrong type: a 400, before any model loads)."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise bad_request("options must be a JSON object")
    out: dict[str, Any] = {}
    for key, value in options.items():
        if key == "stop":
            if isinstance(value, str):
                value = [value]
            if not (isinstance(value, list) and all(isinstance(s, str) for s in value)):
                raise bad_request("options.stop must be a string or a list of strings")
        elif key in SAMPLING or key in _INTEGER:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise bad_request(f"options.{key} must be a number, not {json.dumps(value)}")
            if key in _INTEGER and value != int(value):
                raise bad_request(f"options.{key} must be an integer, not {value}")
            value = int(value) if key in _INTEGER else value
        out[key] = value
    return out


def embed_inputs(value: Any, key: str = "input") -> list[str]:
    """The texts of an embedding request: Ollama's `input` (a string or a list of them; none: load the model only)
    or the older /api/embeddings' `prompt`."""
    if value is None or value == "":
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise bad_request(f"{key} must be a string or a list of strings")


def embed_dimensions(value: Any) -> int | None:
    if value is None or value == 0:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise bad_request(f"dimensions must be a positive integer, not {json.dumps(value)}")
    return value


def shorten(vector: Sequence[float], dimensions: int | None) -> list[float]:
    """An embedding cut to its first `dimensions` and scaled to length 1 again, as Ollama answers `dimensions`."""
    if dimensions is None or dimensions >= len(vector):
        return list(vector)
    head = list(vector[:dimensions])
    norm = math.sqrt(sum(x * x for x in head))
    return [x / norm for x in head] if norm > 0 else head


def sampling_fields(parameters: Mapping[str, Any], options: Mapping[str, Any]) -> dict[str, Any]:
    """llama-server's sampling fields: the model's PARAMETERs (a Modelfile's names are Ollama's options), then the
    request's options, which win; stop strings of both apply, as in Ollama."""
    merged = {**{k: v for k, v in parameters.items() if k in SAMPLING}, **{k: v for k, v in options.items()
                                                                         if k in SAMPLING}}
    out = {SAMPLING[k]: (list(v) if k == "stop" else v) for k, v in merged.items()}
    if "stop" in options and "stop" in parameters:
        out["stop"] = list(dict.fromkeys([*options["stop"], *parameters["stop"]]))
    return out


def format_fields(fmt: Any, *, chat: bool) -> dict[str, Any]:
    """`format` ("json", or a JSON schema as an object) as llama-server's constrained decoding: json_schema for
    /completion, response_format for /v1/chat/completions."""
    if fmt is None or fmt == "":
        return {}
    if fmt == "json":
        return {"response_format": {"type": "json_object"}} if chat else {"json_schema": {}}
    if isinstance(fmt, Mapping):
        if chat:
            return {"response_format": {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}}
        return {"json_schema": dict(fmt)}
    raise bad_request(f'format must be "json" or a JSON schema object, not {json.dumps(fmt)}')


# ------------------------------------------------------------------------------------------ messages


def openai_messages(messages: Any) -> list[dict[str, Any]]:
    """Ollama's chat messages as OpenAI's, which llama-server takes: tool calls' arguments as JSON text, a tool's
    answer as role "tool". Images: ApiError (no model zipmoe serves sees them)."""
    if not isinstance(messages, list):
        raise bad_request("messages must be a list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a role")
        if m.get("images"):
            raise bad_request("this model does not take images")
        msg: dict[str, Any] = {"role": m["role"], "content": m.get("content") or ""}
        if not isinstance(msg["content"], str):
            raise bad_request(f"messages[{i}].content must be a string")
        calls = m.get("tool_calls")
        if calls:
            msg["tool_calls"] = [_openai_tool_call(c, j) for j, c in enumerate(calls)]
        if m.get("tool_name"):
            msg["name"] = m["tool_name"]
        out.append(msg)
    return out


def _openai_tool_call(call: Any, index: int) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise bad_request("a tool call needs a function with a name")
    args = fn.get("arguments", {})
    return {"id": f"call_{index}", "type": "function",
            "function": {"name": fn["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}}


def ollama_tool_calls(calls: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    """OpenAI's tool calls (arguments as JSON text) as Ollama's (arguments as an object)."""
    out = []
    for call in calls or ():
        fn = call.get("function") or {}
        args: Any = fn.get("arguments") or "{}"
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                args = {"arguments": args}
        out.append({"function": {"name": fn.get("name", ""), "arguments": args}})
    return out


# ------------------------------------------------------------------------------------------ answers


def now() -> str:
    """A timestamp as Ollama writes created_at (RFC 3339, UTC, microseconds). Written for every streamed token: the
    date and time of day are formatted once a second."""
    t = time.time()
    second = int(t)
    return f"{_second(second)}.{int((t - second) * 1e6):06d}Z"


@functools.lru_cache(maxsize=2)
def _second(second: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))


def done_reason(stop_type: str | None, finish_reason: str | None = None) -> str:
    """Ollama's done_reason from llama-server's stop_type (eos, word, limit) or OpenAI's finish_reason."""
    if stop_type == "limit" or finish_reason == "length":
        return "length"
    return "stop"


def durations(timings: Mapping[str, Any] | None, total_ns: int, load_ns: int) -> dict[str, int]:
    """The counts and nanosecond durations Ollama ends an answer with, from llama-server's timings."""
    t = timings or {}
    return {"total_duration": total_ns, "load_duration": load_ns,
            "prompt_eval_count": int(t.get("prompt_n", 0) or 0),
            "prompt_eval_duration": int(float(t.get("prompt_ms", 0) or 0) * 1e6),
            "eval_count": int(t.get("predicted_n", 0) or 0),
            "eval_duration": int(float(t.get("predicted_ms", 0) or 0) * 1e6)}


def details(config: Mapping[str, Any]) -> dict[str, Any]:
    """Ollama's `details` of a model from its config blob (pyzipmoe.models.create)."""
    arch = config.get("architecture") or ""
    params = config.get("parameters") or 0
    types = config.get("expert_types") or []
    return {"parent_model": "", "format": "gguf", "family": arch, "families": [arch] if arch else [],
            "parameter_size": _count(params), "quantization_level": "/".join(types) or "unknown"}


def _count(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(n)


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """A request's body: a JSON object, else ApiError 400 (empty: an empty object, as Ollama's GET-like POSTs)."""
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise bad_request(f"invalid JSON in the request body: {e}") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body
