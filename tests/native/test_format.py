"""GGUF structure: the parser's safety on hostile input, and the written layout against docs/FORMAT.md
and the rules of llama.cpp's GGUF reader."""

from __future__ import annotations

import hashlib
import io
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGUFValueType

from pyzipmoe.file import codec
from pyzipmoe.file import convert
from pyzipmoe.file import gguf as format
from pyzipmoe.file import integrity
from pyzipmoe.file import metadata
from pyzipmoe.file import reader
from pyzipmoe.file import writer
from pyzipmoe.errors import FormatError, UnsupportedError, ZipmoeError

from conftest import SMALL_CHUNK


def parse_bytes(data: bytes) -> format.GGUFFile:
    return format.parse_gguf(io.BytesIO(data), len(data), "test.gguf")


def llama_cpp_layout_problems(g: format.GGUFFile) -> list[str]:
    """What ggml's gguf.cpp would refuse: each offset must equal the padded sizes before it."""
    problems, expected = [], 0
    for t in g.tensors:
        if t.offset != expected:
            problems.append(f"{t.name} at {t.offset}, expected {expected}")
        expected = format.align_up(t.nbytes, g.alignment) + t.offset
    return problems


# ------------------------------------------------------------------------------------------------- reading


def test_reads_what_gguf_py_reads(tiny_model: Path) -> None:
    g = format.read_gguf(tiny_model)
    r = gguf.GGUFReader(tiny_model)
    assert [t.name for t in g.tensors] == [t.name for t in r.tensors]
    assert [t.file_offset for t in g.tensors] == [int(t.data_offset) for t in r.tensors]
    assert [t.nbytes for t in g.tensors] == [int(t.n_bytes) for t in r.tensors]
    assert list(g.kv) == [k for k in r.fields if not k.startswith("GGUF.")]
    assert g.data_start == r.data_offset
    assert g.kv["general.architecture"].value == "qwen3moe"


def test_kv_raw_is_the_key_value_section_verbatim(tiny_model: Path) -> None:
    data = tiny_model.read_bytes()
    g = format.read_gguf(tiny_model)
    assert data[24:24 + len(g.kv_raw)] == g.kv_raw
    assert data[24 + len(g.kv_raw):].startswith(format.encode_string(g.tensors[0].name))


@pytest.mark.parametrize("data", [
    b"", b"G", b"GGU", b"GGUF", b"GGUF\x03\x00\x00\x00", b"PK\x03\x04" + bytes(100),
    b"\x00" * 4096, b"a text file, not weights\n",
])
def test_non_gguf_input_is_a_format_error(data: bytes) -> None:
    with pytest.raises(FormatError) as e:
        parse_bytes(data)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("version", [1, 4, 0x03000000])
def test_unsupported_versions_are_refused(version: int) -> None:
    with pytest.raises(UnsupportedError, match="version"):
        parse_bytes(b"GGUF" + struct.pack("<IQQ", version, 0, 0))


def test_every_truncation_is_a_format_error(tiny_model: Path) -> None:
    data = tiny_model.read_bytes()
    g = format.read_gguf(tiny_model)
    first_end = g.tensors[0].file_offset + g.tensors[0].nbytes
    cuts = list(range(4, g.data_start, max(1, g.data_start // 400))) + [g.data_start - 1, g.data_start, first_end - 1]
    for n in cuts:
        with pytest.raises(FormatError, match="truncated"):
            parse_bytes(data[:n])


def test_tensor_past_the_end_names_the_tensor(tiny_model: Path) -> None:
    data = tiny_model.read_bytes()
    g = format.read_gguf(tiny_model)
    with pytest.raises(FormatError, match=f"tensor {g.tensors[0].name} ends at byte"):
        parse_bytes(data[:g.data_start + 8])


def test_random_header_corruption_gives_format_errors_only(tiny_model: Path) -> None:
    """Whatever bytes the header holds, the parser answers with a result or a ZipmoeError."""
    data = tiny_model.read_bytes()
    header_end = format.read_gguf(tiny_model).data_start
    rng = np.random.default_rng(7)
    outcomes = set()
    for _ in range(600):
        damaged = bytearray(data)
        at = int(rng.integers(4, header_end))
        width = int(rng.choice([1, 4, 8]))
        damaged[at:at + width] = rng.integers(0, 256, width, dtype=np.uint8).tobytes()
        try:
            parse_bytes(bytes(damaged))
            outcomes.add("ok")
        except ZipmoeError as e:
            assert "\n" not in str(e)
            outcomes.add("error")
    assert outcomes == {"ok", "error"}


def test_bad_alignment_is_refused() -> None:
    kv = format.encode_kv("general.alignment", GGUFValueType.UINT32, 48)
    with pytest.raises(FormatError, match="power of two"):
        parse_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + kv)


def test_huge_counts_are_refused_before_allocating() -> None:
    with pytest.raises(FormatError, match="more than the file can hold"):
        parse_bytes(b"GGUF" + struct.pack("<IQQ", 3, 1 << 40, 0) + bytes(64))


# ------------------------------------------------------------------------------------------------- writing


@pytest.mark.parametrize("alignment", [32, 8192])
def test_writer_puts_data_companions_on_pages_without_gaps(alignment: int) -> None:
    kv = format.encode_kv("general.alignment", GGUFValueType.UINT32, alignment)
    slots = [metadata.Slot("a", format.GGML_TYPE_I8, (3,)),
             metadata.Slot("b.zipmoe_data", format.GGML_TYPE_I8, None),
             metadata.Slot("c", format.GGML_TYPE_I64, (5,)),
             metadata.Slot("d.zipmoe_data", format.GGML_TYPE_I8, None),
             metadata.Slot("e", format.GGML_TYPE_I8, (7,))]
    f = io.BytesIO()
    w = writer.ZipmoeWriter(f, kv_raw=kv, n_kv=1, slots=slots, alignment=alignment)
    sizes = [w.write_tensor([bytes(range(3))]), w.write_tensor([b"\x01" * 1000]),
             w.write_tensor([bytes(40)]), w.write_tensor([b"\x02" * 5000]), w.write_tensor([bytes(7)])]
    w.finish()
    g = parse_bytes(f.getvalue())
    assert [t.name for t in g.tensors] == [s.name for s in slots]
    assert [t.nbytes for t in g.tensors] == sizes
    assert sizes[1] >= 1000 and sizes[3] == 5000  # the last data companion needs no padding
    assert llama_cpp_layout_problems(g) == []
    assert g.by_name["b.zipmoe_data"].file_offset % metadata.PAGE == 0
    assert g.by_name["d.zipmoe_data"].file_offset % metadata.PAGE == 0
    data = f.getvalue()
    assert data[g.by_name["d.zipmoe_data"].file_offset:][:5000] == b"\x02" * 5000
    assert metadata.PADDING_KEY in g.kv


def test_build_index_checks_table_shapes() -> None:
    with pytest.raises(ValueError, match="do not match"):
        metadata.build_index(codec_name="zstd", level=1, dims=(4, 4, 2), chunk_n=8, data_size=0, lengths=None,
                           regions=np.zeros((3, 2), np.uint64), chunk_ends=np.zeros((2, 2), np.uint64),
                           checksums=np.zeros((2, 2), np.uint64))


# ------------------------------------------------------------------------------------ converted files


def test_output_is_readable_by_gguf_py(zipmoe_models: dict[tuple[str, str], Path]) -> None:
    for path in zipmoe_models.values():
        r = gguf.GGUFReader(path)
        names = [t.name for t in r.tensors]
        assert names[-1] == metadata.SOURCE_HEADER
        assert "blk.0.ffn_up_exps.zipmoe_data" in names and "blk.0.ffn_up_exps.weight" not in names
        assert r.fields["zipmoe.codec"].contents() in ("huff", "zstd", "esc")


def test_output_layout_is_what_llama_cpp_accepts(zipmoe_models: dict[tuple[str, str], Path]) -> None:
    for path in zipmoe_models.values():
        g = format.read_gguf(path)
        assert g.version == 3
        assert llama_cpp_layout_problems(g) == []
        last = g.tensors[-1]
        assert g.file_size == g.data_start + format.align_up(last.offset + last.nbytes, g.alignment)
        for t in g.tensors:
            if t.name.endswith(metadata.DATA_SUFFIX):
                assert t.file_offset % metadata.PAGE == 0, t.name


def test_tensor_infos_follow_the_format(tiny_model: Path, zipmoe_model: Path) -> None:
    src, out = format.read_gguf(tiny_model), format.read_gguf(zipmoe_model)
    expected = []
    for t in src.tensors:
        if metadata.is_expert_tensor(t):
            base = t.name.removesuffix(".weight")
            expected += [(base + ".zipmoe_data", format.GGML_TYPE_I8), (base + ".zipmoe_index", format.GGML_TYPE_I64)]
        else:
            expected.append((t.name, t.ggml_type))
    expected.append((metadata.SOURCE_HEADER, format.GGML_TYPE_I8))
    assert [(t.name, t.ggml_type) for t in out.tensors] == expected
    src_bytes, out_bytes = tiny_model.read_bytes(), zipmoe_model.read_bytes()
    for t in src.tensors:
        if not metadata.is_expert_tensor(t):
            mine = out.by_name[t.name]
            assert mine.dims == t.dims
            assert out_bytes[mine.file_offset:][:mine.nbytes] == src_bytes[t.file_offset:][:t.nbytes], t.name
    header = out.by_name[metadata.SOURCE_HEADER]
    assert header.dims == (src.data_start,)
    assert out_bytes[header.file_offset:][:header.nbytes] == src_bytes[:src.data_start]


def test_metadata_follows_the_format(tiny_model: Path, zipmoe_model: Path) -> None:
    src, out = format.read_gguf(tiny_model), format.read_gguf(zipmoe_model)
    assert out.kv_raw.startswith(src.kv_raw)  # the source's pairs, verbatim and first
    T = GGUFValueType
    added = {k: v for k, v in out.kv.items() if k not in src.kv}
    assert [(k, v.vtype, v.etype) for k, v in added.items()] == [
        ("zipmoe.version", T.UINT32, None), ("zipmoe.codec", T.STRING, None),
        ("zipmoe.codec_level", T.INT32, None), ("zipmoe.chunk_size", T.UINT32, None),
        ("zipmoe.tensors", T.ARRAY, T.STRING), ("zipmoe.source.size", T.UINT64, None),
        ("zipmoe.source.sha256", T.STRING, None), ("zipmoe.source.data_start", T.UINT64, None),
        ("zipmoe.exponent_entropy", T.ARRAY, T.FLOAT32), (integrity.INTEGRITY_KEY, T.ARRAY, T.UINT64),
        (metadata.PADDING_KEY, T.ARRAY, T.UINT8),
    ]
    meta = metadata.ZipmoeMeta.from_gguf(out)
    assert (meta.version, meta.codec, meta.level, meta.chunk_size) == (1, "huff", 0, SMALL_CHUNK)
    assert meta.tensors == tuple(t.name for t in src.tensors if metadata.is_expert_tensor(t))
    assert meta.source_size == tiny_model.stat().st_size
    assert meta.source_sha256 == hashlib.sha256(tiny_model.read_bytes()).hexdigest()
    assert meta.source_data_start == src.data_start
    assert all(2.0 < h < 3.5 for h in meta.exponent_entropy)


def test_index_follows_the_format(zipmoe_model: Path) -> None:
    g = format.read_gguf(zipmoe_model)
    data, index = g.by_name["blk.1.ffn_down_exps.zipmoe_data"], g.by_name["blk.1.ffn_down_exps.zipmoe_index"]
    raw = zipmoe_model.read_bytes()[index.file_offset:][:index.nbytes]
    idx = np.frombuffer(raw, "<i8")
    ne0, ne1, n_expert = reader.open_zipmoe(zipmoe_model).source.by_name["blk.1.ffn_down_exps.weight"].dims
    n_per = ne0 * ne1
    chunks = -(-n_per // SMALL_CHUNK)
    assert list(idx[:16]) == [metadata.INDEX_MAGIC, 1, 2, 0, 30, ne0, ne1, n_expert, 1, n_expert, n_per, SMALL_CHUNK,
                              chunks, data.nbytes, metadata.region_alignment(2 * n_per), 0]
    assert idx.size == 48 + 2 * n_expert + 2 * n_expert * chunks + 1
    assert idx[-1].astype(np.uint64) == np.uint64(codec.checksum(raw[:-8]))
    lengths = idx[16:48].view(np.uint8)
    assert 0 < lengths.max() <= 11
    assert sum(2.0 ** -int(n) for n in lengths if n) == 1.0  # a complete prefix code
    regions = idx[48:48 + 2 * n_expert].reshape(n_expert, 2)
    assert (regions[:, 0] % metadata.region_alignment(2 * n_per) == 0).all() and (np.diff(regions[:, 0]) > 0).all()


def test_open_zipmoe_refuses_a_plain_gguf(tiny_model: Path) -> None:
    with pytest.raises(FormatError, match="not a zipmoe file"):
        reader.open_zipmoe(tiny_model)


def test_raw_index_follows_the_format(tmp_path: Path) -> None:
    """A Q8_0 expert tensor: index fields as FORMAT.md lists them, chunks of whole rows (from zipmoe.chunk_size), and
    regions that are the experts' bytes verbatim."""
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFWriter
    from gguf.quants import quantize

    ne0, ne1, n_expert, chunk_size = 512, 24, 3, 1000
    rng = np.random.default_rng(4)
    blocks = quantize(rng.normal(0, 0.02, (n_expert, ne1, ne0)).astype(np.float32), Q.Q8_0)
    src = tmp_path / "q8.gguf"
    w = GGUFWriter(src, "qwen3moe")
    w.add_tensor("blk.0.ffn_up_exps.weight", blocks, raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    packed = tmp_path / "q8.zipmoe.gguf"
    convert.convert(src, packed, chunk_n=chunk_size, threads=1)
    g = format.read_gguf(packed)
    data, index = g.by_name["blk.0.ffn_up_exps.zipmoe_data"], g.by_name["blk.0.ffn_up_exps.zipmoe_index"]
    raw = packed.read_bytes()
    idx = np.frombuffer(raw[index.file_offset:][:index.nbytes], "<i8")
    row = ne0 // 32 * 34
    expert_size = row * ne1
    chunk_n = 2 * chunk_size // row * row  # whole rows of about 2 * zipmoe.chunk_size bytes
    chunks = -(-expert_size // chunk_n)
    assert list(idx[:16]) == [metadata.INDEX_MAGIC, 1, 4, 0, int(Q.Q8_0), ne0, ne1, n_expert, 1, n_expert, ne0 * ne1,
                              chunk_n, chunks, data.nbytes, 64, 0]
    assert not idx[16:48].any()  # no code table
    assert idx.size == 48 + 2 * n_expert + 2 * n_expert * chunks + 1
    regions = idx[48:48 + 2 * n_expert].reshape(n_expert, 2)
    pairs = idx[48 + 2 * n_expert:-1].reshape(n_expert, chunks, 2)
    source = blocks.reshape(n_expert, -1)
    for e in range(n_expert):
        offset, size = (int(x) for x in regions[e])
        assert size == expert_size and offset % 64 == 0
        region = np.frombuffer(raw, np.uint8, size, data.file_offset + offset)
        np.testing.assert_array_equal(region, source[e])
        ends = [min((c + 1) * chunk_n, expert_size) for c in range(chunks)]
        assert list(pairs[e, :, 0]) == ends
        for c, end in enumerate(ends):  # checksum: empty raw plane, seeded with the chunk's bytes' hash
            code = region[end - (end - c * chunk_n):end]
            assert np.uint64(pairs[e, c, 1]) == np.uint64(codec.checksum(b"", codec.checksum(code)))
    meta = metadata.ZipmoeMeta.from_gguf(g)
    assert (meta.version, meta.codec, meta.level, meta.chunk_size) == (2, "raw", 0, chunk_size)
