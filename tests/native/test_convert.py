"""convert, verify, unpack and inspect: bit-exact round trips, and every bad input refused cleanly."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from pyzipmoe.file import codec
from pyzipmoe.file import convert
from pyzipmoe.file import fileio
from pyzipmoe.file import verify
from pyzipmoe.file import gguf as format
from pyzipmoe.file import metadata
from pyzipmoe.file import reader
from pyzipmoe.errors import ChecksumError, FormatError, UnsupportedError, ZipmoeError

from conftest import ARCHS, CODECS, SMALL_CHUNK


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def files_in(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()}


# ------------------------------------------------------------------------------------------ round trips


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", CODECS)
def test_convert_verify_unpack(arch: str, name: str, tiny_models: dict[str, Path],
                               zipmoe_models: dict[tuple[str, str], Path], tmp_path: Path) -> None:
    src, packed = tiny_models[arch], zipmoe_models[arch, name]
    checked = verify.verify(packed, against=src)
    assert checked.sha256 == sha256(src)
    assert checked.tensors == 3 * 2 and checked.experts == 6 * 8
    assert checked.chunks == checked.experts * -(-2048 // SMALL_CHUNK)
    assert verify.verify(packed).sha256 == checked.sha256
    restored = tmp_path / "restored.gguf"
    report = verify.unpack(packed, restored)
    assert restored.read_bytes() == src.read_bytes()
    assert report.sha256 == sha256(src)
    assert files_in(tmp_path) == {"restored.gguf"}


def test_default_settings_and_report(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "model.zipmoe.gguf"
    report = convert.convert(tiny_model, out)
    assert (report.codec, report.level, report.chunk_n) == ("huff", 0, codec.DEFAULT_CHUNK_N)
    assert report.output_size == out.stat().st_size and report.sha256 == sha256(tiny_model)
    assert len(report.tensors) == 6
    rows = report.rows()
    assert [r.label for r in rows] == ["ffn_down_exps", "ffn_gate_exps", "ffn_up_exps", "other tensors + header",
                                       "whole file"]
    assert rows[-1].bf16_bytes == tiny_model.stat().st_size and rows[-1].zipmoe_bytes == out.stat().st_size
    assert sum(r.zipmoe_bytes for r in rows[:-1]) == rows[-1].zipmoe_bytes
    for t in report.tensors:
        assert t.floor == pytest.approx((8 + t.exponent_entropy) / 16)
        assert t.to_dict()["floor_gap_pct"] == pytest.approx((t.ratio / t.floor - 1) * 100)
    assert verify.verify(out, tiny_model).experts == 48


def test_output_does_not_depend_on_threads(tiny_model: Path, tmp_path: Path) -> None:
    one, four = tmp_path / "1.gguf", tmp_path / "4.gguf"
    convert.convert(tiny_model, one, chunk_n=SMALL_CHUNK, threads=1)
    convert.convert(tiny_model, four, chunk_n=SMALL_CHUNK, threads=4)
    assert one.read_bytes() == four.read_bytes()


def test_zstd_level_is_recorded(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "z.gguf"
    convert.convert(tiny_model, out, codec="zstd", level=5)
    zf = reader.open_zipmoe(out)
    assert (zf.meta.codec, zf.meta.level) == ("zstd", 5)
    assert {c.expert.info.level for c in zf.compressed} == {5}
    verify.verify(out, tiny_model)


def test_ordered_keeps_order_and_bounds_work_in_flight() -> None:
    running, peak, lock = 0, 0, threading.Lock()

    def work(i: int) -> int:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        time.sleep(0.001 * (i % 3))
        with lock:
            running -= 1
        return i * i

    submitted = []
    with ThreadPoolExecutor(8) as pool:
        results = list(fileio.ordered(pool, work, (submitted.append(i) or i for i in range(50)), depth=3))
    assert results == [i * i for i in range(50)]
    assert peak <= 3


# -------------------------------------------------------------------------------------- refused inputs


@pytest.fixture(scope="module")
def i32_moe_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A MoE whose expert tensors are I32: no type llama.cpp computes experts in, refused."""
    from gguf import GGUFWriter

    path = tmp_path_factory.mktemp("i32") / "moe-i32.gguf"
    rng = np.random.default_rng(2)
    w = GGUFWriter(path, "qwen3moe")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", rng.standard_normal((16, 16)).astype(np.float32))
    w.add_tensor("blk.0.ffn_up_exps.weight", rng.integers(0, 9, (4, 8, 16), dtype=np.int32))
    w.add_tensor("blk.0.ffn_down_exps.weight", rng.integers(0, 9, (4, 8, 16), dtype=np.int32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("fixture, error, message", [
    ("not_gguf", FormatError, "not a GGUF file"),
    ("truncated_gguf", FormatError, "truncated"),
    ("non_moe_gguf", UnsupportedError, "not a MoE model"),
    ("i32_moe_gguf", UnsupportedError, "expert tensors are I32 .*stores BF16, F16, F32 and block-quantized"),
    ("zipmoe_model", UnsupportedError, "already a zipmoe file"),
])
def test_convert_refuses(fixture: str, error: type, message: str, request: pytest.FixtureRequest,
                         tmp_path: Path) -> None:
    src = request.getfixturevalue(fixture)
    with pytest.raises(error, match=message) as e:
        convert.convert(src, tmp_path / "out.gguf")
    assert "\n" not in str(e.value)
    assert files_in(tmp_path) == set()


def test_convert_refuses_to_overwrite_its_source(copy_of: Callable[[Path], Path], tiny_model: Path) -> None:
    src = copy_of(tiny_model)
    before = src.read_bytes()
    with pytest.raises(ZipmoeError, match="overwrite the input"):
        convert.convert(src, src.parent / "." / src.name)
    assert src.read_bytes() == before
    assert files_in(src.parent) == {src.name}


def test_convert_refuses_bytes_it_could_not_restore(copy_of: Callable[[Path], Path], tiny_model: Path) -> None:
    src = copy_of(tiny_model)
    with open(src, "ab") as f:
        f.write(b"trailing junk")
    with pytest.raises(UnsupportedError, match="non-zero bytes after the last tensor"):
        convert.convert(src, src.parent / "out.gguf")
    assert files_in(src.parent) == {src.name}


def test_convert_refuses_bad_settings(tiny_model: Path, tmp_path: Path) -> None:
    with pytest.raises(UnsupportedError, match="unknown codec"):
        convert.convert(tiny_model, tmp_path / "o.gguf", codec="lz4")
    with pytest.raises(ZipmoeError, match="chunk size"):
        convert.convert(tiny_model, tmp_path / "o.gguf", chunk_n=0)
    with pytest.raises(ZipmoeError, match="threads"):
        convert.convert(tiny_model, tmp_path / "o.gguf", threads=0)
    assert files_in(tmp_path) == set()


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, RuntimeError])
def test_interrupted_convert_leaves_nothing(interrupt: type, tiny_model: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    calls = 0
    encode = codec.Codec.encode_expert

    def failing(self: codec.Codec, values: np.ndarray, chunk_n: int) -> codec.EncodedExpert:
        nonlocal calls
        calls += 1
        if calls == 20:
            raise interrupt()
        return encode(self, values, chunk_n)

    monkeypatch.setattr(codec.Codec, "encode_expert", failing)
    with pytest.raises(interrupt):
        convert.convert(tiny_model, tmp_path / "out.gguf", threads=2)
    assert calls >= 20
    assert files_in(tmp_path) == set()


def test_interrupted_convert_keeps_an_existing_destination(tiny_model: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    dst = tmp_path / "out.gguf"
    dst.write_bytes(b"previous")
    monkeypatch.setattr(convert, "_write_experts", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        convert.convert(tiny_model, dst)
    assert dst.read_bytes() == b"previous" and files_in(tmp_path) == {"out.gguf"}


# ------------------------------------------------------------------------------------ damaged zipmoe files


def expert_region(path: Path, tensor: str, expert: int) -> tuple[int, codec.ExpertSpan]:
    c = reader.open_zipmoe(path).compressed_by_name[tensor]
    return c.region_file_offset(expert), c.expert.span(expert)


@pytest.mark.parametrize("plane", ["exponents", "sign+mantissa"])
def test_flipped_bit_in_an_expert_is_caught(plane: str, zipmoe_model: Path, copy_of: Callable[[Path], Path],
                                            flip_bit: Callable[[Path, int], None], tmp_path: Path) -> None:
    damaged = copy_of(zipmoe_model)
    start, span = expert_region(damaged, "blk.1.ffn_up_exps.weight", 5)
    flip_bit(damaged, start + (span.exp_offset + 3 if plane == "exponents" else 100))
    with pytest.raises(ChecksumError, match="blk.1.ffn_up_exps.weight: expert 5: "):
        verify.verify(damaged)
    with pytest.raises(ChecksumError):
        verify.unpack(damaged, tmp_path / "restored.gguf")
    assert files_in(tmp_path) == {damaged.name}


def test_tampered_index_is_caught(zipmoe_model: Path, copy_of: Callable[[Path], Path],
                                  flip_bit: Callable[[Path, int], None]) -> None:
    damaged = copy_of(zipmoe_model)
    index = format.read_gguf(damaged).by_name["blk.0.ffn_down_exps.zipmoe_index"]
    flip_bit(damaged, index.file_offset + 8 * 50)  # a region offset
    for action in (verify.verify, convert.inspect, reader.open_zipmoe):
        with pytest.raises(ChecksumError, match="blk.0.ffn_down_exps.weight: index"):
            action(damaged)


def test_inconsistent_index_is_caught_even_with_a_valid_checksum(zipmoe_model: Path,
                                                                 copy_of: Callable[[Path], Path]) -> None:
    damaged = copy_of(zipmoe_model)
    index = format.read_gguf(damaged).by_name["blk.1.ffn_gate_exps.zipmoe_index"]
    data = bytearray(damaged.read_bytes())
    idx = np.frombuffer(data, "<u8", count=index.nbytes // 8, offset=index.file_offset).copy()
    idx[48 + 2 * 3] += 64  # expert 3's region no longer starts on a 4096-byte boundary
    idx[-1] = codec.checksum(idx[:-1])
    data[index.file_offset:index.file_offset + index.nbytes] = idx.tobytes()
    damaged.write_bytes(bytes(data))
    with pytest.raises(FormatError, match="blk.1.ffn_gate_exps.weight: index: "):
        verify.verify(damaged)


def test_corrupted_plain_tensor_is_caught_by_sha256(tiny_model: Path, zipmoe_model: Path,
                                                    copy_of: Callable[[Path], Path],
                                                    flip_bit: Callable[[Path, int], None], tmp_path: Path) -> None:
    damaged = copy_of(zipmoe_model)
    t = format.read_gguf(damaged).by_name["blk.0.attn_q.weight"]
    flip_bit(damaged, t.file_offset + 10, 3)
    with pytest.raises(verify.MismatchError, match="sha256"):
        verify.verify(damaged)
    with pytest.raises(verify.MismatchError, match=r"blk.0.attn_q.weight byte 10: zipmoe gives 0x.., "
                                                    r"the source has 0x.."):
        verify.verify(damaged, against=tiny_model)
    with pytest.raises(verify.MismatchError, match="nothing was written"):
        verify.unpack(damaged, tmp_path / "restored.gguf")
    assert files_in(tmp_path) == {damaged.name}


def test_verify_names_the_first_differing_value(tiny_model: Path, zipmoe_model: Path,
                                                copy_of: Callable[[Path], Path]) -> None:
    other = copy_of(tiny_model)
    t = format.read_gguf(other).by_name["blk.1.ffn_gate_exps.weight"]
    n_per = t.dims[0] * t.dims[1]
    expert, element = 3, 777
    at = t.file_offset + (expert * n_per + element) * 2
    data = bytearray(other.read_bytes())
    old = int.from_bytes(data[at:at + 2], "little")
    data[at:at + 2] = (old ^ 0x8001).to_bytes(2, "little")
    other.write_bytes(bytes(data))
    expected = (f"blk.1.ffn_gate_exps.weight expert 3 element 777 (flat index {3 * n_per + 777}): "
                f"zipmoe gives 0x{old:04x}, the source has 0x{old ^ 0x8001:04x}")
    with pytest.raises(verify.MismatchError) as e:
        verify.verify(zipmoe_model, against=other)
    assert str(e.value) == expected


def test_verify_against_a_file_of_another_size(zipmoe_model: Path, non_moe_gguf: Path) -> None:
    with pytest.raises(verify.MismatchError, match="bytes, but the zipmoe file's source was"):
        verify.verify(zipmoe_model, against=non_moe_gguf)


@pytest.mark.parametrize("cut", [0.5, 0.999])
def test_truncated_zipmoe_file_is_refused(cut: float, zipmoe_model: Path, tmp_path: Path) -> None:
    damaged = tmp_path / "cut.gguf"
    data = zipmoe_model.read_bytes()
    damaged.write_bytes(data[:int(len(data) * cut)])
    for action in (verify.verify, convert.inspect):
        with pytest.raises(FormatError, match="truncated"):
            action(damaged)
    with pytest.raises(FormatError, match="truncated"):
        verify.unpack(damaged, tmp_path / "restored.gguf")
    assert files_in(tmp_path) == {"cut.gguf"}


@pytest.mark.parametrize("old, new, error, message", [
    (b"\x04\x00\x00\x00\x00\x00\x00\x00huff", b"\x04\x00\x00\x00\x00\x00\x00\x00hufg", UnsupportedError,
     "unknown zipmoe codec 'hufg'"),
    (b"zipmoe.version\x04\x00\x00\x00\x01", b"zipmoe.version\x04\x00\x00\x00\x03", UnsupportedError,
     "zipmoe format version 3 is not supported"),
    (b"zipmoe.chunk_size\x04\x00\x00\x00", b"zipmoe.chunk_size\x05\x00\x00\x00", FormatError,
     "zipmoe.chunk_size has the wrong type"),
    (b"zipmoe.tensors", b"zipmoe.tensorz", FormatError, "zipmoe.tensors is missing"),
])
def test_tampered_metadata_is_refused(old: bytes, new: bytes, error: type, message: str, zipmoe_model: Path,
                                      copy_of: Callable[[Path], Path]) -> None:
    damaged = copy_of(zipmoe_model)
    data = damaged.read_bytes()
    assert data.count(old) == 1
    damaged.write_bytes(data.replace(old, new))
    with pytest.raises(error, match=message):
        verify.verify(damaged)


def test_unpack_refuses_to_overwrite_its_input(zipmoe_model: Path, copy_of: Callable[[Path], Path]) -> None:
    packed = copy_of(zipmoe_model)
    with pytest.raises(ZipmoeError, match="overwrite the input"):
        verify.unpack(packed, packed)


def test_interrupted_unpack_leaves_nothing(zipmoe_model: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    decode = codec.ExpertTensor.decode_expert
    calls = 0

    def failing(self: codec.ExpertTensor, *args: object, **kwargs: object) -> np.ndarray:
        nonlocal calls
        calls += 1
        if calls == 30:
            raise KeyboardInterrupt()
        return decode(self, *args, **kwargs)

    monkeypatch.setattr(codec.ExpertTensor, "decode_expert", failing)
    with pytest.raises(KeyboardInterrupt):
        verify.unpack(zipmoe_model, tmp_path / "restored.gguf")
    assert files_in(tmp_path) == set()


# ------------------------------------------------------------------------------------------------ inspect


def test_inspect_zipmoe(zipmoe_model: Path, tiny_model: Path) -> None:
    info = convert.inspect(zipmoe_model)
    assert info["format"] == "zipmoe" and info["compressed"] and info["codec"] == "huff"
    assert info["chunk_size"] == SMALL_CHUNK and info["source"]["sha256"] == sha256(tiny_model)
    assert len(info["tensors"]) == 6
    g = format.read_gguf(zipmoe_model)
    for t in info["tensors"]:
        base = t["name"].removesuffix(".weight")
        assert t["zipmoe_bytes"] == g.by_name[base + ".zipmoe_data"].nbytes + g.by_name[base + ".zipmoe_index"].nbytes
        assert t["n_expert"] == 8 and t["n_chunks"] == -(-2048 // SMALL_CHUNK)
        assert t["floor_gap_pct"] == pytest.approx((t["ratio"] / t["floor"] - 1) * 100)
    whole = info["groups"][-1]
    assert whole["bf16_bytes"] == tiny_model.stat().st_size and whole["zipmoe_bytes"] == zipmoe_model.stat().st_size


def test_inspect_plain_gguf_measures_entropy(tiny_model: Path, zipmoe_model: Path) -> None:
    info = convert.inspect(tiny_model)
    assert info["format"] == "gguf" and not info["compressed"]
    assert info["status"].startswith("not compressed: 6 BF16 expert tensors")
    recorded = metadata.ZipmoeMeta.from_gguf(format.read_gguf(zipmoe_model)).exponent_entropy
    assert [t["exponent_entropy"] for t in info["tensors"]] == pytest.approx(recorded, abs=1e-5)
    assert all(t["zipmoe_bytes"] is None and t["ratio"] is None for t in info["tensors"])


def test_inspect_explains_what_it_cannot_compress(non_moe_gguf: Path, i32_moe_gguf: Path) -> None:
    dense = convert.inspect(non_moe_gguf)
    assert dense["status"].startswith("not a MoE model") and dense["tensors"] == []
    ints = convert.inspect(i32_moe_gguf)
    assert ints["status"].startswith("not convertible: expert tensors are I32")
    assert ints["unsupported_experts"] == [{"name": "blk.0.ffn_up_exps.weight", "type": "I32"},
                                           {"name": "blk.0.ffn_down_exps.weight", "type": "I32"}]


def test_inspect_plain_f16_reports_its_floor(f16_moe_gguf: Path) -> None:
    f16 = convert.inspect(f16_moe_gguf)
    assert f16["unsupported_experts"] == [] and "2 F16 expert tensors" in f16["status"]
    assert [t["type"] for t in f16["tensors"]] == ["F16", "F16"]
    assert all(0.5 < t["floor"] < 1 for t in f16["tensors"])
