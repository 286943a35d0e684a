"""Tiny SYNTHETIC GGUFs of every Mixture-of-Experts architecture that the vendored llama.cpp runs.

pyzipmoe.synth writes realistic models of two architectures; this module writes a minimal model of any
architecture from a spec: its metadata keys and its tensors (names and shapes), as llama.cpp's loader reads them.
The specs (pyzipmoe/synth_arch_specs.json) are derived by tools/dev/probe_archs.py: it gives every model the keys of
llama.cpp's own test fixture, starts from the tensor names gguf-py lists for the architecture, asks llama.cpp's
loader which shape each tensor must have, and keeps the tensors the loader takes (docs/architectures.md). The values are random (seeded by the tensor's name), the vocabulary
is pyzipmoe.synth's SentencePiece one; the files say SYNTHETIC in their name and description.

Expert tensors (`blk.N.ffn_{gate,up,down,gate_up}_exps.weight`) are BF16 with synth's statistics, so zipmoe
compresses them as it does trained weights; everything else is F32 (norm weights 1, per-expert scales 0.5-1.5).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter, LlamaFileType

from .synth import (
    WEIGHT_STD,
    _gaussian_bf16,
    _tensor_rng,
    add_vocab,
)

SPECS_PATH = Path(__file__).with_name("synth_arch_specs.json")
N_VOCAB = 320
"""Tokens of every generated model: synth.build_vocab's 3 special and 256 byte tokens, and 61 word pieces."""

EXPERT_WEIGHT = re.compile(r"blk\.\d+\.ffn_(?:gate|up|down|gate_up)_exps\.weight")

_VALUE_TYPES = {"u32": GGUFValueType.UINT32, "i32": GGUFValueType.INT32, "f32": GGUFValueType.FLOAT32,
                "bool": GGUFValueType.BOOL, "str": GGUFValueType.STRING, "u64": GGUFValueType.UINT64}


@dataclass(frozen=True)
class ArchKey:
    """A metadata key without its `<arch>.` prefix, its GGUF type (u32, i32, f32, bool, str) and value; a list
    value is written as an array of that type."""

    key: str
    type: str
    value: Any


@dataclass(frozen=True)
class ArchTensor:
    """A tensor: name and shape in ggml order (ne0 first), as llama.cpp's loader checks it."""

    name: str
    dims: tuple[int, ...]

    @property
    def is_expert(self) -> bool:
        return EXPERT_WEIGHT.fullmatch(self.name) is not None and len(self.dims) == 3


@dataclass(frozen=True)
class ArchSpec:
    """A generated model of `arch`: its keys and tensors, in file order."""

    arch: str
    keys: tuple[ArchKey, ...]
    tensors: tuple[ArchTensor, ...]

    def to_json(self) -> dict[str, Any]:
        return {"keys": [[k.key, k.type, k.value] for k in self.keys],
                "tensors": [[t.name, list(t.dims)] for t in self.tensors]}

    @classmethod
    def from_json(cls, arch: str, d: dict[str, Any]) -> ArchSpec:
        return cls(arch, tuple(ArchKey(k, t, v) for k, t, v in d["keys"]),
                   tuple(ArchTensor(n, tuple(dims)) for n, dims in d["tensors"]))


def load_specs(path: str | os.PathLike[str] = SPECS_PATH) -> dict[str, ArchSpec]:
    """The architectures with a spec (those stock llama.cpp loads and evaluates from a generated file)."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return {arch: ArchSpec.from_json(arch, d) for arch, d in data["specs"].items()}


def load_exclusions(path: str | os.PathLike[str] = SPECS_PATH) -> dict[str, str]:
    """Architectures with expert tensors that have no spec, and why (what stock llama.cpp said)."""
    with open(path, encoding="utf-8") as f:
        return dict(json.load(f)["excluded"])


# --------------------------------------------------------------------------------------------- values


def _values(name: str, dims: tuple[int, ...], seed: int) -> np.ndarray:
    """float32 values of a non-expert tensor, numpy shape (dims reversed)."""
    shape = tuple(reversed(dims))
    n = math.prod(dims)
    rng = _tensor_rng(seed, name)
    base = name.rsplit(".", 1)[0]
    if name.endswith("norm.weight") or "_norm" in base or base.endswith("norm") or base.endswith("ssm_d"):
        return np.ones(shape, np.float32)
    if name.endswith(".scale") or base.endswith("_scale") or "exps.scale" in name:
        return rng.uniform(0.5, 1.5, n).astype(np.float32).reshape(shape)
    if base.endswith("ssm_a"):
        return -rng.uniform(0.5, 1.5, n).astype(np.float32).reshape(shape)
    std = WEIGHT_STD if len(dims) > 1 and dims[0] > 1 else 0.1
    return (rng.standard_normal(n, dtype=np.float32) * np.float32(std)).reshape(shape)


def _add_key(w: GGUFWriter, arch: str, k: ArchKey) -> None:
    key = k.key if k.key.startswith(("general.", "tokenizer.")) else f"{arch}.{k.key}"
    vtype = _VALUE_TYPES[k.type]
    if isinstance(k.value, list):
        w.add_key_value(key, k.value, GGUFValueType.ARRAY, sub_type=vtype)
    else:
        w.add_key_value(key, k.value, vtype)


def write_arch_model(path: str | os.PathLike[str], spec: ArchSpec, *, seed: int = 0,
                     placeholders: Iterable[str] = ()) -> Path:
    """Writes the SYNTHETIC model `spec` describes to `path` (whole or not at all). `placeholders`: names of
    tensors written as a single F32 value whatever their spec says (tools/dev/probe_archs.py asks the loader
    for their shape that way)."""
    path = Path(path)
    part = path.with_name(path.name + ".part")
    dummy = set(placeholders)
    w = GGUFWriter(part, spec.arch)
    try:
        w.add_name(f"zipmoe SYNTHETIC {spec.arch} (random weights)")
        w.add_description(f"SYNTHETIC: random weights generated by pyzipmoe.synth_arch (seed {seed}) in the shape "
                          f"of a {spec.arch} model; not a trained model, its output is gibberish.")
        w.add_file_type(LlamaFileType.MOSTLY_BF16)
        for k in spec.keys:
            _add_key(w, spec.arch, k)
        add_vocab(w, N_VOCAB)
        data = []
        for t in spec.tensors:
            if t.name in dummy:
                arr = np.zeros(1, np.float32)
                w.add_tensor_info(t.name, arr.shape, arr.dtype, arr.nbytes)
            elif t.is_expert:
                shape = tuple(reversed(t.dims))
                arr = _gaussian_bf16(_tensor_rng(seed, t.name), shape, WEIGHT_STD)
                w.add_tensor_info(t.name, shape, np.dtype(np.uint16), arr.nbytes, raw_dtype=GGMLQuantizationType.BF16)
            else:
                arr = _values(t.name, t.dims, seed)
                w.add_tensor_info(t.name, arr.shape, arr.dtype, arr.nbytes)
            data.append(arr)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for arr in data:
            w.write_tensor_data(arr)
        w.close()
    except BaseException:
        w.close()
        part.unlink(missing_ok=True)
        raise
    os.replace(part, path)
    return path
