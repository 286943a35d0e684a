"""Typed Python face of the native codec: codecs, experts encoded into regions, expert tensors decoded.

Everything here is a thin wrapper over ggml_zipmoe (through `_native`); the bytes it produces and reads
are specified in docs/FORMAT.md. Calls release the GIL, so a ThreadPoolExecutor gives real parallelism.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from .._native import ffi, lib
from ..errors import ChecksumError, FormatError, UnsupportedError, ZipmoeError

CODECS: dict[str, int] = {"zstd": 1, "huff": 2, "esc": 3}  # the entropy coders of BF16/F16 values' code bytes
SPLIT_CODECS = tuple(CODECS)
RAW_CODEC = "raw"  # the one codec of byte-layout types (F32, quantized blocks): their bytes as they are
CODEC_NUMBERS: dict[str, int] = {**CODECS, RAW_CODEC: 4}  # every codec an index may name
CODEC_NAMES: dict[int, str] = {v: k for k, v in CODEC_NUMBERS.items()}
DEFAULT_CODEC = "huff"
# F16's code bytes (exponent and 3 mantissa bits, ~5.5 bits of entropy) give Huffman's multi-symbol table few
# symbols per lookup: zstd-1 coded all-MiniLM-L6-v2's F16 weights as small (+0.15% from the floor, huff +0.40%) and
# decoded them 1.16x faster (bench/results/2026-12-03-codec-f16-quant.md)
DEFAULT_F16_CODEC = "zstd"
DEFAULT_ZSTD_LEVEL = 1
DEFAULT_CHUNK_N = 64 * 1024  # values per chunk: 64 KiB of exponents, decoded inside L2
GGML_TYPE_BF16 = 30
LAYOUT_SPLIT16 = 1  # zipmoe_layout: 2-byte values split into a code byte and a raw byte (BF16, F16)
LAYOUT_BYTES = 2  # the expert's bytes, stored raw (F32, every block-quantized type)


@dataclass(frozen=True)
class TypeLayout:
    """How zipmoe stores experts of a ggml type (zipmoe_type_layout)."""

    layout: int
    blck_size: int  # values per block
    type_size: int  # bytes per block

    @property
    def split(self) -> bool:
        return self.layout == LAYOUT_SPLIT16

    def row_size(self, ne0: int) -> int:
        return ne0 // self.blck_size * self.type_size


def type_layout(ggml_type: int) -> TypeLayout | None:
    """The layout of a ggml type, or None for one zipmoe does not store (integers, F64, unknown numbers)."""
    out = ffi.new("zipmoe_type_info *")
    if not 0 <= ggml_type < 2**31 or lib.zipmoe_type_layout(ggml_type, out) != lib.ZIPMOE_OK:
        return None
    return TypeLayout(out.layout, out.blck_size, out.type_size)


def _check(status: int, what: str) -> int:
    """Turns a native status into an exception carrying the library's own name for it."""
    if status >= 0:
        return status
    name = ffi.string(lib.zipmoe_status_str(status)).decode()
    if status == lib.ZIPMOE_ERR_CHECKSUM:
        raise ChecksumError(f"{what}: {name}")
    if status in (lib.ZIPMOE_ERR_CORRUPT, lib.ZIPMOE_ERR_CODEC):
        raise FormatError(f"{what}: {name}")
    if status == lib.ZIPMOE_ERR_UNSUPPORTED:
        raise UnsupportedError(f"{what}: {name}")
    raise ZipmoeError(f"{what}: {name}")


def _u16(values: np.ndarray) -> np.ndarray:
    """A contiguous uint16 view of BF16 bits (numpy has no bfloat16; bits travel as uint16)."""
    if values.dtype not in (np.uint16, np.int16):
        raise TypeError(f"BF16 values must be given as uint16 bits, not {values.dtype}")
    return np.ascontiguousarray(values.reshape(-1)).view(np.uint16)


def _ptr(array: np.ndarray, ctype: str):
    return ffi.cast(ctype, ffi.from_buffer(array))


def simd_level() -> int:
    return int(lib.zipmoe_simd_level())


def split_bf16(values: np.ndarray, *, scalar: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Returns (exponent plane, sign+mantissa plane) of BF16 bits."""
    src = _u16(values)
    exp = np.empty(src.size, np.uint8)
    sm = np.empty(src.size, np.uint8)
    fn = lib.zipmoe_split_bf16_scalar if scalar else lib.zipmoe_split_bf16
    fn(_ptr(src, "uint16_t *"), src.size, _ptr(exp, "uint8_t *"), _ptr(sm, "uint8_t *"))
    return exp, sm


def split_sm_bf16(values: np.ndarray, *, scalar: bool = False) -> np.ndarray:
    """The sign+mantissa plane of BF16 bits alone (what an expert leaving the hot tier keeps)."""
    src = _u16(values)
    sm = np.empty(src.size, np.uint8)
    fn = lib.zipmoe_split_sm_bf16_scalar if scalar else lib.zipmoe_split_sm_bf16
    fn(_ptr(src, "uint16_t *"), src.size, _ptr(sm, "uint8_t *"))
    return sm


def merge_bf16(exp: np.ndarray, sm: np.ndarray, *, scalar: bool = False, out: np.ndarray | None = None) -> np.ndarray:
    """BF16 bits from the two planes; into out (a contiguous uint16 array of their size) if given."""
    if exp.shape != sm.shape or exp.dtype != np.uint8 or sm.dtype != np.uint8:
        raise ValueError("exponent and sign+mantissa planes must be uint8 arrays of one shape")
    exp, sm = np.ascontiguousarray(exp), np.ascontiguousarray(sm)
    if out is not None and (out.dtype != np.uint16 or out.size != exp.size or not out.flags.c_contiguous):
        raise ValueError("out must be a contiguous uint16 array as large as the planes")
    dst = np.empty(exp.size, np.uint16) if out is None else out
    fn = lib.zipmoe_merge_bf16_scalar if scalar else lib.zipmoe_merge_bf16
    fn(_ptr(exp, "uint8_t *"), _ptr(sm, "uint8_t *"), exp.size, _ptr(dst, "uint16_t *"))
    return dst


def exponent_histogram(values: np.ndarray, hist: np.ndarray | None = None) -> np.ndarray:
    """Adds the exponent histogram of BF16 bits to `hist` (a new uint64[256] if None) and returns it."""
    src = _u16(values)
    if hist is None:
        hist = np.zeros(256, np.uint64)
    lib.zipmoe_exponent_histogram(_ptr(src, "uint16_t *"), src.size, _ptr(hist, "uint64_t *"))
    return hist


def byte_histogram(data: np.ndarray, hist: np.ndarray | None = None) -> np.ndarray:
    """Adds the histogram of bytes (of a byte-layout expert tensor) to `hist` (a new uint64[256] if None)."""
    if hist is None:
        hist = np.zeros(256, np.uint64)
    hist += np.bincount(np.ascontiguousarray(data).reshape(-1).view(np.uint8), minlength=256).astype(np.uint64)
    return hist


def entropy_bits(hist: np.ndarray) -> float:
    """Shannon entropy in bits per symbol of a histogram."""
    counts = hist[hist > 0].astype(np.float64)
    if counts.size == 0:
        return 0.0
    p = counts / counts.sum()
    return float(-(p * np.log2(p)).sum())


def huff_lengths(hist: np.ndarray) -> np.ndarray:
    """Length-limited (11-bit) Huffman code lengths for an exponent histogram."""
    hist = np.ascontiguousarray(hist, np.uint64)
    lengths = np.zeros(256, np.uint8)
    _check(lib.zipmoe_huff_lengths(_ptr(hist, "uint64_t *"), _ptr(lengths, "uint8_t *")), "huffman table")
    return lengths


def esc_classes(hist: np.ndarray) -> np.ndarray:
    """Escape-code classes for an exponent histogram: 1..3 for the 2-bit codes of the three commonest exponents,
    4..10 for the escaped 3-bit codes of the next seven, 0 for the raw bytes of the rest."""
    hist = np.ascontiguousarray(hist, np.uint64)
    classes = np.zeros(256, np.uint8)
    _check(lib.zipmoe_esc_classes(_ptr(hist, "uint64_t *"), _ptr(classes, "uint8_t *")), "escape-code classes")
    return classes


def esc_simd_level() -> int:
    """Which escape-code decoder this CPU runs: 0 = portable scalar, 2 = AVX-512 VBMI2."""
    return int(lib.zipmoe_esc_simd_level())


def checksum(data, seed: int = 0) -> int:
    """XXH3-64 of a bytes-like object."""
    buf = ffi.from_buffer(data)
    return int(lib.zipmoe_checksum(buf, len(buf), seed))


class Workspace:
    """Per-thread scratch memory of the native decoder (one chunk of exponents, zstd contexts)."""

    def __init__(self, chunk_n: int):
        handle = lib.zipmoe_workspace_create(chunk_n)
        if handle == ffi.NULL:
            raise MemoryError("zipmoe workspace allocation failed")
        self.chunk_n = chunk_n
        self._handle = ffi.gc(handle, lib.zipmoe_workspace_free)

    @property
    def handle(self):
        return self._handle


class _WorkspacePool(threading.local):
    """One workspace per thread and chunk size, created on first use."""

    def get(self, chunk_n: int) -> Workspace:
        cached = getattr(self, "ws", None)
        if cached is None or cached.chunk_n < chunk_n:
            cached = self.ws = Workspace(chunk_n)
        return cached


_workspaces = _WorkspacePool()


@dataclass(frozen=True)
class EncodedExpert:
    region: np.ndarray  # uint8: sm plane, padding, exponent chunks (docs/FORMAT.md)
    chunk_ends: np.ndarray  # uint64, one per chunk, from the first chunk's start
    checksums: np.ndarray  # uint64, one per chunk


class Codec:
    """A codec instance (zstd at a level, huff with one tensor's code lengths, esc with its classes, raw) for chunks
    of one ggml type (BF16 unless told). Thread-safe.

    `lengths` is the table the index stores (FORMAT.md): Huffman code lengths, or escape-code classes."""

    def __init__(self, name: str, *, level: int = 0, lengths: np.ndarray | None = None,
                 ggml_type: int = GGML_TYPE_BF16):
        if name not in CODEC_NUMBERS:
            raise UnsupportedError(f"unknown codec {name!r}; choose one of {', '.join(CODEC_NUMBERS)}")
        self.name = name
        self.level = level if name == "zstd" else 0
        self.lengths = None if lengths is None else np.ascontiguousarray(lengths, np.uint8)
        if name == "huff" and self.lengths is None:
            raise ValueError("the huff codec needs code lengths (see huff_lengths)")
        if name == "esc" and self.lengths is None:
            raise ValueError("the esc codec needs its classes (see esc_classes)")
        out = ffi.new("zipmoe_codec_ctx **")
        lengths_ptr = ffi.NULL if self.lengths is None else _ptr(self.lengths, "uint8_t *")
        _check(lib.zipmoe_codec_create_typed(CODEC_NUMBERS[name], self.level, lengths_ptr, ggml_type, out),
               f"{name} codec")
        self._handle = ffi.gc(out[0], lib.zipmoe_codec_free)
        self.ggml_type = ggml_type
        layout = type_layout(ggml_type)
        assert layout is not None  # the native constructor refused the others
        self.layout = layout

    def encode_expert(self, values: np.ndarray, chunk_n: int) -> EncodedExpert:
        """An expert's region: `values` are BF16/F16 bits (uint16) for split types, the expert's bytes (uint8)
        otherwise; chunk_n counts values, or bytes."""
        src = _u16(values) if self.layout.split else np.ascontiguousarray(values.reshape(-1)).view(np.uint8)
        n_chunks = -(-src.size // chunk_n)
        cap = lib.zipmoe_expert_region_bound(self._handle, src.size, chunk_n)
        region = np.empty(cap, np.uint8)
        ends = np.empty(n_chunks, np.uint64)
        sums = np.empty(n_chunks, np.uint64)
        ws = _workspaces.get(chunk_n)
        size = _check(
            lib.zipmoe_expert_encode(
                self._handle, ws.handle, _ptr(src, "void *"), src.size, chunk_n,
                _ptr(region, "void *"), cap, _ptr(ends, "uint64_t *"), _ptr(sums, "uint64_t *"),
            ),
            "encode expert",
        )
        return EncodedExpert(region[:size].copy(), ends, sums)


@dataclass(frozen=True)
class TensorInfo:
    codec: str
    level: int
    ggml_type: int
    ne: tuple[int, int, int, int]
    n_expert: int
    n_per_expert: int
    chunk_n: int  # units: values of split types, bytes of byte-layout types
    n_chunks: int
    data_size: int
    layout: int
    n_units: int
    expert_size: int  # bytes of one decoded expert

    @property
    def split(self) -> bool:
        return self.layout == LAYOUT_SPLIT16


@dataclass(frozen=True)
class ExpertSpan:
    offset: int  # of the region, from the start of the data companion
    size: int
    exp_offset: int  # of the first exponent chunk, from the start of the region


class ExpertTensor:
    """A compressed expert tensor: its index, validated by the native parser, and decoding."""

    def __init__(self, index, data_size: int, name: str = "tensor"):
        self.name = name
        self._index = np.ascontiguousarray(np.frombuffer(index, np.uint8) if not isinstance(index, np.ndarray) else index)
        out = ffi.new("zipmoe_tensor **")
        buf = ffi.from_buffer(self._index)
        _check(lib.zipmoe_tensor_open(buf, len(buf), data_size, out), f"{name}: index")
        self._handle = ffi.gc(out[0], lib.zipmoe_tensor_free)
        raw = ffi.new("zipmoe_tensor_info *")
        lib.zipmoe_tensor_get_info(self._handle, raw)
        self.info = TensorInfo(
            codec=CODEC_NAMES[raw.codec], level=raw.level, ggml_type=raw.ggml_type,
            ne=tuple(raw.ne), n_expert=raw.n_expert, n_per_expert=raw.n_per_expert,
            chunk_n=raw.chunk_n, n_chunks=raw.n_chunks, data_size=raw.data_size,
            layout=raw.layout, n_units=raw.n_units, expert_size=raw.expert_size,
        )

    def span(self, expert: int) -> ExpertSpan:
        raw = ffi.new("zipmoe_expert_span *")
        _check(lib.zipmoe_tensor_expert_span(self._handle, expert, raw), f"{self.name}: expert {expert}")
        return ExpertSpan(raw.offset, raw.size, raw.exp_offset)

    def _new_output(self) -> np.ndarray:
        """An expert's decoded form: uint16 bits of split types, bytes otherwise."""
        info = self.info
        return np.empty(info.n_per_expert, np.uint16) if info.split else np.empty(info.expert_size, np.uint8)

    def decode_expert(self, expert: int, region, out: np.ndarray | None = None, *, ith: int = 0, nth: int = 1) -> np.ndarray:
        """Decodes expert `expert` from its region bytes into `out` (uint16[n_per_expert] for BF16/F16,
        uint8[expert_size] for other types: any contiguous array of expert_size bytes).

        With nth > 1 only the chunks ith, ith+nth, ... are decoded: nth threads with ith = 0..nth-1
        share one expert (see decode_expert_parallel).
        """
        if out is None:
            out = self._new_output()
        if out.nbytes != self.info.expert_size or not out.flags.c_contiguous:
            raise ValueError(f"out must be a contiguous array of {self.info.expert_size} bytes")
        buf = ffi.from_buffer(region)
        ws = _workspaces.get(self.info.chunk_n)
        _check(
            lib.zipmoe_tensor_decode_expert(self._handle, ws.handle, expert, buf, len(buf), _ptr(out, "void *"), ith, nth),
            f"{self.name}: expert {expert}",
        )
        return out

    def decode_expert_parallel(self, expert: int, region, out: np.ndarray | None = None, *, threads: int = 2) -> np.ndarray:
        """Decodes one expert with `threads` threads sharing its chunks."""
        from concurrent.futures import ThreadPoolExecutor

        if out is None:
            out = self._new_output()
        with ThreadPoolExecutor(threads) as pool:
            for f in [pool.submit(self.decode_expert, expert, region, out, ith=i, nth=threads) for i in range(threads)]:
                f.result()
        return out
