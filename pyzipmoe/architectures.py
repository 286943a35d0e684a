"""The Mixture-of-Experts architectures zipmoe has been checked on, one fact for `zipmoe convert` and the tests.

An architecture is VERIFIED when tests/engine/test_architectures.py passes on its generated model
(pyzipmoe.synth_arch): the zipmoe file unpacks byte-identical, and zipmoe's llama.cpp gives stock llama.cpp's logits
and tokens bit for bit, with and without a memory budget (docs/architectures.md). NOT_VERIFIED: architectures
stock llama.cpp runs from a generated file but zipmoe does not yet, and why.
"""

from __future__ import annotations

VERIFIED: frozenset[str] = frozenset({
    "afmoe", "arctic", "bailingmoe", "bailingmoe2", "bailingmoe3", "cohere2moe", "dbrx", "deepseek", "deepseek2",
    "deepseek2-ocr", "deepseek32", "deepseek4", "dots1", "dots3note", "ernie4_5-moe", "exaone-moe", "gemma4",
    "glm-dsa", "glm4moe", "glm5-next", "gpt-oss", "granite_swa", "granitehybrid", "granitemoe", "grok", "grovemoe",
    "hunyuan-moe", "hy_v3", "hy_v4", "jamba", "kimi-k3", "kimi-linear", "laguna", "lfm2moe", "llada-moe", "llama",
    "llama-embed", "llama4", "maple", "mellum", "mimo2", "minicpm", "minimax-01", "minimax-m2", "minimax-m3",
    "mistral3", "mistral4", "nemotron_h_moe", "nomic-bert-moe", "olmoe", "phimoe", "qwen2moe", "qwen35moe",
    "qwen3moe", "qwen3next", "qwen3vlmoe", "qwen4exp", "rnd1", "smallthinker", "step35",
})

NOT_VERIFIED: dict[str, str] = {}


def architecture_note(arch: str | None) -> str | None:
    """What `zipmoe convert` says about a model of `arch` (general.architecture) that zipmoe was not checked on."""
    if arch in VERIFIED:
        return None
    return (f"architecture {arch or '(none)'} is not among those zipmoe is checked on (docs/architectures.md); "
            "check the converted file's output against the original before relying on it")
