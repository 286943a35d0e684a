"""GGUF files: reading any GGUF header safely, and the encoding of its pieces for writers.

Reading is an own small parser rather than gguf-py's GGUFReader: input files are untrusted, and every
malformed, truncated or foreign input must become a one-line `FormatError` (GGUFReader raises whatever
numpy or struct raise), and the converter needs the raw bytes of the source's key/value section.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from ..errors import FormatError, UnsupportedError


GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
GGUF_READ_VERSIONS = (2, 3)  # v2 has the same layout as v3 (64-bit counts); v1 is long gone
GGUF_DEFAULT_ALIGNMENT = 32
GGML_MAX_DIMS = 4
GGML_MAX_NAME = 64  # including the terminating NUL, so names have at most 63 bytes
GGUF_FIXED_HEADER = 24  # magic, version, tensor count, key/value count

GGML_TYPE_I8 = int(GGMLQuantizationType.I8)
GGML_TYPE_I64 = int(GGMLQuantizationType.I64)
GGML_TYPE_BF16 = int(GGMLQuantizationType.BF16)
GGML_TYPE_F16 = int(GGMLQuantizationType.F16)

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


def pread_exact(fd: int, size: int, offset: int, label: str) -> bytes:
    data = os.pread(fd, size, offset)
    if len(data) != size:
        raise FormatError(f"{label}: truncated file (wanted {size} bytes at offset {offset}, got {len(data)})")
    return data
