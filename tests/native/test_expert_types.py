"""Experts of every type zipmoe stores: F16 split like BF16, F32 and quantized blocks raw. Round trips byte for byte
(codec, index, whole files through convert / verify / unpack / inspect), and damage refused as for BF16."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import quantize

from pyzipmoe.errors import ChecksumError, FormatError, UnsupportedError
from pyzipmoe.file import codec, convert, metadata, reader, verify
from pyzipmoe.file import gguf as format

from helpers import llama_bin_dir, unavailable

F16, BF16 = int(Q.F16), int(Q.BF16)
STORED = ("F32", "Q4_0", "Q8_0", "Q4_K", "Q6_K", "IQ4_XS", "MXFP4")  # a sample of the byte-layout types
ALL_F16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)  # every bit pattern: NaNs, infinities, subnormals
SMALL_CHUNK = 300  # values per split chunk; 600 bytes of whole rows per raw chunk: several chunks per expert


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------------------------------ type table


def test_type_table_matches_gguf_py() -> None:
    """The native table restates ggml's block sizes: every type it stores has gguf-py's sizes."""
    stored = {t for t in Q if codec.type_layout(int(t)) is not None}
    assert {Q.F16, Q.BF16, Q.F32, Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.IQ4_XS, Q.MXFP4} <= stored
    for t in stored:
        layout = codec.type_layout(int(t))
        assert (layout.blck_size, layout.type_size) == GGML_QUANT_SIZES[t], t.name
        assert layout.split == (t in (Q.F16, Q.BF16)), t.name


@pytest.mark.parametrize("ggml_type", [Q.I8, Q.I16, Q.I32, Q.I64, Q.F64, Q.Q8_1, Q.Q8_K, 4, 31, 43, 1000, -1])
def test_types_zipmoe_does_not_store(ggml_type: int) -> None:
    assert codec.type_layout(int(ggml_type)) is None


# -------------------------------------------------------------------------------------------- the codec


def f16_bits(n: int, seed: int = 0, std: float = 0.02) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, std, n).astype(np.float16).view(np.uint16)


def split_codec(name: str, values: np.ndarray, ggml_type: int = F16) -> codec.Codec:
    hist = codec.exponent_histogram(values)
    if name == "huff":
        return codec.Codec("huff", lengths=codec.huff_lengths(hist), ggml_type=ggml_type)
    if name == "esc":
        return codec.Codec("esc", lengths=codec.esc_classes(hist), ggml_type=ggml_type)
    return codec.Codec("zstd", level=1, ggml_type=ggml_type)


def compress(experts: np.ndarray, c: codec.Codec, chunk_n: int, dims: tuple[int, int, int]
             ) -> tuple[codec.ExpertTensor, np.ndarray]:
    """Experts (one row per expert: uint16 values or bytes) into a data companion, opened through its index."""
    encoded = [c.encode_expert(e, chunk_n) for e in experts]
    regions = np.zeros((len(encoded), 2), np.uint64)
    offset = 0
    for e, enc in enumerate(encoded):
        regions[e] = (offset, enc.region.size)
        offset = format.align_up(offset + enc.region.size, metadata.region_alignment(experts[0].nbytes))
    data = np.zeros(offset, np.uint8)
    for e, enc in enumerate(encoded):
        data[int(regions[e, 0]):int(regions[e, 0]) + enc.region.size] = enc.region
    index = metadata.build_index(
        codec_name=c.name, level=c.level, dims=dims, chunk_n=chunk_n, data_size=data.size, lengths=c.lengths,
        regions=regions, chunk_ends=np.stack([enc.chunk_ends for enc in encoded]),
        checksums=np.stack([enc.checksums for enc in encoded]), ggml_type=c.ggml_type)
    return codec.ExpertTensor(index, data.size), data


def region(t: codec.ExpertTensor, data: np.ndarray, e: int) -> np.ndarray:
    span = t.span(e)
    return data[span.offset:span.offset + span.size]


@pytest.mark.parametrize("name", ["huff", "esc", "zstd"])
def test_f16_every_bit_pattern_round_trips(name: str) -> None:
    experts = ALL_F16.reshape(2, -1)
    t, data = compress(experts, split_codec(name, experts), 4096, (256, 128, 2))
    assert (t.info.ggml_type, t.info.layout, t.info.expert_size) == (F16, codec.LAYOUT_SPLIT16, 2 * 256 * 128)
    for e in range(2):
        np.testing.assert_array_equal(t.decode_expert(e, region(t, data, e)), experts[e])
        np.testing.assert_array_equal(t.decode_expert_parallel(e, region(t, data, e), threads=3), experts[e])


def test_f16_split_is_the_measured_one() -> None:
    """F16's code byte is bits 14..7 (5 exponent + 3 mantissa bits), its raw byte the sign and 7 mantissa bits: the
    BF16 split functions, scalar and SIMD, on F16 bits (docs/FORMAT.md gives the measurement)."""
    exp_s, sm_s = codec.split_bf16(ALL_F16, scalar=True)
    exp_v, sm_v = codec.split_bf16(ALL_F16)
    np.testing.assert_array_equal(exp_v, exp_s)
    np.testing.assert_array_equal(sm_v, sm_s)
    np.testing.assert_array_equal(exp_s, ((ALL_F16 >> 10) & 0x1F) << 3 | ((ALL_F16 >> 7) & 0x7))
    np.testing.assert_array_equal(codec.merge_bf16(exp_v, sm_v), ALL_F16)
    np.testing.assert_array_equal(codec.merge_bf16(exp_s, sm_s, scalar=True), ALL_F16)


def test_f16_huff_stays_near_its_floor() -> None:
    """Trained-like F16 (Gaussian): Huffman on the 8-bit code byte within 1% of (8 + H(code)) / 16."""
    values = f16_bits(1 << 20, seed=5)
    c = split_codec("huff", values)
    t, data = compress(values.reshape(4, -1), c, 1 << 16, (1024, 256, 4))
    floor = (8 + codec.entropy_bits(codec.exponent_histogram(values))) / 16
    ratio = sum(t.span(e).size for e in range(4)) / values.nbytes
    assert floor < ratio < floor * 1.01


@pytest.mark.parametrize("type_name", STORED)
def test_stored_types_round_trip_raw(type_name: str) -> None:
    ggml_type = int(Q[type_name])
    blck, size = GGML_QUANT_SIZES[Q[type_name]]
    ne0, ne1, n_expert = 2 * 256, 5, 3
    row = ne0 // blck * size
    experts = np.random.default_rng(7).integers(0, 256, (n_expert, row * ne1), dtype=np.uint8)
    c = codec.Codec("raw", ggml_type=ggml_type)
    t, data = compress(experts, c, 2 * row, (ne0, ne1, n_expert))
    info = t.info
    assert (info.codec, info.ggml_type, info.layout) == ("raw", ggml_type, codec.LAYOUT_BYTES)
    assert (info.n_units, info.expert_size, info.n_chunks, info.chunk_n) == (row * ne1, row * ne1, 3, 2 * row)
    for e in range(n_expert):
        span = t.span(e)
        assert span.exp_offset == 0 and span.size == row * ne1
        np.testing.assert_array_equal(region(t, data, e), experts[e])  # the region is the expert, verbatim
        np.testing.assert_array_equal(t.decode_expert(e, region(t, data, e)), experts[e])
        np.testing.assert_array_equal(t.decode_expert_parallel(e, region(t, data, e), threads=2), experts[e])
        damaged = region(t, data, e).copy()
        damaged[row + 1] ^= 0x10
        with pytest.raises(ChecksumError):
            t.decode_expert(e, damaged)


@pytest.mark.parametrize("name, ggml_type", [
    ("huff", int(Q.Q4_K)),   # quantized blocks are stored raw
    ("zstd", int(Q.Q8_0)),
    ("raw", BF16),           # and split values entropy coded
    ("raw", F16),
    ("zstd", int(Q.I8)),     # no expert type
    ("raw", int(Q.F64)),
])
def test_codec_and_type_must_pair(name: str, ggml_type: int) -> None:
    with pytest.raises(UnsupportedError):
        codec.Codec(name, lengths=np.full(256, 8, np.uint8), ggml_type=ggml_type)


def forge(t: codec.ExpertTensor, edit: Callable[[np.ndarray], None]) -> np.ndarray:
    bad = np.asarray(t._index).view(np.uint64).copy()
    edit(bad)
    bad[-1] = codec.checksum(bad[:-1])
    return bad.view(np.int64)


@pytest.mark.parametrize("edit", [
    lambda ix: ix.__setitem__(4, int(Q.F16)),        # raw codec on split values
    lambda ix: ix.__setitem__(4, int(Q.Q4_0)),       # another block size: the chunk counts no longer add up
    lambda ix: ix.__setitem__(4, int(Q.Q8_K)),       # not an expert type
    lambda ix: ix.__setitem__(5, 272),               # rows of partial blocks
    lambda ix: ix.__setitem__(2, 2),                 # huff on quantized blocks
    lambda ix: ix.__setitem__(3, 1),                 # a level for raw
    lambda ix: ix.__setitem__(16, 1),                # a code table for raw
    # expert 0's last raw chunk one byte short, its region too: every size still adds up, only exactness fails
    lambda ix: (ix.__setitem__(54 + 2 * 3, ix[54 + 2 * 3] - 1), ix.__setitem__(49, ix[49] - 1)),
])
def test_forged_raw_index_is_refused(edit: Callable[[np.ndarray], None]) -> None:
    ne0, ne1, n_expert = 256, 4, 3
    row = ne0 // 32 * 34
    experts = np.random.default_rng(1).integers(0, 256, (n_expert, row * ne1), dtype=np.uint8)
    t, data = compress(experts, codec.Codec("raw", ggml_type=int(Q.Q8_0)), row, (ne0, ne1, n_expert))
    with pytest.raises((FormatError, UnsupportedError)):
        codec.ExpertTensor(forge(t, edit), data.size)


def test_forged_raw_chunk_with_a_valid_checksum_decodes_to_its_own_bytes_only() -> None:
    """A raw chunk's code is its bytes: any size but n is refused, whatever its checksum says."""
    c = codec.Codec("raw", ggml_type=int(Q.Q8_0))
    ws = codec.Workspace(1024)
    rng = np.random.default_rng(3)
    for _ in range(50):
        code = rng.integers(0, 256, int(rng.integers(0, 600)), dtype=np.uint8)
        n = int(rng.integers(0, 600))
        out = np.full(1025, 0xAB, np.uint8)
        cs = codec.lib.zipmoe_checksum(codec.ffi.from_buffer(code), 0, codec.checksum(code))
        rc = codec.lib.zipmoe_chunk_decode(c._handle, ws.handle, codec.ffi.from_buffer(code), code.size,
                                           codec.ffi.NULL, n, 1, cs, codec.ffi.from_buffer(out))
        assert rc == (n if n == code.size else codec.lib.ZIPMOE_ERR_CORRUPT)
        if rc == n:
            np.testing.assert_array_equal(out[:n], code)
        assert (out[n if rc == n else 0:] == 0xAB).all()


# ------------------------------------------------------------------------------------------- whole files


def expert_bytes(type_name: str, dims: tuple[int, int, int], rng: np.random.Generator) -> np.ndarray:
    """Expert tensor data in numpy order [n_expert, ne1, row bytes or values]: F16/F32 from Gaussian weights, Q8_0
    and Q4_0 quantized from them by gguf-py; the other quantized types (gguf-py has no quantizer for them) as
    random blocks, which raw storage does not look into."""
    ne0, ne1, n_expert = dims
    weights = rng.normal(0, 0.02, (n_expert, ne1, ne0)).astype(np.float32)
    if type_name in ("F16", "F32"):
        return weights.astype(np.float16 if type_name == "F16" else np.float32)
    if type_name in ("Q8_0", "Q4_0"):
        return quantize(weights, Q[type_name])
    blck, size = GGML_QUANT_SIZES[Q[type_name]]
    return rng.integers(0, 256, (n_expert, ne1, ne0 // blck * size), dtype=np.uint8)


def write_model(path: Path, types: dict[str, str]) -> Path:
    """A one-layer MoE GGUF whose expert tensors (up, gate, down) have the given types."""
    rng = np.random.default_rng(11)
    w = GGUFWriter(path, "qwen3moe")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", rng.standard_normal((16, 512)).astype(np.float32))
    dims = {"up": (512, 6, 4), "gate": (512, 6, 4), "down": (512, 6, 4)}  # ne0 a multiple of every block size
    for role, type_name in types.items():
        data = expert_bytes(type_name, dims[role], rng)
        raw = None if type_name in ("F16", "F32") else Q[type_name]
        if type_name == "BF16":
            data = rng.integers(0x3C00, 0x3D00, dims[role][::-1], dtype=np.uint16)
        w.add_tensor(f"blk.0.ffn_{role}_exps.weight", data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


MODELS = {
    "F16": {"up": "F16", "gate": "F16", "down": "F16"},
    "F32": {"up": "F32", "gate": "F32", "down": "F32"},
    "Q8_0": {"up": "Q8_0", "gate": "Q8_0", "down": "Q8_0"},
    "Q4_K_M": {"up": "Q4_K", "gate": "Q4_K", "down": "Q6_K"},  # mixed, as llama-quantize's Q4_K_M stores them
    "IQ4_XS": {"up": "IQ4_XS", "gate": "IQ4_XS", "down": "IQ4_XS"},
    "BF16+Q4_0": {"up": "BF16", "gate": "Q4_0", "down": "F16"},  # split and raw in one file
}


@pytest.fixture(scope="module")
def typed_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("typed")
    return {name: write_model(root / f"{name}.gguf", types) for name, types in MODELS.items()}


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("codec_name", ["huff", "esc", "zstd"])
def test_convert_verify_unpack_every_type(model: str, codec_name: str, typed_models: dict[str, Path],
                                          tmp_path: Path) -> None:
    src = typed_models[model]
    packed, restored = tmp_path / "m.zipmoe.gguf", tmp_path / "restored.gguf"
    types = MODELS[model]
    if codec_name == "esc" and "F16" in types.values():
        with pytest.raises(UnsupportedError, match="esc codec does not fit F16 experts"):
            convert.convert(src, packed, codec=codec_name, chunk_n=SMALL_CHUNK, threads=2)
        assert not packed.exists()
        return
    report = convert.convert(src, packed, codec=codec_name, chunk_n=SMALL_CHUNK, threads=2)
    any_split = any(t in ("BF16", "F16") for t in types.values())
    assert report.codec == (codec_name if any_split else "raw")
    assert report.level == (1 if codec_name == "zstd" and any_split else 0)
    zf = reader.open_zipmoe(packed)
    for c in zf.compressed:
        want = types[c.name.split("_")[1]]
        assert format.type_name(c.expert.info.ggml_type) == want
        assert c.expert.info.codec == (codec_name if want in ("BF16", "F16") else "raw")
        assert c.expert.info.n_chunks > 1
    v = verify.verify(packed, against=src)
    assert v.sha256 == sha256(src) and v.experts == 12
    verify.unpack(packed, restored)
    assert restored.read_bytes() == src.read_bytes()
    info = convert.inspect(packed)
    assert [t["type"] for t in info["tensors"]] == [types[r] for r in ("up", "gate", "down")]


@pytest.mark.parametrize("model", ["F16", "Q8_0", "Q4_K_M", "BF16+Q4_0"])
def test_flipped_byte_in_any_expert_is_caught(model: str, typed_models: dict[str, Path], tmp_path: Path) -> None:
    packed = tmp_path / "m.zipmoe.gguf"
    convert.convert(typed_models[model], packed, chunk_n=SMALL_CHUNK, threads=2)
    zf = reader.open_zipmoe(packed)
    for c in zf.compressed:
        damaged = tmp_path / "damaged.gguf"
        data = bytearray(packed.read_bytes())
        span = c.expert.span(2)
        data[c.region_file_offset(2) + span.size - 5] ^= 0x04  # inside the last chunk
        damaged.write_bytes(bytes(data))
        with pytest.raises(ChecksumError, match=f"{c.name}: expert 2: "):
            verify.verify(damaged)
        with pytest.raises(ChecksumError):
            verify.unpack(damaged, tmp_path / "restored.gguf")
        assert not (tmp_path / "restored.gguf").exists()


def test_verify_names_the_first_differing_byte_of_a_raw_expert(typed_models: dict[str, Path],
                                                                tmp_path: Path) -> None:
    src = typed_models["Q8_0"]
    packed, other = tmp_path / "m.zipmoe.gguf", tmp_path / "other.gguf"
    convert.convert(src, packed, threads=2)
    t = format.read_gguf(src).by_name["blk.0.ffn_down_exps.weight"]
    expert_size = t.nbytes // 4
    data = bytearray(src.read_bytes())
    data[t.file_offset + expert_size + 77] ^= 0xFF
    other.write_bytes(bytes(data))
    with pytest.raises(verify.MismatchError, match="blk.0.ffn_down_exps.weight expert 1 byte 77: "):
        verify.verify(packed, against=other)


def test_index_of_another_type_than_the_source_is_refused(typed_models: dict[str, Path], tmp_path: Path) -> None:
    """Every index is checked against the source header's tensor: an index retyped Q4_K -> Q5_0 of the very same
    byte size (Q5_0's 32-value blocks of 22 bytes vs Q4_K's 256 of 144 are not, so Q4_K -> IQ4_XS would not be
    either) is caught even with its checksum redone."""
    packed = tmp_path / "m.zipmoe.gguf"
    convert.convert(typed_models["F16"], packed, chunk_n=SMALL_CHUNK, threads=2)
    index = format.read_gguf(packed).by_name["blk.0.ffn_up_exps.zipmoe_index"]
    data = bytearray(packed.read_bytes())
    idx = np.frombuffer(data, "<u8", count=index.nbytes // 8, offset=index.file_offset).copy()
    idx[4] = BF16  # F16 and BF16 split alike: only the type tells them apart
    idx[-1] = codec.checksum(idx[:-1])
    data[index.file_offset:index.file_offset + index.nbytes] = idx.tobytes()
    packed.write_bytes(bytes(data))
    with pytest.raises(FormatError, match="type BF16 vs F16"):
        reader.open_zipmoe(packed)


def test_inspect_plain_quantized_reports_raw_storage(typed_models: dict[str, Path]) -> None:
    info = convert.inspect(typed_models["Q4_K_M"])
    assert info["unsupported_experts"] == []
    assert info["status"].startswith("not compressed: 3 Q4_K/Q6_K expert tensors, which zipmoe stores raw")
    assert [t["type"] for t in info["tensors"]] == ["Q4_K", "Q4_K", "Q6_K"]
    for t in info["tensors"]:  # random blocks: their bytes are incompressible, floor ~ 1
        assert t["floor"] == pytest.approx(t["exponent_entropy"] / 8) and t["floor"] > 0.95


def test_cli_converts_verifies_and_inspects_a_quantized_model(typed_models: dict[str, Path], tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from pyzipmoe.cli import main

    src, packed = typed_models["Q4_K_M"], tmp_path / "m.zipmoe.gguf"
    assert main(["convert", str(src), str(packed), "--quiet"]) == 0
    assert main(["verify", str(packed), "--against", str(src), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(packed)]) == 0
    out = capsys.readouterr().out
    assert "raw codec" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("blk.0.")}
    assert rows["blk.0.ffn_up_exps.weight"][2] == "Q4_K" and rows["blk.0.ffn_down_exps.weight"][2] == "Q6_K"


@pytest.mark.parametrize("model, expected", [
    ("F16", "zstd"),        # F16 code bytes: zstd-1 as small as huff and faster to decode (DEFAULT_F16_CODEC)
    ("BF16+Q4_0", "huff"),  # any BF16 expert: huff
    ("Q4_K_M", "raw"),      # nothing to entropy code
])
def test_auto_codec_follows_the_expert_types(model: str, expected: str, typed_models: dict[str, Path],
                                             tmp_path: Path) -> None:
    report = convert.convert(typed_models[model], tmp_path / "m.zipmoe.gguf", chunk_n=SMALL_CHUNK, threads=2)
    assert report.codec == expected and reader.open_zipmoe(tmp_path / "m.zipmoe.gguf").meta.codec == expected


# ----------------------------------------------------------------------------------------- llama.cpp


def f16_copy(src: Path, dst: Path) -> Path:
    """`src` (a BF16 MoE) with its expert tensors turned F16 (RNE), in place of the same size: each tensor info's
    type field rewritten, each value converted."""
    data = bytearray(src.read_bytes())
    g = format.read_gguf(src)
    for t in g.tensors:
        if not metadata.is_expert_tensor(t):
            continue
        name = t.name.encode()
        at = data.index(struct.pack("<Q", len(name)) + name, 0, g.data_start) + 8 + len(name)
        n_dims = struct.unpack_from("<I", data, at)[0]
        type_at = at + 4 + 8 * n_dims
        assert struct.unpack_from("<I", data, type_at)[0] == BF16
        struct.pack_into("<I", data, type_at, F16)
        bits = np.frombuffer(data, np.uint16, t.nbytes // 2, t.file_offset)
        f16 = (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float16).view(np.uint16)
        data[t.file_offset:t.file_offset + t.nbytes] = f16.tobytes()
    dst.write_bytes(bytes(data))
    return dst


def test_llama_runs_an_f16_zipmoe_exactly_or_refuses(tiny_model: Path, tmp_path: Path) -> None:
    """The integrity promise for F16: zipmoe's llama.cpp either gives the F16 source's logits bit for bit or
    refuses the file; never a silently different answer. (A loader that knows only BF16 experts refuses it by its
    zipmoe.version, 2: it once took the F16 bits for BF16 and computed wrong logits.)"""
    import json
    import os
    import subprocess
    import sys

    bin_dir = llama_bin_dir()
    src = f16_copy(tiny_model, tmp_path / "tiny-f16.gguf")
    packed = tmp_path / "tiny-f16.zipmoe.gguf"
    convert.convert(src, packed, threads=2)
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"reference": str(src), "files": [str(packed)], "env": {}}))
    worker = Path(__file__).with_name("mutation_worker.py")
    done = subprocess.run([sys.executable, str(worker), str(job)], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, LLAMA_CPP_LIB_PATH=str(bin_dir), OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    reply = json.loads(done.stdout.strip().splitlines()[-1])
    assert reply["reference"]["outcome"] == "loaded"  # stock-typed F16 runs
    (result,) = reply["results"]
    assert result["class"] == "ok", result


def test_format_version_says_whether_every_expert_is_bf16(tiny_model: Path, typed_models: dict[str, Path],
                                                          tmp_path: Path) -> None:
    convert.convert(tiny_model, tmp_path / "bf16.zipmoe.gguf", threads=2)
    assert reader.open_zipmoe(tmp_path / "bf16.zipmoe.gguf").meta.version == 1
    for model in ("F16", "Q8_0", "BF16+Q4_0"):
        packed = tmp_path / f"{model}.zipmoe.gguf"
        convert.convert(typed_models[model], packed, threads=2)
        assert reader.open_zipmoe(packed).meta.version == 2


def test_an_index_store_of_a_byte_layout_type_puts_each_expert_whole(typed_models: dict[str, Path],
                                                                      tmp_path: Path) -> None:
    """An engine that keeps a quantized type repacked (llama.cpp's CPU backend) gets each decoded expert of a zipmoe
    GGUF put whole, once, from its stored bytes: the index's chunks need not hold whole groups of rows. A split
    (F16) store has nothing to put."""
    from pyzipmoe._native import ffi, lib

    packed = tmp_path / "q8.zipmoe.gguf"
    convert.convert(typed_models["Q8_0"], packed, chunk_n=SMALL_CHUNK, threads=2)
    ct = reader.open_zipmoe(packed).compressed[0]
    src = format.read_gguf(typed_models["Q8_0"]).by_name[ct.name]
    with open(typed_models["Q8_0"], "rb") as f:
        f.seek(src.file_offset)
        ref = np.frombuffer(f.read(src.nbytes), np.uint8).reshape(src.dims[2], -1)
    with open(packed, "rb") as f:
        f.seek(ct.index.file_offset)
        index = f.read(ct.index.nbytes)
    out = ffi.new("zipmoe_store **")
    assert lib.zipmoe_store_open(ct.name.encode(), index, len(index), ct.data.nbytes, out) == 0
    handle = ffi.gc(out[0], lib.zipmoe_store_free)
    info = ffi.new("zipmoe_tensor_info *")
    lib.zipmoe_store_get_info(handle, info)
    rows = info.ne[1]
    assert info.n_chunks > 1 and info.expert_size == ref.shape[1] and rows == 6
    puts = []

    @ffi.callback("void(void *, void *, const void *, int64_t)")
    def put(ctx, dst, src_rows, n_rows):  # a layout of its own: every byte inverted
        puts.append(n_rows)
        data = np.frombuffer(ffi.buffer(src_rows, info.expert_size), np.uint8)
        ffi.buffer(dst, info.expert_size)[:] = (data ^ 0xFF).tobytes()

    assert lib.zipmoe_store_set_raw_put(handle, put, ffi.NULL, 4) == lib.ZIPMOE_ERR_ARG  # (6 rows: no whole groups)
    assert lib.zipmoe_store_set_raw_put(handle, put, ffi.NULL, 3) == 0
    dst, size = ffi.new("void **"), ffi.new("size_t *")
    with open(packed, "rb") as f:
        assert lib.zipmoe_store_bind(handle, f.fileno(), ct.data.file_offset, dst, size) == 0
    weights = np.frombuffer(ffi.buffer(dst[0], info.n_expert * info.expert_size), np.uint8).reshape(info.n_expert, -1)
    ids = np.ascontiguousarray([[0, 2], [3, 2]], np.int32)
    where = np.full(ids.shape, -1, np.int32)
    key = ffi.new("char[1]")
    assert lib.zipmoe_store_materialize(handle, key, ffi.from_buffer(ids), 2, 2, 4, 8,
                                        ffi.from_buffer("int32_t[]", where), 0, 1) >= 0
    np.testing.assert_array_equal(weights[where], ref[ids] ^ 0xFF)
    assert puts == [rows] * 3  # each routed expert once, whole

    f16 = tmp_path / "f16.zipmoe.gguf"
    convert.convert(typed_models["F16"], f16, threads=2)
    ct = reader.open_zipmoe(f16).compressed[0]
    with open(f16, "rb") as f:
        f.seek(ct.index.file_offset)
        index = f.read(ct.index.nbytes)
    assert lib.zipmoe_store_open(ct.name.encode(), index, len(index), ct.data.nbytes, out) == 0
    split = ffi.gc(out[0], lib.zipmoe_store_free)
    assert lib.zipmoe_store_set_raw_put(split, put, ffi.NULL, 3) == lib.ZIPMOE_ERR_ARG


def test_version_1_with_other_types_is_refused(typed_models: dict[str, Path], tmp_path: Path) -> None:
    """Version 1 readers take every expert for BF16: a file claiming version 1 must hold nothing else."""
    packed = tmp_path / "m.zipmoe.gguf"
    convert.convert(typed_models["F16"], packed, threads=2)
    data = bytearray(packed.read_bytes())
    key = b"zipmoe.version"
    at = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key)
    assert struct.unpack_from("<II", data, at) == (4, 2)  # GGUF u32, value 2
    struct.pack_into("<I", data, at + 4, 1)
    packed.write_bytes(bytes(data))
    with pytest.raises(FormatError, match="zipmoe.version 1 with a F16 expert tensor"):
        reader.open_zipmoe(packed)


@pytest.mark.parametrize("preset", ["F16", "Q8_0", "Q4_K_M", "IQ4_XS"])
def test_llama_quantize_outputs_round_trip(preset: str, tiny_model: Path, tmp_path: Path) -> None:
    """Files as llama-quantize writes them (its own type choices: the tiny model's rows are not a multiple of 256,
    so K and IQ4_XS presets fall back per tensor to other types, a mixed file): byte-identical round trips."""
    import subprocess

    import pyzipmoe

    tool = pyzipmoe.build_dir() / "bin" / "llama-quantize"
    if not tool.is_file():
        unavailable(f"{tool} not built (cmake --build build --target llama-quantize)")
    src, packed, restored = tmp_path / f"{preset}.gguf", tmp_path / "m.zipmoe.gguf", tmp_path / "restored.gguf"
    done = subprocess.run([str(tool), str(tiny_model), str(src), preset, "1"], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    convert.convert(src, packed, chunk_n=SMALL_CHUNK, threads=2)
    types = {format.type_name(c.expert.info.ggml_type) for c in reader.open_zipmoe(packed).compressed}
    assert types and "BF16" not in types, types
    verify.verify(packed, against=src)
    verify.unpack(packed, restored)
    assert restored.read_bytes() == src.read_bytes()
