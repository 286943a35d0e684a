"""The synthetic MoE generator: file structure, determinism, BF16 rounding, value statistics, routing, and
(when a llama.cpp build is available through ZIPMOE_LLAMA_BIN) that stock llama.cpp loads and runs the files."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader

from pyzipmoe import synth

ARCHS = ("qwen3moe", "olmoe")
TINY = synth.PRESETS["tiny"]


def tiny(arch: str = "qwen3moe", **changes: object) -> synth.SynthConfig:
    return dataclasses.replace(synth.for_arch(TINY, arch), **changes)


def field(reader: GGUFReader, key: str) -> object:
    return reader.fields[key].contents()


def bf16_values(tensor: object) -> np.ndarray:
    """A BF16 tensor's values as float32, in numpy order."""
    return synth.bf16_to_f32(np.asarray(tensor.data).view(np.uint16))


# ------------------------------------------------------------------------------------------- structure


@pytest.mark.parametrize("arch", ARCHS)
def test_tensors_have_the_shapes_and_types_llama_cpp_expects(tmp_path: Path, arch: str) -> None:
    c = tiny(arch)
    info = synth.write_config(tmp_path / "m.gguf", c)
    reader = GGUFReader(info.path)
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == info.n_tensors == 3 + 12 * c.n_layer

    expected_ggml_shapes = {
        "ffn_gate_exps": [c.n_embd, c.n_ff_exp, c.n_expert],
        "ffn_up_exps": [c.n_embd, c.n_ff_exp, c.n_expert],
        "ffn_down_exps": [c.n_ff_exp, c.n_embd, c.n_expert],
        "ffn_gate_inp": [c.n_embd, c.n_expert],
    }
    for i in range(c.n_layer):
        for kind, shape in expected_ggml_shapes.items():
            t = tensors[f"blk.{i}.{kind}.weight"]
            assert [int(n) for n in t.shape] == shape
            want = GGMLQuantizationType.F32 if kind == "ffn_gate_inp" else GGMLQuantizationType.BF16
            assert t.tensor_type == want
    for name, t in tensors.items():
        if name.endswith("norm.weight"):
            assert t.tensor_type == GGMLQuantizationType.F32
    q_norm = c.head_dim if arch == "qwen3moe" else c.n_embd
    assert [int(n) for n in tensors["blk.0.attn_q_norm.weight"].shape] == [q_norm]
    assert [int(n) for n in tensors["token_embd.weight"].shape] == [c.n_embd, c.n_vocab]

    expert_bytes = sum(int(t.n_bytes) for name, t in tensors.items() if name.endswith("_exps.weight"))
    assert info.expert_bytes == expert_bytes == 3 * c.n_layer * c.n_expert * c.n_ff_exp * c.n_embd * 2
    assert info.file_size == info.path.stat().st_size
    assert not (tmp_path / "m.gguf.part").exists()


@pytest.mark.parametrize("arch", ARCHS)
def test_metadata_describes_a_synthetic_moe_with_a_llama_vocab(tmp_path: Path, arch: str) -> None:
    c = tiny(arch)
    reader = GGUFReader(synth.write_config(tmp_path / "m.gguf", c).path)
    assert field(reader, "general.architecture") == arch
    assert "synthetic" in field(reader, "general.name") and "random weights" in field(reader, "general.name")
    assert field(reader, f"{arch}.block_count") == c.n_layer
    assert field(reader, f"{arch}.embedding_length") == c.n_embd
    assert field(reader, f"{arch}.expert_count") == c.n_expert
    assert field(reader, f"{arch}.expert_used_count") == c.n_expert_used
    assert field(reader, f"{arch}.attention.head_count_kv") == c.n_head_kv
    assert field(reader, f"{arch}.attention.key_length") == c.head_dim
    if arch == "qwen3moe":
        assert field(reader, "qwen3moe.expert_feed_forward_length") == c.n_ff_exp
    else:
        assert field(reader, "olmoe.feed_forward_length") == c.n_ff_exp

    tokens = field(reader, "tokenizer.ggml.tokens")
    assert field(reader, "tokenizer.ggml.model") == "llama"
    assert len(tokens) == len(field(reader, "tokenizer.ggml.scores")) == c.n_vocab
    assert tokens[:3] == ["<unk>", "<s>", "</s>"]
    assert tokens[3 + 0x0A] == "<0x0A>"
    assert [field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("unknown", "bos", "eos")] == [0, 1, 2]


def test_vocab_is_unique_and_fills_any_size() -> None:
    for n in (synth.MIN_VOCAB, 320, 32000):
        tokens, scores, types = synth.build_vocab(n)
        assert len(tokens) == len(set(tokens)) == len(scores) == len(types) == n
    assert synth.build_vocab(32000)[0][:320] == synth.build_vocab(320)[0]


def test_invalid_configs_are_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="n_expert_used"):
        tiny(n_expert_used=9)
    with pytest.raises(ValueError, match="olmoe needs"):
        dataclasses.replace(TINY, arch="olmoe")  # tiny uses GQA, which olmoe lacks
    with pytest.raises(ValueError, match="n_vocab"):
        tiny(n_vocab=100)
    assert synth.for_arch(TINY, "olmoe").n_head_kv == TINY.n_head


def test_presets_have_their_advertised_sizes() -> None:
    size = {name: synth.tensor_data_bytes(c) for name, c in synth.PRESETS.items()}
    assert size["tiny"] < 4 << 20
    assert 50e6 <= size["small"] <= 100e6
    assert size["1g"] >= 1 << 30
    assert 2.7 * 2**30 <= size["2.8g"] <= 2.9 * 2**30
    c = synth.PRESETS["2.8g"]
    assert (c.n_embd, c.n_ff_exp, c.n_expert, c.n_expert_used, c.n_layer) == (2048, 768, 32, 4, 8)
    assert synth.size_preset_for_bytes(1 << 30) == "1g"
    assert synth.size_preset_for_bytes(1) == "tiny"


def test_a_failed_write_leaves_no_file(tmp_path: Path) -> None:
    def interrupt(done: int, total: int, name: str) -> None:
        if name.startswith("blk.1."):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        synth.write_config(tmp_path / "m.gguf", TINY, progress=interrupt)
    assert list(tmp_path.iterdir()) == []


def test_progress_reports_every_tensor_up_to_the_total(tmp_path: Path) -> None:
    calls: list[tuple[int, int, str]] = []
    info = synth.write_config(tmp_path / "m.gguf", TINY, progress=lambda *a: calls.append(a))
    assert len(calls) == info.n_tensors
    assert [done for done, _, _ in calls] == sorted(done for done, _, _ in calls)
    assert calls[-1] == (synth.tensor_data_bytes(TINY), synth.tensor_data_bytes(TINY), "output.weight")


# ------------------------------------------------------------------------------------------ determinism


def test_same_seed_gives_the_same_file_and_another_seed_other_weights(tmp_path: Path) -> None:
    a = synth.write_config(tmp_path / "a.gguf", tiny(seed=5)).path.read_bytes()
    b = synth.write_config(tmp_path / "b.gguf", tiny(seed=5)).path.read_bytes()
    c = synth.write_config(tmp_path / "c.gguf", tiny(seed=6)).path.read_bytes()
    assert a == b
    assert len(a) == len(c) and a != c
    experts = [{t.name: bytes(t.data) for t in GGUFReader(tmp_path / f"{x}.gguf").tensors} for x in "ac"]
    assert experts[0]["blk.0.ffn_up_exps.weight"] != experts[1]["blk.0.ffn_up_exps.weight"]


def test_write_synthetic_moe_defaults_to_the_tiny_preset(tmp_path: Path) -> None:
    info = synth.write_synthetic_moe(tmp_path / "m.gguf")
    assert info.config == TINY
    assert info.path.read_bytes() == synth.write_config(tmp_path / "n.gguf", TINY).path.read_bytes()


# ---------------------------------------------------------------------------------------- BF16 rounding


@pytest.mark.parametrize(("f32_bits", "bf16_bits"), [
    (0x3F800000, 0x3F80),  # 1.0, exact
    (0x3F808000, 0x3F80),  # tie, odd bit clear: stays (to even)
    (0x3F818000, 0x3F82),  # tie, odd bit set: up (to even)
    (0x3F808001, 0x3F81),  # just above the tie: up
    (0x3F807FFF, 0x3F80),  # just below the tie: down
    (0xBF818000, 0xBF82),  # negative tie
    (0x00008000, 0x0000),  # subnormal tie to even zero
    (0x00018000, 0x0002),  # subnormal tie, up
    (0x7F7F7FFF, 0x7F7F),  # largest value that stays finite
    (0x7F7FFFFF, 0x7F80),  # FLT_MAX overflows to +inf
    (0x7F800000, 0x7F80),  # +inf
    (0xFF800000, 0xFF80),  # -inf
    (0x7FC00000, 0x7FC0),  # quiet NaN
    (0x7F800001, 0x7FC0),  # NaN whose payload is all in the dropped bits: still NaN
    (0xFFFFFFFF, 0xFFFF),  # negative NaN, all ones: must not wrap around to zero
    (0x80000000, 0x8000),  # -0.0
])
def test_f32_to_bf16_rounds_to_nearest_even(f32_bits: int, bf16_bits: int) -> None:
    x = np.array([f32_bits], dtype=np.uint32).view(np.float32)
    assert int(synth.f32_to_bf16_rne(x)[0]) == bf16_bits


def test_f32_to_bf16_matches_a_reference_on_random_values() -> None:
    """Against a direct definition: the nearer of the two neighbouring BF16 values, ties to the even one."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(200_000) * np.exp(rng.uniform(-80, 80, 200_000))).astype(np.float32)
    x = x[np.abs(x) < 3e38]
    lo = (x.view(np.uint32) >> 16).astype(np.uint16)
    hi = lo + np.uint16(1)
    d_lo = np.abs(x.astype(np.float64) - synth.bf16_to_f32(lo))
    d_hi = np.abs(x.astype(np.float64) - synth.bf16_to_f32(hi))
    want = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    np.testing.assert_array_equal(synth.f32_to_bf16_rne(x), want)
    torch = pytest.importorskip("torch")
    got_torch = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(synth.f32_to_bf16_rne(x), got_torch)


# ----------------------------------------------------------------------------------------- statistics


def exponent_entropy(values: np.ndarray) -> float:
    bits = synth.f32_to_bf16_rne(values)
    counts = np.bincount(((bits >> 7) & 0xFF).ravel(), minlength=256)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())


def test_expert_weights_have_realistic_scale_and_exponent_entropy(tmp_path: Path) -> None:
    reader = GGUFReader(synth.write_config(tmp_path / "m.gguf", TINY).path)
    for t in reader.tensors:
        if t.name.endswith("_exps.weight"):
            v = bf16_values(t)
            assert np.all(np.isfinite(v))
            assert 0.015 < float(v.std()) < 0.03
            assert 2.45 < exponent_entropy(v) < 2.8, t.name


# ------------------------------------------------------------------------------------------- routing


def expert_usage(path: Path, n_tokens: int = 256) -> list[np.ndarray]:
    """Per layer, the share of top-k selections each expert gets, from a numpy forward pass of a qwen3moe
    model on random tokens. RoPE is left out: it rotates q and k but does not change the routing statistics."""
    reader = GGUFReader(path)
    w = {t.name: (bf16_values(t) if t.tensor_type == GGMLQuantizationType.BF16 else np.asarray(t.data))
         for t in reader.tensors}
    n_head = int(field(reader, "qwen3moe.attention.head_count"))
    n_head_kv = int(field(reader, "qwen3moe.attention.head_count_kv"))
    k = int(field(reader, "qwen3moe.expert_used_count"))
    n_layer = int(field(reader, "qwen3moe.block_count"))

    def rms_norm(x: np.ndarray, g: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * g

    emb = w["token_embd.weight"]
    h = emb[np.random.default_rng(0).integers(3, emb.shape[0], n_tokens)]
    mask = np.triu(np.full((n_tokens, n_tokens), -np.inf, dtype=np.float32), 1)
    usage = []
    for i in range(n_layer):
        p = f"blk.{i}."
        x = rms_norm(h, w[p + "attn_norm.weight"])
        q, kk, v = (x @ w[p + f"attn_{n}.weight"].T for n in "qkv")
        q = rms_norm(q.reshape(n_tokens, n_head, -1), w[p + "attn_q_norm.weight"])
        kk = np.repeat(rms_norm(kk.reshape(n_tokens, n_head_kv, -1), w[p + "attn_k_norm.weight"]),
                       n_head // n_head_kv, axis=1)
        v = np.repeat(v.reshape(n_tokens, n_head_kv, -1), n_head // n_head_kv, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, kk) / np.sqrt(q.shape[-1]) + mask
        att = np.exp(scores - scores.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        h = h + np.einsum("hqk,khd->qhd", att, v).reshape(n_tokens, -1) @ w[p + "attn_output.weight"].T
        x = rms_norm(h, w[p + "ffn_norm.weight"])
        logits = x @ w[p + "ffn_gate_inp.weight"].T
        top = np.argsort(-logits, axis=1)[:, :k]
        usage.append(np.bincount(top.ravel(), minlength=logits.shape[1]) / top.size)
        gates = np.exp(logits - logits.max(1, keepdims=True))
        gates = np.take_along_axis(gates, top, 1)
        gates /= gates.sum(1, keepdims=True)
        out = np.zeros_like(h)
        for slot in range(k):
            for e in np.unique(top[:, slot]):
                rows = top[:, slot] == e
                g, u = (x[rows] @ w[p + f"ffn_{n}_exps.weight"][e].T for n in ("gate", "up"))
                out[rows] += gates[rows, slot, None] * ((g / (1 + np.exp(-g)) * u) @ w[p + "ffn_down_exps.weight"][e].T)
        h = h + out
    return usage


def test_uniform_routing_is_balanced_and_skewed_routing_zipf_like(tmp_path: Path) -> None:
    config = dataclasses.replace(synth.PRESETS["tiny"], n_expert=16, n_expert_used=4, n_layer=3)
    uniform = expert_usage(synth.write_config(tmp_path / "u.gguf", config).path)
    skewed = expert_usage(synth.write_config(tmp_path / "s.gguf", dataclasses.replace(config, routing="skewed")).path)
    zipf = 1 / np.arange(1, 17)
    zipf /= zipf.sum()
    for u, s in zip(uniform, skewed):
        assert u.max() < 2.0 / 16 and u.min() > 0.4 / 16  # within sampling noise of 1/16
        s = np.sort(s)[::-1]
        assert s[0] > 2.5 / 16 and s[:4].sum() > 0.5  # a few popular experts...
        assert np.abs(np.cumsum(s) - np.cumsum(zipf)).max() < 0.15  # ...on a profile close to Zipf's


# --------------------------------------------------------------------------------------------- llama.cpp


def llama_bin(name: str) -> Path:
    directory = os.environ.get("ZIPMOE_LLAMA_BIN")
    if not directory:
        pytest.skip("set ZIPMOE_LLAMA_BIN to a llama.cpp build's bin directory to run stock llama.cpp on the files")
    path = Path(directory) / name
    if not path.is_file():
        pytest.skip(f"ZIPMOE_LLAMA_BIN has no {name}")
    return path


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("routing", ["uniform", "skewed"])
def test_stock_llama_cpp_loads_and_generates(tmp_path: Path, arch: str, routing: str) -> None:
    # llama-simple rather than llama-completion: the latter drops its output when stdout is not a terminal
    binary = llama_bin("llama-simple")
    c = tiny(arch, routing=routing)
    model = synth.write_config(tmp_path / "m.gguf", c).path
    run = subprocess.run([str(binary), "-m", str(model), "-n", "8", "hello world"], check=False,
                         capture_output=True, text=True, errors="replace", timeout=120)
    log = run.stderr
    assert run.returncode == 0, log[-2000:]
    assert re.search(rf"arch\s+= {arch}\b", log)
    assert re.search(rf"n_expert\s+= {c.n_expert}\b", log)
    assert re.search(rf"n_expert_used\s+= {c.n_expert_used}\b", log)
    assert re.search(r"file type\s+= BF16", log)
    assert re.search(r"decoded 8 tokens", log), log[-2000:]
    assert "hello world" in run.stdout  # the prompt, echoed before the generated text
