"""Modelfiles: Ollama's syntax read exactly, every mistake an error with its line, and render() round trips."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyzipmoe.models import modelfile as M
from pyzipmoe.models.modelfile import Message, ModelfileError, parse, render

FULL = '''\
# a Modelfile as people write them for Ollama
from ./qwen3moe-bf16.gguf

parameter Temperature 0.7
PARAMETER top_k 20
PARAMETER top_p 0.8
PARAMETER repeat_penalty 1.1
PARAMETER num_ctx 4096
PARAMETER stop "<|im_end|>"
PARAMETER stop <|endoftext|>
PARAMETER seed 42
PARAMETER memory_budget 8GiB
PARAMETER cache_policy lru
PARAMETER cache_mode unbounded
System """You are a helpful assistant.
Answer in "one" sentence.  """
TEMPLATE """{% for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}<|im_start|>assistant
"""
MESSAGE user Is the sky blue?
MESSAGE assistant "Yes, on a clear day."
LICENSE """Apache License
Version 2.0"""
LICENSE MIT
'''


def test_full_modelfile() -> None:
    mf = parse(FULL)
    assert mf.from_ == "./qwen3moe-bf16.gguf"
    assert dict(mf.parameters) == {"temperature": 0.7, "top_k": 20, "top_p": 0.8, "repeat_penalty": 1.1,
                                   "num_ctx": 4096, "stop": ["<|im_end|>", "<|endoftext|>"], "seed": 42,
                                   "memory_budget": 8 << 30, "cache_policy": "lru", "cache_mode": "unbounded"}
    assert mf.system == 'You are a helpful assistant.\nAnswer in "one" sentence.  '
    assert mf.template is not None and mf.template.startswith("{% for message in messages %}<|im_start|>")
    assert mf.template.endswith("<|im_start|>assistant\n")
    assert mf.messages == (Message("user", "Is the sky blue?"), Message("assistant", "Yes, on a clear day."))
    assert mf.license == ("Apache License\nVersion 2.0", "MIT")
    assert mf.lines["FROM"] == 2 and mf.lines["temperature"] == 4 and mf.lines["SYSTEM"] == 15
    assert mf.warnings == ()


def test_render_round_trips() -> None:
    mf = parse(FULL)
    text = render(mf, header=["generated"])
    assert text.startswith("# generated\n\nFROM ./qwen3moe-bf16.gguf\n")
    assert "PARAMETER memory_budget 8GiB" in text
    assert parse(text) == mf


def test_quirks_of_ollama_syntax() -> None:
    # a "..." value may span lines and ends at a quote that ends a line; quotes inside are text
    mf = parse('FROM m\nSYSTEM "say "hi" twice\n  please"\nMESSAGE user """"quoted" start"""')
    assert mf.system == 'say "hi" twice\n  please'
    assert mf.messages == (Message("user", '"quoted" start'),)
    # # starts a comment only at the start of a line; CRLF and a BOM are fine
    mf = parse('\ufeff  # comment\r\nFROM m\r\nPARAMETER stop #\r\n')
    assert mf.parameters["stop"] == ["#"] and mf.from_ == "m"
    # an empty quoted value is a value (an empty system prompt replaces a base model's)
    assert parse('FROM m\nSYSTEM ""').system == ""


@pytest.mark.parametrize(("text", "line", "fragment"), [
    ("FROM m\nFORM x", 2, "unknown directive 'FORM'"),
    ("FROM m\nADAPTER ./lora.gguf", 2, "LoRA adapters are not supported"),
    ("FROM m\n\nPARAMETER temprature 0.5", 3, "unknown parameter 'temprature'"),
    ("FROM m\nPARAMETER temperature warm", 2, "'warm' is not a number"),
    ("FROM m\nPARAMETER temperature -1", 2, "must be at least 0"),
    ("FROM m\nPARAMETER top_p 1.5", 2, "must be at most 1"),
    ("FROM m\nPARAMETER num_ctx 2048.5", 2, "not a whole number"),
    ("FROM m\nPARAMETER num_ctx 0", 2, "must be at least 1"),
    ("FROM m\nPARAMETER temperature nan", 2, "not a finite number"),
    ("FROM m\nPARAMETER memory_budget lots", 2, "PARAMETER memory_budget 'lots' is not a size: write e.g. 6GiB"),
    ("FROM m\nPARAMETER memory_budget 101%", 2, "more than all of the memory"),
    ("FROM m\nPARAMETER memory_budget -1GiB", 2, "is negative"),
    ("FROM m\nPARAMETER cache_policy fast", 2, "not one of lfuda, tlfu, lru, lfu, fifo"),
    ("FROM m\nPARAMETER cache_mode lru", 2, "not one of unbounded, none"),
    ("FROM m\nPARAMETER cache_mode none\nPARAMETER cache_policy none", 3, "cache_mode is already set on line 2"),
    ("FROM m\nPARAMETER seed 1\nPARAMETER seed 2", 3, "already set on line 2"),
    ("FROM m\nPARAMETER temperature", 2, "needs a name and a value"),
    ("FROM m\nSYSTEM a\nSYSTEM b", 3, "already given on line 2"),
    ("FROM a\nFROM b", 2, "already given on line 1"),
    ("FROM m\nSYSTEM", 2, "SYSTEM needs a value"),
    ("FROM m\nMESSAGE robot hello", 2, "role 'robot' is not one of system, user, assistant"),
    ("FROM m\nMESSAGE user", 2, "needs a role and a text"),
    ('FROM m\n\nSYSTEM """never\nclosed', 3, '""" opened here is never closed'),
    ('FROM m\nSYSTEM "never\nclosed', 2, '" opened here is never closed'),
    ('FROM m\nSYSTEM """a\nb""" trailing', 3, "unexpected text after the closing"),
    ("FROM m\nTEMPLATE {{ .System }} {{ .Prompt }}", 2, "Ollama Go template"),
    ("FROM m\nTEMPLATE {% for m in messages %}", 2, "not a Jinja chat template"),
    ("PARAMETER seed 1", None, "no FROM line"),
])
def test_errors_name_the_line(text: str, line: int | None, fragment: str) -> None:
    with pytest.raises(ModelfileError) as e:
        parse(text, source="my.Modelfile")
    assert e.value.line == line
    prefix = f"my.Modelfile, line {line}: " if line else "my.Modelfile: "
    assert str(e.value).startswith(prefix) and fragment in str(e.value), str(e.value)
    assert e.value.exit_code == 2


# KB/GB/TB are binary, as --memory-budget and the runtime read the same parameter (one size parser)
@pytest.mark.parametrize(("text", "n"), [("1048576", 1 << 20), ("8GiB", 8 << 30), ("8G", 8 << 30), ("8gb", 8 << 30),
                                         ("512 MiB", 512 << 20), ("1.5K", 1536), ("2TB", 2 << 40), ("100B", 100)])
def test_sizes(text: str, n: int) -> None:
    assert M.parse_size(text) == n
    assert M.parse_size(M.format_size(n)) == n


@pytest.mark.parametrize("text", ["", "GiB", "8 XB", "8iB", "-1", "1e3"])
def test_bad_sizes(text: str) -> None:
    with pytest.raises(ValueError):
        M.parse_size(text)


def test_stored_parameters_are_checked() -> None:
    assert M.check_parameters({"temperature": 1, "stop": ["a"], "cache_mode": "none", "cache_policy": "fifo",
                               "memory_budget": "60%"}, "x") == {
        "temperature": 1, "stop": ["a"], "cache_mode": "none", "cache_policy": "fifo", "memory_budget": "60%"}
    for bad in ({"temperature": "hot"}, {"stop": "a"}, {"num_ctx": 0}, {"num_ctx": True}, {"mirostat": 1},
                {"cache_policy": "fast"}, {"cache_mode": "lru"}, {"top_p": 2.0}, {"memory_budget": "lots"},
                {"memory_budget": -1}, {"memory_budget": True}):
        with pytest.raises(M.ZipmoeError):
            M.check_parameters(bad, "the parameters blob")


def test_cache_policies_are_the_runtimes() -> None:
    from pyzipmoe.runtime import config

    assert M.PARAMETERS[M.CACHE_MODE_PARAMETER].choices == config.CACHE_MODES


# \r is a line break (CRLF files are read as LF), so a value cannot keep one
values = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\r"), max_size=40)


@settings(max_examples=300, deadline=None)
@given(system=values, stop=st.lists(values.filter(lambda s: s.strip() == s and s and "\n" not in s), max_size=3),
       messages=st.lists(st.tuples(st.sampled_from(M.ROLES), values), max_size=3))
def test_render_parse_round_trip_property(system: str, stop: list[str], messages: list[tuple[str, str]]) -> None:
    mf = M.Modelfile("m", {"stop": stop} if stop else {}, None, system, (), tuple(Message(r, c) for r, c in messages))
    try:
        text = render(mf)
    except ValueError:  # the few values the syntax cannot hold (a lone \"\"\" with a quote ending a line)
        return
    assert parse(text) == mf


# ------------------------------------------------------------------------------------- Modelfile = CLI


@pytest.mark.parametrize(("text", "value"), [("auto", "auto"), ("AUTO", "auto"), ("60%", "60%"), (" 12.5 % ", "12.5%"),
                                             ("8GiB", 8 << 30), ("512 MiB", 512 << 20), ("1.5g", 3 << 29),
                                             ("0", 0)])
def test_memory_budget_takes_what_the_flag_takes(text: str, value: int | str) -> None:
    """PARAMETER memory_budget reads what --memory-budget reads (the same parser: pyzipmoe.runtime.budget), sizes as
    bytes and what depends on the machine (auto, a percentage) as written; it renders back to the same."""
    from pyzipmoe.runtime.budget import parse_budget

    mf = parse(f"FROM m\nPARAMETER memory_budget {text}\n")
    assert mf.parameters["memory_budget"] == value
    if isinstance(value, int):
        assert parse_budget(text) == value
    assert parse(render(mf)) == mf
    assert M.check_parameters(dict(mf.parameters), "x") == dict(mf.parameters)


def test_cache_policy_is_the_eviction_policy() -> None:
    """cache_policy means what --policy (and Llama's cache_policy) means; the cache mode is cache_mode."""
    from pyzipmoe.runtime import config

    assert M.PARAMETERS["cache_policy"].choices == config.POLICIES
    mf = parse("FROM m\nPARAMETER cache_policy LRU\nPARAMETER cache_mode none\n")
    assert dict(mf.parameters) == {"cache_policy": "lru", "cache_mode": "none"} and mf.warnings == ()


@pytest.mark.parametrize("mode", ["unbounded", "none"])
def test_old_spelling_of_the_cache_mode_is_read_with_one_warning(mode: str) -> None:
    mf = parse(f"FROM m\n\nPARAMETER cache_policy {mode}\n", source="old.Modelfile")
    assert dict(mf.parameters) == {"cache_mode": mode}
    assert len(mf.warnings) == 1 and mf.warnings[0].startswith("old.Modelfile, line 3: PARAMETER cache_policy")
    assert f"PARAMETER cache_mode {mode}" in mf.warnings[0] and "\n" not in mf.warnings[0]
    assert f"PARAMETER cache_mode {mode}\n" in render(mf)
    # a package stored with the old spelling reads the same, without a warning (its owner cannot change it)
    assert M.check_parameters({"cache_policy": mode}, "x") == {"cache_mode": mode}
