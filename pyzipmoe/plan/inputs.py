"""What the planner plans from: the model's geometry (read from its GGUF), the machine's costs (measured, given in a
file, or conservative defaults) and how often each expert is routed (a trace's activation counts).
"""

from __future__ import annotations

import json
import math
import os
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import FormatError, UnsupportedError, ZipmoeError

if TYPE_CHECKING:
    from ..file.reader import ZipmoeFile


TIERS = ("hot", "warm", "sm", "cold")

# Conservative costs for a machine nobody has measured: a slow core, a SATA-class SSD, a laptop's memory.
DEFAULT_DECODE_RATE = 0.5e9  # BF16 bytes one core decodes per second (huff does 1-2 GB/s on current cores)
DEFAULT_DISK_BANDWIDTH = 0.5e9  # bytes per second
DEFAULT_READ_LATENCY = 1e-4  # seconds per read
DEFAULT_MEMORY_BANDWIDTH = 10e9  # bytes per second a token's matmuls stream (dense tensors + k experts per layer)


class PlanInputError(ZipmoeError):
    """A trace, costs or model file the planner cannot use (exit status 2, bad input)."""


# --------------------------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Costs:
    """What a routed expert costs on this machine."""

    cores: int  # cores that decode experts (chunks of one expert are shared between them)
    t_decode: float  # seconds for one core to decode one expert of one layer (all of its tensors)
    disk_bandwidth: float  # bytes per second
    read_latency: float  # seconds per read, on top of bytes / bandwidth
    base_seconds_per_token: float  # a generated token with every expert hot
    t_read_sm: float | None = None  # seconds an sm-tier expert of a layer adds for its codes (measured through the
    t_read_cold: float | None = None  # runtime by `zipmoe calibrate`); None: from bytes, bandwidth and latency
    t_layer: float | None = None  # seconds a layer adds whenever it reads a cold expert from disk: the wait for
                                  # the first read, which no decoding overlaps (scaled by bytes for sm codes)

    def __post_init__(self) -> None:
        if isinstance(self.cores, bool) or not isinstance(self.cores, int) or self.cores < 1:
            raise ZipmoeError(f"cores must be a whole number of at least 1, got {self.cores!r}")
        for name, lowest, strict in (("t_decode", 0, False), ("disk_bandwidth", 0, True), ("read_latency", 0, False),
                                     ("base_seconds_per_token", 0, True)):
            value = getattr(self, name)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not ok or value < lowest or (strict and value == lowest):
                raise ZipmoeError(f"{name} must be a {'positive' if strict else 'non-negative'} number, got {value!r}")
        for name in ("t_read_sm", "t_read_cold", "t_layer"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value < 0):
                raise ZipmoeError(f"{name} must be a non-negative number or absent, got {value!r}")


@dataclass(frozen=True)
class ModelGeometry:
    """The shape of a model's experts, and the bytes one expert of each MoE layer takes in each tier."""

    n_layer: int  # blocks of the model: the first dimension of activation counts
    n_expert: int
    n_expert_used: int  # k: experts a token routes to in each layer
    layers: tuple[int, ...]  # block indices of the MoE layers, the ones planned
    hot_bytes: tuple[int, ...]  # per MoE layer: one expert decoded, BF16 (2 bytes a value)
    warm_bytes: tuple[int, ...]  # its compressed region (the mean over the layer's experts, rounded up)
    sm_bytes: tuple[int, ...]  # its sign+mantissa plane (1 byte a value)
    dense_bytes: int = 0  # every other tensor a token reads (only the default base cost uses it)
    # per MoE layer: the largest expert tensor's share of the layer's compressed bytes (a store reads one tensor;
    # gate, up and down: about 1/3); empty: one tensor a layer
    tensor_shares: tuple[float, ...] = ()
    # per MoE layer: whether its experts have the compressed tiers (warm, sm): every expert tensor of the layer is
    # stored through the split codec. False: some are stored raw (a plain GGUF's, a quantized zipmoe tensor's),
    # which the runtime keeps decoded or reads from the file: the layer is planned hot and cold only. Empty: all
    # layers have them. (A raw layer has sm_bytes 0: it has no value to decode, see decode_share.)
    tiered: tuple[bool, ...] = ()

    def __post_init__(self) -> None:
        if not 1 <= self.n_expert_used <= self.n_expert:
            raise ZipmoeError(f"experts used per token ({self.n_expert_used}) must be between 1 and the number of "
                              f"experts ({self.n_expert})")
        if not self.layers:
            raise ZipmoeError("the model has no MoE layers to plan")
        if len(set(self.layers)) != len(self.layers) or not all(0 <= i < self.n_layer for i in self.layers):
            raise ZipmoeError(f"MoE layers {list(self.layers)} are not distinct blocks of 0..{self.n_layer - 1}")
        for name in ("hot_bytes", "warm_bytes", "sm_bytes"):
            sizes = getattr(self, name)
            if len(sizes) != len(self.layers) or any(s < 0 for s in sizes):
                raise ZipmoeError(f"{name} must give one size (>= 0) for each of the {len(self.layers)} MoE layers")
        if self.tiered and len(self.tiered) != len(self.layers):
            raise ZipmoeError(f"tiered must say for each of the {len(self.layers)} MoE layers whether it has the "
                              "compressed tiers")
        if self.tensor_shares and (len(self.tensor_shares) != len(self.layers)
                                   or not all(0 < f <= 1 for f in self.tensor_shares)):
            raise ZipmoeError(f"tensor_shares must give one fraction in (0, 1] for each of the {len(self.layers)} "
                              "MoE layers")

    @classmethod
    def uniform(cls, n_layer: int, n_expert: int, n_expert_used: int, hot_bytes: int, warm_bytes: int,
                sm_bytes: int, dense_bytes: int = 0) -> ModelGeometry:
        """Every block a MoE layer with experts of the same sizes."""
        return cls(n_layer, n_expert, n_expert_used, tuple(range(n_layer)), (hot_bytes,) * n_layer,
                   (warm_bytes,) * n_layer, (sm_bytes,) * n_layer, dense_bytes)

    def read_sm_bytes(self, i: int) -> int:
        """What an sm-tier expert of MoE layer i reads from disk: its exponent codes."""
        return max(0, self.warm_bytes[i] - self.sm_bytes[i])

    def has_tiers(self, i: int) -> bool:
        """Whether MoE layer i may keep experts warm or sm (see `tiered`)."""
        return self.tiered[i] if self.tiered else True

    def decode_share(self, i: int) -> float:
        """What decoding an expert of MoE layer i costs against one of the first layer with values to decode: by
        their values stored through the split codec (sm_bytes, a byte a value); 0 for a layer stored raw, whose
        experts are read as stored and not decoded. 1 for every layer of a model whose layers are alike."""
        ref = next((s for s in self.sm_bytes if s > 0), 0)
        return self.sm_bytes[i] / ref if ref else 0.0

    def tensor_share(self, i: int) -> float:
        """The largest expert tensor's share of MoE layer i's bytes."""
        return self.tensor_shares[i] if self.tensor_shares else 1.0

    @property
    def all_hot_bytes(self) -> int:
        """The budget that keeps every expert decoded."""
        return self.n_expert * sum(self.hot_bytes)


def _llama_int(kv: Mapping[str, Any], key: str, label: str) -> int:
    entry = kv.get(key)
    value = None if entry is None else entry.value
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PlanInputError(f"{label}: metadata key {key} is missing or not a positive whole number")
    return value


def geometry_from_gguf(path: ZipmoeFile | str | os.PathLike[str]) -> ModelGeometry:
    """The geometry of a zipmoe or plain GGUF: llama.cpp's expert counts and block count, and the sizes of each
    layer's experts as the runtime serves them (pyzipmoe.plan.experts): decoded, each tensor in its own type (a
    Q4_K_M file's Q6_K ffn_down_exps at Q6_K's size); as stored (a compressed region, or a raw expert's bytes); and
    the sign+mantissa plane of the values stored through the split codec (none for raw tensors, whose layers have
    no compressed tiers: `tiered`).

    Loads the native library (a zipmoe file's indexes are validated by it). Raises PlanInputError for a file that
    is no GGUF, has no expert tensors, or whose expert tensors disagree with its metadata.
    """
    from ..file.reader import ZipmoeFile
    from .experts import model_experts

    label = str(path.path if isinstance(path, ZipmoeFile) else path)
    try:
        m = model_experts(path)
    except (FormatError, UnsupportedError) as e:
        raise PlanInputError(str(e)) from None
    except OSError as e:
        raise PlanInputError(f"{label}: {e.strerror or e}") from None
    kv = m.gguf.kv
    arch_kv = kv.get("general.architecture")
    if arch_kv is None or not isinstance(arch_kv.value, str):
        raise PlanInputError(f"{label}: metadata key general.architecture is missing")
    arch = arch_kv.value
    n_layer = _llama_int(kv, f"{arch}.block_count", label)
    n_expert = _llama_int(kv, f"{arch}.expert_count", label)
    n_used = _llama_int(kv, f"{arch}.expert_used_count", label)

    by_layer: dict[int, list[Any]] = {}
    for t in m.tensors:
        if not 0 <= t.block < n_layer or t.n_expert != n_expert:
            raise PlanInputError(f"{label}: expert tensor {t.name} does not fit {arch}.block_count = {n_layer} and "
                                 f"{arch}.expert_count = {n_expert}")
        by_layer.setdefault(t.block, []).append(t)
    if not by_layer:
        raise PlanInputError(f"{label}: no expert tensors: nothing to plan")

    layers = tuple(sorted(by_layer))
    tensor_regions = [[t.stored_bytes for t in by_layer[i]] for i in layers]
    regions = [sum(r) for r in tensor_regions]
    # what a prompt reads of a layer's experts is read one tensor at a time: the largest stored one's share
    shares = [max(r) / sum(r) if sum(r) else 1.0 for r in tensor_regions]
    return ModelGeometry(n_layer=n_layer, n_expert=n_expert, n_expert_used=n_used, layers=layers,
                         hot_bytes=tuple(sum(t.expert_size for t in by_layer[i]) for i in layers),
                         warm_bytes=tuple(-(-r // n_expert) for r in regions),
                         sm_bytes=tuple(sum(t.n_values for t in by_layer[i] if t.split) for i in layers),
                         dense_bytes=m.dense_bytes, tensor_shares=tuple(shares),
                         tiered=tuple(all(t.split for t in by_layer[i]) for i in layers))


def default_costs(geometry: ModelGeometry, cores: int | None = None) -> Costs:
    """A conservative guess for a machine nobody measured (see the DEFAULT_* constants): decoding at 0.5 GB/s of BF16
    (or F16) per core, a 0.5 GB/s disk with 0.1 ms per read, and a base token that streams the dense tensors and the
    k routed experts of every layer at 10 GB/s."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    # the layers with values to decode (tier_seconds scales them by decode_share); 0 for a model stored raw, whose
    # experts are only read
    decoding = [h for h, s in zip(geometry.hot_bytes, geometry.sm_bytes) if s > 0]
    decoded = sum(decoding) / len(decoding) if decoding else 0.0
    active = geometry.dense_bytes + geometry.n_expert_used * sum(geometry.hot_bytes)
    return Costs(cores=cores, t_decode=decoded / DEFAULT_DECODE_RATE, disk_bandwidth=DEFAULT_DISK_BANDWIDTH,
                 read_latency=DEFAULT_READ_LATENCY,
                 base_seconds_per_token=max(active / DEFAULT_MEMORY_BANDWIDTH, 1e-6))


COST_FIELDS = tuple(f.name for f in fields(Costs))
# measured through the engine; without them, reads take bytes / bandwidth and a layer's invocation costs nothing
OPTIONAL_COST_FIELDS = ("t_read_sm", "t_read_cold", "t_layer")


def costs_from_dict(values: Mapping[str, Any], *, defaults: Costs, label: str, strict: bool = True) -> Costs:
    """`defaults` with the fields `values` gives; unknown keys are an error when `strict` (a typo in a costs file
    would otherwise be ignored silently), skipped otherwise (a calibration may record more than costs)."""
    if not isinstance(values, Mapping):
        raise PlanInputError(f"{label}: expected a JSON object with keys {', '.join(COST_FIELDS)}")
    unknown = sorted(set(values) - set(COST_FIELDS))
    if strict and unknown:
        raise PlanInputError(f"{label}: unknown key(s) {', '.join(unknown)}; expected {', '.join(COST_FIELDS)}")
    merged = {**asdict(defaults), **{k: v for k, v in values.items() if k in COST_FIELDS}}
    try:
        return Costs(**merged)
    except ZipmoeError as e:
        raise PlanInputError(f"{label}: {e}") from None


def costs_from_file(path: str | os.PathLike[str], *, defaults: Costs) -> Costs:
    """Costs from a JSON file with some or all of the keys cores, t_decode, disk_bandwidth, read_latency and
    base_seconds_per_token; the missing ones come from `defaults`."""
    try:
        values = json.loads(Path(path).read_text())
    except OSError as e:
        raise PlanInputError(f"{path}: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PlanInputError(f"{path}: not JSON ({e})") from None
    return costs_from_dict(values, defaults=defaults, label=str(path))


# ---------------------------------------------------------------------------------------- frequencies


def uniform_counts(geometry: ModelGeometry) -> np.ndarray:
    """Activation counts that make every expert equally likely (no trace)."""
    return np.ones((geometry.n_layer, geometry.n_expert))


def validate_counts(counts: Any, n_layer: int, n_expert: int, label: str = "activation counts") -> np.ndarray:
    """Activation counts [n_layer, n_expert] as floats; a layer never used gets uniform counts (no evidence)."""
    a = np.asarray(counts)
    if a.dtype == bool or not (np.issubdtype(a.dtype, np.integer) or np.issubdtype(a.dtype, np.floating)):
        raise PlanInputError(f"{label}: counts must be numbers, got dtype {a.dtype}")
    if a.shape != (n_layer, n_expert):
        raise PlanInputError(f"{label}: counts have shape {a.shape}, expected (n_layer, n_expert) = "
                             f"({n_layer}, {n_expert}) for this model")
    a = a.astype(np.float64)
    if not np.isfinite(a).all():
        raise PlanInputError(f"{label}: counts must be finite numbers")
    if (a < 0).any():
        raise PlanInputError(f"{label}: counts must not be negative (found {a.min():g})")
    if not a.any():
        raise PlanInputError(f"{label}: every count is zero: expected the experts each token routed to")
    a[~a.any(axis=1)] = 1.0
    return a


UNREADABLE = (ValueError, EOFError, zipfile.BadZipFile)  # what np.load raises for a file that is not numpy


def load_numpy(path: str | os.PathLike[str], fail: Callable[[str], Exception]) -> Any:
    """np.load(path) without pickles: an array, or an NpzFile to close; raises fail(why) where it cannot be read
    (why: the system's reason, or "not a readable numpy file (...)")."""
    try:
        return np.load(path, allow_pickle=False)
    except OSError as e:
        raise fail(str(e.strerror or e)) from None
    except UNREADABLE as e:  # not numpy, truncated, damaged, or an object array
        raise fail(f"not a readable numpy file ({e})") from None


def _trace_array(path: str | os.PathLike[str], expected: str) -> np.ndarray:
    """The counts array of an .npy, or of an .npz's key "counts"; PlanInputError if it cannot be read."""
    loaded = load_numpy(path, lambda why: PlanInputError(f"trace {path}: {why}; {expected}"))
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        return loaded
    with loaded:
        if "counts" not in loaded.files:
            raise PlanInputError(f"trace {path}: no key 'counts' (keys: {', '.join(loaded.files) or 'none'}); "
                                 f"{expected}")
        try:
            return loaded["counts"]
        except (*UNREADABLE, OSError) as e:  # a damaged or pickled member
            raise PlanInputError(f"trace {path}: key 'counts' cannot be read ({e}); {expected}") from None


def counts_from_trace(path: str | os.PathLike[str], n_layer: int, n_expert: int) -> np.ndarray:
    """Activation counts from a trace: an .npz with key "counts", or an .npy, of integer counts shaped
    (n_prompts, n_layer, n_expert); summed over the prompts and validated as by validate_counts."""
    expected = f"expected an .npz with key 'counts' or an .npy of shape (n_prompts, {n_layer}, {n_expert})"
    counts = _trace_array(path, expected)
    if counts.ndim != 3:
        raise PlanInputError(f"trace {path}: counts have {counts.ndim} dimension(s), shape {counts.shape}; {expected}")
    if counts.shape[1:] != (n_layer, n_expert):
        raise PlanInputError(f"trace {path}: counts have shape {counts.shape}; {expected}")
    if counts.dtype == bool or not np.issubdtype(counts.dtype, np.integer):
        raise PlanInputError(f"trace {path}: counts have dtype {counts.dtype}, expected integers")
    if counts.size and counts.min() < 0:
        raise PlanInputError(f"trace {path}: counts must not be negative (found {counts.min()})")
    return validate_counts(counts.sum(axis=0, dtype=np.float64), n_layer, n_expert, f"trace {path}")
