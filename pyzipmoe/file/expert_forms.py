"""Which tensors of a GGUF zipmoe stores, and in what form: the expert tensors (refusing a form it was never checked
on), the file's format version and the codec "auto" means for them.
"""

from __future__ import annotations

import re

from . import codec as zcodec
from ..errors import UnsupportedError
from .gguf import GGML_TYPE_BF16, GGML_TYPE_F16, GGUFFile, Tensor, type_name
from .metadata import FORMAT_VERSION, TYPED_FORMAT_VERSION, expert_layout, is_expert_tensor


EXPERT_SIDE_NAME = re.compile(
    r"blk\.\d+\.(?:ffn_(?:up|gate|down|gate_up)_exps\.(?:bias|scale|input_scale)|ffn_norm_exps\.weight)")
"""Per-expert tensors that are not matrices: biases (gpt-oss), output and input scales, arctic's expert norm.
llama.cpp reads them beside the expert matrices (ggml_add_id, ggml_mul), not through ggml_mul_mat_id, so they stay
plain tensors."""


def unknown_expert_tensors(g: GGUFFile) -> list[Tensor]:
    """Tensors named like expert tensors (`_exps`) in a form zipmoe knows neither to compress nor to keep: compressing
    or keeping a form it was never checked on would be a guess about how llama.cpp reads it."""
    return [t for t in g.tensors if "_exps" in t.name and not is_expert_tensor(t) and not
            (EXPERT_SIDE_NAME.fullmatch(t.name) and len(t.dims) <= 2)]


def _form(t: Tensor) -> str:
    return f"{t.name} ({len(t.dims)}-D {'x'.join(map(str, t.dims))}, {type_name(t.ggml_type)})"


def expert_tensors(g: GGUFFile) -> list[Tensor]:
    """The tensors zipmoe stores; refuses a file that has none, an expert tensor of a type it cannot store, or an
    `_exps` tensor of a form it does not know (unknown_expert_tensors)."""
    unknown = unknown_expert_tensors(g)
    if unknown:
        raise UnsupportedError(f"{g.label}: {_form(unknown[0])} is an expert tensor of a form zipmoe does not know "
                               "(it compresses blk.N.ffn_{up,gate,down,gate_up}_exps.weight, 3-D, and keeps their "
                               ".bias/.scale/.input_scale); it does not convert the file rather than guess")
    experts = [t for t in g.tensors if is_expert_tensor(t)]
    if not experts:
        raise UnsupportedError(f"{g.label}: not a MoE model: no tensor is named "
                               "blk.N.ffn_{up,gate,down,gate_up}_exps.weight, so there is nothing to compress")
    other = [t for t in experts if expert_layout(t) is None]
    if other:
        types = sorted({type_name(t.ggml_type) for t in other})
        raise UnsupportedError(f"{g.label}: expert tensors are {'/'.join(types)} (e.g. {other[0].name}); zipmoe "
                               "stores BF16, F16, F32 and block-quantized experts, not these")
    return experts


def format_version(experts: list[Tensor]) -> int:
    """1 for all-BF16 experts (what every zipmoe reader reads), else 2: a reader that knows only BF16 experts
    refuses the file by its version instead of taking other bits for BF16."""
    return FORMAT_VERSION if all(t.ggml_type == GGML_TYPE_BF16 for t in experts) else TYPED_FORMAT_VERSION


def auto_codec(experts: list[Tensor]) -> str:
    """The codec "auto" means for these experts: huff, unless every split expert is F16, whose code bytes zstd-1
    codes as small and decodes faster (zcodec.DEFAULT_F16_CODEC)."""
    split = [t for t in experts if (layout := expert_layout(t)) is not None and layout.split]
    if split and all(t.ggml_type == GGML_TYPE_F16 for t in split):
        return zcodec.DEFAULT_F16_CODEC
    return zcodec.DEFAULT_CODEC


def check_codec_fits(g: GGUFFile, experts: list[Tensor], codec_name: str) -> None:
    """esc gives short codes to 10 code bytes; F16's code bytes (exponent and 3 mantissa bits) spread over ~8 times
    as many, so esc made F16 experts larger than they are (+9% on all-MiniLM-L6-v2: bench_codec.py)."""
    f16 = [t for t in experts if t.ggml_type == GGML_TYPE_F16]
    if codec_name == "esc" and f16:
        raise UnsupportedError(f"{g.label}: the esc codec does not fit F16 experts (e.g. {f16[0].name}): it would "
                               "store them larger than they are; use huff (the default) or zstd")
