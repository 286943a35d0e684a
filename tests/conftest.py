"""Shared fixtures: tiny synthetic MoE GGUFs of two architectures, and GGUFs zipmoe must refuse.

Models are session-scoped and read-only; a test that damages a file copies it first (`copy_of`).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter

import helpers
from pyzipmoe import synth

ARCHS = ("qwen3moe", "olmoe")
CODECS = ("huff", "zstd", "esc")
SMALL_CHUNK = 300  # several chunks per tiny expert (2048 values), the last one shorter


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_models(models_dir: Path) -> dict[str, Path]:
    """The tiny preset in both architectures."""
    paths = {}
    for arch in ARCHS:
        paths[arch] = models_dir / f"tiny-{arch}.gguf"
        synth.write_config(paths[arch], synth.for_arch(synth.PRESETS["tiny"], arch))
    return paths


@pytest.fixture(scope="session")
def tiny_model(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["qwen3moe"]


@pytest.fixture(scope="session")
def zipmoe_models(tiny_models: dict[str, Path], models_dir: Path) -> dict[tuple[str, str], Path]:
    """Every tiny model converted with every codec, in several chunks per expert."""
    from pyzipmoe.file import convert

    out = {}
    for arch, src in tiny_models.items():
        for name in CODECS:
            out[arch, name] = models_dir / f"tiny-{arch}.{name}.zipmoe.gguf"
            convert.convert(src, out[arch, name], codec=name, chunk_n=SMALL_CHUNK, threads=2)
    return out


@pytest.fixture(scope="session")
def zipmoe_model(zipmoe_models: dict[tuple[str, str], Path]) -> Path:
    return zipmoe_models["qwen3moe", "huff"]


@pytest.fixture(scope="session")
def small_models(models_dir: Path) -> tuple[Path, Path]:
    """The small preset (BF16, 61 MiB: 48 MiB of experts, 16 per layer) and its zipmoe GGUF, for runs in memory
    limits; read-only."""
    from pyzipmoe.file import convert

    bf16, packed = models_dir / "small.gguf", models_dir / "small.zipmoe.gguf"
    synth.write_config(bf16, synth.PRESETS["small"])
    convert.convert(bf16, packed, threads=2)
    return bf16, packed


# Rows of 256 values: what llama-quantize's k-quants take whole (narrower rows fall back to other types).
QUANT_CONFIG = synth.SynthConfig(n_embd=256, n_ff_exp=256, n_head=4, n_head_kv=2, head_dim=64)


@pytest.fixture(scope="session")
def typed_models(models_dir: Path) -> dict[str, Path]:
    """One synthetic MoE (SYNTHETIC weights) as BF16 and as llama-quantize derives it (synth.QUANT_TYPES: F16,
    Q8_0, Q6_K, Q4_K_M with some ffn_down_exps in Q6_K, IQ4_XS): plain GGUFs of every kind people run."""
    helpers.llama_bin_dir()  # (skips, or fails under CI, without zipmoe's build)
    quantize = helpers.llama_bin_dir() / "llama-quantize"
    if not quantize.is_file():
        helpers.unavailable(f"{quantize} was not built")
    paths = {"BF16": models_dir / "typed-BF16.gguf"}
    synth.write_config(paths["BF16"], QUANT_CONFIG)
    for qtype in synth.QUANT_TYPES:
        paths[qtype] = synth.quantize(paths["BF16"], models_dir / f"typed-{qtype}.gguf", qtype, program=quantize)
    return paths


def _write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType | None]]) -> Path:
    """A small GGUF; arrays are in numpy order (the reverse of ggml's)."""
    w = GGUFWriter(path, "qwen3moe")
    w.add_block_count(1)
    for name, (data, raw_type) in tensors.items():
        w.add_tensor(name, data, raw_dtype=raw_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="session")
def non_moe_gguf(models_dir: Path) -> Path:
    """A dense model: no expert tensors."""
    rng = np.random.default_rng(1)
    return _write_gguf(models_dir / "dense.gguf", {
        "token_embd.weight": (rng.standard_normal((16, 8)).astype(np.float32), None),
        "blk.0.ffn_up.weight": (rng.integers(0, 1 << 16, (8, 8), dtype=np.uint16), GGMLQuantizationType.BF16),
    })


@pytest.fixture(scope="session")
def f16_moe_gguf(models_dir: Path) -> Path:
    """A MoE whose expert tensors are F16."""
    rng = np.random.default_rng(2)
    experts = rng.standard_normal((4, 8, 16)).astype(np.float16)
    return _write_gguf(models_dir / "moe-f16.gguf", {
        "token_embd.weight": (rng.standard_normal((16, 16)).astype(np.float32), None),
        "blk.0.ffn_up_exps.weight": (experts, None),
        "blk.0.ffn_down_exps.weight": (experts.copy(), None),
    })


@pytest.fixture(scope="session")
def not_gguf(models_dir: Path) -> Path:
    path = models_dir / "notes.gguf"
    path.write_text("these are not the weights you are looking for\n")
    return path


@pytest.fixture(scope="session")
def truncated_gguf(models_dir: Path, tiny_model: Path) -> Path:
    """The tiny model cut in the middle of its tensor data."""
    path = models_dir / "truncated.gguf"
    data = tiny_model.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])
    return path


@pytest.fixture
def copy_of(tmp_path: Path) -> Callable[[Path], Path]:
    """A writable copy of a session model in this test's own directory."""

    def copy(src: Path) -> Path:
        dst = tmp_path / src.name
        shutil.copyfile(src, dst)
        return dst

    return copy


@pytest.fixture
def flip_bit() -> Callable[[Path, int], None]:
    """Flips one bit of a file in place, as a failing disk or a bad download would."""

    def flip(path: Path, offset: int, bit: int = 0) -> None:
        with open(path, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)[0]
            f.seek(offset)
            f.write(bytes([byte ^ (1 << bit)]))

    return flip


@pytest.fixture(scope="session")
def llama_lib_dir() -> Path:
    """build/bin with zipmoe's libllama and llama-cpp-python's Python part: skip without them, except under CI,
    where a test that needs them must run."""
    return helpers.llama_bin_dir()


@pytest.fixture(scope="session")
def cgroup_parent() -> Path:
    """Where a test may make a memory cgroup (v1) and change its limit: skip when not root or without the
    memory controller."""
    return helpers.memory_cgroup_parent()
