"""GGUF structure: reading any GGUF header safely, writing zipmoe GGUFs exactly as docs/FORMAT.md says.

Reading is an own small parser rather than gguf-py's GGUFReader: input files are untrusted, and every
malformed, truncated or foreign input must become a one-line `FormatError` (GGUFReader raises whatever
numpy or struct raise), and the converter needs the raw bytes of the source's key/value section.

Writing follows llama.cpp's reader (ggml/src/gguf.cpp), which is stricter than the GGUF spec: every
tensor's offset must equal the padded sizes of the tensors before it in tensor-info order, so tensor data
is contiguous and the only freedom is *inside* a tensor. That is how data companions land on 4096-aligned
file offsets: a data companion is padded at its end so that the next one starts on a page, and the
header is padded (key `zipmoe.header_padding`) so that the first one does.
"""

from __future__ import annotations

import io
import os
import re
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from . import codec
from ..errors import ChecksumError, FormatError, UnsupportedError

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
GGUF_READ_VERSIONS = (2, 3)  # v2 has the same layout as v3 (64-bit counts); v1 is long gone
GGUF_DEFAULT_ALIGNMENT = 32
GGML_MAX_DIMS = 4
GGML_MAX_NAME = 64  # including the terminating NUL, so names have at most 63 bytes
PAGE = 4096  # data companions and expert regions start on multiples of this

FORMAT_VERSION = 1
INDEX_MAGIC = 0x3158444945504D5A  # the bytes "ZMPEIDX1"
INDEX_VERSION = 1
INDEX_HEADER = 48
REGION_ALIGN = PAGE  # of expert regions whose BF16 size is at least SMALL_EXPERT
SMALL_EXPERT = 64 * 1024
SMALL_REGION_ALIGN = 64  # page-aligning experts smaller than ~a page would waste more than it saves
SOURCE_HEADER = "zipmoe.source_header"
DATA_SUFFIX = ".zipmoe_data"
INDEX_SUFFIX = ".zipmoe_index"
PADDING_KEY = "zipmoe.header_padding"
INTEGRITY_KEY = "zipmoe.integrity"
INTEGRITY_MAGIC = 0x31544E4945504D5A  # the bytes "ZMPEINT1"
INTEGRITY_VERSION = 1
INTEGRITY_BLOCK = 1 << 20  # block size of the chained hash
INTEGRITY_HEADER = 6  # magic, version, self offset, metadata size, metadata hash, tensor count
KIND_HASHED = 1  # the tensor's bytes are hashed
KIND_COMPANION = 2  # an expert data companion: its chunks carry their own checksums
GGUF_FIXED_HEADER = 24  # magic, version, tensor count, key/value count

GGML_TYPE_I8 = int(GGMLQuantizationType.I8)
GGML_TYPE_I64 = int(GGMLQuantizationType.I64)
GGML_TYPE_BF16 = int(GGMLQuantizationType.BF16)

EXPERT_NAME = re.compile(r"blk\.\d+\.ffn_(?:up|gate|down|gate_up)_exps\.weight")

_SCALARS: dict[int, str] = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_MIN_KV_BYTES = 8 + 4 + 1  # empty key, value type, smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # empty name, no dims, type, offset


def align_up(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def type_name(ggml_type: int) -> str:
    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


def tensor_nbytes(ggml_type: int, dims: Sequence[int]) -> int:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    n = 1
    for d in dims:
        n *= d
    return n // block * size


# ------------------------------------------------------------------------------------------ reading


@dataclass(frozen=True)
class KV:
    """One key/value pair: its GGUF value type (and element type for arrays) and the decoded value."""

    vtype: int
    value: Any
    etype: int | None = None


@dataclass(frozen=True)
class Tensor:
    """A tensor info entry; `offset` is relative to the data section, `file_offset` absolute."""

    name: str
    dims: tuple[int, ...]  # ggml order: dims[0] is contiguous
    ggml_type: int
    offset: int
    nbytes: int
    file_offset: int


@dataclass(frozen=True)
class GGUFFile:
    """The header of a GGUF file, validated against the size of the file it came from."""

    label: str  # how messages name the file
    version: int
    kv: dict[str, KV]
    kv_raw: bytes  # the key/value section exactly as stored, for verbatim copying
    tensors: tuple[Tensor, ...]
    alignment: int
    data_start: int
    file_size: int
    by_name: dict[str, Tensor] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_name", {t.name: t for t in self.tensors})

    @property
    def n_kv(self) -> int:
        return len(self.kv)

    @property
    def is_zipmoe(self) -> bool:
        return "zipmoe.version" in self.kv


class _Cursor:
    """Bounds-checked little-endian reads from the start of a stream of known total size.

    The stream is read in growing blocks, so a header of many megabytes (large vocabularies) costs a few
    reads, and nothing past the header is ever read.
    """

    def __init__(self, stream: BinaryIO, size: int, label: str):
        self._stream = stream
        self._size = size
        self._label = label
        self._buf = bytearray()
        self.pos = 0

    def _need(self, n: int, what: str) -> int:
        end = self.pos + n
        if end > self._size:
            raise FormatError(f"{self._label}: truncated GGUF ({what} would end at byte {end}, "
                              f"the file has {self._size})")
        if end > len(self._buf):
            want = min(self._size, max(end, 2 * len(self._buf), 1 << 16)) - len(self._buf)
            self._buf += self._stream.read(want)
            if end > len(self._buf):
                raise FormatError(f"{self._label}: truncated GGUF (file ended while reading {what})")
        start, self.pos = self.pos, end
        return start

    def remaining(self) -> int:
        return self._size - self.pos

    def unpack(self, fmt: str, what: str) -> Any:
        start = self._need(struct.calcsize(fmt), what)
        return struct.unpack_from(fmt, self._buf, start)[0]

    def u32(self, what: str) -> int:
        return self.unpack("<I", what)

    def u64(self, what: str) -> int:
        return self.unpack("<Q", what)

    def raw(self, n: int, what: str) -> bytes:
        start = self._need(n, what)
        return bytes(self._buf[start:start + n])

    def string(self, what: str) -> str:
        n = self.u64(what)
        data = self.raw(n, what)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise FormatError(f"{self._label}: {what} is not valid UTF-8") from None

    def count(self, what: str, min_item_bytes: int) -> int:
        """A count of items that must each take at least min_item_bytes of what remains of the file."""
        n = self.u64(what)
        if n * min_item_bytes > self.remaining():
            raise FormatError(f"{self._label}: {what} is {n}, more than the file can hold: corrupt or truncated")
        return n

    def slice(self, start: int, end: int) -> bytes:
        return bytes(self._buf[start:end])

    def value(self, vtype: int, what: str) -> KV:
        if vtype in _SCALARS:
            return KV(vtype, self.unpack(_SCALARS[vtype], what))
        if vtype == GGUFValueType.STRING:
            return KV(vtype, self.string(what))
        if vtype != GGUFValueType.ARRAY:
            raise FormatError(f"{self._label}: {what} has unknown value type {vtype}")
        etype = self.u32(what)
        if etype in _SCALARS:
            dtype = np.dtype(_SCALARS[etype])
            n = self.count(f"{what} length", dtype.itemsize)
            return KV(vtype, np.frombuffer(self.raw(n * dtype.itemsize, what), dtype).copy(), etype)
        if etype == GGUFValueType.STRING:
            n = self.count(f"{what} length", 8)
            return KV(vtype, [self.string(what) for _ in range(n)], etype)
        # llama.cpp's reader has no nested arrays either
        raise FormatError(f"{self._label}: {what} is an array of unsupported type {etype}")


def _alignment(kv: dict[str, KV], label: str) -> int:
    entry = kv.get("general.alignment")
    if entry is None:
        return GGUF_DEFAULT_ALIGNMENT
    if entry.vtype != GGUFValueType.UINT32 or entry.value == 0 or entry.value & (entry.value - 1):
        raise FormatError(f"{label}: general.alignment must be a u32 power of two, got {entry.value!r}")
    return int(entry.value)


def _tensor_info(cur: _Cursor, label: str, i: int) -> tuple[str, tuple[int, ...], int, int]:
    name = cur.string(f"name of tensor {i}")
    n_dims = cur.u32(f"dimension count of {name}")
    if n_dims > GGML_MAX_DIMS:
        raise FormatError(f"{label}: tensor {name} has {n_dims} dimensions (at most {GGML_MAX_DIMS})")
    dims = tuple(cur.u64(f"dimensions of {name}") for _ in range(n_dims))
    ggml_type = cur.u32(f"type of {name}")
    offset = cur.u64(f"offset of {name}")
    try:
        block, _ = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise FormatError(f"{label}: tensor {name} has unknown type {ggml_type}") from None
    if any(d >= 1 << 63 for d in dims) or (dims and dims[0] % block):
        raise FormatError(f"{label}: tensor {name} has invalid dimensions {list(dims)} for {type_name(ggml_type)}")
    return name, dims, ggml_type, offset


def parse_gguf(stream: BinaryIO, size: int, label: str) -> GGUFFile:
    """Parses a GGUF header from the start of `stream`, whose file is `size` bytes long.

    Tensor data is never read; every offset is checked against `size`.
    """
    cur = _Cursor(stream, size, label)
    if size < 4 or cur.raw(4, "magic") != GGUF_MAGIC:
        raise FormatError(f"{label}: not a GGUF file (it does not start with 'GGUF')")
    version = cur.u32("version")
    if version not in GGUF_READ_VERSIONS:
        raise UnsupportedError(f"{label}: GGUF version {version} is not supported (only 2 and 3; "
                               "a big-endian GGUF shows up as a huge version)")
    n_tensors = cur.count("tensor count", _MIN_TENSOR_INFO_BYTES)
    n_kv = cur.count("key/value count", _MIN_KV_BYTES)
    kv_start = cur.pos
    kv: dict[str, KV] = {}
    for i in range(n_kv):
        key = cur.string(f"key {i}")
        if key in kv:
            raise FormatError(f"{label}: duplicate key {key}")
        kv[key] = cur.value(cur.u32(f"type of {key}"), f"value of {key}")
    kv_raw = cur.slice(kv_start, cur.pos)
    alignment = _alignment(kv, label)
    infos = [_tensor_info(cur, label, i) for i in range(n_tensors)]
    data_start = align_up(cur.pos, alignment)
    if n_tensors and data_start > size:
        raise FormatError(f"{label}: truncated GGUF (the data section would start at byte {data_start}, "
                          f"the file has {size})")
    tensors = []
    seen: set[str] = set()
    for name, dims, ggml_type, offset in infos:
        if name in seen:
            raise FormatError(f"{label}: duplicate tensor {name}")
        seen.add(name)
        if offset % alignment:
            raise FormatError(f"{label}: tensor {name} is at offset {offset}, not a multiple of the "
                              f"alignment {alignment}")
        nbytes = tensor_nbytes(ggml_type, dims)
        end = data_start + offset + nbytes
        if end > size:
            raise FormatError(f"{label}: tensor {name} ends at byte {end} but the file has {size}: "
                              "truncated file?")
        tensors.append(Tensor(name, dims, ggml_type, offset, nbytes, data_start + offset))
    return GGUFFile(label, version, kv, kv_raw, tuple(tensors), alignment, data_start, size)


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Parses the header of the GGUF file at `path` (OSError if it cannot be opened)."""
    with open(path, "rb") as f:
        return parse_gguf(f, os.fstat(f.fileno()).st_size, str(path))


# ------------------------------------------------------------------------------------ expert tensors


def is_expert_tensor(t: Tensor) -> bool:
    """Named like an expert tensor and 3-D; its type is checked separately (non-BF16 ones are refused)."""
    return EXPERT_NAME.fullmatch(t.name) is not None and len(t.dims) == 3


def companion_names(name: str) -> tuple[str, str]:
    """(data, index) companion names of the expert tensor `name` (`<base>.weight`)."""
    base = name.removesuffix(".weight")
    return base + DATA_SUFFIX, base + INDEX_SUFFIX


def n_chunks(n_per_expert: int, chunk_n: int) -> int:
    return -(-n_per_expert // chunk_n)


def index_len(n_expert: int, chunks_per_expert: int) -> int:
    return INDEX_HEADER + 2 * n_expert + 2 * n_expert * chunks_per_expert + 1


def region_alignment(n_per_expert: int) -> int:
    """Alignment of expert regions: a page for experts big enough to be read page by page."""
    return REGION_ALIGN if 2 * n_per_expert >= SMALL_EXPERT else SMALL_REGION_ALIGN


def build_index(*, codec_name: str, level: int, dims: Sequence[int], chunk_n: int, data_size: int,
                lengths: np.ndarray | None, regions: np.ndarray, chunk_ends: np.ndarray,
                checksums: np.ndarray) -> np.ndarray:
    """The `<base>.zipmoe_index` companion of FORMAT.md, checksum included, as int64 elements.

    `regions` is uint64 [E, 2] (offset, size); `chunk_ends` and `checksums` are uint64 [E, C].
    """
    ne0, ne1, n_expert = dims
    n_per = ne0 * ne1
    c = n_chunks(n_per, chunk_n)
    if regions.shape != (n_expert, 2) or chunk_ends.shape != (n_expert, c) or checksums.shape != (n_expert, c):
        raise ValueError("region and chunk tables do not match the tensor's shape")
    idx = np.zeros(index_len(n_expert, c), "<u8")
    idx[:16] = [INDEX_MAGIC, INDEX_VERSION, codec.CODECS[codec_name], level & (2**64 - 1), GGML_TYPE_BF16,
                ne0, ne1, n_expert, 1, n_expert, n_per, chunk_n, c, data_size, region_alignment(n_per), 0]
    if lengths is not None:
        idx[16:48] = np.ascontiguousarray(lengths, np.uint8).view("<u8")
    body = INDEX_HEADER + 2 * n_expert
    idx[INDEX_HEADER:body] = regions.reshape(-1)
    pairs = idx[body:-1].reshape(n_expert, c, 2)
    pairs[..., 0] = chunk_ends
    pairs[..., 1] = checksums
    idx[-1] = codec.checksum(idx[:-1])
    return idx.view("<i8")


# --------------------------------------------------------------------------------------- metadata


@dataclass(frozen=True)
class ZipmoeMeta:
    """The `zipmoe.*` keys of FORMAT.md."""

    codec: str
    level: int
    chunk_size: int
    tensors: tuple[str, ...]
    source_size: int
    source_sha256: str
    source_data_start: int
    exponent_entropy: tuple[float, ...]
    version: int = FORMAT_VERSION

    def encode(self) -> tuple[bytes, int]:
        """The key/value bytes, in FORMAT.md's order, and their count."""
        T = GGUFValueType
        pairs = [
            encode_kv("zipmoe.version", T.UINT32, self.version),
            encode_kv("zipmoe.codec", T.STRING, self.codec),
            encode_kv("zipmoe.codec_level", T.INT32, self.level),
            encode_kv("zipmoe.chunk_size", T.UINT32, self.chunk_size),
            encode_kv("zipmoe.tensors", T.ARRAY, list(self.tensors), T.STRING),
            encode_kv("zipmoe.source.size", T.UINT64, self.source_size),
            encode_kv("zipmoe.source.sha256", T.STRING, self.source_sha256),
            encode_kv("zipmoe.source.data_start", T.UINT64, self.source_data_start),
            encode_kv("zipmoe.exponent_entropy", T.ARRAY, list(self.exponent_entropy), T.FLOAT32),
        ]
        return b"".join(pairs), len(pairs)

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> ZipmoeMeta:
        T = GGUFValueType

        def get(key: str, vtype: int, etype: int | None = None) -> Any:
            entry = g.kv.get(key)
            if entry is None:
                raise FormatError(f"{g.label}: zipmoe metadata key {key} is missing")
            if entry.vtype != vtype or entry.etype != etype:
                raise FormatError(f"{g.label}: zipmoe metadata key {key} has the wrong type")
            return entry.value

        version = get("zipmoe.version", T.UINT32)
        if version != FORMAT_VERSION:
            raise UnsupportedError(f"{g.label}: zipmoe format version {version} is not supported "
                                   f"(this zipmoe reads version {FORMAT_VERSION})")
        meta = cls(
            codec=get("zipmoe.codec", T.STRING),
            level=int(get("zipmoe.codec_level", T.INT32)),
            chunk_size=int(get("zipmoe.chunk_size", T.UINT32)),
            tensors=tuple(get("zipmoe.tensors", T.ARRAY, T.STRING)),
            source_size=int(get("zipmoe.source.size", T.UINT64)),
            source_sha256=get("zipmoe.source.sha256", T.STRING),
            source_data_start=int(get("zipmoe.source.data_start", T.UINT64)),
            exponent_entropy=tuple(float(x) for x in get("zipmoe.exponent_entropy", T.ARRAY, T.FLOAT32)),
            version=version,
        )
        if meta.codec not in codec.CODECS:
            raise UnsupportedError(f"{g.label}: unknown zipmoe codec {meta.codec!r}")
        if len(set(meta.tensors)) != len(meta.tensors):
            raise FormatError(f"{g.label}: zipmoe.tensors lists a tensor twice")
        if len(meta.exponent_entropy) != len(meta.tensors):
            raise FormatError(f"{g.label}: zipmoe.exponent_entropy has {len(meta.exponent_entropy)} entries "
                              f"for {len(meta.tensors)} tensors")
        if not re.fullmatch(r"[0-9a-f]{64}", meta.source_sha256):
            raise FormatError(f"{g.label}: zipmoe.source.sha256 is not a hex sha256")
        return meta


# ------------------------------------------------------------------------------------------ writing


def encode_string(s: str) -> bytes:
    data = s.encode("utf-8")
    return struct.pack("<Q", len(data)) + data


def encode_kv(key: str, vtype: int, value: Any, etype: int | None = None) -> bytes:
    head = encode_string(key) + struct.pack("<I", vtype)
    if vtype in _SCALARS:
        return head + struct.pack(_SCALARS[vtype], value)
    if vtype == GGUFValueType.STRING:
        return head + encode_string(value)
    if etype == GGUFValueType.STRING:
        body = b"".join(encode_string(s) for s in value)
    else:
        body = np.asarray(value, _SCALARS[etype]).tobytes()
    return head + struct.pack("<IQ", etype, len(value)) + body


def encode_tensor_info(name: str, dims: Sequence[int], ggml_type: int, offset: int) -> bytes:
    return encode_string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, ggml_type, offset)


# ------------------------------------------------------------------------------------- integrity record


def integrity_hash(data: Any, h: int = 0) -> int:
    """The chained hash of FORMAT.md: h = XXH3_64(block, seed = h) over 1 MiB blocks, from h = 0."""
    view = memoryview(data).cast("B")
    for start in range(0, len(view), INTEGRITY_BLOCK):
        h = codec.checksum(view[start:start + INTEGRITY_BLOCK], h)
    return h


class ChainHash:
    """integrity_hash of a stream of pieces of any sizes."""

    def __init__(self) -> None:
        self._h = 0
        self._pending = bytearray()

    def update(self, piece: Any) -> None:
        view = memoryview(piece).cast("B")
        if self._pending:
            take = min(len(view), INTEGRITY_BLOCK - len(self._pending))
            self._pending += view[:take]
            view = view[take:]
            if len(self._pending) < INTEGRITY_BLOCK:
                return
            self._h = codec.checksum(self._pending, self._h)
            self._pending.clear()
        whole = len(view) // INTEGRITY_BLOCK * INTEGRITY_BLOCK
        self._h = integrity_hash(view[:whole], self._h)
        self._pending += view[whole:]

    def digest(self) -> int:
        return codec.checksum(self._pending, self._h) if self._pending else self._h


def integrity_len(n_tensors: int) -> int:
    return INTEGRITY_HEADER + 2 * n_tensors + 1


def build_integrity(self_offset: int, meta_size: int, meta_hash: int,
                    tensors: Sequence[tuple[int, int]]) -> np.ndarray:
    """The `zipmoe.integrity` value: uint64 elements, its own checksum last."""
    rec = np.zeros(integrity_len(len(tensors)), "<u8")
    rec[:INTEGRITY_HEADER] = [INTEGRITY_MAGIC, INTEGRITY_VERSION, self_offset, meta_size, meta_hash, len(tensors)]
    if tensors:
        rec[INTEGRITY_HEADER:-1] = np.asarray(tensors, np.uint64).reshape(-1)
    rec[-1] = codec.checksum(rec[:-1])
    return rec


@dataclass(frozen=True)
class IntegrityRecord:
    """A parsed `zipmoe.integrity` value, its shape and own checksum validated (not yet the file)."""

    raw: np.ndarray  # uint64 elements as stored
    self_offset: int
    meta_size: int
    meta_hash: int
    kinds: tuple[int, ...]
    hashes: tuple[int, ...]

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> IntegrityRecord | None:
        entry = g.kv.get(INTEGRITY_KEY)
        if entry is None:
            return None
        label = f"{g.label}: {INTEGRITY_KEY}"
        if entry.vtype != GGUFValueType.ARRAY or entry.etype != GGUFValueType.UINT64:
            raise FormatError(f"{label} has the wrong type: the record is damaged")
        rec = np.asarray(entry.value, "<u8")
        if rec.size < INTEGRITY_HEADER + 1 or codec.checksum(rec[:-1]) != int(rec[-1]):
            raise ChecksumError(f"{label}: the record is damaged (it does not match its own checksum)")
        magic, version, self_offset, meta_size, meta_hash, n = (int(x) for x in rec[:INTEGRITY_HEADER])
        if magic != INTEGRITY_MAGIC:
            raise FormatError(f"{label}: the record is damaged (bad magic)")
        if version != INTEGRITY_VERSION:
            raise UnsupportedError(f"{label}: version {version} is not supported (this zipmoe reads "
                                   f"{INTEGRITY_VERSION})")
        if rec.size != integrity_len(n):
            raise FormatError(f"{label}: the record is damaged (its length does not match its tensor count)")
        pairs = rec[INTEGRITY_HEADER:-1].reshape(n, 2)
        return cls(rec, self_offset, meta_size, meta_hash, tuple(int(k) for k in pairs[:, 0]),
                   tuple(int(h) for h in pairs[:, 1]))


def _hash_file_range(fd: int, offset: int, size: int, label: str, hole: bytes = b"",
                     hole_at: int = 0) -> tuple[int, bool]:
    """integrity_hash of [offset, offset + size) of fd, with the bytes at hole_at (which must equal `hole`)
    hashed as zeros. Returns the hash and whether the hole matched."""
    h, matched = 0, True
    for start in range(0, size, INTEGRITY_BLOCK):
        a = offset + start
        block = bytearray(pread_exact(fd, min(INTEGRITY_BLOCK, size - start), a, label))
        lo, hi = max(hole_at, a), min(hole_at + len(hole), a + len(block))
        if lo < hi:
            matched &= block[lo - a:hi - a] == hole[lo - hole_at:hi - hole_at]
            block[lo - a:hi - a] = bytes(hi - lo)
        h = codec.checksum(block, h)
    return h, matched


def check_integrity(path: str | os.PathLike[str], g: GGUFFile, record: IntegrityRecord | None) -> int:
    """Checks the file against its integrity record, as llama.cpp's loader does (patches/0005): the metadata
    and every hashed tensor. Returns the number of bytes hashed; raises a one-line FormatError (ChecksumError
    for damaged bytes) that names what is damaged."""
    label = str(path)
    if record is None:
        raise FormatError(f"{label}: no {INTEGRITY_KEY} record (written by an older zipmoe): the metadata and "
                          "dense tensors cannot be checked; convert the source again (`zipmoe unpack`, then "
                          "`zipmoe convert`)")
    if len(record.kinds) != len(g.tensors):
        raise FormatError(f"{label}: the file has {len(g.tensors)} tensors but {INTEGRITY_KEY} lists "
                          f"{len(record.kinds)}: the tensor list is damaged")
    if record.meta_size != g.data_start:
        raise FormatError(f"{label}: the metadata is damaged: the tensor data starts at byte {g.data_start}, "
                          f"{INTEGRITY_KEY} recorded {record.meta_size}")
    rec_bytes = record.raw.tobytes()
    if record.self_offset + len(rec_bytes) > record.meta_size:
        raise FormatError(f"{label}: the {INTEGRITY_KEY} record is damaged (it places itself outside the metadata)")
    fd = os.open(path, os.O_RDONLY)
    try:
        h, matched = _hash_file_range(fd, 0, record.meta_size, label, rec_bytes, record.self_offset)
        if not matched:
            raise FormatError(f"{label}: the {INTEGRITY_KEY} record is damaged (it is not where it says it is)")
        if h != record.meta_hash:
            raise ChecksumError(f"{label}: the metadata (header, key/value pairs and tensor infos: bytes "
                                f"0-{record.meta_size}) is damaged: it does not match the checksum recorded at "
                                "conversion")
        hashed = record.meta_size
        for t, kind, want in zip(g.tensors, record.kinds, record.hashes):
            if kind == KIND_COMPANION:
                if not t.name.endswith(DATA_SUFFIX):
                    raise FormatError(f"{label}: the tensor list is damaged: {INTEGRITY_KEY} lists {t.name} as a "
                                      "data companion")
                continue
            if kind != KIND_HASHED:
                raise FormatError(f"{label}: the {INTEGRITY_KEY} record is damaged (unknown kind {kind} for {t.name})")
            got, _ = _hash_file_range(fd, t.file_offset, t.nbytes, label)
            if got != want:
                raise ChecksumError(f"{label}: tensor {t.name} is damaged: its bytes do not match the checksum "
                                    "recorded at conversion")
            hashed += t.nbytes
    finally:
        os.close(fd)
    return hashed


@dataclass(frozen=True)
class Slot:
    """A tensor of the output, in tensor-info order.

    `dims` is None for a 1-D tensor whose length is known only once its data is written (a data
    companion); such a tensor starts at a page-aligned file offset.
    """

    name: str
    ggml_type: int
    dims: tuple[int, ...] | None

    @property
    def nbytes(self) -> int:
        if self.dims is None:
            raise ValueError(f"{self.name} has no size until it is written")
        return tensor_nbytes(self.ggml_type, self.dims)

    @property
    def page_aligned(self) -> bool:
        return self.dims is None


def zipmoe_slots(source: GGUFFile, expert_names: set[str], chunk_n: int) -> list[Slot]:
    """The output's tensors: the source's, experts replaced by their companions, the source header last."""
    slots = []
    for t in source.tensors:
        if t.name in expert_names:
            data, index = companion_names(t.name)
            ne0, ne1, n_expert = t.dims
            slots.append(Slot(data, GGML_TYPE_I8, None))
            slots.append(Slot(index, GGML_TYPE_I64, (index_len(n_expert, n_chunks(ne0 * ne1, chunk_n)),)))
        else:
            slots.append(Slot(t.name, t.ggml_type, t.dims))
    slots.append(Slot(SOURCE_HEADER, GGML_TYPE_I8, (source.data_start,)))
    for s in slots:
        if len(s.name.encode()) >= GGML_MAX_NAME:
            raise UnsupportedError(f"tensor name {s.name} is longer than GGUF's {GGML_MAX_NAME - 1} bytes")
    return slots


def _fixed_run(slots: Sequence[Slot], start: int, alignment: int) -> int | None:
    """Padded bytes of the fixed-size slots from `start` up to the next page-aligned slot, or None if
    no page-aligned slot follows."""
    total = 0
    for s in slots[start:]:
        if s.page_aligned:
            return total
        total += align_up(s.nbytes, alignment)
    return None


def _padding_kv(n: int) -> bytes:
    return encode_kv(PADDING_KEY, GGUFValueType.ARRAY, [0] * n, GGUFValueType.UINT8)


def encode_header(kv: bytes, n_kv: int, slots: Sequence[Slot], dims: Sequence[tuple[int, ...]],
                  offsets: Sequence[int]) -> bytes:
    """A GGUF v3 header; slots past the given dims and offsets get placeholders of the same width."""
    infos = []
    for i, s in enumerate(slots):
        shape = dims[i] if i < len(dims) else (s.dims or (0,))
        infos.append(encode_tensor_info(s.name, shape, s.ggml_type, offsets[i] if i < len(offsets) else 0))
    return GGUF_MAGIC + struct.pack("<IQQ", GGUF_VERSION, len(slots), n_kv) + kv + b"".join(infos)


def header_padding(kv: bytes, n_kv: int, slots: Sequence[Slot], alignment: int) -> bytes:
    """The `zipmoe.header_padding` pair, sized so that the first data companion starts on a page.

    Everything before the first data companion has a fixed size, so the header is the one place
    where padding can go (llama.cpp allows no gap before a tensor).
    """
    base = len(encode_header(kv + _padding_kv(0), n_kv + 1, slots, (), ()))
    before = _fixed_run(slots, 0, alignment)
    n = 0 if before is None or alignment >= PAGE else (-(base + before)) % PAGE
    return _padding_kv(n)


class ZipmoeWriter:
    """Writes a GGUF whose tensors arrive one after the other in tensor-info order.

    The header is written first with placeholder offsets and data companion sizes (fixed-width fields,
    so its length is final) and rewritten by finish(), once the sizes are known.
    """

    def __init__(self, f: BinaryIO, *, kv_raw: bytes, n_kv: int, slots: Sequence[Slot], alignment: int,
                 integrity: bool = False):
        self._f = f
        self._slots = list(slots)
        self._alignment = alignment
        # the integrity record (FORMAT.md) is written as zeros now and filled in by finish()
        self._integrity: list[tuple[int, int]] | None = [] if integrity else None
        self._record_at = 0  # offset of the record's value bytes in self._kv
        if integrity:
            placeholder = [0] * integrity_len(len(self._slots))
            record_kv = encode_kv(INTEGRITY_KEY, GGUFValueType.ARRAY, placeholder, GGUFValueType.UINT64)
            self._record_at = len(kv_raw) + len(record_kv) - 8 * len(placeholder)
            kv_raw, n_kv = kv_raw + record_kv, n_kv + 1
        self._kv = kv_raw + header_padding(kv_raw, n_kv, self._slots, alignment)
        self._n_kv = n_kv + 1
        self._dims: list[tuple[int, ...]] = []
        self._offsets: list[int] = []
        self._pos = 0  # next free byte, relative to the data section
        header = self._header()
        self._header_size = len(header)
        self.data_start = align_up(len(header), alignment)
        f.seek(0)
        f.write(header)
        f.write(bytes(self.data_start - len(header)))

    def _header(self) -> bytes:
        return encode_header(self._kv, self._n_kv, self._slots, self._dims, self._offsets)

    @property
    def file_pos(self) -> int:
        return self.data_start + self._pos

    def write_tensor(self, pieces: Iterable[Any]) -> int:
        """Writes the next tensor's data from buffers and returns its size in bytes (for a data
        companion, including the zero padding that puts the next data companion on a page)."""
        i = len(self._offsets)
        slot = self._slots[i]
        if slot.page_aligned and self.file_pos % PAGE:
            raise AssertionError(f"{slot.name} would start at file offset {self.file_pos}, not on a page")
        n = 0
        hasher = ChainHash() if self._integrity is not None and not slot.page_aligned else None
        for piece in pieces:
            if hasher is not None:
                hasher.update(piece)
            n += self._f.write(piece)
        if self._integrity is not None:
            self._integrity.append((KIND_COMPANION, 0) if hasher is None else (KIND_HASHED, hasher.digest()))
        if slot.page_aligned:
            follow = _fixed_run(self._slots, i + 1, self._alignment)
            pad = 0 if follow is None else (-(self.file_pos + n + follow)) % PAGE
            n += self._f.write(bytes(pad))
            dims = (n // tensor_nbytes(slot.ggml_type, (1,)),)
        elif n != slot.nbytes:
            raise FormatError(f"{slot.name}: wrote {n} bytes, expected {slot.nbytes}")
        else:
            dims = slot.dims
        self._offsets.append(self._pos)
        self._dims.append(dims)
        padded = align_up(n, self._alignment)
        self._f.write(bytes(padded - n))
        self._pos += padded
        return n

    def finish(self) -> None:
        if len(self._offsets) != len(self._slots):
            raise AssertionError(f"{len(self._slots) - len(self._offsets)} tensors were not written")
        header = self._header()
        if len(header) != self._header_size:
            raise AssertionError("the final header's size differs from the placeholder's")
        if self._integrity is not None:
            # the metadata is hashed with the record's value as zeros: exactly the header as it is now
            meta_hash = integrity_hash(header + bytes(self.data_start - len(header)))
            record = build_integrity(GGUF_FIXED_HEADER + self._record_at, self.data_start, meta_hash,
                                     self._integrity)
            at = self._record_at
            self._kv = self._kv[:at] + record.tobytes() + self._kv[at + record.nbytes:]
            header = self._header()
        self._f.seek(0)
        self._f.write(header)
        self._f.seek(0, io.SEEK_END)


# ------------------------------------------------------------------------------ reading zipmoe files


@dataclass(frozen=True)
class CompressedTensor:
    """An expert tensor of a zipmoe file: its validated index and where its data companion lies."""

    name: str  # the original name, <base>.weight
    expert: codec.ExpertTensor
    data: Tensor  # the data companion in the zipmoe file
    index: Tensor
    source: Tensor  # the original tensor, as the source header lists it

    def region_file_offset(self, expert: int) -> int:
        return self.data.file_offset + self.expert.span(expert).offset


@dataclass(frozen=True)
class ZipmoeFile:
    path: Path
    gguf: GGUFFile
    meta: ZipmoeMeta
    source: GGUFFile  # parsed from zipmoe.source_header; offsets checked against zipmoe.source.size
    compressed: tuple[CompressedTensor, ...]
    source_header: Tensor
    integrity: IntegrityRecord | None = None  # None in files written before the record existed

    @property
    def compressed_by_name(self) -> dict[str, CompressedTensor]:
        return {c.name: c for c in self.compressed}


def pread_exact(fd: int, size: int, offset: int, label: str) -> bytes:
    data = os.pread(fd, size, offset)
    if len(data) != size:
        raise FormatError(f"{label}: truncated file (wanted {size} bytes at offset {offset}, got {len(data)})")
    return data


def _companion(g: GGUFFile, name: str, ggml_type: int) -> Tensor:
    t = g.by_name.get(name)
    if t is None:
        raise FormatError(f"{g.label}: companion tensor {name} is missing")
    if t.ggml_type != ggml_type or len(t.dims) != 1:
        raise FormatError(f"{g.label}: companion tensor {name} must be a 1-D {type_name(ggml_type)} tensor")
    return t


def _check_source_tensors(g: GGUFFile, meta: ZipmoeMeta, source: GGUFFile) -> None:
    """The zipmoe file must hold every non-expert tensor of its source, with the same type and shape."""
    compressed = set(meta.tensors)
    expected = {t.name for t in source.tensors if is_expert_tensor(t) and t.ggml_type == GGML_TYPE_BF16}
    if compressed != expected:
        raise FormatError(f"{g.label}: zipmoe.tensors does not list the source's BF16 expert tensors")
    for t in source.tensors:
        if t.name in compressed:
            continue
        mine = g.by_name.get(t.name)
        if mine is None:
            raise FormatError(f"{g.label}: tensor {t.name} of the source is missing")
        if (mine.ggml_type, mine.dims) != (t.ggml_type, t.dims):
            raise FormatError(f"{g.label}: tensor {t.name} differs in type or shape from the source's")


def restore_zeros(source: GGUFFile, source_size: int) -> int:
    """Bytes of the restored source that lie outside its header and tensors (restored as zeros)."""
    return source_size - source.data_start - sum(t.nbytes for t in source.tensors)


def _check_restore_size(g: GGUFFile, meta: ZipmoeMeta, source: GGUFFile) -> None:
    """Bounds the work of verify and unpack: the converter refuses sources with more zero bytes between their
    tensors than its output will hold, so a zipmoe.source.size that implies more (say 2^60 bytes) is damage,
    refused here before anything is written or hashed."""
    zeros = restore_zeros(source, meta.source_size)
    if zeros > g.file_size:
        raise FormatError(f"{g.label}: zipmoe.source.size ({meta.source_size}) would restore {zeros} bytes of zeros "
                          f"between tensors, more than the whole file ({g.file_size}): the metadata is damaged")


def _open_compressed(fd: int, g: GGUFFile, meta: ZipmoeMeta, source: GGUFFile, name: str) -> CompressedTensor:
    src = source.by_name.get(name)
    if src is None or not is_expert_tensor(src) or src.ggml_type != GGML_TYPE_BF16:
        raise FormatError(f"{g.label}: {name} is listed in zipmoe.tensors but is no BF16 expert tensor "
                          "of the source")
    data_name, index_name = companion_names(name)
    data = _companion(g, data_name, GGML_TYPE_I8)
    index = _companion(g, index_name, GGML_TYPE_I64)
    raw = pread_exact(fd, index.nbytes, index.file_offset, g.label)
    expert = codec.ExpertTensor(raw, data.nbytes, name=name)
    info = expert.info
    if (info.ne[:3], info.codec, info.level, info.chunk_n) != (src.dims, meta.codec, meta.level, meta.chunk_size):
        raise FormatError(f"{g.label}: {name}: the index disagrees with the metadata (shape {list(info.ne[:3])} "
                          f"vs {list(src.dims)}, codec {info.codec} level {info.level} vs {meta.codec} level "
                          f"{meta.level}, chunk size {info.chunk_n} vs {meta.chunk_size})")
    return CompressedTensor(name, expert, data, index, src)


def open_zipmoe(path: str | os.PathLike[str]) -> ZipmoeFile:
    """Reads and validates a zipmoe file's structure: metadata, source header and every index."""
    path = Path(path)
    g = read_gguf(path)
    if not g.is_zipmoe:
        raise FormatError(f"{path}: not a zipmoe file (no zipmoe.version key); convert it with `zipmoe convert`")
    meta = ZipmoeMeta.from_gguf(g)
    header = g.by_name.get(SOURCE_HEADER)
    if header is None or header.ggml_type != GGML_TYPE_I8 or header.nbytes != meta.source_data_start:
        raise FormatError(f"{path}: {SOURCE_HEADER} is missing or is not {meta.source_data_start} bytes of I8")
    fd = os.open(path, os.O_RDONLY)
    try:
        raw = pread_exact(fd, header.nbytes, header.file_offset, str(path))
        source = parse_gguf(io.BytesIO(raw), meta.source_size, f"{path}: {SOURCE_HEADER}")
        if source.data_start != meta.source_data_start:
            raise FormatError(f"{path}: the source header's data section starts at {source.data_start}, "
                              f"not at zipmoe.source.data_start {meta.source_data_start}")
        _check_source_tensors(g, meta, source)
        _check_restore_size(g, meta, source)
        compressed = tuple(_open_compressed(fd, g, meta, source, name) for name in meta.tensors)
    finally:
        os.close(fd)
    return ZipmoeFile(path, g, meta, source, compressed, header, IntegrityRecord.from_gguf(g))
