"""Synthetic BF16 Mixture-of-Experts GGUFs that stock llama.cpp loads and runs.

zipmoe needs MoE models of known shape and size for tests and benchmarks, without downloading gigabytes
of trained weights. These files have random weights, but everything zipmoe cares about is realistic:

* the tensor layout, names, types and metadata of a real qwen3moe or olmoe GGUF, so llama.cpp runs them;
* the value statistics of the BF16 expert tensors: Gaussian with a log-normal per-row scale, which gives
  an exponent entropy of about 2.6 bits, like trained weights (the compression ratio depends on it);
* optionally, skewed routing (a few popular experts per layer), so expert-cache benchmarks see a
  realistic Zipf-like usage profile instead of perfectly balanced experts.

Generation streams: tensors are generated and written one at a time, each from its own RNG (seeded by
`seed` and the tensor's name), so peak memory is about one tensor and a file is reproducible bit for bit.
"""

from __future__ import annotations

import itertools
import math
import os
import string
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal, get_args

import numpy as np
from gguf import GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFWriter, LlamaFileType, TokenType

Arch = Literal["qwen3moe", "olmoe"]
Routing = Literal["uniform", "skewed"]

ProgressFn = Callable[[int, int, str], None]
"""Called after each tensor is written with (tensor data bytes written so far, tensor_data_bytes(config),
tensor name); sizes include the alignment padding, so the last call has done == total."""

WEIGHT_STD = 0.02
"""Standard deviation of the projection matrices (attention and experts), typical of trained LLMs."""

EMBED_STD = 0.04
"""Token embeddings are a little wider than projections in trained models."""

ROW_SCALE_SIGMA = 0.25
"""Log-normal spread of per-row scales: trained weights have channels of different magnitude, which widens
the exponent distribution from ~2.55 bits (pure Gaussian) to the ~2.6 bits typical of trained BF16 weights."""

QK_NORM_WEIGHT = 4.0
"""Gain of the q/k RMS norms. With unit gain, random q.k scores are all alike, so every token averages its
whole context; layer after layer these averages build one direction shared by all tokens (the "rank
collapse" of random transformers), and the routers send every token to the same few experts. A gain of 4
makes attention sharp, keeping the residual stream token-specific, so uniform routing stays balanced."""

MASSIVE_DIM = 0
"""Residual dimension that carries a large constant ("massive activation") in skewed-routing models. The
router has no bias tensor, so a per-expert preference needs an input component of consistent sign."""

MASSIVE_RATIO = 3.0
"""The massive value is this many times the estimated RMS of the last layer's residual stream, so that the
noise the experts add to its dimension cannot flip its sign."""

ZIPF_EXPONENT = 1.0
"""Expert of popularity rank r (0-based) gets router logit bias -ZIPF_EXPONENT * ln(r + 1) against logit
noise of unit spread: with top-k selection that gives usage shares close to a Zipf law."""

MIN_VOCAB = 3 + 256 + 1
"""<unk> <s> </s>, the 256 byte tokens, and at least one word piece."""

_BLOCK_VALUES = 1 << 22
"""Values generated per float32 block: bounds the scratch memory of a tensor to 16 MiB plus its output."""

_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
_UNK_ID, _BOS_ID, _EOS_ID = 0, 1, 2
_SPACE = "\u2581"  # SentencePiece's word-boundary marker
_WORDS = (
    "the", "of", "and", "to", "a", "in", "is", "it", "you", "that", "he", "was", "for", "on", "are", "with", "as",
    "I", "his", "they", "be", "at", "one", "have", "this", "from", "or", "had", "by", "not", "word", "but", "what",
    "some", "we", "can", "out", "other", "were", "all", "there", "when", "up", "use", "your", "how", "said", "an",
    "each", "she", "which", "do", "their", "time", "if", "will", "way", "about", "many", "then", "them", "write",
    "would", "like", "so", "these", "her", "long", "make", "thing", "see", "him", "two", "has", "look", "more",
    "day", "could", "go", "come", "did", "number", "sound", "no", "most", "people", "my", "over", "know", "water",
    "than", "call", "first", "who", "may", "down", "side", "been", "now", "find", "hello", "world", "model",
    "expert", "weight",
)


@dataclass(frozen=True)
class SynthConfig:
    """Shape and content of a synthetic MoE model; the defaults are the "tiny" preset."""

    arch: Arch = "qwen3moe"
    n_layer: int = 2
    n_embd: int = 64
    n_ff_exp: int = 32
    n_expert: int = 8
    n_expert_used: int = 2
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 16
    n_vocab: int = 320
    n_ctx: int = 256
    seed: int = 0
    routing: Routing = "uniform"
    tied_output: bool = False  # no output.weight: llama.cpp then multiplies by token_embd for the logits
    expert_scales: bool = False  # ffn_*_exps.scale (F32, one per expert): llama.cpp scales each expert's output

    def __post_init__(self) -> None:
        problems = list(_config_problems(self))
        if problems:
            raise ValueError("invalid synthetic model config: " + "; ".join(problems))


@dataclass(frozen=True)
class SynthInfo:
    """What write_synthetic_moe wrote."""

    path: Path
    config: SynthConfig
    file_size: int
    expert_bytes: int
    """Bytes of all BF16 expert tensors (the part zipmoe compresses)."""
    n_tensors: int


def _config_problems(c: SynthConfig) -> Iterator[str]:
    """Yield what makes `c` unloadable by llama.cpp (or unrepresentable)."""
    if c.arch not in get_args(Arch):
        yield f"arch {c.arch!r} is not one of {get_args(Arch)}"
    if c.routing not in get_args(Routing):
        yield f"routing {c.routing!r} is not one of {get_args(Routing)}"
    sizes = ("n_layer", "n_embd", "n_ff_exp", "n_expert", "n_expert_used", "n_head", "n_head_kv",
             "head_dim", "n_ctx")
    for name in sizes:
        if getattr(c, name) < 1:
            yield f"{name} must be >= 1, got {getattr(c, name)}"
    if c.seed < 0:
        yield f"seed must be >= 0, got {c.seed}"
    if c.n_vocab < MIN_VOCAB:
        yield f"n_vocab must be >= {MIN_VOCAB} (3 special + 256 byte tokens + 1 piece), got {c.n_vocab}"
    if c.n_layer > 512:
        yield f"n_layer must be <= 512 (llama.cpp's LLAMA_MAX_LAYERS), got {c.n_layer}"
    if c.n_expert > 1024:
        yield f"n_expert must be <= 1024 (llama.cpp's LLAMA_MAX_EXPERTS), got {c.n_expert}"
    if c.n_expert_used > c.n_expert:
        yield f"n_expert_used ({c.n_expert_used}) must be <= n_expert ({c.n_expert})"
    if c.n_head % c.n_head_kv:
        yield f"n_head ({c.n_head}) must be a multiple of n_head_kv ({c.n_head_kv})"
    if c.arch == "olmoe" and (c.n_head * c.head_dim != c.n_embd or c.n_head_kv != c.n_head):
        yield ("olmoe needs n_head * head_dim == n_embd and n_head_kv == n_head "
               "(its q/k norms span n_embd); use for_arch(config, 'olmoe')")
    if c.routing == "skewed" and c.n_embd < 2:
        yield "skewed routing needs n_embd >= 2"


def for_arch(config: SynthConfig, arch: Arch) -> SynthConfig:
    """`config` for another architecture, adapting the attention geometry where the architecture needs it.

    olmoe has no grouped-query attention and normalises q/k over the whole n_embd, so it gets
    n_head_kv = n_head and head_dim = n_embd / n_head; expert shapes, which zipmoe cares about, are kept.
    """
    if arch != "olmoe":
        return replace(config, arch=arch)
    if config.n_embd % config.n_head:
        raise ValueError(f"olmoe needs n_embd ({config.n_embd}) divisible by n_head ({config.n_head})")
    return replace(config, arch=arch, n_head_kv=config.n_head, head_dim=config.n_embd // config.n_head)


PRESETS: dict[str, SynthConfig] = {
    # ~0.35 MB, 2048 values per expert: unit tests.
    "tiny": SynthConfig(),
    # ~64 MB: quick end-to-end runs.
    "small": SynthConfig(n_layer=4, n_embd=512, n_ff_exp=256, n_expert=16, n_expert_used=4,
                         n_head=8, n_head_kv=2, head_dim=64, n_vocab=4096, n_ctx=2048),
    # ~1.05 GiB: just over 1 GiB, for code paths that only large files take (offsets, I/O sizes, memory).
    "1g": SynthConfig(n_layer=10, n_embd=1024, n_ff_exp=512, n_expert=32, n_expert_used=4,
                      n_head=16, n_head_kv=4, head_dim=64, n_vocab=16000, n_ctx=4096),
    # ~2.78 GiB: the reference benchmark model, Qwen3-30B-A3B's layer geometry with 8 layers and 32 experts.
    "2.8g": SynthConfig(n_layer=8, n_embd=2048, n_ff_exp=768, n_expert=32, n_expert_used=4,
                        n_head=32, n_head_kv=4, head_dim=128, n_vocab=32000, n_ctx=4096),
}


# ----------------------------------------------------------------------------------------------- values


def f32_to_bf16_rne(x: np.ndarray) -> np.ndarray:
    """BF16 bit patterns (uint16) of float32 values, rounded to nearest, ties to even.

    This is what PyTorch's `.to(torch.bfloat16)` does, so the synthetic expert tensors have the bit
    statistics of real checkpoints (truncation would bias every mantissa down). NaNs stay NaN (quieted,
    sign kept) instead of rounding into infinity; finite values beyond the BF16 range round to +-inf.
    """
    f32 = np.ascontiguousarray(x, dtype=np.float32)
    bits = f32.view(np.uint32)
    lsb = (bits >> np.uint32(16)) & np.uint32(1)  # ties go to the even neighbour
    out = ((bits + (lsb + np.uint32(0x7FFF))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(f32)
    if nan.any():
        out[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return out


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """float32 values of BF16 bit patterns (exact: BF16 is the top half of float32)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def _tensor_rng(seed: int, name: str) -> np.random.Generator:
    """A generator that depends only on the seed and the tensor name, not on the order of generation."""
    return np.random.default_rng(np.random.SeedSequence([seed, zlib.crc32(name.encode())]))


def _gaussian_bf16(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    """BF16 Gaussian matrix (rows along the last axis) with a log-normal per-row scale.

    Generated in float32 blocks of about _BLOCK_VALUES values, so the scratch memory stays small even
    for the largest embedding or expert tensor.
    """
    out = np.empty(shape, dtype=np.uint16)
    rows = out.reshape(-1, shape[-1])
    rows_per_block = max(1, _BLOCK_VALUES // shape[-1])
    for start in range(0, rows.shape[0], rows_per_block):
        n = min(rows_per_block, rows.shape[0] - start)
        block = rng.standard_normal((n, shape[-1]), dtype=np.float32)
        block *= (std * np.exp(rng.normal(0.0, ROW_SCALE_SIGMA, (n, 1)))).astype(np.float32)
        rows[start:start + n] = f32_to_bf16_rne(block)
    return out


# Skewed routing. The bias that ranks the experts reaches the router through MASSIVE_DIM, whose value is
# constant in the residual stream: it comes from the embedding, attention neither reads it (attention
# norm weight 0) nor writes it (zero output row), and only the experts add a little noise to it. After each
# RMS norm its size depends on the RMS of the rest of the stream, which grows layer by layer;
# _router_inputs estimates both from the weight scales, and each router is scaled to match.


def _embedding(rng: np.random.Generator, c: SynthConfig) -> np.ndarray:
    """Token embeddings; with skewed routing every token carries the massive value in MASSIVE_DIM."""
    emb = _gaussian_bf16(rng, (c.n_vocab, c.n_embd), EMBED_STD)
    if c.routing == "skewed":
        emb[:, MASSIVE_DIM] = f32_to_bf16_rne(np.float32([_massive_value(c)]))[0]
    return emb


def _attn_norm(c: SynthConfig) -> np.ndarray:
    """Attention input norm weights: 1.0, but 0.0 on MASSIVE_DIM in skewed models.

    Attention that saw the massive value would give every token's q, k and v a shared component, turn a
    few keys into "attention sinks" and add a large random per-expert bias on top of the Zipf one.
    """
    g = np.ones(c.n_embd, dtype=np.float32)
    if c.routing == "skewed":
        g[MASSIVE_DIM] = 0.0
    return g


def _attn_output(rng: np.random.Generator, c: SynthConfig) -> np.ndarray:
    """Attention output projection; in skewed models its MASSIVE_DIM row is zero to keep that value constant."""
    w = _gaussian_bf16(rng, (c.n_embd, c.n_head * c.head_dim), WEIGHT_STD)
    if c.routing == "skewed":
        w[MASSIVE_DIM] = 0
    return w


def _router(rng: np.random.Generator, c: SynthConfig, layer: int) -> np.ndarray:
    """Router weights (n_expert, n_embd), F32, giving logits of about unit spread.

    For skewed routing, each layer ranks its experts in a random order (popular experts differ between
    layers, as in trained MoEs) and the expert of rank r gets a logit bias of -ZIPF_EXPONENT * ln(r + 1)
    through the MASSIVE_DIM column. The estimate behind it is rough, so the profile is a little steeper in
    some layers than in others.
    """
    w = rng.standard_normal((c.n_expert, c.n_embd), dtype=np.float32) / np.float32(math.sqrt(c.n_embd))
    if c.routing == "skewed":
        massive_in, rest_rms = _router_inputs(c)[layer]
        w /= np.float32(rest_rms)
        bias = -ZIPF_EXPONENT * np.log1p(rng.permutation(c.n_expert))
        w[:, MASSIVE_DIM] = (bias - bias.mean()) / massive_in
    return w


def _attn_gain(c: SynthConfig) -> float:
    """Rough RMS of one attention output for an input of unit RMS (v and output projections in series)."""
    return WEIGHT_STD**2 * math.sqrt(c.n_embd * c.n_head * c.head_dim)


def _massive_value(c: SynthConfig) -> float:
    return MASSIVE_RATIO * math.sqrt(EMBED_STD**2 + c.n_layer * _attn_gain(c) ** 2)


def _router_inputs(c: SynthConfig) -> list[tuple[float, float]]:
    """Estimated router input per layer of a skewed model: (value in MASSIVE_DIM, RMS of the other dims).

    The residual outside MASSIVE_DIM starts as the embedding and gains one attention output per layer
    (expert outputs are an order of magnitude smaller); attention's input is normalised over all dims, so
    the massive value shrinks what it sees of the rest, strongly so in layer 0.
    """
    m2 = _massive_value(c) ** 2 / c.n_embd  # contribution of MASSIVE_DIM to the mean square
    rest2 = EMBED_STD**2
    inputs = []
    for _ in range(c.n_layer):
        rest2 += _attn_gain(c) ** 2 * rest2 / (rest2 + m2)
        norm = math.sqrt(rest2 + m2)
        inputs.append((_massive_value(c) / norm, math.sqrt(rest2) / norm))
    return inputs


# ------------------------------------------------------------------------------------------ tensor plan


@dataclass(frozen=True)
class _TensorSpec:
    """One tensor: name, numpy shape (ggml shape reversed), and how to generate its data from an RNG."""

    name: str
    shape: tuple[int, ...]
    make: Callable[[np.random.Generator], np.ndarray] = field(repr=False)
    bf16: bool

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * (2 if self.bf16 else 4)

    @property
    def padded_nbytes(self) -> int:
        """Bytes it takes in the file's data section."""
        return GGUFWriter.ggml_pad(self.nbytes, GGUF_DEFAULT_ALIGNMENT)

    @property
    def is_expert(self) -> bool:
        return self.name.endswith("_exps.weight")


def _bf16(name: str, shape: tuple[int, ...], std: float = WEIGHT_STD) -> _TensorSpec:
    return _TensorSpec(name, shape, lambda rng: _gaussian_bf16(rng, shape, std), bf16=True)


def _norm(name: str, n: int, value: float = 1.0) -> _TensorSpec:
    """An RMS-norm weight vector: F32 as every converter writes them, constant."""
    return _TensorSpec(name, (n,), lambda rng: np.full(n, value, dtype=np.float32), bf16=False)


def _expert_scale(name: str, n_expert: int) -> _TensorSpec:
    """Per-expert output scales, each different (0.5 to 1.5): a graph that scaled by the wrong expert shows."""
    return _TensorSpec(name, (n_expert,), lambda rng: rng.uniform(0.5, 1.5, n_expert).astype(np.float32), bf16=False)


def _tensor_plan(c: SynthConfig) -> list[_TensorSpec]:
    """Every tensor of the model, in file order, with the shapes llama.cpp's loader checks."""
    q_dim, kv_dim = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
    qk_norm = (c.head_dim, c.head_dim) if c.arch == "qwen3moe" else (q_dim, kv_dim)
    embd_shape = (c.n_vocab, c.n_embd)
    plan = [_TensorSpec("token_embd.weight", embd_shape, lambda rng: _embedding(rng, c), bf16=True)]
    for i in range(c.n_layer):
        p = f"blk.{i}."
        plan += [
            _TensorSpec(p + "attn_norm.weight", (c.n_embd,), lambda rng: _attn_norm(c), bf16=False),
            _bf16(p + "attn_q.weight", (q_dim, c.n_embd)),
            _bf16(p + "attn_k.weight", (kv_dim, c.n_embd)),
            _bf16(p + "attn_v.weight", (kv_dim, c.n_embd)),
            _TensorSpec(p + "attn_output.weight", (c.n_embd, q_dim), lambda rng: _attn_output(rng, c), bf16=True),
            _norm(p + "attn_q_norm.weight", qk_norm[0], QK_NORM_WEIGHT),
            _norm(p + "attn_k_norm.weight", qk_norm[1], QK_NORM_WEIGHT),
            _norm(p + "ffn_norm.weight", c.n_embd),
            _TensorSpec(p + "ffn_gate_inp.weight", (c.n_expert, c.n_embd),
                        lambda rng, i=i: _router(rng, c, i), bf16=False),
            _bf16(p + "ffn_gate_exps.weight", (c.n_expert, c.n_ff_exp, c.n_embd)),
            _bf16(p + "ffn_up_exps.weight", (c.n_expert, c.n_ff_exp, c.n_embd)),
            _bf16(p + "ffn_down_exps.weight", (c.n_expert, c.n_embd, c.n_ff_exp)),
        ]
        if c.expert_scales:
            plan += [_expert_scale(p + f"ffn_{kind}_exps.scale", c.n_expert) for kind in ("gate", "up", "down")]
    plan.append(_norm("output_norm.weight", c.n_embd))
    if not c.tied_output:
        plan.append(_bf16("output.weight", embd_shape))
    return plan


def tensor_data_bytes(config: SynthConfig) -> int:
    """Bytes of tensor data in the file (the file is this plus a header of a few to a few hundred KB)."""
    return sum(t.padded_nbytes for t in _tensor_plan(config))


def size_preset_for_bytes(min_bytes: int) -> str:
    """Name of the smallest preset whose tensor data alone is at least `min_bytes`."""
    fitting = [(tensor_data_bytes(c), name) for name, c in PRESETS.items() if tensor_data_bytes(c) >= min_bytes]
    if not fitting:
        raise ValueError(f"no preset has {min_bytes} bytes; the largest is "
                         f"{max(tensor_data_bytes(c) for c in PRESETS.values())} bytes")
    return min(fitting)[1]


# ---------------------------------------------------------------------------------------------- metadata


def _word_pieces() -> Iterator[str]:
    """SentencePiece-style pieces, most useful first: letters, common words, then ever longer n-grams."""
    yield _SPACE
    yield from string.ascii_lowercase + string.ascii_uppercase + string.digits + string.punctuation
    yield from (_SPACE + w for w in _WORDS)
    for n in itertools.count(1):
        for letters in itertools.product(string.ascii_lowercase, repeat=n):
            yield _SPACE + "".join(letters)
            yield "".join(letters)


def build_vocab(n_vocab: int) -> tuple[list[str], list[float], list[int]]:
    """A llama (SentencePiece) vocabulary of exactly n_vocab tokens: (tokens, scores, token types).

    Ids 0-2 are <unk> <s> </s>, 3-258 the byte tokens <0x00>..<0xFF> (llama.cpp needs <0x0A> as its
    newline token and falls back to bytes for anything else), then word pieces scored by rank.
    """
    tokens = list(_SPECIAL_TOKENS) + [f"<0x{b:02X}>" for b in range(256)]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    scores = [0.0] * len(tokens)
    seen = set(tokens)
    for piece in _word_pieces():
        if len(tokens) == n_vocab:
            break
        if piece in seen:
            continue
        seen.add(piece)
        scores.append(-float(len(tokens) - len(_SPECIAL_TOKENS) - 256))
        tokens.append(piece)
        types.append(TokenType.NORMAL)
    return tokens, scores, [int(t) for t in types]


def _add_metadata(w: GGUFWriter, c: SynthConfig) -> None:
    """Key/value pairs in the form convert_hf_to_gguf.py writes them for the architecture."""
    w.add_name(f"zipmoe synthetic {c.arch} (random weights)")
    w.add_description(f"Random Gaussian weights generated by pyzipmoe.synth (seed {c.seed}, {c.routing} "
                      "routing); not a trained model, its output is gibberish.")
    w.add_file_type(LlamaFileType.MOSTLY_BF16)
    w.add_context_length(c.n_ctx)
    w.add_embedding_length(c.n_embd)
    w.add_block_count(c.n_layer)
    if c.arch == "qwen3moe":
        w.add_feed_forward_length(c.n_ff_exp * c.n_expert_used)
        w.add_expert_feed_forward_length(c.n_ff_exp)
        w.add_rope_freq_base(1_000_000.0)
    else:
        w.add_feed_forward_length(c.n_ff_exp)  # olmoe's expert width
        w.add_rope_freq_base(10_000.0)
    w.add_head_count(c.n_head)
    w.add_head_count_kv(c.n_head_kv)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(c.n_expert)
    w.add_expert_used_count(c.n_expert_used)
    add_vocab(w, c.n_vocab)


def add_vocab(w: GGUFWriter, n_vocab: int) -> None:
    """The tokenizer keys of every synthetic model: build_vocab's tokens as a llama (SentencePiece) vocabulary."""
    tokens, scores, types = build_vocab(n_vocab)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(_UNK_ID)
    w.add_bos_token_id(_BOS_ID)
    w.add_eos_token_id(_EOS_ID)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)


# ------------------------------------------------------------------------------------------------ writing


def write_config(path: str | os.PathLike[str], config: SynthConfig, *,
                 progress: ProgressFn | None = None) -> SynthInfo:
    """Write the model described by `config` to `path`, streaming one tensor at a time.

    The file appears under its name only when complete (it is written to `<path>.part` and renamed; the
    part is removed on failure), so an interrupted run never leaves a truncated GGUF that looks like a model.
    """
    path = Path(path)
    part = path.with_name(path.name + ".part")
    plan = _tensor_plan(config)
    writer = GGUFWriter(part, config.arch)
    try:
        _add_metadata(writer, config)
        for t in plan:
            if t.bf16:
                writer.add_tensor_info(t.name, t.shape, np.dtype(np.uint16), t.nbytes,
                                       raw_dtype=GGMLQuantizationType.BF16)
            else:
                writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        total, done = sum(t.padded_nbytes for t in plan), 0
        for t in plan:
            writer.write_tensor_data(t.make(_tensor_rng(config.seed, t.name)))
            done += t.padded_nbytes
            if progress is not None:
                progress(done, total, t.name)
        writer.close()
    except BaseException:
        writer.close()
        part.unlink(missing_ok=True)
        raise
    os.replace(part, path)
    return SynthInfo(path=path, config=config, file_size=path.stat().st_size,
                     expert_bytes=sum(t.nbytes for t in plan if t.is_expert), n_tensors=len(plan))


def write_synthetic_moe(
    path: str | os.PathLike[str], *,
    arch: Arch = "qwen3moe",
    n_layer: int = 2,
    n_embd: int = 64,
    n_ff_exp: int = 32,
    n_expert: int = 8,
    n_expert_used: int = 2,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int = 16,
    n_vocab: int = 320,
    n_ctx: int = 256,
    seed: int = 0,
    routing: Routing = "uniform",
    progress: ProgressFn | None = None,
) -> SynthInfo:
    """Write a synthetic BF16 MoE GGUF (defaults: the "tiny" preset); see SynthConfig and write_config.

    For a preset: `write_config(path, PRESETS["small"])`, or with changes,
    `write_config(path, dataclasses.replace(PRESETS["small"], seed=1, routing="skewed"))`.
    """
    config = SynthConfig(arch=arch, n_layer=n_layer, n_embd=n_embd, n_ff_exp=n_ff_exp, n_expert=n_expert,
                         n_expert_used=n_expert_used, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim,
                         n_vocab=n_vocab, n_ctx=n_ctx, seed=seed, routing=routing)
    return write_config(path, config, progress=progress)


# ------------------------------------------------------------------------------------------ quantized copies

# The types tests and benchmarks derive from a synthetic BF16 model with llama.cpp's llama-quantize, as people get
# the GGUFs they run: F16 and the common quantizations (Q4_K_M mixes types: some ffn_down_exps become Q6_K).
# k-quants need rows of a multiple of 256 values; narrower rows make llama-quantize fall back to other types.
QUANT_TYPES = ("F16", "Q8_0", "Q6_K", "Q4_K_M", "IQ4_XS")


def quantize(src: str | os.PathLike[str], dst: str | os.PathLike[str], qtype: str, *,
             program: str | os.PathLike[str] | None = None, threads: int = 2) -> Path:
    """`dst`: the GGUF `src` quantized to `qtype` (a llama-quantize type name: F16, Q8_0, Q4_K_M, ...) by
    llama-quantize (default: zipmoe's build, build/bin), written whole or not at all. RuntimeError with
    llama-quantize's last words if it fails; FileNotFoundError if it is not built."""
    import subprocess

    from .paths import bin_dir

    prog = Path(program) if program is not None else bin_dir() / "llama-quantize"
    if not prog.is_file():
        raise FileNotFoundError(f"{prog} is not built (cmake --build build --target llama-quantize)")
    dst = Path(dst)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    try:
        done = subprocess.run([str(prog), os.fspath(src), str(tmp), qtype, str(threads)], capture_output=True,
                              text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"llama-quantize {qtype} failed (exit status {done.returncode}): "
                               f"{(done.stderr or done.stdout)[-1500:]}")
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
    return dst
