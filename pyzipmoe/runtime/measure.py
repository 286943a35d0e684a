"""What decoding and reading experts cost on this machine, measured once per machine and model file, and cached.

The planner needs a few numbers it cannot know from the file alone (`Calibration.as_costs_dict()`):

  cores                  CPUs this process may use: its affinity mask, capped by its cgroup's CPU quota
  t_decode               core-seconds the engine spends to decode one expert of one layer (every expert tensor of
                         the layer: gate, up and down) from RAM: wall time per expert on all cores x cores
  t_read_sm, t_read_cold wall seconds an expert of a layer costs when its exponent codes, or its whole region,
                         come from disk
  read_latency           seconds of a cold read of one page of the model file (median)
  disk_bandwidth         bytes/s of cold reads of whole expert regions, one read at a time, net of read_latency:
                         reading S bytes takes read_latency + S / disk_bandwidth
  base_seconds_per_token what a generated token costs with every expert decoded

  t_layer                wall seconds a layer adds per token whenever it reads from disk: the wait for its
                         first read, which no decoding overlaps (read_latency + one region / disk_bandwidth)

Those are measured through the engine (`engine=True`, the default; pyzipmoe.runtime.timing): the model generates greedily
in fresh processes, with every expert decoded (the base), with k hot slots per layer and the rest of the experts
warm, sm or cold, and with half the experts hot and the rest cold; each run's time per token is the base plus
the layers that decoded and the experts the runtime counted in each tier times their costs, which the six runs
determine. That is what the planner predicts with; on the 2.8g bench model the
runtime's stores driven directly from Python (`engine=False`: quicker, no engine needed) cost 3x as much per
expert as the engine pays, and the planner's predictions were off by as much.

Besides those: decode throughput of each codec (huff, esc and zstd, those the file does not use measured on the
same expert re-encoded), and the per-value cost of splitting and merging the BF16 planes.

CPU costs are thread CPU time, the median of many timed batches: other load on the machine does not inflate them
(`cores` says how many such cores there are). Disk costs are wall time of cold reads (pyzipmoe.plan.disk).

A model whose experts are stored raw (a plain GGUF, a zipmoe file of quantized experts) decodes nothing: it is
timed hot and cold only (three engine runs: all experts hot in the cache, k and half of them), t_decode is 0, and
there is no sm cost nor decode speed. F16 experts decode through the split codec as BF16 ones do.

The results are kept per machine and model file (pyzipmoe.plan.calibration).
"""

from __future__ import annotations

import os
import re
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import FormatError, UnsupportedError
from ..plan import calibration
from ..plan.disk import drop_page_cache, measure_disk
from ..plan.calibration import (
    Calibration,
    CalibrationError,
    cache_file,
    load_calibration,
    model_fingerprint,
    save_calibration,
    usable_cores,
)
from ..progress import Progress, Silent

DEFAULT_READ_BYTES = 256 << 20  # a few hundred MiB: enough reads for a stable median, a few seconds on an SSD
DEFAULT_MIN_SECONDS = 0.25  # of CPU time per timing: enough batches for a stable median
_BATCH_SECONDS = 1e-3  # a timed batch lasts at least this: far above the clock's resolution and call overhead
_MAX_SAMPLES = 10_000
_LAYER = re.compile(r"blk\.(\d+)\.")


# ------------------------------------------------------------------------------------------ measuring


def seconds_per_call(fn: Callable[[], object], min_seconds: float,
                     clock: Callable[[], float] = time.thread_time) -> float:
    """Median seconds of one call of `fn` by `clock` (default: this thread's CPU time), over batches of calls
    long enough for the clock, measured for at least `min_seconds` in all (at least 5 batches)."""
    fn()  # warm up: workspaces allocated, pages touched, code paged in
    n, dt = 1, 0.0
    while n < (1 << 20):
        t0 = clock()
        for _ in range(n):
            fn()
        dt = clock() - t0
        if dt >= _BATCH_SECONDS:
            break
        n *= 2
    samples, spent = [dt / n], dt
    while len(samples) < 5 or (spent < min_seconds and len(samples) < _MAX_SAMPLES):
        t0 = clock()
        for _ in range(n):
            fn()
        dt = clock() - t0
        samples.append(dt / n)
        spent += dt
    return statistics.median(samples)


def _pread(fd: int, size: int, offset: int, label: str) -> np.ndarray:
    out = np.empty(size, np.uint8)
    if os.preadv(fd, [memoryview(out)], offset) != size:
        raise CalibrationError(f"{label}: truncated file (wanted {size} bytes at offset {offset})")
    return out


def _reencoded(values: np.ndarray, info: Any, codec_name: str, name: str) -> tuple[Any, np.ndarray]:
    """One expert's values encoded with another codec, as a one-expert tensor of its type (BF16 or F16):
    (ExpertTensor, region)."""
    from ..file import codec
    from ..file.metadata import build_index

    typed = {"ggml_type": info.ggml_type}
    if codec_name == "huff":
        coder = codec.Codec("huff", lengths=codec.huff_lengths(codec.exponent_histogram(values)), **typed)
    elif codec_name == "esc":
        coder = codec.Codec("esc", lengths=codec.esc_classes(codec.exponent_histogram(values)), **typed)
    else:
        coder = codec.Codec("zstd", level=codec.DEFAULT_ZSTD_LEVEL, **typed)
    enc = coder.encode_expert(values, info.chunk_n)
    size = enc.region.size
    index = build_index(codec_name=codec_name, level=coder.level, dims=(info.ne[0], info.ne[1], 1),
                        chunk_n=info.chunk_n, data_size=size, lengths=coder.lengths,
                        regions=np.array([[0, size]], np.uint64), chunk_ends=enc.chunk_ends[None],
                        checksums=enc.checksums[None], ggml_type=info.ggml_type)
    return codec.ExpertTensor(index, size, name=f"{name} ({codec_name})"), enc.region


@dataclass(frozen=True)
class DecodeCosts:
    t_decode: float
    values_per_second: dict[str, float]
    merge_seconds_per_value: float
    split_seconds_per_value: float


def measure_decode(fd: int, tensors: Sequence[Any], expert: int, file_codec: str, *, min_seconds: float,
                   label: str, progress: Progress) -> DecodeCosts:
    """Decodes expert `expert` of every tensor in `tensors` (one layer's CompressedTensors stored through the split
    codec, BF16 or F16) on this thread."""
    from ..file import codec
    from .._native import ffi, lib

    regions = [_pread(fd, c.expert.span(expert).size, c.region_file_offset(expert), label) for c in tensors]
    outs = [np.empty(c.expert.info.n_per_expert, np.uint16) for c in tensors]  # (2-byte values: BF16 or F16)
    n_values = sum(o.size for o in outs)
    progress.start("calibrate: decode", n_values * 2 * len(codec.CODECS))

    def decode_all(experts: Sequence[Any], inputs: Sequence[np.ndarray], index: int) -> Callable[[], None]:
        def run() -> None:
            for t, region, out in zip(experts, inputs, outs, strict=True):
                t.decode_expert(index, region, out)
        return run

    speed = seconds_per_call(decode_all([c.expert for c in tensors], regions, expert), min_seconds)
    speeds = {file_codec: n_values / speed}
    # The runtime decodes into memory an evicted expert gave back, whose pages fault in zeroed again: that is
    # part of what a decode costs it (as much as the decoding itself when a budget keeps few experts decoded).
    t_decode = seconds_per_call(_into_fresh_memory([c.expert for c in tensors], regions, expert, outs), min_seconds)
    progress.advance(n_values * 2)
    values = [o.copy() for o in outs]  # the decoded expert: what the other codecs encode
    for other in (n for n in codec.CODECS if n != file_codec):
        pairs = [_reencoded(v, c.expert.info, other, c.name) for v, c in zip(values, tensors, strict=True)]
        seconds = seconds_per_call(decode_all([t for t, _ in pairs], [r for _, r in pairs], 0), min_seconds)
        for v, o in zip(values, outs, strict=True):
            if not np.array_equal(v, o):
                raise AssertionError(f"{label}: {other} re-encoding did not decode to the same values")
        speeds[other] = n_values / seconds
        progress.advance(n_values * 2)

    # split/merge alone, on preallocated planes: codec.merge_bf16 would time a fresh output's page faults too
    bf16 = np.concatenate(values)
    exp, sm = np.empty(bf16.size, np.uint8), np.empty(bf16.size, np.uint8)
    p_bf16, p_exp, p_sm = (ffi.cast(t, ffi.from_buffer(a)) for t, a in
                           (("uint16_t *", bf16), ("uint8_t *", exp), ("uint8_t *", sm)))
    split = seconds_per_call(lambda: lib.zipmoe_split_bf16(p_bf16, bf16.size, p_exp, p_sm), min_seconds)
    merge = seconds_per_call(lambda: lib.zipmoe_merge_bf16(p_exp, p_sm, bf16.size, p_bf16), min_seconds)
    return DecodeCosts(t_decode, speeds, merge / bf16.size, split / bf16.size)


def _into_fresh_memory(experts: Sequence[Any], inputs: Sequence[np.ndarray], index: int,
                       like: Sequence[np.ndarray]) -> Callable[[], None]:
    """A call that decodes into newly mapped anonymous memory (page faults and zeroing included) and unmaps it."""
    import mmap

    def run() -> None:
        for t, region, out in zip(experts, inputs, like, strict=True):
            with mmap.mmap(-1, out.nbytes) as fresh:
                target = np.frombuffer(fresh, np.uint16)
                t.decode_expert(index, region, target)
                del target
    return run


@dataclass(frozen=True)
class TierCosts:
    """Wall seconds, on all cores, to make one expert of a layer (every tensor) decoded."""

    warm: float | None  # from its compressed region in RAM: decoding (into pages an evicted expert left)
    sm: float | None  # from its sign+mantissa plane in RAM, the exponent codes read from disk
    cold: float  # from disk
    # (warm and sm None: a layer stored raw, which has no such tiers; its cold experts are read, not decoded)


class _LayerStores:
    """The runtime's stores for one layer's expert tensors, reading the model file: what the engine would use."""

    def __init__(self, fd: int, tensors: Sequence[Any], label: str) -> None:
        from .._native import ffi, lib

        from ..file.reader import CompressedTensor

        self.ffi, self.lib, self.handles, self.keys, self.elapsed = ffi, lib, [], [], 0.0
        for t in tensors:  # (StoredExperts)
            out = ffi.new("zipmoe_store **")
            c = t.source
            if isinstance(c, CompressedTensor):  # a zipmoe file's: through its index
                index = _pread(fd, c.index.nbytes, c.index.file_offset, label).tobytes()
                opened = lib.zipmoe_store_open(t.name.encode(), index, len(index), c.data.nbytes, out)
                offset = c.data.file_offset
            else:  # a plain GGUF's, served as stored (as the loader opens it: zipmoe_llama_open_raw)
                ne = ffi.new("int64_t[4]", [*t.ne, 1])
                opened = lib.zipmoe_store_open_raw(t.name.encode(), t.ggml_type, ne, t.expert_size // t.ne[1], out)
                offset = c.file_offset
            if opened < 0:
                raise CalibrationError(f"{label}: {t.name}: the runtime refused to serve it")
            handle = ffi.gc(out[0], lib.zipmoe_store_free)
            if lib.zipmoe_store_bind(handle, fd, offset, ffi.new("void **"), ffi.new("size_t *")) < 0:
                raise CalibrationError(f"{label}: {t.name}: the runtime cannot read its data")
            self.handles.append(handle)

    def materialize(self, experts: Sequence[int], threads: int) -> float:
        """Seconds of wall time to make `experts` decoded in every store of the layer, as one token routing to
        them would: one invocation per store, `threads` threads calling it at once as the engine's do, the
        reader reading ahead."""
        import threading

        ids = np.array(experts, np.int32)
        failed: list[int] = []
        for h in self.handles:  # one store after another, like the graph's ops
            key = self.ffi.new("char[1]")  # a new invocation
            self.keys.append(key)
            start = threading.Barrier(threads + 1)

            def run(ith: int, h: Any = h, key: Any = key, start: threading.Barrier = start) -> None:
                start.wait()
                if self.lib.zipmoe_store_materialize(h, key, self.ffi.from_buffer(ids), ids.size, 1, 4, ids.size * 4,
                                                     self.ffi.NULL, ith, threads) < 0:
                    failed.append(ith)

            workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
            for w in workers:
                w.start()
            start.wait()
            t0 = time.perf_counter()
            for w in workers:
                w.join()
            self.elapsed += time.perf_counter() - t0
        if failed:
            raise CalibrationError("the runtime failed to decode an expert while calibrating")
        return self.elapsed


def measure_tiers(fd: int, tensors: Sequence[Any], n_expert: int, n_used: int, *, threads: int, label: str,
                  progress: Progress, tokens: int = 4) -> TierCosts:
    """Times the runtime's own paths for `tokens` groups of `n_used` experts of one layer (what a token routes to),
    on `threads` threads as the engine calls it, page cache dropped before every disk-bound pass: the wall time a
    routed expert costs in each tier, reader thread, slots, the cores' sharing and all. Runs with budgets of its
    own (the process's budget is changed: calibrate in a process that runs no model)."""
    from .._native import lib

    unbounded = (1 << 64) - 1
    layer_bytes = sum(t.expert_size for t in tensors) * n_expert
    lib.zipmoe_cache_set_reserve(layer_bytes)  # as a model loads: evicted pages are reused, as in a run
    n_used = max(1, min(n_used, n_expert))
    groups = [[(t * n_used + i) % n_expert for i in range(n_used)] for t in range(max(1, min(tokens, n_expert // n_used)))]
    tiered = all(t.split for t in tensors)  # else cold only: the runtime keeps no compressed copy of a raw expert
    tiers = (("cold", 0, 0), ("warm", unbounded, 0), ("sm", 0, unbounded)) if tiered else (("cold", 0, 0),)
    progress.start("calibrate: tiers", (2 * len(tiers) - 1) * len(groups))
    times: dict[str, float] = {}
    try:
        for tier, warm, sm in tiers:
            lib.zipmoe_cache_configure(0, warm, sm, lib.ZIPMOE_POLICY_LRU)  # hot 0: every use decodes
            stores = _LayerStores(fd, tensors, label)
            if tier != "cold":  # a first pass puts them in the tier
                for g in groups:
                    stores.materialize(g, threads)
                    progress.advance(1)
            drop_page_cache(fd)
            samples = []
            for g in groups:
                before = stores.elapsed
                samples.append((stores.materialize(g, threads) - before) / len(g))
                progress.advance(1)
            times[tier] = statistics.median(samples)
            del stores
    finally:
        lib.zipmoe_cache_configure(unbounded, 0, 0, lib.ZIPMOE_POLICY_TOKEN_LFU)
        lib.zipmoe_cache_set_reserve(0)
    if not tiered:
        return TierCosts(warm=None, sm=None, cold=times["cold"])
    return TierCosts(warm=times["warm"], sm=max(times["sm"], times["warm"]), cold=max(times["cold"], times["warm"]))


@dataclass(frozen=True)
class EngineCosts:
    """Wall seconds per generated token with every expert decoded, and per routed expert of a layer in each
    tier, as the engine pays them on all cores."""

    base: float
    layer: float  # once per layer that reads at all, per token
    warm: float | None  # None: a model stored raw (no compressed tiers)
    sm: float | None
    cold: float


ENGINE_WARMUP, ENGINE_TOKENS = 32, 32  # tokens before timing (the experts settle in their tiers), tokens timed
ENGINE_BASE_WARMUP = 200  # every expert decoded, and its huge pages collapsed (that takes ~100 tokens on 2 cores)


def measure_engine(model_path: Path, *, threads: int, expert_tensors: int, first_read: float,
                   progress: Progress) -> EngineCosts | None:
    """The tier costs the engine pays, from six timed generations (see the module's docstring); None when the runs
    cannot tell them apart (a model whose generation settles on so few experts that a tier is never used).
    first_read: seconds of a layer's first read from disk (the disk's latency and one region at its bandwidth),
    which no decoding overlaps: t_layer."""
    from ..plan.inputs import geometry_from_gguf
    from .budget import model_memory
    from .timing import time_generation

    geometry = geometry_from_gguf(model_path)
    need = model_memory(model_path)
    budget = str(need.whole)  # room for every plan below
    k, n = geometry.n_expert_used, geometry.n_expert
    tiered = [geometry.has_tiers(i) for i in range(len(geometry.layers))]
    if 2 * k > n or (any(tiered) and not all(tiered)):
        return None  # (a model mixing raw and compressed layers: its tiers are timed through the stores)

    def timed(hot: int | None, warm: int = 0, sm: int = 0) -> dict[str, Any]:
        llama: dict[str, Any] = {}  # no budget: every expert stays decoded
        if hot is not None:
            llama = {"memory_budget": budget, "cache_policy": "lru",
                     "plan": ";".join(f"{b}:{hot},{warm},{sm}" for b in geometry.layers)}
        fd = os.open(model_path, os.O_RDONLY)
        try:
            drop_page_cache(fd)  # cold reads come from the disk
        finally:
            os.close(fd)
        run = time_generation(model_path, llama=llama, warmup=ENGINE_WARMUP if hot is not None else ENGINE_BASE_WARMUP,
                              gen=ENGINE_TOKENS, threads=threads)
        progress.advance(1)
        return run

    def per_token(run: dict[str, Any], key: str) -> float:
        """Experts of a layer per generated token (the runtime counts every expert tensor: gate, up, down)."""
        return float(run["stats"][key]) / expert_tensors / ENGINE_TOKENS

    half = n // 2
    if not any(tiered):
        return _raw_engine_costs(timed, per_token, n, k, half, first_read, progress)
    progress.start("calibrate: engine", 6)
    # all decoded; k hot slots and the rest cold, warm or sm; half the experts hot and the rest cold or warm
    # (fewer experts per layer that reads: what tells the wait for a layer's first read from its experts')
    runs = [timed(None), timed(k), timed(k, n - k), timed(k, 0, n - k), timed(half), timed(half, n - half)]
    # every run's seconds per token = base + t_layer * layers that read + warm, sm and cold experts times their
    # costs, per token: six runs, four unknowns, least squares (the all-decoded run still meets a few experts for
    # the first time). t_layer is the disk's, not fitted: nearly every layer reads in every run that reads at all,
    # so a fitted t_layer traded off against the base and the cold cost (16 ms against a 1.6 ms read, the base
    # down to a fifth, on a shared 2-core machine)
    counts = np.array([[1.0, *(per_token(r, key) for key in ("reading_calls", "hits_warm", "hits_sm", "misses"))]
                       for r in runs])
    seconds = np.array([r["seconds"] / ENGINE_TOKENS for r in runs])
    counts[3, 1] *= geometry.read_sm_bytes(0) / max(1, geometry.warm_bytes[0])  # its first reads are codes only
    if min(counts[1, 4], counts[2, 2], counts[3, 3], counts[4, 4], counts[5, 2]) <= 0:
        return None  # a tier no run used
    layer = first_read
    columns = [0, 2, 3, 4]
    solved = dict(zip(columns, np.linalg.lstsq(counts[:, columns], seconds - layer * counts[:, 1], rcond=None)[0]))
    base, warm, sm, cold = (float(solved[i]) for i in columns)
    tiny = 1e-7  # no tier may look free: every split would tie
    warm = max(warm, tiny)
    return EngineCosts(base=max(base, tiny), layer=max(layer, 0.0), warm=warm, sm=max(sm, warm), cold=max(cold, warm))


def _raw_engine_costs(timed: Callable[..., dict[str, Any]], per_token: Callable[[dict[str, Any], str], float],
                      n: int, k: int, half: int, first_read: float, progress: Progress) -> EngineCosts | None:
    """measure_engine for a model stored raw (a plain GGUF, a quantized zipmoe file): its experts are hot or read
    from the file, so three runs (all n experts hot; k hot slots; half of them hot) determine the base and what a
    cold expert costs (its read and its copy into place, no decode); t_layer is the disk's, as for compressed ones.
    The base is timed through the cache too, all of it hot: without a budget a plain GGUF runs stock llama.cpp's
    graph, which is not what the other runs add their reads to."""
    progress.start("calibrate: engine", 3)
    runs = [timed(n), timed(k), timed(half)]
    counts = np.array([[1.0, per_token(r, "misses")] for r in runs])
    seconds = np.array([r["seconds"] / ENGINE_TOKENS for r in runs])
    reading = np.array([per_token(r, "reading_calls") for r in runs])
    if min(counts[1, 1], counts[2, 1]) <= 0:
        return None  # no run read an expert
    base, cold = (float(v) for v in np.linalg.lstsq(counts, seconds - first_read * reading, rcond=None)[0])
    tiny = 1e-7  # a read is never free
    return EngineCosts(base=max(base, tiny), layer=max(first_read, 0.0), warm=None, sm=None, cold=max(cold, tiny))


def _open_model(model_path: str | os.PathLike[str]) -> Any:
    """The model's expert tensors (pyzipmoe.plan.experts): a zipmoe GGUF's or a plain GGUF's."""
    from ..plan.experts import model_experts

    path = Path(model_path).expanduser()
    if not path.exists():
        raise CalibrationError(f"{path}: no such file")
    if not path.is_file():
        raise CalibrationError(f"{path}: not a file")
    try:
        m = model_experts(path)
    except (FormatError, UnsupportedError) as e:
        raise CalibrationError(str(e)) from None
    if not m.tensors:
        raise CalibrationError(f"{path}: no expert tensors to measure (not a MoE model)")
    return m


def _experts_used(m: Any) -> int:
    """The model's experts per token (<arch>.expert_used_count), or 1 if it does not say."""
    for key, kv in m.gguf.kv.items():
        if key.endswith(".expert_used_count"):
            return int(kv.value)
    return 1


def _first_layer(tensors: Sequence[Any]) -> tuple[int, list[Any]]:
    """The lowest layer number with expert tensors, and those tensors (StoredExperts)."""
    layers: dict[int, list[Any]] = {}
    for t in tensors:
        layers.setdefault(t.block, []).append(t)
    layer = min(layers)
    return layer, layers[layer]


def calibrate(model_path: str | os.PathLike[str], *, force: bool = False, progress: Progress | None = None,
              read_bytes: int = DEFAULT_READ_BYTES, min_seconds: float = DEFAULT_MIN_SECONDS,
              base_seconds_per_token: float | None = None, engine: bool = True) -> Calibration:
    """The costs of running the model at `model_path` (a zipmoe GGUF, or a plain GGUF that runs under a budget) on
    this machine: from the cache when it holds a calibration of this very file on this machine (unless `force`),
    else measured (a few seconds) and cached.

    Experts stored through the split codec (BF16, F16) are decoded; experts stored raw (a plain GGUF's, a zipmoe
    file's quantized ones) have no decode to measure: what they cost is their read (t_read_cold), and t_decode is
    0 for a model with no other experts. The decoder's figures (decode speeds, split and merge) are then absent.

    read_bytes: how much of the file the disk measurement reads (everything if the file's experts hold less).
    min_seconds: CPU time spent on each decode timing (there are four: two codecs, split, merge).
    base_seconds_per_token: recorded as given; None: measured through the engine, else the cached value, if any.
    engine: measure tier costs and the base through the engine (generating; some tens of seconds), else through
    the stores alone (seconds; no base). A cached calibration measured without the engine is measured again
    when the engine is asked for.
    """
    progress = progress or Silent()
    path = Path(model_path).expanduser()
    cached = load_calibration(path)
    given_base = base_seconds_per_token
    if base_seconds_per_token is None and cached is not None:
        base_seconds_per_token = cached.base_seconds_per_token
    if cached is not None and engine and cached.tier_source != "engine":
        cached = None
    if cached is not None and not force:
        if base_seconds_per_token != cached.base_seconds_per_token:
            cached = replace(cached, base_seconds_per_token=base_seconds_per_token)
            _save_quietly(cached, cache_file(path, cached.machine))
        return cached
    m = _open_model(path)
    fingerprint, machine = model_fingerprint(path), calibration.machine_id()  # before measuring: a change during it shows later
    started, t0 = time.time(), time.perf_counter()
    layer, tensors = _first_layer(m.tensors)
    split = [t for t in m.tensors if t.split]
    expert = 0
    label = str(path)
    decode = None
    if split:  # the first layer with values to decode (the planner scales the others by their values)
        _, decoding = _first_layer(split)
        fd = os.open(path, os.O_RDONLY)
        try:
            decode = measure_decode(fd, [t.source for t in decoding], expert, m.codec, min_seconds=min_seconds,
                                    label=label, progress=progress)
        finally:
            os.close(fd)
    regions = [r for t in m.tensors for r in t.regions]
    disk = measure_disk(path, regions, read_bytes, progress=progress)
    measured = None
    if engine:
        from .timing import TimingError

        try:
            region = sum(t.regions[expert][1] for t in tensors) / len(tensors)  # a layer's first read
            measured = measure_engine(path, threads=usable_cores(), expert_tensors=len(tensors),
                                      first_read=disk.latency + region / disk.bandwidth, progress=progress)
        except TimingError as e:
            warnings.warn(f"{e}; tier costs are measured through the stores alone", stacklevel=2)
    if measured is not None:
        tiers = TierCosts(warm=measured.warm, sm=measured.sm, cold=measured.cold)
        base_seconds_per_token = measured.base if given_base is None else given_base
    else:
        fd = os.open(path, os.O_RDONLY)
        try:
            tiers = measure_tiers(fd, tensors, tensors[0].n_expert, _experts_used(m), threads=usable_cores(),
                                  label=label, progress=progress)
        finally:
            os.close(fd)
    progress.close()
    cal = Calibration(
        model=fingerprint, machine=machine, measured_at=started, seconds=time.perf_counter() - t0,
        codec=m.codec, chunk_size=m.chunk_size, layer=layer, expert_tensors=len(tensors),
        expert_values=sum(t.n_values for t in tensors),
        expert_compressed_bytes=sum(t.regions[expert][1] for t in tensors),
        # the planner's layer delay is max(decodes * t_decode / cores, sm * t_read_sm + cold * t_read_cold): with
        # these, a token all in one tier costs what it was measured to cost. A layer stored raw decodes nothing
        t_decode=tiers.warm * usable_cores() if tiers.warm is not None else 0.0,
        t_decode_fresh=decode.t_decode if decode else None, t_read_sm=tiers.sm, t_read_cold=tiers.cold,
        decode_values_per_second=decode.values_per_second if decode else {},
        merge_seconds_per_value=decode.merge_seconds_per_value if decode else None,
        split_seconds_per_value=decode.split_seconds_per_value if decode else None,
        disk_bandwidth=disk.bandwidth, read_latency=disk.latency, read_size=disk.read_size, reads=disk.reads,
        bytes_read=disk.bytes_read, page_cache_dropped=disk.page_cache_dropped, cores=usable_cores(),
        base_seconds_per_token=base_seconds_per_token, tier_source="engine" if measured is not None else "stores",
        t_layer=measured.layer if measured is not None else None, plain=m.plain,
    )
    _save_quietly(cal, cache_file(path, machine))
    return cal


def _save_quietly(cal: Calibration, path: Path) -> None:
    """A cache that cannot be written (read-only home) costs a warning, not the measurement."""
    try:
        save_calibration(cal, path)
    except OSError as e:
        warnings.warn(f"could not cache the calibration in {path}: {e.strerror or e}", stacklevel=3)
