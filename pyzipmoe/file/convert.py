"""MoE GGUF -> zipmoe GGUF (convert), and what compression would gain (inspect); pyzipmoe.file.verify goes back.

BF16 and F16 experts are split and entropy coded; experts of other types (F32, quantized blocks) are stored raw,
chunked and checksummed (docs/FORMAT.md).

Everything streams: expert tensors are read expert by expert with pread (not through mmap, whose pages
would count against the process), at most `threads + 2` experts are in flight, and the output is
written in order. Peak memory is a few experts per thread, whatever the size of the model.

Outputs are written to a temporary file next to the destination and renamed when complete, so an
error or Ctrl-C never leaves a half-written file under the destination's name.

Which tensors are stored and how: expert_forms.py; the bounded-memory file helpers (shared with verify): fileio.py;
the sizes reported: sizes.py.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from . import codec as zcodec
from ..errors import UnsupportedError, ZipmoeError
from ..progress import Progress, Silent
from .expert_forms import auto_codec, check_codec_fits, expert_tensors, format_version
from .fileio import (BLOCK, atomic_output, byte_blocks, ordered, pread_into, read_into, refuse_same_file,
                     tensors_by_offset, thread_count)
from .gguf import GGUFFile, Tensor, align_up, pread_exact, read_gguf, type_name
from .metadata import (
    ExpertShape,
    ZipmoeMeta,
    build_index,
    expert_layout,
    expert_shape,
    is_expert_tensor,
    region_alignment,
    zipmoe_slots,
)
from .reader import ZipmoeFile, open_zipmoe, restore_zeros
from .sizes import SizeRow, TensorStats, size_rows
from .writer import ZipmoeWriter

CODEC_CHOICES = ("auto", "huff", "esc", "zstd")
CHUNK_MAX = 1 << 24  # ZIPMOE_CHUNK_MAX of zipmoe.h


def _codec_name(name: str) -> str:
    if name != "auto" and name not in zcodec.SPLIT_CODECS:
        raise UnsupportedError(f"unknown codec {name!r}; choose one of {', '.join(CODEC_CHOICES)}")
    return name


# ----------------------------------------------------------------------------------------- the source


def _code_histogram(t: Tensor, view: memoryview, hist: np.ndarray) -> None:
    """Adds a run of tensor t's bytes to its histogram: code bytes of BF16/F16 values, all bytes otherwise."""
    layout = expert_layout(t)
    if layout is not None and layout.split:
        zcodec.exponent_histogram(np.frombuffer(view, np.uint16), hist)
    else:
        zcodec.byte_histogram(np.frombuffer(view, np.uint8), hist)


def _check_zero_gaps(g: GGUFFile, experts: list[Tensor]) -> None:
    """Refuses a source with more bytes between its tensors than the output will hold (header copy, dense
    tensors and half of each expert tensor at least): a reader can then bound what restoring costs
    (reader._check_restore_size) and tell a damaged zipmoe.source.size from a real one."""
    zeros = restore_zeros(g, g.file_size)
    expert_bytes = sum(t.nbytes for t in experts)
    floor = g.data_start + sum(t.nbytes for t in g.tensors) - expert_bytes + expert_bytes // 2
    if zeros > floor:
        raise UnsupportedError(f"{g.label}: {zeros} bytes lie between or after its tensors, more than zipmoe's output "
                               f"would hold ({floor}); zipmoe does not convert such files")


@dataclass(frozen=True)
class SourceScan:
    sha256: str
    histograms: dict[str, np.ndarray]  # code-byte histogram of each expert tensor (_code_histogram)


def scan_source(f: BinaryIO, g: GGUFFile, experts: Iterable[Tensor], progress: Progress) -> SourceScan:
    """Pass 1: one sequential read of the whole file for its sha256 and the experts' code-byte histograms,
    checking that the bytes between tensors are zero (unpack restores them as zeros)."""
    expert_names = {t.name for t in experts}
    histograms = {name: np.zeros(256, np.uint64) for name in expert_names}
    sha = hashlib.sha256()
    buf = bytearray(BLOCK)
    progress.start("scan", g.file_size)
    f.seek(0)

    def read(size: int, what: str, visit: Callable[[memoryview], None] | None = None) -> None:
        for _, n in byte_blocks(size):
            view = memoryview(buf)[:n]
            read_into(f, view, g.label)
            sha.update(view)
            if visit is not None:
                visit(view)
            progress.advance(n)

    def zeros(where: str) -> Callable[[memoryview], None]:
        def check(view: memoryview) -> None:
            if np.frombuffer(view, np.uint8).any():
                raise UnsupportedError(f"{g.label}: non-zero bytes {where}; zipmoe unpack could not restore them")
        return check

    read(g.data_start, "header")
    pos = g.data_start
    for t in tensors_by_offset(g):
        read(t.file_offset - pos, "gap", zeros(f"before tensor {t.name}"))
        if t.name in expert_names:
            read(t.nbytes, t.name, lambda v, t=t, h=histograms[t.name]: _code_histogram(t, v, h))
        else:
            read(t.nbytes, t.name)
        pos = t.file_offset + t.nbytes
    read(g.file_size - pos, "tail", zeros("after the last tensor"))
    return SourceScan(sha.hexdigest(), histograms)


# ---------------------------------------------------------------------------------------- converting


@dataclass(frozen=True)
class ConvertReport:
    src: str
    dst: str
    codec: str
    level: int
    chunk_n: int
    threads: int
    source_size: int
    output_size: int
    sha256: str
    seconds: float
    tensors: tuple[TensorStats, ...]
    warnings: tuple[str, ...] = ()

    def rows(self) -> list[SizeRow]:
        return size_rows(self.tensors, source_size=self.source_size, output_size=self.output_size)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tensors"] = [t.to_dict() for t in self.tensors]
        d["groups"] = [r.to_dict() for r in self.rows()]
        return d


@dataclass(frozen=True)
class _Settings:
    codec: str
    level: int
    chunk_n: int
    depth: int  # experts in flight


class _ChunkTable:
    """Regions and chunk tables of one tensor's experts, filled in as they are written."""

    def __init__(self, n_expert: int, chunks: int):
        self.regions = np.zeros((n_expert, 2), np.uint64)
        self.chunk_ends = np.zeros((n_expert, chunks), np.uint64)
        self.checksums = np.zeros((n_expert, chunks), np.uint64)


def _tensor_codec(settings: _Settings, shape: ExpertShape, ggml_type: int, hist: np.ndarray) -> zcodec.Codec:
    if shape.codec_name == "huff":
        return zcodec.Codec("huff", lengths=zcodec.huff_lengths(hist), ggml_type=ggml_type)
    if shape.codec_name == "esc":
        return zcodec.Codec("esc", lengths=zcodec.esc_classes(hist), ggml_type=ggml_type)
    if shape.codec_name == "zstd":
        return zcodec.Codec("zstd", level=settings.level, ggml_type=ggml_type)
    return zcodec.Codec(zcodec.RAW_CODEC, ggml_type=ggml_type)


def _expert_regions(pool: ThreadPoolExecutor, fd: int, t: Tensor, coder: zcodec.Codec, shape: ExpertShape,
                    settings: _Settings, table: _ChunkTable, progress: Progress, label: str) -> Iterator[Any]:
    """The data companion's bytes: expert regions in order, each starting on a 4096-byte boundary."""
    size = shape.expert_size
    dtype = np.uint16 if shape.layout.split else np.uint8

    def encode(e: int) -> zcodec.EncodedExpert:
        values = pread_into(fd, np.empty(size // np.dtype(dtype).itemsize, dtype), t.file_offset + e * size, label)
        return coder.encode_expert(values, shape.chunk_n)

    pos = 0
    for e, enc in enumerate(ordered(pool, encode, range(shape.n_expert), settings.depth)):
        start = align_up(pos, region_alignment(size))
        yield bytes(start - pos)
        table.regions[e] = (start, enc.region.size)
        table.chunk_ends[e] = enc.chunk_ends
        table.checksums[e] = enc.checksums
        yield enc.region
        pos = start + enc.region.size
        progress.advance(size)


def _copy(fd: int, offset: int, size: int, label: str, progress: Progress | None = None) -> Iterator[bytes]:
    for start, n in byte_blocks(size):
        data = pread_exact(fd, n, offset + start, label)
        if progress is not None:
            progress.advance(n)
        yield data


def _write_experts(w: ZipmoeWriter, pool: ThreadPoolExecutor, fd: int, t: Tensor, shape: ExpertShape,
                   hist: np.ndarray, settings: _Settings, progress: Progress, label: str) -> int:
    """Writes one expert tensor's data and index companions; returns their total size."""
    coder = _tensor_codec(settings, shape, t.ggml_type, hist)
    table = _ChunkTable(shape.n_expert, shape.n_chunks)
    data_size = w.write_tensor(_expert_regions(pool, fd, t, coder, shape, settings, table, progress, label))
    index = build_index(codec_name=shape.codec_name, level=coder.level, dims=t.dims, chunk_n=shape.chunk_n,
                        data_size=data_size, lengths=coder.lengths, regions=table.regions,
                        chunk_ends=table.chunk_ends, checksums=table.checksums, ggml_type=t.ggml_type)
    return data_size + w.write_tensor([index.view(np.uint8)])


def _write_zipmoe(out: BinaryIO, fd: int, g: GGUFFile, meta: ZipmoeMeta, scan: SourceScan,
                  settings: _Settings, threads: int, progress: Progress) -> dict[str, int]:
    """Pass 2: the zipmoe file, tensors in the source's tensor-info order. Returns the compressed
    size of each expert tensor."""
    kv, n_kv = meta.encode()
    shapes = {t.name: expert_shape(t, settings.chunk_n, settings.codec) for t in g.tensors if t.name in meta.tensors}
    w = ZipmoeWriter(out, kv_raw=g.kv_raw + kv, n_kv=g.n_kv + n_kv, slots=zipmoe_slots(g, shapes),
                     alignment=g.alignment, integrity=True)
    sizes = {}
    progress.start(f"encode ({settings.codec})", sum(t.nbytes for t in g.tensors))
    with ThreadPoolExecutor(threads, thread_name_prefix="zipmoe-encode") as pool:
        for t in g.tensors:
            if t.name in scan.histograms:
                sizes[t.name] = _write_experts(w, pool, fd, t, shapes[t.name], scan.histograms[t.name], settings,
                                               progress, g.label)
            else:
                w.write_tensor(_copy(fd, t.file_offset, t.nbytes, g.label, progress))
    w.write_tensor(_copy(fd, 0, g.data_start, g.label))
    w.finish()
    return sizes


def convert(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, codec: str = "auto",
            level: int = zcodec.DEFAULT_ZSTD_LEVEL, chunk_n: int = zcodec.DEFAULT_CHUNK_N,
            threads: int | None = None, progress: Progress | None = None,
            warn: Callable[[str], None] | None = None) -> ConvertReport:
    """Compresses the expert tensors of the GGUF `src` into the zipmoe GGUF `dst`.

    codec: "auto" (huff; zstd-1 where the split experts are all F16: auto_codec), "huff", "esc" or "zstd" (at
    `level`), the codec of BF16/F16 experts (others are stored raw); chunk_n: values per independently decodable chunk (for raw experts: whole rows of about as many bytes as
    chunk_n BF16 values); threads: encoding threads (default: all CPUs); warn: called once with what the report's
    warnings say (default: printed to stderr as `zipmoe: warning: ...`), for a model of an architecture zipmoe was not
    checked on (pyzipmoe.architectures).
    """
    t0 = time.monotonic()
    src, dst = Path(src), Path(dst)
    codec_name = _codec_name(codec)
    if not 1 <= chunk_n <= CHUNK_MAX:
        raise ZipmoeError(f"the chunk size must be between 1 and {CHUNK_MAX} values, got {chunk_n}")
    threads = thread_count(threads)
    progress = progress or Silent()
    refuse_same_file(src, dst)
    g = read_gguf(src)
    if g.is_zipmoe:
        raise UnsupportedError(f"{src}: already a zipmoe file; `zipmoe unpack` restores its source")
    experts = expert_tensors(g)
    warnings = _architecture_warnings(g)
    for note in warnings:
        (warn or _print_warning)(note)
    if codec_name == "auto":
        codec_name = auto_codec(experts)
    check_codec_fits(g, experts, codec_name)
    _check_zero_gaps(g, experts)
    settings = _Settings(codec_name, level if codec_name == "zstd" else 0, chunk_n, threads + 2)
    try:
        with open(src, "rb", buffering=0) as f:
            scan = scan_source(f, g, experts, progress)
            entropies = {t.name: zcodec.entropy_bits(scan.histograms[t.name]) for t in experts}
            # the file's codec is that of its split experts; a file with none is all raw
            any_split = any(expert_layout(t).split for t in experts)  # type: ignore[union-attr]
            meta = ZipmoeMeta(version=format_version(experts), codec=codec_name if any_split else zcodec.RAW_CODEC,
                              level=settings.level if any_split else 0, chunk_size=chunk_n,
                              tensors=tuple(t.name for t in experts), source_size=g.file_size,
                              source_sha256=scan.sha256, source_data_start=g.data_start,
                              exponent_entropy=tuple(entropies[t.name] for t in experts))
            with atomic_output(dst) as out:
                sizes = _write_zipmoe(out, f.fileno(), g, meta, scan, settings, threads, progress)
    finally:
        progress.close()
    stats = tuple(TensorStats(t.name, t.dims, t.nbytes, sizes[t.name], entropies[t.name], t.ggml_type)
                  for t in experts)
    return ConvertReport(str(src), str(dst), meta.codec, meta.level, chunk_n, threads, g.file_size,
                         dst.stat().st_size, scan.sha256, time.monotonic() - t0, stats, warnings)


def _architecture_warnings(g: GGUFFile) -> tuple[str, ...]:
    from ..architectures import architecture_note

    kv = g.kv.get("general.architecture")
    note = architecture_note(kv.value if kv is not None and isinstance(kv.value, str) else None)
    return () if note is None else (note,)


def _print_warning(note: str) -> None:
    print(f"zipmoe: warning: {note}", file=sys.stderr)


# ----------------------------------------------------------------------------------------- inspecting


def _inspect_zipmoe(zf: ZipmoeFile) -> dict[str, Any]:
    meta = zf.meta
    stats = [TensorStats(c.name, c.source.dims, c.source.nbytes, c.data.nbytes + c.index.nbytes, h, c.source.ggml_type)
             for c, h in zip(zf.compressed, meta.exponent_entropy, strict=True)]
    rows = size_rows(stats, source_size=meta.source_size, output_size=zf.gguf.file_size)
    return {
        "file": str(zf.path), "format": "zipmoe", "file_size": zf.gguf.file_size, "compressed": True,
        "status": f"zipmoe v{meta.version}, {meta.codec} codec: {rows[-1].ratio:.1%} of the source's size",
        "codec": meta.codec, "codec_level": meta.level, "chunk_size": meta.chunk_size,
        "integrity_record": zf.integrity is not None,
        "source": {"size": meta.source_size, "sha256": meta.source_sha256, "data_start": meta.source_data_start},
        "tensors": [{**s.to_dict(), "n_expert": c.expert.info.n_expert, "n_chunks": c.expert.info.n_chunks}
                    for s, c in zip(stats, zf.compressed, strict=True)],
        "unsupported_experts": [],
        "groups": [r.to_dict() for r in rows],
    }


def _measured_entropy(fd: int, t: Tensor, label: str, progress: Progress) -> float:
    hist = np.zeros(256, np.uint64)
    for block in _copy(fd, t.file_offset, t.nbytes, label, progress):
        _code_histogram(t, memoryview(block), hist)
    return zcodec.entropy_bits(hist)


def _plain_status(stats: list[TensorStats], unsupported: list[Tensor]) -> str:
    if unsupported:
        types = "/".join(sorted({type_name(t.ggml_type) for t in unsupported}))
        return (f"not convertible: expert tensors are {types}; zipmoe stores BF16, F16, F32 and block-quantized "
                "experts")
    if stats:
        types = "/".join(sorted({type_name(s.ggml_type) for s in stats}))
        split = [s for s in stats if s.split]
        if not split:
            return (f"not compressed: {len(stats)} {types} expert tensors, which zipmoe stores raw (chunked and "
                    "checksummed: `zipmoe convert`)")
        floor = sum(s.bf16_bytes * s.floor for s in split) / sum(s.bf16_bytes for s in split)
        return (f"not compressed: {len(stats)} {types} expert tensors; at the entropy floor the "
                f"{len(split)} BF16/F16 ones would take {floor:.1%} of their size (`zipmoe convert` compresses them)")
    return "not a MoE model: no expert tensors, nothing for zipmoe to compress"


def _inspect_plain(g: GGUFFile, progress: Progress) -> dict[str, Any]:
    experts = [t for t in g.tensors if is_expert_tensor(t)]
    stored = [t for t in experts if expert_layout(t) is not None]
    unsupported = [t for t in experts if expert_layout(t) is None]
    progress.start("measure", sum(t.nbytes for t in stored))
    fd = os.open(g.label, os.O_RDONLY)
    try:
        stats = [TensorStats(t.name, t.dims, t.nbytes, None, _measured_entropy(fd, t, g.label, progress),
                             t.ggml_type)
                 for t in stored]
    finally:
        os.close(fd)
    rows = size_rows(stats, source_size=g.file_size, output_size=None) if stats else []
    return {
        "file": g.label, "format": "gguf", "file_size": g.file_size, "compressed": False,
        "status": _plain_status(stats, unsupported),
        "tensors": [s.to_dict() for s in stats],
        "unsupported_experts": [{"name": t.name, "type": type_name(t.ggml_type)} for t in unsupported],
        "groups": [r.to_dict() for r in rows],
    }


def inspect(path: str | os.PathLike[str], *, progress: Progress | None = None) -> dict[str, Any]:
    """Sizes, exponent entropy, entropy floor and achieved ratio per tensor, for a zipmoe file; for a
    plain GGUF, its expert tensors with their measured exponent entropy and floor."""
    progress = progress or Silent()
    try:
        g = read_gguf(path)
        return _inspect_zipmoe(open_zipmoe(path)) if g.is_zipmoe else _inspect_plain(g, progress)
    finally:
        progress.close()
