"""The store server's pure parts: Ollama's keep_alive, options and format mapped to llama-server's fields, and the
rule that divides one memory budget between the loaded models (no process, no model file)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pyzipmoe.server import ollama as O
from pyzipmoe.server.app import DEFAULT_ORIGINS, origin_allowed
from pyzipmoe.server.budget import Tenant, divide, evictions


@pytest.mark.parametrize(("given", "seconds"), [
    ("5m", 300.0), ("1h30m", 5400.0), ("250ms", 0.25), ("30s", 30.0), ("1.5h", 5400.0), (0, 0.0), ("0", 0.0),
    (120, 120.0), ("45", 45.0), (-1, None), ("-1", None), ("-1m", None), (2.5, 2.5),
])
def test_keep_alive_as_ollama_reads_it(given: object, seconds: float | None) -> None:
    assert O.parse_keep_alive(given) == seconds


@pytest.mark.parametrize("given", ["5 minutes", "m", "", "5x", True, [], {"a": 1}, "1h-3m"])
def test_a_bad_keep_alive_is_a_400(given: object) -> None:
    with pytest.raises(O.ApiError) as e:
        O.parse_keep_alive(given)
    assert e.value.status == 400 and "keep_alive" in e.value.message


def test_embedding_inputs_dimensions_and_shortening() -> None:
    assert O.embed_inputs("a") == ["a"] and O.embed_inputs(["a", "b"]) == ["a", "b"]
    assert O.embed_inputs(None) == [] and O.embed_inputs("") == []
    for bad in (3, ["a", 1], {"a": 1}):
        with pytest.raises(O.ApiError) as e:
            O.embed_inputs(bad)
        assert e.value.status == 400
    assert O.embed_dimensions(None) is None and O.embed_dimensions(0) is None and O.embed_dimensions(4) == 4
    for bad in (-1, 2.5, True, "4"):
        with pytest.raises(O.ApiError):
            O.embed_dimensions(bad)
    assert O.shorten([3.0, 4.0, 12.0], 2) == [0.6, 0.8]
    assert O.shorten([1.0, 2.0], 5) == [1.0, 2.0] and O.shorten([1.0, 2.0], None) == [1.0, 2.0]


def test_options_become_llama_server_fields_and_the_request_wins() -> None:
    params = {"temperature": 0.7, "top_k": 20, "stop": ["<end>"], "num_ctx": 2048, "memory_budget": "1GiB"}
    options = O.check_options({"temperature": 0, "num_predict": 12, "seed": 7, "top_p": 0.9, "min_p": 0.05,
                               "repeat_penalty": 1.1, "stop": "###", "num_ctx": 512, "num_gpu": 99})
    fields = O.sampling_fields(params, options)
    assert fields == {"temperature": 0, "top_k": 20, "n_predict": 12, "seed": 7, "top_p": 0.9, "min_p": 0.05,
                      "repeat_penalty": 1.1, "stop": ["###", "<end>"]}


@pytest.mark.parametrize("options", [{"temperature": "hot"}, {"top_k": 1.5}, {"stop": [1]}, {"seed": True}, [1]])
def test_bad_options_are_a_400(options: object) -> None:
    with pytest.raises(O.ApiError) as e:
        O.check_options(options)
    assert e.value.status == 400


def test_format_json_and_schema() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert O.format_fields("json", chat=False) == {"json_schema": {}}
    assert O.format_fields(schema, chat=False) == {"json_schema": schema}
    assert O.format_fields("json", chat=True) == {"response_format": {"type": "json_object"}}
    assert O.format_fields(schema, chat=True)["response_format"]["json_schema"]["schema"] == schema
    assert O.format_fields(None, chat=True) == {} and O.format_fields("", chat=False) == {}
    with pytest.raises(O.ApiError):
        O.format_fields("yaml", chat=False)


def test_tool_calls_round_trip_between_ollama_and_openai() -> None:
    ollama_msgs = [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_name": "weather"}]
    openai = O.openai_messages(ollama_msgs)
    assert openai[0]["tool_calls"][0]["function"] == {"name": "weather", "arguments": '{"city": "Paris"}'}
    assert openai[1] == {"role": "tool", "content": "sunny", "name": "weather"}
    assert O.ollama_tool_calls(openai[0]["tool_calls"]) == ollama_msgs[0]["tool_calls"]
    with pytest.raises(O.ApiError):
        O.openai_messages([{"role": "user", "content": "look", "images": ["aGk="]}])


def test_done_reason_and_durations() -> None:
    assert O.done_reason("limit") == "length" and O.done_reason("eos") == "stop" and O.done_reason("word") == "stop"
    assert O.done_reason(None, "length") == "length" and O.done_reason(None, "tool_calls") == "stop"
    d = O.durations({"prompt_n": 5, "prompt_ms": 1.5, "predicted_n": 8, "predicted_ms": 20.0}, 10, 3)
    assert d == {"total_duration": 10, "load_duration": 3, "prompt_eval_count": 5, "prompt_eval_duration": 1500000,
                 "eval_count": 8, "eval_duration": 20000000}


@pytest.mark.parametrize("raw", [b"{bad", b"[1, 2]", b"\"text\"", b"{\"a\": " + b"[" * 100000])
def test_malformed_json_is_a_400(raw: bytes) -> None:
    with pytest.raises(O.ApiError) as e:
        O.parse_json_object(raw)
    assert e.value.status == 400


@pytest.mark.parametrize(("origin", "allowed"), [
    ("http://localhost", True), ("http://localhost:3000", True), ("https://127.0.0.1:8443", True),
    ("app://obsidian.md", True), ("http://evil.example", False), ("http://localhost.evil.example", False),
    ("null", False),
])
def test_browser_origins_from_the_allowlist(origin: str, allowed: bool) -> None:
    assert origin_allowed(origin, DEFAULT_ORIGINS) is allowed
    assert origin_allowed("https://chat.example.com", (*DEFAULT_ORIGINS, "https://chat.example.com"))


def test_the_model_answering_gets_the_room_idle_ones_keep_their_minimum() -> None:
    a, b = Tenant("a", 100, 1000, last_used=1.0), Tenant("b", 200, 800, last_used=2.0)
    assert divide(1500, [a, b]) == {"a": 700, "b": 800}  # b, the most recent, whole; a what is left
    assert divide(600, [a, b]) == {"a": 100, "b": 500}  # a shrinks to its minimum first
    a.last_used = 3.0
    assert divide(600, [a, b]) == {"a": 400, "b": 200}  # the room follows the model answering
    assert sum(divide(2000, [a, b]).values()) == 1800  # never more than the models can use


def test_unload_the_least_recently_used_only_when_minimums_do_not_fit() -> None:
    a, b, c = Tenant("a", 100, 1000, 1.0), Tenant("b", 200, 800, 2.0), Tenant("c", 300, 900, 3.0)
    assert evictions(600, [a, b, c]) == []  # the minimums fit: nothing unloaded, however small the shares
    assert evictions(600, [a, b, c], incoming=100) == ["a"]
    assert evictions(600, [a, b, c], incoming=100, busy=["a"]) == ["b"]
    assert evictions(350, [a, b, c], incoming=50, busy=["c"]) == ["a", "b"]
    assert evictions(350, [a, b, c], incoming=100, busy=["c"]) is None  # c answers: no room for 100 more


def test_shared_budget_publishes_each_model_s_share_through_its_control_file(zipmoe_model: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The shares reach the models' control files as the runtime's splits (the hot tier grows with the share),
    move with the model answering, and an `auto` budget that shrinks below the minimums names the idle model to
    unload, the least recently used."""
    from pyzipmoe.runtime.budget import model_memory
    from pyzipmoe.runtime.cache_control import store_sizes
    from pyzipmoe.runtime.supervise import W_HOT, W_SEQ, ControlFile
    from pyzipmoe.server.budget import SharedBudget

    need = model_memory(zipmoe_model)
    sizes = store_sizes(zipmoe_model)
    total = 2 * need.minimum + need.expert_bytes // 2
    budget = SharedBudget(total)
    controls = {n: ControlFile.create() for n in ("a", "b")}
    try:
        for name in ("a", "b"):
            tenant = Tenant(name, need.minimum, need.whole)
            share, victims = budget.admit(tenant)
            assert victims == []
            budget.make_room(tenant)
            budget.add(tenant, share, control=controls[name], sizes=sizes, other_bytes=need.other_bytes)
        assert budget.share("b") == min(need.whole, total - need.minimum) and budget.share("a") == total - budget.share("b")
        # a was shrunk for b (a split published, whole: seq even); b runs with the budget it loaded with
        assert controls["a"].value(W_SEQ) > 0 and controls["a"].value(W_SEQ) % 2 == 0
        assert controls["b"].value(W_SEQ) == 0
        hot_a = controls["a"].value(W_HOT)
        budget.touch("a")
        assert budget.share("a") > budget.share("b") and budget.share("a") + budget.share("b") <= total
        assert controls["a"].value(W_HOT) > hot_a
        assert budget.share("b") == need.minimum  # down to its minimum: no decoded experts kept
        assert controls["b"].value(W_SEQ) > 0 and controls["b"].value(W_HOT) == 0
        budget.auto, budget.total = True, total
        monkeypatch.setattr(budget, "_read_total", lambda: 2 * need.minimum - 1)
        assert budget.refresh(busy=["b"]) == ["a"] and budget.refresh() == []  # (read once: no move, no victims)
    finally:
        for c in controls.values():
            c.close()


class _Content:
    """What sse reads of a response: its body in the reads given."""

    def __init__(self, reads: list[bytes]) -> None:
        self.reads = reads

    async def iter_any(self):  # type: ignore[no-untyped-def]
        for r in self.reads:
            yield r


class _Response:
    def __init__(self, reads: list[bytes]) -> None:
        self.content = _Content(reads)


def _events_of(reads: list[bytes]) -> list[list[dict]]:
    import asyncio

    from pyzipmoe.server.stream import sse

    async def collect() -> list[list[dict]]:
        return [batch async for batch in sse(_Response(reads))]  # type: ignore[arg-type]

    return asyncio.run(collect())


def test_server_sent_events_split_across_reads_and_batched_within_one() -> None:
    """llama-server's stream as the front reads it: an event split over two reads comes out whole, the events of one
    read come out together (answered with one write), [DONE] ends it, a last event without a newline still counts."""
    a, b, c = b'data: {"content": "a"}\n\n', b'data: {"content": "b"}\n\n', b'data: {"content": "c", "stop": true}'
    assert _events_of([a[:9], a[9:] + b, c]) == [[{"content": "a"}, {"content": "b"}],
                                                 [{"content": "c", "stop": True}]]
    assert _events_of([a + b + b"data: [DONE]\n\n" + a]) == [[{"content": "a"}, {"content": "b"}]]
    assert _events_of([b": comment\n\n", a]) == [[{"content": "a"}]]


def test_an_error_in_the_stream_is_an_api_error() -> None:
    for reads in ([b'data: {"error": {"message": "boom"}}\n\n'], [b'error: {"message": "boom"}\n\n']):
        with pytest.raises(O.ApiError) as e:
            _events_of(reads)
        assert e.value.message == "boom"
