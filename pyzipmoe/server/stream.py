"""Talking to a model's llama-server and answering as Ollama streams: llama-server's error answers as ours, its
server-sent events decoded, and the NDJSON lines written back.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
from aiohttp import web

from . import ollama as O


async def upstream_error(r: aiohttp.ClientResponse) -> O.ApiError:
    """llama-server's error answer ({"error": {"message": ...}}) as ours, with its status."""
    text = await r.text()
    try:
        err = json.loads(text).get("error")
        message = err.get("message") if isinstance(err, dict) else str(err)
    except (ValueError, AttributeError):
        message = text.strip() or r.reason or "error"
    return O.ApiError(r.status, message or "error")


async def sse(r: aiohttp.ClientResponse) -> AsyncIterator[list[dict[str, Any]]]:
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


class Ndjson:
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
