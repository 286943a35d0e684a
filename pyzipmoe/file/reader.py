"""Opening zipmoe GGUFs (what pyzipmoe.file.writer writes): the metadata, every compressed expert tensor's index
and the source file's header, each checked against the others before anything is decoded.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from pathlib import Path

from . import codec
from ..errors import FormatError
from .gguf import (
    GGML_TYPE_BF16,
    GGML_TYPE_I64,
    GGML_TYPE_I8,
    GGUFFile,
    Tensor,
    parse_gguf,
    pread_exact,
    read_gguf,
    type_name,
)
from .integrity import IntegrityRecord
from .metadata import FORMAT_VERSION, SOURCE_HEADER, ZipmoeMeta, companion_names, expert_layout, expert_shape, is_expert_tensor


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
    expected = {t.name for t in source.tensors if is_expert_tensor(t) and expert_layout(t) is not None}
    if compressed != expected:
        raise FormatError(f"{g.label}: zipmoe.tensors does not list the source's expert tensors")
    for t in source.tensors:
        if t.name in compressed:
            continue
        mine = g.by_name.get(t.name)
        if mine is None:
            raise FormatError(f"{g.label}: tensor {t.name} of the source is missing")
        if (mine.ggml_type, mine.dims) != (t.ggml_type, t.dims):
            raise FormatError(f"{g.label}: tensor {t.name} differs in type or shape from the source's")


def _check_version(g: GGUFFile, meta: ZipmoeMeta, source: GGUFFile) -> None:
    """Version 1 promises BF16 experts only (its readers take every expert for BF16); other types need version 2."""
    if meta.version == FORMAT_VERSION:
        other = [n for n in meta.tensors if source.by_name[n].ggml_type != GGML_TYPE_BF16]
        if other:
            raise FormatError(f"{g.label}: zipmoe.version 1 with a {type_name(source.by_name[other[0]].ggml_type)} "
                              f"expert tensor ({other[0]}): such files are version 2; the metadata is damaged")


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
    if src is None or not is_expert_tensor(src) or expert_layout(src) is None:
        raise FormatError(f"{g.label}: {name} is listed in zipmoe.tensors but is no expert tensor zipmoe stores "
                          "in the source")
    data_name, index_name = companion_names(name)
    data = _companion(g, data_name, GGML_TYPE_I8)
    index = _companion(g, index_name, GGML_TYPE_I64)
    raw = pread_exact(fd, index.nbytes, index.file_offset, g.label)
    expert = codec.ExpertTensor(raw, data.nbytes, name=name)
    info = expert.info
    # split experts use the file's codec and chunk size; the others are raw in whole rows (expert_shape)
    want = expert_shape(src, meta.chunk_size, meta.codec)
    level = meta.level if want.layout.split else 0
    if (info.ne[:3], info.ggml_type, info.codec, info.level, info.chunk_n) != (
            src.dims, src.ggml_type, want.codec_name, level, want.chunk_n):
        raise FormatError(f"{g.label}: {name}: the index disagrees with the metadata (shape {list(info.ne[:3])} "
                          f"vs {list(src.dims)}, type {type_name(info.ggml_type)} vs {type_name(src.ggml_type)}, "
                          f"codec {info.codec} level {info.level} vs {want.codec_name} level {level}, chunk size "
                          f"{info.chunk_n} vs {want.chunk_n})")
    return CompressedTensor(name, expert, data, index, src)


def as_zipmoe(model: ZipmoeFile | str | os.PathLike[str]) -> ZipmoeFile:
    """`model` parsed: itself where the caller has opened it already (so that one command parses a file once, however
    many parts of it need the structure), else open_zipmoe(model)."""
    return model if isinstance(model, ZipmoeFile) else open_zipmoe(model)


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
        _check_version(g, meta, source)
        _check_restore_size(g, meta, source)
        compressed = tuple(_open_compressed(fd, g, meta, source, name) for name in meta.tensors)
    finally:
        os.close(fd)
    return ZipmoeFile(path, g, meta, source, compressed, header, IntegrityRecord.from_gguf(g))
