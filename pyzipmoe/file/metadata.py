"""zipmoe's metadata in a GGUF (docs/FORMAT.md): the `zipmoe.*` keys, expert tensors and their companions, the
chunk index of a compressed expert tensor, and the layout of a zipmoe GGUF's header and tensor slots.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf.constants import GGUFValueType

from . import codec
from ..errors import FormatError, UnsupportedError
from .gguf import (
    GGML_MAX_NAME,
    GGML_TYPE_BF16,
    GGML_TYPE_I64,
    GGML_TYPE_I8,
    GGUFFile,
    GGUF_MAGIC,
    GGUF_VERSION,
    Tensor,
    align_up,
    encode_kv,
    encode_tensor_info,
    tensor_nbytes,
)


PAGE = 4096  # data companions and expert regions start on multiples of this
CHUNK_MAX = 1 << 24  # ZIPMOE_CHUNK_MAX of zipmoe.h: units per chunk

FORMAT_VERSION = 1  # files whose experts are all BF16
TYPED_FORMAT_VERSION = 2  # files with experts of other types: readers that know BF16 only refuse them by version
FORMAT_VERSIONS = (FORMAT_VERSION, TYPED_FORMAT_VERSION)
INDEX_MAGIC = 0x3158444945504D5A  # the bytes "ZMPEIDX1"
INDEX_VERSION = 1
INDEX_HEADER = 48
REGION_ALIGN = PAGE  # of expert regions whose decoded size is at least SMALL_EXPERT
SMALL_EXPERT = 64 * 1024
SMALL_REGION_ALIGN = 64  # page-aligning experts smaller than ~a page would waste more than it saves
SOURCE_HEADER = "zipmoe.source_header"
DATA_SUFFIX = ".zipmoe_data"
INDEX_SUFFIX = ".zipmoe_index"
PADDING_KEY = "zipmoe.header_padding"

EXPERT_NAME = re.compile(r"blk\.\d+\.ffn_(?:up|gate|down|gate_up)_exps\.weight")


# ------------------------------------------------------------------------------------ expert tensors


def is_expert_tensor(t: Tensor) -> bool:
    """Named like an expert tensor and 3-D; its type is checked separately (expert_layout)."""
    return EXPERT_NAME.fullmatch(t.name) is not None and len(t.dims) == 3


def expert_layout(t: Tensor) -> codec.TypeLayout | None:
    """How zipmoe stores the expert tensor `t`, or None where it does not (its type, or rows of partial blocks)."""
    layout = codec.type_layout(t.ggml_type)
    if layout is None or t.dims[0] % layout.blck_size:
        return None
    return layout


@dataclass(frozen=True)
class ExpertShape:
    """An expert tensor's units (values of BF16/F16, bytes of other types) and chunks, as its index records them."""

    layout: codec.TypeLayout
    n_expert: int
    n_units: int  # per expert
    expert_size: int  # bytes of one expert
    chunk_n: int  # units per chunk
    codec_name: str  # the file's codec for split types, "raw" for the others

    @property
    def n_chunks(self) -> int:
        return n_chunks(self.n_units, self.chunk_n)


def expert_shape(t: Tensor, chunk_size: int, split_codec: str) -> ExpertShape:
    """The units and chunks of expert tensor `t` in a file whose zipmoe.chunk_size is `chunk_size`: that many values
    per chunk for BF16/F16; for byte-layout types as many whole rows as fill the bytes a BF16 chunk decodes to
    (2 * chunk_size, at least one row, at most the expert and CHUNK_MAX bytes)."""
    layout = expert_layout(t)
    if layout is None:
        raise UnsupportedError(f"{t.name}: zipmoe does not store {t.ggml_type}-type experts of this shape")
    ne0, ne1, n_expert = t.dims
    if layout.split:
        return ExpertShape(layout, n_expert, ne0 * ne1, 2 * ne0 * ne1, chunk_size, split_codec)
    row = layout.row_size(ne0)
    size = row * ne1
    chunk = min(max(1, 2 * chunk_size // row) * row, size, CHUNK_MAX // layout.type_size * layout.type_size)
    return ExpertShape(layout, n_expert, size, size, chunk, codec.RAW_CODEC)


def companion_names(name: str) -> tuple[str, str]:
    """(data, index) companion names of the expert tensor `name` (`<base>.weight`)."""
    base = name.removesuffix(".weight")
    return base + DATA_SUFFIX, base + INDEX_SUFFIX


def n_chunks(n_per_expert: int, chunk_n: int) -> int:
    return -(-n_per_expert // chunk_n)


def index_len(n_expert: int, chunks_per_expert: int) -> int:
    return INDEX_HEADER + 2 * n_expert + 2 * n_expert * chunks_per_expert + 1


def region_alignment(expert_size: int) -> int:
    """Alignment of expert regions: a page for experts (decoded, in bytes) big enough to be read page by page."""
    return REGION_ALIGN if expert_size >= SMALL_EXPERT else SMALL_REGION_ALIGN


def build_index(*, codec_name: str, level: int, dims: Sequence[int], chunk_n: int, data_size: int,
                lengths: np.ndarray | None, regions: np.ndarray, chunk_ends: np.ndarray,
                checksums: np.ndarray, ggml_type: int = GGML_TYPE_BF16) -> np.ndarray:
    """The `<base>.zipmoe_index` companion of FORMAT.md, checksum included, as int64 elements.

    `regions` is uint64 [E, 2] (offset, size); `chunk_ends` and `checksums` are uint64 [E, C]; chunk_n counts
    units of `ggml_type` (values, or bytes for byte-layout types).
    """
    ne0, ne1, n_expert = dims
    n_per = ne0 * ne1
    layout = codec.type_layout(ggml_type)
    if layout is None:
        raise UnsupportedError(f"ggml type {ggml_type} is not one zipmoe stores")
    units = n_per if layout.split else layout.row_size(ne0) * ne1
    c = n_chunks(units, chunk_n)
    if regions.shape != (n_expert, 2) or chunk_ends.shape != (n_expert, c) or checksums.shape != (n_expert, c):
        raise ValueError("region and chunk tables do not match the tensor's shape")
    idx = np.zeros(index_len(n_expert, c), "<u8")
    expert_size = 2 * n_per if layout.split else units
    idx[:16] = [INDEX_MAGIC, INDEX_VERSION, codec.CODEC_NUMBERS[codec_name], level & (2**64 - 1), ggml_type,
                ne0, ne1, n_expert, 1, n_expert, n_per, chunk_n, c, data_size, region_alignment(expert_size), 0]
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
        if version not in FORMAT_VERSIONS:
            raise UnsupportedError(f"{g.label}: zipmoe format version {version} is not supported "
                                   f"(this zipmoe reads versions {' and '.join(map(str, FORMAT_VERSIONS))})")
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
        if meta.codec not in codec.CODEC_NUMBERS:
            raise UnsupportedError(f"{g.label}: unknown zipmoe codec {meta.codec!r}")
        if len(set(meta.tensors)) != len(meta.tensors):
            raise FormatError(f"{g.label}: zipmoe.tensors lists a tensor twice")
        if len(meta.exponent_entropy) != len(meta.tensors):
            raise FormatError(f"{g.label}: zipmoe.exponent_entropy has {len(meta.exponent_entropy)} entries "
                              f"for {len(meta.tensors)} tensors")
        if not re.fullmatch(r"[0-9a-f]{64}", meta.source_sha256):
            raise FormatError(f"{g.label}: zipmoe.source.sha256 is not a hex sha256")
        return meta


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


def zipmoe_slots(source: GGUFFile, shapes: dict[str, ExpertShape]) -> list[Slot]:
    """The output's tensors: the source's, experts (`shapes`, by name) replaced by their companions, the source
    header last."""
    slots = []
    for t in source.tensors:
        shape = shapes.get(t.name)
        if shape is not None:
            data, index = companion_names(t.name)
            slots.append(Slot(data, GGML_TYPE_I8, None))
            slots.append(Slot(index, GGML_TYPE_I64, (index_len(shape.n_expert, shape.n_chunks),)))
        else:
            slots.append(Slot(t.name, t.ggml_type, t.dims))
    slots.append(Slot(SOURCE_HEADER, GGML_TYPE_I8, (source.data_start,)))
    for s in slots:
        if len(s.name.encode()) >= GGML_MAX_NAME:
            raise UnsupportedError(f"tensor name {s.name} is longer than GGUF's {GGML_MAX_NAME - 1} bytes")
    return slots


def fixed_run(slots: Sequence[Slot], start: int, alignment: int) -> int | None:
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
    before = fixed_run(slots, 0, alignment)
    n = 0 if before is None or alignment >= PAGE else (-(base + before)) % PAGE
    return _padding_kv(n)
