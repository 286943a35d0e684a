"""The native codec: bit-exact round trips, SIMD against scalar, threads, and hostile input."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from pyzipmoe.file import codec
from pyzipmoe.file import gguf as format
from pyzipmoe.file import metadata
from pyzipmoe.errors import ChecksumError, FormatError, UnsupportedError

ALL_BF16 = np.arange(65536, dtype=np.uint16)  # every bit pattern: NaN payloads, +-0, +-Inf, subnormals


def gaussian_bf16(n: int, seed: int = 0, scale: float = 0.02) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal(n, dtype=np.float32) * np.float32(scale)
    u = x.view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def make_codec(name: str, values: np.ndarray) -> codec.Codec:
    if name == "huff":
        return codec.Codec("huff", lengths=codec.huff_lengths(codec.exponent_histogram(values)))
    if name == "esc":
        return codec.Codec("esc", lengths=codec.esc_classes(codec.exponent_histogram(values)))
    return codec.Codec("zstd", level=1)


def compress(experts: np.ndarray, name: str, chunk_n: int) -> tuple[codec.ExpertTensor, np.ndarray]:
    """Compresses experts [E, ne1, ne0] into a data companion and opens it through its index."""
    n_expert, ne1, ne0 = experts.shape
    c = make_codec(name, experts)
    encoded = [c.encode_expert(experts[e], chunk_n) for e in range(n_expert)]
    regions = np.zeros((n_expert, 2), np.uint64)
    offset = 0
    for e, enc in enumerate(encoded):
        regions[e] = (offset, enc.region.size)
        offset = format.align_up(offset + enc.region.size, metadata.region_alignment(2 * ne0 * ne1))
    data = np.zeros(offset, np.uint8)
    for e, enc in enumerate(encoded):
        data[int(regions[e, 0]):int(regions[e, 0]) + enc.region.size] = enc.region
    index = metadata.build_index(
        codec_name=name, level=c.level, dims=(ne0, ne1, n_expert), chunk_n=chunk_n, data_size=data.size,
        lengths=c.lengths, regions=regions,
        chunk_ends=np.stack([enc.chunk_ends for enc in encoded]), checksums=np.stack([enc.checksums for enc in encoded]),
    )
    return codec.ExpertTensor(index, data.size), data


def region(t: codec.ExpertTensor, data: np.ndarray, e: int) -> np.ndarray:
    span = t.span(e)
    return data[span.offset:span.offset + span.size]


def roundtrip(experts: np.ndarray, name: str, chunk_n: int) -> None:
    t, data = compress(experts, name, chunk_n)
    for e in range(experts.shape[0]):
        out = t.decode_expert(e, region(t, data, e))
        np.testing.assert_array_equal(out, experts[e].reshape(-1))


# ------------------------------------------------------------------------------------- split/merge


def test_split_merge_all_bit_patterns_scalar_and_simd_agree():
    exp_s, sm_s = codec.split_bf16(ALL_BF16, scalar=True)
    exp_v, sm_v = codec.split_bf16(ALL_BF16)
    np.testing.assert_array_equal(exp_s, exp_v)
    np.testing.assert_array_equal(sm_s, sm_v)
    np.testing.assert_array_equal(exp_s, (ALL_BF16 >> 7) & 0xFF)
    np.testing.assert_array_equal(sm_s, ((ALL_BF16 >> 8) & 0x80) | (ALL_BF16 & 0x7F))
    np.testing.assert_array_equal(codec.split_sm_bf16(ALL_BF16, scalar=True), sm_s)
    np.testing.assert_array_equal(codec.split_sm_bf16(ALL_BF16), sm_s)
    np.testing.assert_array_equal(codec.merge_bf16(exp_s, sm_s, scalar=True), ALL_BF16)
    np.testing.assert_array_equal(codec.merge_bf16(exp_s, sm_s), ALL_BF16)


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 31, 32, 33, 63, 65, 1000, 4099])
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_simd_matches_scalar_at_every_length_and_alignment(n, offset):
    values = np.random.default_rng(n).integers(0, 65536, n + offset, dtype=np.uint16)[offset:]
    exp_s, sm_s = codec.split_bf16(values, scalar=True)
    exp_v, sm_v = codec.split_bf16(values)
    np.testing.assert_array_equal(exp_s, exp_v)
    np.testing.assert_array_equal(sm_s, sm_v)
    np.testing.assert_array_equal(codec.split_sm_bf16(values, scalar=True), sm_s)
    np.testing.assert_array_equal(codec.split_sm_bf16(values), sm_s)
    np.testing.assert_array_equal(codec.merge_bf16(exp_v, sm_v), values)
    np.testing.assert_array_equal(codec.merge_bf16(exp_v, sm_v, scalar=True), values)


@pytest.mark.parametrize("n", [32768, 32768 + 17, 65536 + 5])
def test_large_merges_stream_the_same_values_at_every_alignment(n):
    """A merge of 64 KiB or more writes around the caches from dst's first 32-byte boundary on."""
    values = np.random.default_rng(n).integers(0, 65536, n, dtype=np.uint16)
    exp, sm = codec.split_bf16(values, scalar=True)
    buf = np.full(n + 16, 0xDEAD, np.uint16)
    for k in range(16):  # dst at every 2-byte offset within 32 bytes
        buf[:] = 0xDEAD
        out = buf[k:k + n]
        assert codec.merge_bf16(exp, sm, out=out) is out
        np.testing.assert_array_equal(out, values)
        assert (buf[:k] == 0xDEAD).all() and (buf[k + n:] == 0xDEAD).all()  # nothing written beside it


def test_histogram_counts_exponents():
    values = gaussian_bf16(10_001)
    hist = codec.exponent_histogram(values)
    np.testing.assert_array_equal(hist, np.bincount((values >> 7) & 0xFF, minlength=256).astype(np.uint64))


# ------------------------------------------------------------------------------------ Huffman code


def kraft_complete(lengths: np.ndarray) -> bool:
    present = lengths[lengths > 0].astype(np.int64)
    return int((1 << (11 - present)).sum()) == 1 << 11


def test_huffman_lengths_are_limited_and_complete_for_extreme_skew():
    hist = np.zeros(256, np.uint64)
    hist[:60] = [2 ** (59 - i) for i in range(60)]  # would need 59-bit codes unlimited
    lengths = codec.huff_lengths(hist)
    assert lengths.max() <= 11
    assert (lengths[:60] > 0).all() and (lengths[60:] == 0).all()
    assert kraft_complete(lengths)


def test_huffman_single_symbol_and_uniform():
    hist = np.zeros(256, np.uint64)
    hist[127] = 1000
    lengths = codec.huff_lengths(hist)
    assert lengths[127] == 1 and kraft_complete(lengths)
    assert (codec.huff_lengths(np.ones(256, np.uint64)) == 8).all()


def test_huffman_rejects_empty_histogram_and_bad_tables():
    with pytest.raises(Exception):
        codec.huff_lengths(np.zeros(256, np.uint64))
    bad = np.zeros(256, np.uint8)
    bad[:3] = 1  # Kraft sum 3/2: not a prefix code
    with pytest.raises(FormatError):
        codec.Codec("huff", lengths=bad)
    incomplete = np.zeros(256, np.uint8)
    incomplete[:3] = 2  # Kraft sum 3/4: some bit strings decode to nothing
    with pytest.raises(FormatError):
        codec.Codec("huff", lengths=incomplete)


def test_huffman_is_near_entropy_on_gaussian_weights():
    values = gaussian_bf16(1 << 18)
    hist = codec.exponent_histogram(values)
    t, data = compress(values.reshape(1, 512, 512), "huff", 65536)
    floor = (8 + codec.entropy_bits(hist)) / 16
    ratio = t.span(0).size / (2 * values.size)
    assert floor <= ratio < floor * 1.01


# ------------------------------------------------------------------------------------- escape code


def test_escape_classes_rank_the_commonest_exponents():
    hist = np.zeros(256, np.uint64)
    hist[[120, 121, 122, 119, 118, 117, 123, 116, 115, 124, 114, 113]] = [90, 80, 80, 60, 50, 40, 30, 20, 10, 5, 4, 3]
    classes = codec.esc_classes(hist)
    assert list(classes[[120, 121, 122]]) == [1, 2, 3]  # the tie 121/122 goes to the smaller exponent
    assert list(classes[[119, 118, 117, 123, 116, 115, 124]]) == [4, 5, 6, 7, 8, 9, 10]
    assert classes[114] == classes[113] == 0 and np.count_nonzero(classes) == 10
    few = np.zeros(256, np.uint64)
    few[[7, 9]] = [1, 2]
    assert list(codec.esc_classes(few)[[9, 7]]) == [1, 2] and np.count_nonzero(codec.esc_classes(few)) == 2


def test_escape_codec_rejects_bad_classes():
    for bad in (np.full(256, 11, np.uint8), np.r_[np.ones(2, np.uint8), np.zeros(254, np.uint8)]):
        with pytest.raises(FormatError):
            codec.Codec("esc", lengths=bad)
    with pytest.raises(ValueError):
        codec.Codec("esc")
    codec.Codec("esc", lengths=np.zeros(256, np.uint8))  # every exponent raw: valid, if large


def esc_chunk(c: codec.Codec, exp: np.ndarray) -> np.ndarray:
    """The escape-code chunk of an exponent plane (its sign+mantissa bytes play no part)."""
    ws = codec.Workspace(max(exp.size, 1))
    cap = codec.lib.zipmoe_chunk_bound(c._handle, exp.size)
    dst = np.empty(cap, np.uint8)
    values = codec.merge_bf16(exp, np.zeros(exp.size, np.uint8))
    size = codec.lib.zipmoe_chunk_encode(c._handle, ws.handle, codec.ffi.cast("uint16_t *", codec.ffi.from_buffer(values)),
                                         exp.size, codec.ffi.from_buffer(dst), cap)
    assert size >= 0
    return dst[:size].copy()


ESC_LEVELS = sorted({0, codec.esc_simd_level()})  # 0 the portable decoder; 2 AVX-512 VBMI2 where the CPU has it


def esc_decode_levels(c: codec.Codec, code: np.ndarray, n: int) -> list[tuple[int, np.ndarray | None]]:
    """(status, output) of the dispatched decoder, then of each level this CPU has, into guarded buffers."""
    results = []
    for level in [None] + ESC_LEVELS:
        out = np.full(n + 64, 0xAB, np.uint8)
        buf = codec.ffi.from_buffer(code) if code.size else codec.ffi.new("uint8_t[1]")
        if level is None:
            ws = codec.Workspace(max(n, 1))
            rc = codec.lib.zipmoe_chunk_decode_exponents(c._handle, ws.handle, buf, code.size,
                                                         codec.ffi.from_buffer(out), n)
        else:
            rc = codec.lib.zipmoe_esc_decode_chunk_at(c._handle, level, buf, code.size, codec.ffi.from_buffer(out), n)
        assert (out[n:] == 0xAB).all()  # nothing written past n
        results.append((int(rc), out[:n] if rc >= 0 else None))
    return results


def test_escape_levels_above_the_cpus_are_refused():
    c = make_codec("esc", gaussian_bf16(100))
    out = np.zeros(4, np.uint8)
    for level in {1, 3} | ({2} - set(ESC_LEVELS)):
        rc = codec.lib.zipmoe_esc_decode_chunk_at(c._handle, level, codec.ffi.new("uint8_t[16]"), 16,
                                                  codec.ffi.from_buffer(out), 4)
        assert rc == codec.lib.ZIPMOE_ERR_UNSUPPORTED, level


@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 31, 32, 33, 63, 64, 65, 127, 128, 129, 1000, 4099, 65536])
@pytest.mark.parametrize("kind", ["gaussian", "all raw", "primary only", "every byte"])
def test_escape_simd_decoders_match_the_portable_one(n, kind):
    rng = np.random.default_rng(n)
    if kind == "gaussian":
        exp = (gaussian_bf16(n, seed=n) >> 7).astype(np.uint8)
    elif kind == "primary only":
        exp = rng.choice(np.array([120, 121, 122], np.uint8), n)
    else:
        exp = rng.integers(0, 256, n, dtype=np.uint8)
    hist = np.bincount(exp, minlength=256).astype(np.uint64)
    classes = np.zeros(256, np.uint8) if kind == "all raw" else codec.esc_classes(hist)
    c = codec.Codec("esc", lengths=classes)
    code = esc_chunk(c, exp)
    for rc, out in esc_decode_levels(c, code, n):
        assert rc == n
        np.testing.assert_array_equal(out, exp)


def test_escape_decoders_agree_on_corrupt_chunks():
    """Chunks with consistent sizes but wrong counts of escapes: every decoder refuses them the same way, and none
    writes past n nor reads past the chunk (the SIMD loads are masked or bounded to it)."""
    rng = np.random.default_rng(5)
    exp = (gaussian_bf16(3000, seed=5) >> 7).astype(np.uint8)
    c = make_codec("esc", codec.merge_bf16(exp, np.zeros(exp.size, np.uint8)))
    good = esc_chunk(c, exp)
    n_sec, n_raw = good[:8].view("<u4")
    outcomes = set()
    for trial in range(400):
        bad = good.copy()
        how = trial % 4
        if how == 0:  # flipped bits anywhere past the header
            for pos in rng.integers(8, bad.size, 3):
                bad[pos] ^= np.uint8(1 << int(rng.integers(0, 8)))
        elif how == 1:  # fewer raw bytes declared, the chunk shortened to match
            k = int(rng.integers(1, 4))
            bad = np.r_[np.array([n_sec, max(int(n_raw) - k, 0)], "<u4").view(np.uint8), bad[8:bad.size - k]]
        elif how == 2:  # random planes of the right total size
            bad[8:] = rng.integers(0, 256, bad.size - 8, dtype=np.uint8)
        else:  # header counts that do not fit the chunk's size
            bad[:8] = np.array(rng.integers(0, 4000, 2), "<u4").view(np.uint8)
        results = esc_decode_levels(c, bad, exp.size)
        rc, out = results[0]
        assert {r for r, _ in results} == {rc}
        assert rc == exp.size or rc == codec.lib.ZIPMOE_ERR_CORRUPT
        for _, other in results[1:]:
            if rc >= 0:
                np.testing.assert_array_equal(out, other)
        outcomes.add(rc)
    assert outcomes == {exp.size, codec.lib.ZIPMOE_ERR_CORRUPT}  # both kinds of result were exercised


def test_escape_code_is_close_to_huffman_on_gaussian_weights():
    values = gaussian_bf16(1 << 18)
    sizes = {name: compress(values.reshape(1, 512, 512), name, 65536)[0].span(0).size for name in ("huff", "esc")}
    bits = {name: (size * 8 / values.size) - 8 for name, size in sizes.items()}  # exponent bits a value
    assert bits["huff"] < bits["esc"] < bits["huff"] + 0.45


# ---------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("name", ["huff", "esc", "zstd"])
def test_all_bit_patterns_roundtrip(name):
    roundtrip(ALL_BF16.reshape(2, 128, 256), name, 4096)


@pytest.mark.parametrize("name", ["huff", "esc", "zstd"])
@pytest.mark.parametrize("shape,chunk_n", [
    ((1, 1, 1), 1),          # one value
    ((3, 1, 1), 7),          # chunk larger than the expert
    ((2, 3, 11), 7),         # odd sizes, last chunk short
    ((2, 64, 64), 4096),     # exactly one chunk
    ((2, 65, 63), 4096),     # not a multiple of the chunk
    ((1, 97, 101), 33),      # many small chunks: stream tails everywhere
    ((2, 256, 513), 65536),  # default chunk size, one short chunk
])
def test_roundtrip_shapes_and_chunkings(name, shape, chunk_n):
    values = gaussian_bf16(int(np.prod(shape)), seed=sum(shape)).reshape(shape)
    roundtrip(values, name, chunk_n)


def test_empty_chunk_encodes_and_decodes():
    """An expert is never empty, but the chunk-level API accepts n = 0: a header of empty streams."""
    c = codec.Codec("huff", lengths=codec.huff_lengths(np.ones(256, np.uint64)))
    ws = codec.Workspace(16)
    buf = codec.ffi.new("uint8_t[64]")
    size = codec.lib.zipmoe_chunk_encode(c._handle, ws.handle, codec.ffi.NULL, 0, buf, 64)
    assert size == 12
    out = codec.ffi.new("uint16_t[1]")
    assert codec.lib.zipmoe_chunk_decode(c._handle, ws.handle, buf, size, codec.ffi.NULL, 0, 0, 0, out) == 0


@pytest.mark.parametrize("name", ["huff", "esc", "zstd"])
@pytest.mark.parametrize("threads", [2, 3, 5])
def test_threads_sharing_one_expert_decode_identically(name, threads):
    values = gaussian_bf16(3 * 200 * 300, seed=threads).reshape(3, 200, 300)
    t, data = compress(values, name, 4000)  # 15 chunks: uneven shares
    for e in range(3):
        out = t.decode_expert_parallel(e, region(t, data, e), threads=threads)
        np.testing.assert_array_equal(out, values[e].reshape(-1))


@settings(max_examples=60, deadline=None)
@given(
    values=hnp.arrays(np.uint16, st.integers(1, 3000)),
    chunk_n=st.integers(1, 4096),
    name=st.sampled_from(["huff", "esc", "zstd"]),
)
def test_arbitrary_arrays_roundtrip(values, chunk_n, name):
    roundtrip(values.reshape(1, 1, -1), name, chunk_n)


@settings(max_examples=30, deadline=None)
@given(
    exps=hnp.arrays(np.uint8, st.integers(1, 2000), elements=st.integers(100, 130)),
    sms=st.binary(min_size=2000, max_size=2000),
    chunk_n=st.integers(1, 700),
)
def test_skewed_exponents_roundtrip(exps, sms, chunk_n):
    sm = np.frombuffer(sms, np.uint8)[: exps.size]
    values = codec.merge_bf16(exps, sm.copy())
    roundtrip(values.reshape(1, 1, -1), "huff", chunk_n)
    roundtrip(values.reshape(1, 1, -1), "esc", chunk_n)


# ------------------------------------------------------------------------------- hostile input


@pytest.mark.parametrize("name", ["huff", "esc", "zstd"])
def test_every_flipped_bit_in_a_region_is_caught(name):
    values = gaussian_bf16(2 * 40 * 50, seed=7).reshape(2, 40, 50)
    t, data = compress(values, name, 512)
    span = t.span(1)
    rng = np.random.default_rng(0)
    padding = range(t.info.n_per_expert, span.exp_offset)  # affects no value, so covered by no checksum
    for pos in rng.integers(0, span.size, 200):
        bad = data.copy()
        bad[span.offset + pos] ^= np.uint8(1 << int(rng.integers(0, 8)))
        if pos in padding:
            np.testing.assert_array_equal(t.decode_expert(1, region(t, bad, 1)), values[1].reshape(-1))
            continue
        with pytest.raises(ChecksumError):
            t.decode_expert(1, region(t, bad, 1))
        np.testing.assert_array_equal(t.decode_expert(0, region(t, bad, 0)), values[0].reshape(-1))


def test_tampered_index_is_refused():
    values = gaussian_bf16(2 * 30 * 30).reshape(2, 30, 30)
    t, data = compress(values, "huff", 256)
    index = np.asarray(t._index).view(np.int64).copy()
    for pos in range(index.size):
        bad = index.copy()
        bad[pos] ^= 1 << 40
        with pytest.raises((FormatError, UnsupportedError)):  # a flipped version reads as a newer one
            codec.ExpertTensor(bad, data.size)
    with pytest.raises(FormatError):
        codec.ExpertTensor(index[:-3], data.size)  # truncated
    with pytest.raises(FormatError):
        codec.ExpertTensor(index, data.size - 1)  # data companion of another size
    with pytest.raises(FormatError):
        codec.ExpertTensor(index.view(np.uint8)[:17], data.size)


def forge(index: np.ndarray, edit) -> np.ndarray:
    """An index edited and re-checksummed, as an attacker who knows the format would write it."""
    bad = index.view(np.uint64).copy()
    edit(bad)
    bad[-1] = codec.checksum(bad[:-1])
    return bad.view(np.int64)


@pytest.mark.parametrize("edit", [
    lambda ix: ix.__setitem__(9, 1 << 62),                  # absurd expert count
    lambda ix: ix.__setitem__(10, 1 << 60),                 # absurd expert size
    lambda ix: ix.__setitem__(5, 1 << 33),                  # ne0 * ne1 != n_per_expert
    lambda ix: ix.__setitem__(11, 0),                       # zero chunk size
    lambda ix: ix.__setitem__(48, 3),                       # unaligned region
    lambda ix: ix.__setitem__(49, 1 << 50),                 # region past the data
    lambda ix: ix.__setitem__(50, 0),                       # regions overlap
    lambda ix: ix.__setitem__(52, 1 << 40),                 # chunk end past its region
    lambda ix: ix.__setitem__(4, 2),                        # Q4_0: stored raw, not with huff
    lambda ix: ix.__setitem__(4, 24),                       # I8: no expert type
    lambda ix: ix.__setitem__(2, 4),                        # raw codec for BF16 values
    lambda ix: ix.__setitem__(2, 9),                        # unknown codec
    lambda ix: ix.__setitem__(16, 0x0101010101010101),      # not a prefix code
])
def test_forged_inconsistent_index_is_refused(edit):
    values = gaussian_bf16(2 * 30 * 30).reshape(2, 30, 30)
    t, data = compress(values, "huff", 256)
    with pytest.raises(Exception) as err:
        codec.ExpertTensor(forge(np.asarray(t._index).view(np.int64), edit), data.size)
    assert isinstance(err.value, (FormatError, UnsupportedError))


@pytest.mark.parametrize("name", ["huff", "esc", "zstd"])
def test_forged_chunks_with_valid_checksums_never_write_out_of_bounds(name):
    """Random chunk bytes with a matching checksum: an error or n values, never more, never a crash."""
    values = gaussian_bf16(4096, seed=3)
    c = make_codec(name, values)
    ws = codec.Workspace(1024)
    rng = np.random.default_rng(1)
    sm = rng.integers(0, 256, 1024, dtype=np.uint8)
    for trial in range(300):
        code = rng.integers(0, 256, int(rng.integers(0, 600)), dtype=np.uint8)
        if name == "huff" and code.size >= 12 and trial % 2:
            code[:12] = np.frombuffer(np.array(rng.integers(0, 200, 3), "<u4").tobytes(), np.uint8)
        n = int(rng.integers(0, 1024))
        out = np.full(1025, 0xABCD, np.uint16)
        cs = codec.lib.zipmoe_checksum(codec.ffi.from_buffer(sm), n, codec.checksum(code))
        rc = codec.lib.zipmoe_chunk_decode(
            c._handle, ws.handle, codec.ffi.from_buffer(code), code.size, codec.ffi.from_buffer(sm), n, 1, cs,
            codec.ffi.cast("uint16_t *", codec.ffi.from_buffer(out)),
        )
        assert rc == n or rc in (codec.lib.ZIPMOE_ERR_CORRUPT, codec.lib.ZIPMOE_ERR_CODEC)
        assert (out[n:] == 0xABCD).all()
