"""MoE GGUF -> zipmoe GGUF (convert), and what compression would gain (inspect); pyzipmoe.file.verify goes back.

BF16 and F16 experts are split and entropy coded; experts of other types (F32, quantized blocks) are stored raw,
chunked and checksummed (docs/FORMAT.md).

Everything streams: expert tensors are read expert by expert with pread (not through mmap, whose pages
would count against the process), at most `threads + 2` experts are in flight, and the output is
written in order. Peak memory is a few experts per thread, whatever the size of the model.

Outputs are written to a temporary file next to the destination and renamed when complete, so an
error or Ctrl-C never leaves a half-written file under the destination's name.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import numpy as np

from . import codec as zcodec
from ..atomic import replacing
from ..errors import FormatError, UnsupportedError, ZipmoeError
from ..progress import Progress, Silent
from .gguf import GGML_TYPE_BF16, GGML_TYPE_F16, GGUFFile, Tensor, align_up, pread_exact, read_gguf, type_name
from .metadata import (
    FORMAT_VERSION,
    TYPED_FORMAT_VERSION,
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
from .writer import ZipmoeWriter


BLOCK = 8 << 20  # bytes per read when copying or scanning: large enough for sequential throughput
CODEC_CHOICES = ("auto", "huff", "esc", "zstd")
CHUNK_MAX = 1 << 24  # ZIPMOE_CHUNK_MAX of zipmoe.h

T = TypeVar("T")
R = TypeVar("R")


# ------------------------------------------------------------------------------------------ statistics


@dataclass(frozen=True)
class TensorStats:
    """Sizes of one expert tensor; zipmoe_bytes is None while it is not compressed. bf16_bytes is the source
    tensor's size, whatever its type; exponent_entropy the entropy of its code bytes (exponents of BF16, code bytes
    of F16), or of all its bytes for byte-layout types."""

    name: str
    dims: tuple[int, ...]
    bf16_bytes: int
    zipmoe_bytes: int | None
    exponent_entropy: float
    ggml_type: int = GGML_TYPE_BF16

    @property
    def split(self) -> bool:
        layout = zcodec.type_layout(self.ggml_type)
        return layout is not None and layout.split

    @property
    def floor(self) -> float:
        """Smallest size fraction an order-0 code can reach: for a split type 8 raw bits plus H(code byte) bits of 16;
        for a byte-layout type H(byte) bits of 8 (what entropy coding its bytes could reach; they are stored raw)."""
        return (8 + self.exponent_entropy) / 16 if self.split else self.exponent_entropy / 8

    @property
    def ratio(self) -> float | None:
        return None if self.zipmoe_bytes is None else self.zipmoe_bytes / self.bf16_bytes

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "dims": list(self.dims), "type": type_name(self.ggml_type), "floor": self.floor,
                "ratio": self.ratio, "floor_gap_pct": _gap_pct(self.ratio, self.floor)}


@dataclass(frozen=True)
class SizeRow:
    """A line of the size table: a group of tensors, or the rest of the file, or the whole file."""

    label: str
    n_tensors: int
    bf16_bytes: int
    zipmoe_bytes: int | None
    floor_bytes: float

    @property
    def ratio(self) -> float | None:
        return None if self.zipmoe_bytes is None or not self.bf16_bytes else self.zipmoe_bytes / self.bf16_bytes

    @property
    def floor(self) -> float:
        return self.floor_bytes / self.bf16_bytes if self.bf16_bytes else 1.0

    @property
    def floor_gap_pct(self) -> float | None:
        return _gap_pct(self.ratio, self.floor)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": self.ratio, "floor": self.floor, "floor_gap_pct": self.floor_gap_pct}


def _gap_pct(ratio: float | None, floor: float) -> float | None:
    """How far the achieved size fraction is above the entropy floor, in percent."""
    return None if ratio is None else (ratio / floor - 1) * 100


def _group_label(name: str) -> str:
    """blk.7.ffn_down_exps.weight -> ffn_down_exps."""
    return name.split(".")[2]


def size_rows(tensors: Iterable[TensorStats], *, source_size: int, output_size: int | None) -> list[SizeRow]:
    """Rows per expert group (ffn_up_exps, ...), then the rest of the file, then the whole file."""
    tensors = list(tensors)
    compressed = output_size is not None
    rows = []
    for label in sorted({_group_label(t.name) for t in tensors}):
        group = [t for t in tensors if _group_label(t.name) == label]
        rows.append(SizeRow(label, len(group), sum(t.bf16_bytes for t in group),
                            sum(t.zipmoe_bytes or 0 for t in group) if compressed else None,
                            sum(t.bf16_bytes * t.floor for t in group)))
    expert_bf16 = sum(t.bf16_bytes for t in tensors)
    expert_zipmoe = sum(t.zipmoe_bytes or 0 for t in tensors)
    expert_floor = sum(t.bf16_bytes * t.floor for t in tensors)
    other = source_size - expert_bf16
    rows.append(SizeRow("other tensors + header", 0, other,
                        output_size - expert_zipmoe if compressed else None, other))
    rows.append(SizeRow("whole file", 0, source_size, output_size, expert_floor + other))
    return rows


# -------------------------------------------------------------------------------------------- helpers


def _ordered(pool: ThreadPoolExecutor, fn: Callable[[T], R], items: Iterable[T], depth: int) -> Iterator[R]:
    """fn over items on the pool, results in order, at most `depth` submitted and not yet consumed
    (this bounds memory: each result may be a whole expert)."""
    pending: deque[Future[R]] = deque()
    try:
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= depth:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for f in pending:
            f.cancel()


def pread_into(fd: int, out: np.ndarray, offset: int, label: str) -> np.ndarray:
    """Fills `out` from the file at `offset`, without an intermediate bytes object."""
    view = memoryview(out).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise FormatError(f"{label}: truncated file (nothing to read at offset {offset + done})")
        done += n
    return out


def _read_into(f: BinaryIO, view: memoryview, label: str) -> None:
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise FormatError(f"{label}: the file ended early; was it changed while being read?")
        done += n


def byte_blocks(size: int, block: int = BLOCK) -> Iterator[tuple[int, int]]:
    """(start, length) of consecutive blocks covering [0, size)."""
    for start in range(0, size, block):
        yield start, min(block, size - start)


def thread_count(threads: int | None) -> int:
    n = threads if threads is not None else (os.cpu_count() or 1)
    if n < 1:
        raise ZipmoeError(f"--threads must be at least 1, got {n}")
    return n


@contextmanager
def atomic_output(dst: Path) -> Iterator[BinaryIO]:
    """A new file that appears as `dst` only once the block completes; removed on any error or Ctrl-C."""
    # checked first: these would otherwise fail only at the end, or name the temporary file
    if dst.is_dir():
        raise IsADirectoryError(errno.EISDIR, "the output is a directory", str(dst))
    if not dst.parent.is_dir():
        raise FileNotFoundError(errno.ENOENT, "no such directory for the output", str(dst.parent))
    # 0o666 lets the umask decide, as for any new file
    with replacing(dst, 0o666, "w+b") as f:
        yield f


def refuse_same_file(a: Path, b: Path) -> None:
    if a.resolve() == b.resolve() or (b.exists() and a.exists() and os.path.samefile(a, b)):
        raise ZipmoeError(f"{b}: the output would overwrite the input; choose another file name")


def _codec_name(name: str) -> str:
    if name != "auto" and name not in zcodec.SPLIT_CODECS:
        raise UnsupportedError(f"unknown codec {name!r}; choose one of {', '.join(CODEC_CHOICES)}")
    return name


def format_version(experts: list[Tensor]) -> int:
    """1 for all-BF16 experts (what every zipmoe reader reads), else 2: a reader that knows only BF16 experts
    refuses the file by its version instead of taking other bits for BF16."""
    return FORMAT_VERSION if all(t.ggml_type == GGML_TYPE_BF16 for t in experts) else TYPED_FORMAT_VERSION


def auto_codec(experts: list[Tensor]) -> str:
    """The codec "auto" means for these experts: huff, unless every split expert is F16, whose code bytes zstd-1
    codes as small and decodes faster (zcodec.DEFAULT_F16_CODEC)."""
    split = [t for t in experts if (layout := expert_layout(t)) is not None and layout.split]
    if split and all(t.ggml_type == GGML_TYPE_F16 for t in split):
        return zcodec.DEFAULT_F16_CODEC
    return zcodec.DEFAULT_CODEC


# ----------------------------------------------------------------------------------------- the source


EXPERT_SIDE_NAME = re.compile(
    r"blk\.\d+\.(?:ffn_(?:up|gate|down|gate_up)_exps\.(?:bias|scale|input_scale)|ffn_norm_exps\.weight)")
"""Per-expert tensors that are not matrices: biases (gpt-oss), output and input scales, arctic's expert norm.
llama.cpp reads them beside the expert matrices (ggml_add_id, ggml_mul), not through ggml_mul_mat_id, so they stay
plain tensors."""


def unknown_expert_tensors(g: GGUFFile) -> list[Tensor]:
    """Tensors named like expert tensors (`_exps`) in a form zipmoe knows neither to compress nor to keep: compressing
    or keeping a form it was never checked on would be a guess about how llama.cpp reads it."""
    return [t for t in g.tensors if "_exps" in t.name and not is_expert_tensor(t) and not
            (EXPERT_SIDE_NAME.fullmatch(t.name) and len(t.dims) <= 2)]


def _form(t: Tensor) -> str:
    return f"{t.name} ({len(t.dims)}-D {'x'.join(map(str, t.dims))}, {type_name(t.ggml_type)})"


def expert_tensors(g: GGUFFile) -> list[Tensor]:
    """The tensors zipmoe stores; refuses a file that has none, an expert tensor of a type it cannot store, or an
    `_exps` tensor of a form it does not know (unknown_expert_tensors)."""
    unknown = unknown_expert_tensors(g)
    if unknown:
        raise UnsupportedError(f"{g.label}: {_form(unknown[0])} is an expert tensor of a form zipmoe does not know "
                               "(it compresses blk.N.ffn_{up,gate,down,gate_up}_exps.weight, 3-D, and keeps their "
                               ".bias/.scale/.input_scale); it does not convert the file rather than guess")
    experts = [t for t in g.tensors if is_expert_tensor(t)]
    if not experts:
        raise UnsupportedError(f"{g.label}: not a MoE model: no tensor is named "
                               "blk.N.ffn_{up,gate,down,gate_up}_exps.weight, so there is nothing to compress")
    other = [t for t in experts if expert_layout(t) is None]
    if other:
        types = sorted({type_name(t.ggml_type) for t in other})
        raise UnsupportedError(f"{g.label}: expert tensors are {'/'.join(types)} (e.g. {other[0].name}); zipmoe "
                               "stores BF16, F16, F32 and block-quantized experts, not these")
    return experts


def _code_histogram(t: Tensor, view: memoryview, hist: np.ndarray) -> None:
    """Adds a run of tensor t's bytes to its histogram: code bytes of BF16/F16 values, all bytes otherwise."""
    layout = expert_layout(t)
    if layout is not None and layout.split:
        zcodec.exponent_histogram(np.frombuffer(view, np.uint16), hist)
    else:
        zcodec.byte_histogram(np.frombuffer(view, np.uint8), hist)


def _check_codec_fits(g: GGUFFile, experts: list[Tensor], codec_name: str) -> None:
    """esc gives short codes to 10 code bytes; F16's code bytes (exponent and 3 mantissa bits) spread over ~8 times
    as many, so esc made F16 experts larger than they are (+9% on all-MiniLM-L6-v2: bench_codec.py)."""
    f16 = [t for t in experts if t.ggml_type == GGML_TYPE_F16]
    if codec_name == "esc" and f16:
        raise UnsupportedError(f"{g.label}: the esc codec does not fit F16 experts (e.g. {f16[0].name}): it would "
                               "store them larger than they are; use huff (the default) or zstd")


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


def tensors_by_offset(g: GGUFFile) -> list[Tensor]:
    """Tensors in file order; refuses overlaps (the bytes could not be restored from one copy)."""
    ordered = sorted(g.tensors, key=lambda t: t.file_offset)
    for a, b in zip(ordered, ordered[1:]):
        if b.file_offset < a.file_offset + a.nbytes:
            raise FormatError(f"{g.label}: tensors {a.name} and {b.name} overlap")
    return ordered


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
            _read_into(f, view, g.label)
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
    for e, enc in enumerate(_ordered(pool, encode, range(shape.n_expert), settings.depth)):
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
    _check_codec_fits(g, experts, codec_name)
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
