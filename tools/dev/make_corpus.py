"""Seed corpora for the fuzz targets, generated from the test models (nothing binary is kept in the repository).

    python tools/dev/make_corpus.py OUT_DIR

writes OUT_DIR/chunk/* (inputs of fuzz_chunk.c: real huff and zstd chunks with their code lengths and sm bytes)
and OUT_DIR/index/* (inputs of fuzz_index.c: real index + data companion pairs of small tensors), made from tiny
synthetic MoEs (pyzipmoe.synth) converted with both codecs and small chunks, and from small MoEs of other expert
types (F16 split like BF16; Q8_0 and Q4_K stored raw) for the index target.
"""

from __future__ import annotations

import struct
import sys
import tempfile
from pathlib import Path

import numpy as np

from pyzipmoe.file import convert
from pyzipmoe import synth
from pyzipmoe.file.metadata import INDEX_HEADER
from pyzipmoe.file.reader import open_zipmoe

CHUNKS_PER_TENSOR = 6


def chunk_seeds(zf, raw: bytes, codec_bit: int) -> list[bytes]:
    seeds = []
    for c in zf.compressed[:2]:
        info = c.expert.info
        idx = np.frombuffer(raw[c.index.file_offset:][:c.index.nbytes], "<u8")
        lengths = idx[16:48].tobytes() if info.codec == "huff" else bytes(256)
        for e in range(min(info.n_expert, 2)):
            span = c.expert.span(e)
            region = raw[c.data.file_offset + span.offset:][:span.size]
            ends = idx[INDEX_HEADER + 2 * info.n_expert:-1].reshape(info.n_expert, info.n_chunks, 2)[e, :, 0]
            begin = 0
            for k in range(min(info.n_chunks, CHUNKS_PER_TENSOR // 2)):
                end = int(ends[k])
                first = k * info.chunk_n
                n = min(info.chunk_n, info.n_per_expert - first)
                sm = region[first:first + n]
                code = region[span.exp_offset + begin:span.exp_offset + end]
                for check in (0, 2):
                    seeds.append(bytes([codec_bit | check]) + struct.pack("<I", n)[:3] + lengths + sm + code)
                begin = end
    return seeds


def index_seeds(zf, raw: bytes) -> list[bytes]:
    seeds = []
    for c in zf.compressed[:3]:
        index = raw[c.index.file_offset:][:c.index.nbytes]
        data = raw[c.data.file_offset:][:c.data.nbytes]
        for mode in (0, 1, 3):
            seeds.append(bytes([mode]) + struct.pack("<I", len(index)) + index + data)
    return seeds


def typed_moe(path: Path, types: dict[str, str]) -> Path:
    """A one-layer MoE (4 experts of 256 x 4) whose up/gate/down expert tensors have the given types."""
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFWriter
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import quantize

    rng = np.random.default_rng(5)
    w = GGUFWriter(path, "qwen3moe")
    w.add_tensor("token_embd.weight", rng.standard_normal((8, 256)).astype(np.float32))
    for role, type_name in types.items():
        weights = rng.normal(0, 0.02, (4, 4, 256)).astype(np.float32)
        if type_name == "F16":
            w.add_tensor(f"blk.0.ffn_{role}_exps.weight", weights.astype(np.float16))
        elif type_name == "Q8_0":
            w.add_tensor(f"blk.0.ffn_{role}_exps.weight", quantize(weights, Q.Q8_0), raw_dtype=Q.Q8_0)
        else:  # raw storage does not look into the blocks
            blck, size = GGML_QUANT_SIZES[Q[type_name]]
            blocks = rng.integers(0, 256, (4, 4, 256 // blck * size), dtype=np.uint8)
            w.add_tensor(f"blk.0.ffn_{role}_exps.weight", blocks, raw_dtype=Q[type_name])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def main(out: Path) -> None:
    (out / "chunk").mkdir(parents=True, exist_ok=True)
    (out / "index").mkdir(parents=True, exist_ok=True)
    n = 0
    with tempfile.TemporaryDirectory() as tmp:
        cfg = synth.PRESETS["tiny"]
        for arch in ("qwen3moe", "olmoe"):
            src = Path(tmp) / f"{arch}.gguf"
            synth.write_config(src, synth.for_arch(cfg, arch))
            for codec, bit, chunk_n in (("huff", 0, 300), ("zstd", 1, 300), ("huff", 0, 2048)):
                dst = Path(tmp) / f"{arch}-{codec}-{chunk_n}.zipmoe.gguf"
                convert.convert(src, dst, codec=codec, chunk_n=chunk_n, threads=1)
                zf, raw = open_zipmoe(dst), dst.read_bytes()
                for kind, seeds in (("chunk", chunk_seeds(zf, raw, bit)), ("index", index_seeds(zf, raw))):
                    for i, seed in enumerate(seeds):
                        (out / kind / f"{arch}-{codec}-{chunk_n}-{i:03d}").write_bytes(seed)
                        n += 1
        for name, types in (("f16", {"up": "F16", "gate": "F16", "down": "F16"}),
                            ("quant", {"up": "Q8_0", "gate": "Q4_K", "down": "Q8_0"})):
            src = typed_moe(Path(tmp) / f"{name}.gguf", types)
            dst = Path(tmp) / f"{name}.zipmoe.gguf"
            convert.convert(src, dst, chunk_n=300, threads=1)
            for i, seed in enumerate(index_seeds(open_zipmoe(dst), dst.read_bytes())):
                (out / "index" / f"{name}-{i:03d}").write_bytes(seed)
                n += 1
    print(f"{n} seeds in {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
