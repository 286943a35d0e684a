"""The tier planner: how many experts of each MoE layer to keep hot, warm or sign+mantissa-only under a memory
budget, from how often each expert is routed (the ZipMoE paper's planner: "Efficient On-Device MoE Serving via
Lossless Compression and Cache-Affinity Scheduling", ICML 2026).

Tiers, exclusive, with a number of slots per tier in each layer:

    hot   decoded BF16 resident                                  a routed hot expert costs nothing
    warm  compressed region resident (sm plane + exponent codes) one decode
    sm    sign+mantissa plane resident, exponent codes on disk    one decode + reading the codes
    cold  nothing resident                                        one decode + reading the whole region

The runtime's eviction keeps the most used experts in the highest tiers, so the model is by rank: within a layer,
experts sorted by routing frequency fill the hot slots, then the warm ones, then the sm ones; the rest are cold.

Routing: a token routes to exactly k = n_expert_used experts of each layer. The planner uses the maximum-entropy
design that routes expert i with its observed probability pi_i: conditional Poisson sampling (independent
Bernoulli(p_i), conditioned on exactly k successes), p fitted to pi by the fixed point of Chen, Dempster & Liu
(1994). Under it the numbers of routed experts in the tiers have an exact joint distribution (a product of the
tiers' Poisson-binomial pmfs, conditioned on the total k), so a layer's expected delay per generated token is exact:

    E[max(N_decoded * t_decode / cores, N_sm * t_read_sm + N_cold * t_read_cold)]

decoding on all cores overlapping the reads; t_read = bytes / disk_bandwidth + read_latency. The predicted
generation speed is 1 / (base_seconds_per_token + the sum of the layers' delays).

The budget covers the expert tiers only (every layer's hot, warm and sm slots): not the dense tensors, the KV
cache, nor the experts the expert tensor in flight decodes. It is cut into `steps` units; each layer's table of best
delay per unit count (the splits no cheaper split beats) is combined across layers by dynamic programming. A plan
never exceeds the budget; rounding may leave up to one unit per layer unused.

The plan reaches the runtime as the environment variable ZIPMOE_PLAN, one entry per MoE layer (block index),
separated by semicolons; the experts of a layer beyond its slots are cold, and layers without experts are not
listed:

    ZIPMOE_PLAN="<layer>:<hot>,<warm>,<sm>;<layer>:<hot>,<warm>,<sm>;..."      e.g. "0:12,4,0;1:10,6,2"
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
import os
import re
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import FormatError, UnsupportedError, ZipmoeError

__all__ = [
    "COST_FIELDS", "TIERS", "CostModel", "Costs", "LayerDesign", "LayerPlan", "LayerTable",
    "ModelGeometry", "Plan", "PlanInputError", "RecencyDesign", "TierSeconds", "conditional_poisson", "cost_model",
    "costs_from_dict", "costs_from_file", "counts_from_trace", "cp_inclusion", "decode_plan", "default_costs",
    "expected_delay", "fixed_split_plan", "geometry_from_gguf", "hit_rates", "inclusion_targets", "layer_delay", "layer_design",
    "layer_table", "lfu_ranks", "lru_ranks", "miss_fractions", "plan", "plan_for_budget", "plan_tiers", "prompt_read_bytes", "runtime_plan", "poisson_binomial", "pool_designs",
    "pooling_strength", "recency_design", "split_delays", "tier_count_distribution", "tier_seconds", "token_delays",
    "uniform_counts", "validate_counts",
]

TIERS = ("hot", "warm", "sm", "cold")

# Conservative costs for a machine nobody has measured: a slow core, a SATA-class SSD, a laptop's memory.
DEFAULT_DECODE_RATE = 0.5e9  # BF16 bytes one core decodes per second (huff does 1-2 GB/s on current cores)
DEFAULT_DISK_BANDWIDTH = 0.5e9  # bytes per second
DEFAULT_READ_LATENCY = 1e-4  # seconds per read
DEFAULT_MEMORY_BANDWIDTH = 10e9  # bytes per second a token's matmuls stream (dense tensors + k experts per layer)
DEFAULT_BUDGET_STEPS = 2048

CP_TOLERANCE = 1e-12  # largest error of a fitted inclusion probability
CP_MAX_ITERATIONS = 10_000
_CAP = 1 - 1e-12  # an inclusion probability this close to 1 is 1 (rounding must not leave 0.9999999999999998)


class PlanInputError(ZipmoeError):
    """A trace, costs or model file the planner cannot use: `zipmoe plan` exits with 1 (2 is for usage errors)."""

    exit_code = 1


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

    def tensor_share(self, i: int) -> float:
        """The largest expert tensor's share of MoE layer i's bytes."""
        return self.tensor_shares[i] if self.tensor_shares else 1.0

    @property
    def all_hot_bytes(self) -> int:
        """The budget that keeps every expert decoded."""
        return self.n_expert * sum(self.hot_bytes)


_BLOCK = re.compile(r"blk\.(\d+)\.")


def _llama_int(kv: Mapping[str, Any], key: str, label: str) -> int:
    entry = kv.get(key)
    value = None if entry is None else entry.value
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PlanInputError(f"{label}: metadata key {key} is missing or not a positive whole number")
    return value


def geometry_from_gguf(path: str | os.PathLike[str]) -> ModelGeometry:
    """The geometry of a zipmoe GGUF: llama.cpp's expert counts and block count, sizes from each expert's region.

    Loads the native library (the indexes are validated by it). Raises PlanInputError for a file that is no zipmoe
    GGUF or whose expert tensors disagree with its metadata.
    """
    from ..file.gguf import DATA_SUFFIX, INDEX_SUFFIX, SOURCE_HEADER, open_zipmoe

    label = str(path)
    try:
        z = open_zipmoe(path)
    except (FormatError, UnsupportedError) as e:
        raise PlanInputError(str(e)) from None
    except OSError as e:
        raise PlanInputError(f"{label}: {e.strerror or e}") from None
    arch_kv = z.gguf.kv.get("general.architecture")
    if arch_kv is None or not isinstance(arch_kv.value, str):
        raise PlanInputError(f"{label}: metadata key general.architecture is missing")
    arch = arch_kv.value
    n_layer = _llama_int(z.gguf.kv, f"{arch}.block_count", label)
    n_expert = _llama_int(z.gguf.kv, f"{arch}.expert_count", label)
    n_used = _llama_int(z.gguf.kv, f"{arch}.expert_used_count", label)

    by_layer: dict[int, list[Any]] = {}
    for t in z.compressed:
        m = _BLOCK.match(t.name)
        block = int(m.group(1)) if m else -1
        if not 0 <= block < n_layer or t.expert.info.n_expert != n_expert:
            raise PlanInputError(f"{label}: expert tensor {t.name} does not fit {arch}.block_count = {n_layer} and "
                                 f"{arch}.expert_count = {n_expert}")
        by_layer.setdefault(block, []).append(t)
    if not by_layer:
        raise PlanInputError(f"{label}: no compressed expert tensors: nothing to plan")

    layers = tuple(sorted(by_layer))
    values = [sum(t.expert.info.n_per_expert for t in by_layer[i]) for i in layers]
    tensor_regions = [[sum(t.expert.span(e).size for e in range(n_expert)) for t in by_layer[i]] for i in layers]
    regions = [sum(r) for r in tensor_regions]
    # what a prompt reads of a layer's experts is read one tensor at a time: the largest compressed one's share
    shares = [max(r) / sum(r) if sum(r) else 1.0 for r in tensor_regions]
    companion = (DATA_SUFFIX, INDEX_SUFFIX)
    dense = sum(t.nbytes for t in z.gguf.tensors if not t.name.endswith(companion) and t.name != SOURCE_HEADER)
    return ModelGeometry(n_layer=n_layer, n_expert=n_expert, n_expert_used=n_used, layers=layers,
                         hot_bytes=tuple(2 * v for v in values),
                         warm_bytes=tuple(-(-r // n_expert) for r in regions),
                         sm_bytes=tuple(values), dense_bytes=dense, tensor_shares=tuple(shares))


def default_costs(geometry: ModelGeometry, cores: int | None = None) -> Costs:
    """A conservative guess for a machine nobody measured (see the DEFAULT_* constants): decoding at 0.5 GB/s of BF16
    per core, a 0.5 GB/s disk with 0.1 ms per read, and a base token that streams the dense tensors and the k routed
    experts of every layer at 10 GB/s."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    mean_hot = sum(geometry.hot_bytes) / len(geometry.hot_bytes)
    active = geometry.dense_bytes + geometry.n_expert_used * sum(geometry.hot_bytes)
    return Costs(cores=cores, t_decode=mean_hot / DEFAULT_DECODE_RATE, disk_bandwidth=DEFAULT_DISK_BANDWIDTH,
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


def _trace_array(path: str | os.PathLike[str], expected: str) -> np.ndarray:
    """The counts array of an .npy, or of an .npz's key "counts"; PlanInputError if it cannot be read."""
    unreadable = (ValueError, EOFError, zipfile.BadZipFile)  # not numpy, truncated, damaged, or an object array
    try:
        loaded = np.load(path, allow_pickle=False)
    except OSError as e:
        raise PlanInputError(f"trace {path}: {e.strerror or e}; {expected}") from None
    except unreadable as e:
        raise PlanInputError(f"trace {path}: not a readable numpy file ({e}); {expected}") from None
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        return loaded
    with loaded:
        if "counts" not in loaded.files:
            raise PlanInputError(f"trace {path}: no key 'counts' (keys: {', '.join(loaded.files) or 'none'}); "
                                 f"{expected}")
        try:
            return loaded["counts"]
        except (*unreadable, OSError) as e:  # a damaged or pickled member
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


# ------------------------------------------------------------------------------- the routing design


def inclusion_targets(frequencies: np.ndarray, k: int) -> np.ndarray:
    """pi_i = k f_i / sum(f), capped at 1 with the excess spread over the others in proportion to f (evenly when
    they were never seen), so that sum(pi) = k: the probability that a token routes to expert i."""
    f = np.asarray(frequencies, np.float64)
    if not 1 <= k <= f.size:
        raise ZipmoeError(f"cannot route {k} of {f.size} experts")
    pi = np.zeros(f.size)
    capped = np.zeros(f.size, bool)
    while True:
        rest = np.flatnonzero(~capped)
        if rest.size == 0:
            return pi
        weights = f[rest] if f[rest].sum() > 0 else np.ones(rest.size)
        share = (k - capped.sum()) * weights / weights.sum()
        over = share >= _CAP
        if not over.any():
            pi[rest] = share
            return pi
        capped[rest[over]] = True
        pi[capped] = 1.0


def poisson_binomial(p: np.ndarray, k: int) -> np.ndarray:
    """P(S = j) for j = 0..k, S the number of successes of independent Bernoulli(p_i)."""
    pmf = np.zeros(k + 1)
    pmf[0] = 1.0
    for q in np.asarray(p, np.float64):
        pmf[1:] = pmf[1:] * (1 - q) + pmf[:-1] * q
        pmf[0] *= 1 - q
    return pmf


def _prefix_pmfs(p: np.ndarray, k: int) -> np.ndarray:
    """Row i: the pmf (0..k) of successes among p[:i], each row scaled to a maximum of 1 (only ratios within a row
    are used, and the scaling keeps long products of small probabilities from underflowing)."""
    rows = np.zeros((p.size + 1, k + 1))
    row = np.zeros(k + 1)
    row[0] = 1.0
    for i, q in enumerate(p):
        rows[i] = row
        row = row * (1 - q)
        row[1:] += rows[i, :-1] * q
        top = row.max()
        if top > 0:
            row /= top
    rows[p.size] = row
    return rows


def cp_inclusion(p: np.ndarray, k: int) -> np.ndarray:
    """The inclusion probabilities of the conditional Poisson design: independent Bernoulli(p_i), conditioned on
    exactly k successes.

    With A_i, B_i the probabilities that the others have k, k-1 successes, pi_i = p_i B_i / ((1 - p_i) A_i + p_i B_i);
    A and B come from the pmfs of the experts before and after i, so each is a sum of positive terms (exact to
    rounding, unlike the alternating recursions of elementary symmetric polynomials).
    """
    p = np.asarray(p, np.float64)
    before = _prefix_pmfs(p, k)[:-1]
    after = _prefix_pmfs(p[::-1], k)[::-1][1:]
    others_k = (before * after[:, ::-1]).sum(axis=1)
    others_k_minus_1 = (before[:, :k] * after[:, k - 1::-1]).sum(axis=1) if k > 0 else np.zeros(p.size)
    chosen = p * others_k_minus_1
    return chosen / ((1 - p) * others_k + chosen)


def conditional_poisson(pi: np.ndarray, k: int, *, tol: float = CP_TOLERANCE,
                        max_iter: int = CP_MAX_ITERATIONS) -> np.ndarray:
    """The Bernoulli probabilities p of the conditional Poisson design of size k whose inclusion probabilities are pi
    (p_i = 1 where pi_i = 1: always chosen; 0 where pi_i = 0: never), by the fixed point of Chen, Dempster & Liu
    (1994) on the odds w_i = p_i / (1 - p_i):  w_i <- w_i * pi_i / pi_i(w)."""
    pi = np.asarray(pi, np.float64)
    if ((pi < 0) | (pi > 1)).any() or abs(pi.sum() - k) > 1e-9 * max(1, k):
        raise ZipmoeError(f"inclusion probabilities must lie in [0, 1] and sum to k = {k} (sum {pi.sum():.12g})")
    sure, never = pi >= _CAP, pi <= 0
    free = ~(sure | never)
    p = sure.astype(np.float64)
    k_free = k - int(sure.sum())
    if k_free == 0 or not free.any():
        return p
    target = pi[free]
    odds = target / (1 - target)  # the Poisson design with these probabilities: the usual starting point
    for _ in range(max_iter):
        got = cp_inclusion(odds / (1 + odds), k_free)
        error = float(np.max(np.abs(got - target)))
        if error <= tol:
            p[free] = odds / (1 + odds)
            return p
        odds *= target / got
    raise ZipmoeError(f"the conditional Poisson fit did not converge in {max_iter} iterations (largest error "
                      f"{error:.1e}, tolerance {tol:.0e}): the routing frequencies are too extreme to model")


@dataclass(frozen=True)
class LayerDesign:
    """A layer's routing model, experts in rank order (most used first)."""

    k: int
    order: np.ndarray  # expert ids by rank
    inclusion: np.ndarray  # by rank: the probability that a token routes to the expert
    bernoulli: np.ndarray  # by rank: the conditional Poisson design's p

    def expected_delay(self, seconds: TierSeconds, hot: int, warm: int, sm: int) -> float:
        return expected_delay(self, seconds, hot, warm, sm)

    def hit_rates(self, hot: int, warm: int, sm: int) -> tuple[float, float, float, float]:
        return hit_rates(self, hot, warm, sm)

    def split_delays(self, seconds: TierSeconds) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        return split_delays(self, seconds)


def layer_design(frequencies: np.ndarray, k: int) -> LayerDesign:
    """Ranks a layer's experts by frequency (ties by id) and fits the design that routes k of them per token."""
    f = np.asarray(frequencies, np.float64)
    order = np.argsort(-f, kind="stable")
    pi = inclusion_targets(f, k)[order]
    return LayerDesign(k=k, order=order, inclusion=pi, bernoulli=conditional_poisson(pi, k))


# ---------------------------------------------------------------------------------- the recency design


RECENCY_MIN_TOKENS = 16  # generated tokens a layer's routing log must score before the recency model is used


def lru_ranks(routing: np.ndarray) -> np.ndarray:
    """Where each routed expert stood in the runtime's LRU order just before its token: 0 the most recently used.

    routing: bool [entries, n_expert], the experts each generated token (or prompt batch) routed to, oldest
    first. Returns int [entries, n_expert], -1 where the entry did not route to the expert and n_expert where it
    had not been seen (nothing tells where it stood). Ties are broken as the runtime evicts: among experts last
    used by the same entry, the lower id goes first, so it stands lower."""
    routing = np.asarray(routing, bool)
    tokens, n = routing.shape
    last = np.full(n, -1)
    ids = np.arange(n)
    ranks = np.full((tokens, n), -1)
    for t in range(tokens):
        for e in np.flatnonzero(routing[t]):
            if last[e] < 0:
                ranks[t, e] = n
            else:
                ranks[t, e] = np.count_nonzero(last > last[e]) + np.count_nonzero((last == last[e]) & (ids > e))
        last[routing[t]] = t
    return ranks


def lfu_ranks(routing: np.ndarray, initial_uses: np.ndarray | None = None) -> np.ndarray:
    """Where each routed expert stood in the runtime's (token-weighted) LFU order just before its token: 0 the
    first to stay. Like lru_ranks (same arguments and result), for the default policy.

    A store with c slots of a tier that every routed expert enters keeps, after a token routing to the set R,
    R and the c - |R| experts of its previous content with the most uses (ties: the higher id stays, as the
    runtime evicts the lowest id first); with c < |R|, the c of R with the most uses (another layer's invocation
    trims it). Such caches nest (the one with c + 1 slots holds the one with c, and at most one expert more:
    Mattson et al.'s stack property), so one order gives every size: rank r means held by every cache of more
    than r slots. After a token, R comes first by uses, then each further position c takes the expert with the
    most uses among the previous order's first c experts not in R that no earlier position took (a heap).

    uses: the runtime's counters, the tokens routed to each expert since load, which start at `initial_uses`
    (default 0) where the log begins. An entry of the log adds 1 to each expert it routed to; a prompt batch in
    the runtime adds its number of tokens routed there, which a boolean log does not keep."""
    routing = np.asarray(routing, bool)
    tokens, n = routing.shape
    uses = np.zeros(n, np.int64) if initial_uses is None else np.asarray(initial_uses, np.int64).copy()
    if uses.shape != (n,):
        raise PlanInputError(f"initial uses must be one count per expert ({n}), got shape {uses.shape}")
    order: list[int] = []  # every expert seen, first to stay first
    ranks = np.full((tokens, n), -1)
    for t in range(tokens):
        routed = np.flatnonzero(routing[t])
        position = {e: i for i, e in enumerate(order)}
        ranks[t, routed] = [position.get(int(e), n) for e in routed]
        uses[routed] += 1
        chosen = set(int(e) for e in routed)
        new = sorted(chosen, key=lambda e: (int(uses[e]), e), reverse=True)
        heap = [(-int(uses[e]), -e) for e in order[: len(new)] if e not in chosen]  # the most uses pop first
        heapq.heapify(heap)
        for e in order[len(new):]:
            if e not in chosen:
                heapq.heappush(heap, (-int(uses[e]), -e))
            new.append(-heapq.heappop(heap)[1])
        new.extend(-e for _, e in sorted(heap))
        order = new
    return ranks


MODELLED_POLICIES = ("tlfu", "lru", "lfu")  # the runtime's policies the recency design models (FIFO: as LRU)


@dataclass(frozen=True)
class RecencyDesign:
    """A layer's routing as the order in which a run's tokens routed, under the runtime's eviction policy: LRU
    (lru_ranks) or (token-weighted) LFU, the default (lfu_ranks).

    The tiers are modelled as one stack: an expert that stood at rank r before its token is hot when r < hot,
    warm when r < hot + warm, sm when r < hot + warm + sm, else cold. The runtime's tiers are that stack when a
    layer keeps hot and sm experts (an expert leaving the hot tier keeps its sign+mantissa plane, taken from its
    decoded values, and enters the sm tier if it outranks the sm tier's last), or warm and sm ones without a hot
    tier (decoding on every use; a warm expert gives up its codes for the sm tier): tests/test_store.py checks the
    runtime's hits against this model token by token, for both policies. With both hot and warm slots it is not:
    an expert leaving the hot tier has no exponent codes to become warm with. split_delays therefore offers only
    the splits it predicts. Unlike the frequency design it sees that a conversation keeps coming back to the
    experts it used last, which is what keeps a small hot tier useful. Delays and hit rates are the means over
    the scored tokens, weighted by `weights` (pool_designs mixes other layers' tokens into a layer's design with them)."""

    k: int
    n_expert: int
    ranks: np.ndarray  # [tokens, k]: the stack ranks of each scored token's routed experts (n_expert: never seen)
    weights: np.ndarray | None = None  # [tokens]: each scored token's weight in the means; None: 1 each

    def __post_init__(self) -> None:
        if self.weights is None:
            return
        w = np.asarray(self.weights, np.float64)
        if w.shape != self.ranks.shape[:1] or not np.isfinite(w).all() or (w < 0).any() or not w.sum() > 0:
            raise ZipmoeError(f"a recency design's weights must be one finite weight >= 0 per scored token "
                              f"({self.ranks.shape[0]}), not all zero")
        object.__setattr__(self, "weights", w)  # frozen: the validated float copy replaces what was given

    @property
    def token_weights(self) -> np.ndarray:
        """[tokens]: each scored token's weight (ones when the design has none)."""
        return np.ones(self.ranks.shape[0]) if self.weights is None else self.weights

    @property
    def tokens(self) -> float:
        """The total weight of the scored tokens: their number when unweighted."""
        return float(self.token_weights.sum())

    def tier_counts(self, hot: int, warm: int, sm: int) -> np.ndarray:
        """[tokens, 4]: how many of each token's routed experts were hot, warm, sm and cold."""
        _tier_bounds(self.n_expert, hot, warm, sm)
        below = [np.count_nonzero(self.ranks < x, axis=1) for x in (hot, hot + warm, hot + warm + sm)]
        return np.stack([below[0], below[1] - below[0], below[2] - below[1], self.k - below[2]], axis=1)

    def expected_delay(self, seconds: TierSeconds, hot: int, warm: int, sm: int) -> float:
        _, b, c, d = self.tier_counts(hot, warm, sm).T
        w = self.token_weights
        return float(w @ layer_delay(b, c, d, seconds) / w.sum())

    def hit_rates(self, hot: int, warm: int, sm: int) -> tuple[float, float, float, float]:
        w = self.token_weights
        rates = w @ self.tier_counts(hot, warm, sm) / (w.sum() * self.k)
        return float(rates[0]), float(rates[1]), float(rates[2]), float(rates[3])

    def split_delays(self, seconds: TierSeconds) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(hot, warm, sm, delay) for every split of the layer without both hot and warm slots, as expected_delay
        gives each.

        With tier boundaries x1 <= x2 <= x3 and x1 = 0 or x1 = x2 (see above), a token's delay depends only on
        how many of its routed experts rank below x2 and below x3, b(x2) and b(x3): b(x) steps from j to j + 1 at
        x = r_j + 1, its j-th lowest rank + 1. Over the (x2, x3) plane a token is thus at one (b2, b3) on each of
        the (k + 1)^2 rectangles its ranks cut: W[x2, x3, b2, b3], the weight of the tokens there, takes 4 corners
        per rectangle in a 2-D difference array and two cumulative sums. Work O(tokens k^2 + (n k)^2), not
        O(tokens n^2): pooled designs hold the tokens of every layer.
        """
        n, k, w = self.n_expert, self.k, self.token_weights
        tokens = self.ranks.shape[0]
        # b(x) = j on [s_j, s_j+1): s_0 = 0, s_j = r_j + 1 (ranks ascending), s_k+1 = n + 1, past every split
        starts = np.concatenate([np.zeros((tokens, 1), np.int64), np.minimum(np.sort(self.ranks, axis=1), n) + 1,
                                 np.full((tokens, 1), n + 1, np.int64)], axis=1)
        lo, hi = starts[:, :-1], starts[:, 1:]  # [tokens, j]
        b2, b3 = np.indices((k + 1, k + 1))
        c, d = b3 - b2, k - b3
        reads = c * seconds.read_sm + d * seconds.read_cold
        first_read = np.where(c > 0, seconds.layer_sm, np.where(d > 0, seconds.layer, 0.0))
        possible = b3 >= b2
        per_count = np.stack([np.where(possible, np.maximum(k * seconds.decode, reads) + first_read, 0.0),  # x1 = 0
                              np.where(possible, np.maximum((k - b2) * seconds.decode, reads) + first_read, 0.0)])
        side = n + 2
        # W sums weights >= 0: what is nearer 0 than the least weight is rounding (none with whole weights)
        snap = 0.5 * w[w > 0].min()
        totals = np.zeros((2, n + 1, n + 1))  # [x1 = 0 or x1 = x2, x2, x3]
        cells = np.arange(k + 1)
        for j in range(k + 1):  # b2 = j: one slab of W at a time keeps memory at O(n^2 k)
            diff = np.zeros(side * side * (k + 1))
            for x2, sign2 in ((lo[:, j], 1.0), (hi[:, j], -1.0)):
                for x3, sign3 in ((lo, 1.0), (hi, -1.0)):
                    index = (x2[:, None] * side + x3) * (k + 1) + cells  # [tokens, b3]
                    diff += np.bincount(index.ravel(), np.repeat(sign2 * sign3 * w, k + 1), minlength=diff.size)
            weight = diff.reshape(side, side, k + 1).cumsum(axis=0).cumsum(axis=1)[: n + 1, : n + 1]
            weight[np.abs(weight) < snap] = 0.0
            totals += np.einsum("xyb,cb->cxy", weight, per_count[:, j])
        totals /= w.sum()
        hot, warm, sm, delay = [], [], [], []
        for x2 in range(n + 1):
            x1 = np.array([0, x2]) if x2 > 0 else np.array([0])  # no hot slots, or no warm ones (see above)
            x3 = np.arange(x2, n + 1)
            g1, g3 = np.meshgrid(x1, x3, indexing="ij")
            hot.append(g1.ravel())
            warm.append(x2 - g1.ravel())
            sm.append(g3.ravel() - x2)
            delay.append(totals[: x1.size, x2, x3].ravel())
        return np.concatenate(hot), np.concatenate(warm), np.concatenate(sm), np.concatenate(delay)


def recency_design(routing: np.ndarray, k: int, *, history: int | None = None, policy: str = "tlfu",
                   initial_uses: np.ndarray | None = None) -> RecencyDesign | None:
    """The recency design of a layer from its routing log (bool [entries, n_expert], oldest first; an entry is a
    generated token, or a prompt's batch routed at once) under the runtime's eviction `policy` (one of MODELLED_POLICIES;
    LFU's uses start at `initial_uses`, see lfu_ranks): the first `history` entries (default a quarter) only
    tell where the experts stand; the generated tokens after them (entries of exactly k experts) are scored. None
    when fewer than RECENCY_MIN_TOKENS would be scored."""
    routing = np.asarray(routing, bool)
    if routing.ndim != 2:
        raise PlanInputError(f"a routing log must be [tokens, n_expert], got shape {routing.shape}")
    if policy not in MODELLED_POLICIES:
        raise PlanInputError(f"the planner models the policies {', '.join(MODELLED_POLICIES)}, not {policy!r}")
    history = routing.shape[0] // 4 if history is None else history
    scored = np.flatnonzero(routing.sum(axis=1) == k)
    scored = scored[scored >= history]
    if scored.size < RECENCY_MIN_TOKENS:
        return None
    ranks = (lru_ranks(routing) if policy == "lru" else lfu_ranks(routing, initial_uses))[scored]
    ranks = np.sort(np.where(ranks >= 0, ranks, np.iinfo(np.int64).max), axis=1)[:, :k]
    return RecencyDesign(k=k, n_expert=routing.shape[1], ranks=ranks)


def miss_fractions(design: RecencyDesign) -> np.ndarray:
    """[n_expert - 1]: for each cut c = 1..n_expert-1, the (weighted) share of the routed experts that ranked >= c,
    the ones c hot slots would miss."""
    n = design.n_expert
    ranked = np.bincount(np.minimum(design.ranks, n).ravel(), np.repeat(design.token_weights, design.k),
                         minlength=n + 1)
    at_or_above = ranked[::-1].cumsum()[::-1]  # [c]: routed experts ranked >= c
    return at_or_above[1:n] / at_or_above[0]


def pooling_strength(designs: Sequence[RecencyDesign]) -> float:
    """How many tokens' worth of the pooled design (every layer's tokens) to mix into each layer's own: the prior
    strength n0 of an empirical Bayes shrinkage, by the method of moments. 0 for fewer than two layers; inf where
    the layers differ no more than sampling alone would make them.

    A short routing log (a few dozen scored tokens a layer) measures each layer's delay curve with much noise, and
    the planner's dynamic programme, picking the best-looking split per layer, fits that noise (the optimizer's
    curse): layers that route alike got very different slots, and plans measured slower than the equal split.
    Shrinking each layer toward the pool plans per layer where the data supports it. Over the cuts c of the LRU
    stack, the miss fraction m_i(c) of layer i varies between layers by S_b = sum_c var_i m_i(c), of which
    sampling explains S_w = sum_c mean_i m_i(c) (1 - m_i(c)) / (n_i k) (n_i its scored tokens' weight): the true
    spread is tau2 = S_b - S_w, and n0 = mean(n_i) S_w / tau2. The LRU ranks of consecutive tokens are correlated
    (a token reuses the last one's experts), so S_w underestimates the sampling variance and n0 errs toward less
    pooling."""
    if len(designs) < 2:
        return 0.0
    if len({(d.n_expert, d.k) for d in designs}) > 1:
        raise ZipmoeError("only layers with the same number of experts and experts per token can be pooled")
    tokens = np.array([d.tokens for d in designs])
    miss = np.stack([miss_fractions(d) for d in designs])  # [layers, cuts]
    between = float(miss.var(axis=0, ddof=1).sum())
    within = float((miss * (1 - miss) / (tokens[:, None] * designs[0].k)).mean(axis=0).sum())
    spread = between - within
    return math.inf if spread <= 0 else float(tokens.mean() * within / spread)


def pool_designs(designs: Sequence[LayerDesign | RecencyDesign]) -> tuple[LayerDesign | RecencyDesign, ...]:
    """Each recency design shrunk toward the pool of the recency designs with its n_expert and k (see
    pooling_strength): its own tokens with their weights (n_i in all) and every pooled layer's tokens with n0 in
    all, so its delays are (n_i delay_i + n0 delay_pool) / (n_i + n0). Frequency designs, and a recency design
    with no other to pool with, are returned as they are; with n0 infinite every pooled layer gets the pool."""
    out = list(designs)
    groups: dict[tuple[int, int], list[tuple[int, RecencyDesign]]] = {}
    for i, d in enumerate(designs):
        if isinstance(d, RecencyDesign):
            groups.setdefault((d.n_expert, d.k), []).append((i, d))
    for (n, k), members in groups.items():
        n0 = pooling_strength([d for _, d in members])
        if n0 == 0:
            continue
        pool_weights = np.concatenate([d.token_weights for _, d in members])
        pool = RecencyDesign(k=k, n_expert=n, ranks=np.concatenate([d.ranks for _, d in members]),
                             weights=pool_weights)
        prior = pool_weights * (n0 / pool_weights.sum()) if math.isfinite(n0) else None
        for i, d in members:
            out[i] = pool if prior is None else RecencyDesign(
                k=k, n_expert=n, ranks=np.concatenate([d.ranks, pool.ranks]),
                weights=np.concatenate([d.token_weights, prior]))
    return tuple(out)


# ------------------------------------------------------------------------------------ delay of a split


@dataclass(frozen=True)
class TierSeconds:
    """A layer's costs per routed expert, in seconds of wall time."""

    decode: float  # t_decode / cores: decoding shares the cores
    read_sm: float  # reading an sm-tier expert's exponent codes
    read_cold: float  # reading a cold expert's region
    layer: float = 0.0  # once per token when the layer reads a cold expert: the wait for the first read
    layer_sm: float = 0.0  # the same when its first read is an sm expert's codes (the reader takes those first)


def tier_seconds(geometry: ModelGeometry, costs: Costs, i: int) -> TierSeconds:
    """The costs of MoE layer i (its index in geometry.layers)."""
    def read(nbytes: int, measured: float | None, measured_bytes: int) -> float:
        if measured is not None:  # measured through the runtime on the first MoE layer: scaled by size
            return measured * nbytes / max(1, measured_bytes)
        return nbytes / costs.disk_bandwidth + costs.read_latency

    return TierSeconds(decode=costs.t_decode / costs.cores,
                       read_sm=read(geometry.read_sm_bytes(i), costs.t_read_sm, geometry.read_sm_bytes(0)),
                       read_cold=read(geometry.warm_bytes[i], costs.t_read_cold, geometry.warm_bytes[0]),
                       layer=costs.t_layer or 0.0,
                       layer_sm=(costs.t_layer or 0.0) * geometry.read_sm_bytes(i) / max(1, geometry.warm_bytes[i]))


def _tier_bounds(n: int, hot: int, warm: int, sm: int) -> tuple[int, int, int, int, int]:
    if min(hot, warm, sm) < 0 or hot + warm + sm > n:
        raise ZipmoeError(f"slots hot {hot}, warm {warm}, sm {sm} do not fit a layer of {n} experts")
    return 0, hot, hot + warm, hot + warm + sm, n


def _compositions(k: int) -> np.ndarray:
    """Mask over (a, b, c, d) in 0..k: a + b + c + d = k."""
    a, b, c, d = np.indices((k + 1,) * 4)
    return a + b + c + d == k


def tier_count_distribution(design: LayerDesign, hot: int, warm: int, sm: int) -> np.ndarray:
    """P(N_hot = a, N_warm = b, N_sm = c, N_cold = d) for a token, shape (k+1,)*4 (zero unless a+b+c+d = k): the
    product of the tiers' Poisson-binomial pmfs, conditioned on k routed experts in all."""
    k = design.k
    bounds = _tier_bounds(design.bernoulli.size, hot, warm, sm)
    pmfs = [poisson_binomial(design.bernoulli[lo:hi], k) for lo, hi in itertools.pairwise(bounds)]
    joint = np.einsum("a,b,c,d->abcd", *pmfs) * _compositions(k)
    return joint / joint.sum()


def layer_delay(b: Any, c: Any, d: Any, seconds: TierSeconds) -> Any:
    """A layer's delay for a token with b warm, c sm and d cold routed experts: every one of them is decoded, the
    sm and cold ones read first, decoding overlaps the reads; and the wait for the first read, if any (an sm
    expert's codes when there is one, the reader's first: the wait scales with the bytes)."""
    return np.maximum((b + c + d) * seconds.decode, c * seconds.read_sm + d * seconds.read_cold) + \
        np.where(c > 0, seconds.layer_sm, np.where(d > 0, seconds.layer, 0.0))


def token_delays(k: int, seconds: TierSeconds) -> np.ndarray:
    """A layer's delay for each (N_hot, N_warm, N_sm, N_cold), shape (k+1,)*4 (layer_delay)."""
    _, b, c, d = np.indices((k + 1,) * 4)
    return layer_delay(b, c, d, seconds)


def expected_delay(design: LayerDesign, seconds: TierSeconds, hot: int, warm: int, sm: int) -> float:
    """A layer's expected delay per generated token with these slots."""
    return float((tier_count_distribution(design, hot, warm, sm) * token_delays(design.k, seconds)).sum())


def hit_rates(design: LayerDesign, hot: int, warm: int, sm: int) -> tuple[float, float, float, float]:
    """The expected fraction of routed experts found in each tier: E[N_tier] / k = sum of the tier's pi / k."""
    bounds = _tier_bounds(design.inclusion.size, hot, warm, sm)
    hot_rate, warm_rate, sm_rate, cold_rate = (float(design.inclusion[lo:hi].sum() / design.k)
                                               for lo, hi in itertools.pairwise(bounds))
    return hot_rate, warm_rate, sm_rate, cold_rate


def _range_pmfs(p: np.ndarray, k: int) -> np.ndarray:
    """R[x, y]: the pmf (0..k) of successes among p[x:y], shape (n+1, n+1, k+1), zero for y < x."""
    n = p.size
    r = np.zeros((n + 1, n + 1, k + 1))
    r[np.arange(n + 1), np.arange(n + 1), 0] = 1.0
    for y in range(n):  # extend every range that ends at y by expert y
        prev = r[: y + 1, y]
        r[: y + 1, y + 1] = prev * (1 - p[y])
        r[: y + 1, y + 1, 1:] += prev[:, :-1] * p[y]
    return r


def split_delays(design: LayerDesign, seconds: TierSeconds) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(hot, warm, sm, delay) for every split of a layer, the same delays as expected_delay in one pass.

    With tier boundaries x1 <= x2 <= x3 (ranks [0, x1) hot, [x1, x2) warm, [x2, x3) sm, the rest cold), the delay is
    sum over c, d of H[x1, x2, c, d] * U[x2, x3, c, d] / P(k routed), where H sums the hot and warm counts against
    the delay and U holds the sm and cold pmfs: one matrix product per x2. Memory grows as (n k)^2: some 200 MB at
    peak for 256 experts with k = 8.
    """
    k, p = design.k, design.bernoulli
    n = p.size
    r = _range_pmfs(p, k)
    total = r[0, n, k]  # every split's joint pmf sums to this
    a, c, d = np.indices((k + 1,) * 3)
    b = k - a - c - d
    delay_acd = np.where(b >= 0, layer_delay(b, c, d, seconds), 0)
    hot_warm = np.zeros((n + 1, n + 1, k + 1, k + 1))  # H[x1, x2, c, d] = sum over a of R[0, x1](a) R[x1, x2](b) delay
    for hot_count in range(k + 1):
        warm_count = np.clip(b[hot_count], 0, k)
        hot_warm += r[0, :, hot_count][:, None, None, None] * r[:, :, warm_count] * delay_acd[hot_count]
    cold = r[:, n]  # [x3, d]: the pmf of the cold experts, ranks [x3, n)
    sm_cold = r[:, :, :, None] * cold[None, :, None, :]  # U[x2, x3, c, d] = R[x2, x3](c) * R[x3, n](d)
    kk = (k + 1) ** 2
    hot, warm, sm, delay = [], [], [], []
    for x2 in range(n + 1):
        delays = hot_warm[: x2 + 1, x2].reshape(-1, kk) @ sm_cold[x2, x2:].reshape(-1, kk).T / total
        x1, x3 = np.meshgrid(np.arange(x2 + 1), np.arange(x2, n + 1), indexing="ij")
        hot.append(x1.ravel())
        warm.append(x2 - x1.ravel())
        sm.append(x3.ravel() - x2)
        delay.append(delays.ravel())
    return np.concatenate(hot), np.concatenate(warm), np.concatenate(sm), np.concatenate(delay)


# ------------------------------------------------------------------------------------- optimisation


@dataclass(frozen=True)
class LayerTable:
    """The splits of one layer that no cheaper split beats: bytes ascending, delay strictly descending."""

    hot: np.ndarray
    warm: np.ndarray
    sm: np.ndarray
    nbytes: np.ndarray
    delay: np.ndarray


def layer_table(design: LayerDesign | RecencyDesign, seconds: TierSeconds, hot_bytes: int, warm_bytes: int,
                sm_bytes: int) -> LayerTable:
    """The Pareto frontier (bytes, delay) of a layer's splits; its first entry costs no bytes (no slots)."""
    hot, warm, sm, delay = design.split_delays(seconds)
    nbytes = hot.astype(np.int64) * hot_bytes + warm.astype(np.int64) * warm_bytes + sm.astype(np.int64) * sm_bytes
    order = np.argsort(nbytes)  # splits of equal bytes come in any order: the last kept of each is their best
    d = delay[order]
    best_before = np.minimum.accumulate(np.concatenate(([np.inf], d[:-1])))
    kept = order[d < best_before * (1 - 1e-12)]  # rounding must not make a dearer split look better
    keep = kept[np.append(nbytes[kept][1:] != nbytes[kept][:-1], True)]
    return LayerTable(hot[keep], warm[keep], sm[keep], nbytes[keep], delay[keep])


@dataclass(frozen=True)
class CostModel:
    """A model on a machine under a routing profile: what a plan for any budget is computed from."""

    geometry: ModelGeometry
    costs: Costs
    designs: tuple[LayerDesign | RecencyDesign, ...]  # per MoE layer
    tables: tuple[LayerTable, ...]

    @property
    def recency(self) -> bool:
        """Whether every layer is planned from the order of a run's routing (the recency design)."""
        return all(isinstance(d, RecencyDesign) for d in self.designs)


def cost_model(geometry: ModelGeometry, costs: Costs, counts: np.ndarray | None = None,
               routing: Mapping[int, np.ndarray] | None = None, *, policy: str = "tlfu") -> CostModel:
    """Fits each MoE layer's routing design and tabulates its splits: the recency design under the run's eviction
    `policy` where `routing` (block -> bool [tokens, n_expert], the order generated tokens routed in) has enough
    tokens, shrunk toward the pool of all layers' recency designs as far as the layers do not differ more than
    their logs' noise (pool_designs), else the frequency design of the activation counts [n_layer, n_expert]
    (None: uniform). Given with a routing log, the counts are the runtime's since load (they include the log's),
    which LFU's order starts from. The expensive part of planning; plans for many budgets share it."""
    g = geometry
    live = counts is not None
    counts = uniform_counts(g) if counts is None else validate_counts(counts, g.n_layer, g.n_expert)
    routing = routing or {}
    policy = policy if policy in MODELLED_POLICIES else "lru"  # FIFO is not a stack: LRU is the nearest

    def design(block: int) -> LayerDesign | RecencyDesign:
        log = routing.get(block)
        before = np.maximum(np.rint(counts[block]).astype(np.int64) - np.asarray(log, bool).sum(axis=0), 0) \
            if live and log is not None else None
        recent = recency_design(log, g.n_expert_used, policy=policy, initial_uses=before) if log is not None else None
        return recent if recent is not None else layer_design(counts[block], g.n_expert_used)

    designs = pool_designs([design(block) for block in g.layers])  # short logs: shrunk toward all layers
    tables = tuple(layer_table(designs[i], tier_seconds(g, costs, i), g.hot_bytes[i], g.warm_bytes[i], g.sm_bytes[i])
                   for i in range(len(g.layers)))
    return CostModel(g, costs, designs, tables)


def _cheapest_best(table: LayerTable, unit: int) -> tuple[np.ndarray, np.ndarray]:
    """(units, index into the table) of the best split at each distinct cost in budget units (rounded up)."""
    units = (table.nbytes + unit - 1) // unit
    last_of_each = np.append(units[1:] != units[:-1], True)  # the frontier's delay falls with cost: keep the last
    return units[last_of_each], np.flatnonzero(last_of_each)


def _allocate(options: Sequence[tuple[np.ndarray, np.ndarray]], n_units: int) -> list[int]:
    """Dynamic programming over layers: for each layer, the option (units, delay) to take so that the total delay
    is least with total units <= n_units. Returns an option index per layer."""
    budgets = np.arange(n_units + 1)
    best = np.zeros(n_units + 1)  # least delay of the layers so far within each budget
    choices = []
    for units, delay in options:
        rest = budgets[:, None] - units[None, :]
        candidates = np.where(rest >= 0, best[np.maximum(rest, 0)] + delay[None, :], np.inf)
        choice = candidates.argmin(axis=1)
        choices.append(choice)
        best = candidates[budgets, choice]
    picks, left = [0] * len(options), n_units
    for i in reversed(range(len(options))):
        picks[i] = int(choices[i][left])
        left -= int(options[i][0][picks[i]])
    return picks


def plan_for_budget(model: CostModel, budget: int, *, steps: int = DEFAULT_BUDGET_STEPS) -> Plan:
    """The slots per tier of every MoE layer that minimise the expected delay with at most `budget` bytes in the
    expert tiers. The budget is cut into `steps` units (exact when budget <= steps)."""
    if budget < 0:
        raise ZipmoeError(f"the budget must not be negative, got {budget}")
    g = model.geometry
    if budget >= g.all_hot_bytes:
        return _plan_from_splits(model, [(g.n_expert, 0, 0)] * len(g.layers), budget)
    unit = max(1, -(-budget // steps))
    frontiers = [_cheapest_best(t, unit) for t in model.tables]
    options = [(units, t.delay[index]) for (units, index), t in zip(frontiers, model.tables)]
    picks = _allocate(options, budget // unit)
    splits = []
    for t, (_, index), pick in zip(model.tables, frontiers, picks):
        j = index[pick]
        splits.append((int(t.hot[j]), int(t.warm[j]), int(t.sm[j])))
    return _plan_from_splits(model, _spend_leftover(g, splits, budget), budget)


PLAN_MARGIN = 0.25  # how much of the time tokens wait for experts a plan must save for a run to take it


def runtime_plan(model: CostModel, budget: int, *, margin: float = PLAN_MARGIN) -> Plan:
    """The plan a run takes: plan_for_budget's, unless it is predicted to save less than `margin` of the time
    tokens wait for experts when the budget keeps decoded experts only (the same hot slots in every layer); a
    run then keeps those.

    The cost model's predictions fall within about 25% of measured speed (tools/bench_planner.py), and decoded
    experts alone were the best or near-best fixed split at every budget measured from 60% up on the synthetic
    model: a plan the model rates only slightly better is as likely slower, and it moves memory between tiers
    and layers for nothing. Where routing is skewed, or the budget small, plans save far more than that."""
    best = plan_for_budget(model, budget)
    decoded = fixed_split_plan(model, budget, 1.0, 0.0, 0.0)
    return best if best.delay < (1 - margin) * decoded.delay else decoded


def _spend_leftover(g: ModelGeometry, splits: list[tuple[int, int, int]], budget: int) -> list[tuple[int, int, int]]:
    """Turns what the plan leaves of the budget into hot slots, layer after layer, from cold experts first, then
    from sm and warm ones: a slot the model sees no use for (a routing log only shows the experts it saw) still
    serves the experts it did not see, and memory left idle serves nothing."""
    splits = [list(x) for x in splits]
    left = budget - sum(h * g.hot_bytes[i] + w * g.warm_bytes[i] + s * g.sm_bytes[i]
                        for i, (h, w, s) in enumerate(splits))
    for source, size in ((None, None), (2, g.sm_bytes), (1, g.warm_bytes)):  # cold, sm, warm experts become hot
        grew = True
        while grew:
            grew = False
            for i, x in enumerate(splits):
                cost = g.hot_bytes[i] - (size[i] if size else 0)
                has = g.n_expert - sum(x) if source is None else x[source]
                if has > 0 and cost <= left:
                    x[0] += 1
                    if source is not None:
                        x[source] -= 1
                    left -= cost
                    grew = True
    return [(h, w, s) for h, w, s in splits]


def fixed_split_plan(model: CostModel, budget: int, hot_share: float, warm_share: float,
                     sm_share: float) -> Plan:
    """The plan that gives each tier a fixed share of the budget, with the same slots in every layer (what a
    runtime without a planner does; benchmarks compare it with plan_for_budget)."""
    shares = (hot_share, warm_share, sm_share)
    if min(shares) < 0 or sum(shares) > 1 + 1e-9:
        raise ZipmoeError(f"tier shares {shares} must be non-negative and add up to at most 1")
    if budget < 0:
        raise ZipmoeError(f"the budget must not be negative, got {budget}")
    g = model.geometry
    left = g.n_expert
    slots = []
    for share, sizes in zip(shares, (g.hot_bytes, g.warm_bytes, g.sm_bytes)):
        per_slot = sum(sizes)  # one slot in every layer
        n = left if per_slot == 0 else min(left, int(share * budget) // per_slot)
        slots.append(n)
        left -= n
    return _plan_from_splits(model, [tuple(slots)] * len(g.layers), budget)  # type: ignore[list-item]


DIRECT_ALIGN = 4096  # the reader's O_DIRECT block (ZIPMOE_DIRECT_ALIGN)


def prompt_read_bytes(geometry: ModelGeometry, splits: Sequence[tuple[int, int, int]]) -> int:
    """What a prompt's read buffers hold at once under these slots (hot, warm, sm per MoE layer): the store that
    decodes stages what its experts that are not in RAM read (a cold expert's region, an sm expert's codes), and the
    next store's are read ahead into a second buffer as large; twice the largest store's, then, each read in its
    span of whole O_DIRECT blocks. The runtime charges the same for its shares (zipmoe_budget_split_tiers).
    (Without the blocks, a plan on the tiny test preset, whose regions are 3 KiB, left 28 KiB for 40 of reads.)"""
    g = geometry
    most = 0.0
    for i, (hot, warm, sm) in enumerate(splits):
        cold = g.n_expert - hot - warm - sm
        # each read takes its span of whole O_DIRECT blocks in the buffer: up to two blocks more
        most = max(most, (cold * g.warm_bytes[i] + sm * g.read_sm_bytes(i)) * g.tensor_share(i)
                   + (cold + sm) * 2 * DIRECT_ALIGN)
    return 2 * math.ceil(most)


READ_ROOM_ROUNDS = 8  # plans made to find the room for a prompt's reads before taking the most the glue gives them


def plan_tiers(model: CostModel, tiers: int, split: tuple[float, float, float] | None = None) -> Plan:
    """The plan a run applies for `tiers` bytes (the budget less its minimum): runtime_plan's, or with `split`
    (hot, warm, sm shares) fixed_split_plan's, for the most bytes that leave a prompt's read buffers room beside
    the slots (prompt_read_bytes, at most half of `tiers`, as the glue caps it). Out of the budget, those buffers
    (~100 MiB at 40% of the 2.8g model) sat in a container's room beside it and squeezed out the page cache of the
    weights that are not experts. Plan.read_bytes says how much was left. Fewer slots can only read more, so the
    room grows from round to round until the plan's reads fit it."""
    def make(nbytes: int) -> Plan:
        return runtime_plan(model, nbytes) if split is None else fixed_split_plan(model, nbytes, *split)

    g, cap, room = model.geometry, tiers // 2, 0
    for _ in range(READ_ROOM_ROUNDS):
        plan = make(tiers - room)
        need = min(cap, prompt_read_bytes(g, [(lp.hot, lp.warm, lp.sm) for lp in plan.layers]))
        if need <= room:
            return replace(plan, read_bytes=room)
        room = need
    return replace(make(tiers - cap), read_bytes=cap)


def plan(geometry: ModelGeometry, costs: Costs, counts: np.ndarray | None, budget: int, *,
         steps: int = DEFAULT_BUDGET_STEPS) -> Plan:
    """cost_model then plan_for_budget: the best plan for one budget."""
    return plan_for_budget(cost_model(geometry, costs, counts), budget, steps=steps)


# --------------------------------------------------------------------------------------------- plans


@dataclass(frozen=True)
class LayerPlan:
    layer: int  # block index
    hot: int
    warm: int
    sm: int
    cold: int
    nbytes: int
    delay: float  # expected seconds per generated token
    hit_rates: tuple[float, float, float, float]  # expected fraction of routed experts in hot, warm, sm, cold


@dataclass(frozen=True)
class Plan:
    layers: tuple[LayerPlan, ...]
    budget: int  # bytes the expert tiers could use
    base_seconds_per_token: float
    read_bytes: int = 0  # bytes left beside the tiers for a prompt's read buffers (plan_tiers)

    @property
    def nbytes(self) -> int:
        return sum(lp.nbytes for lp in self.layers)

    @property
    def delay(self) -> float:
        """Expected seconds per generated token spent on experts that are not hot."""
        return sum(lp.delay for lp in self.layers)

    @property
    def tokens_per_second(self) -> float:
        """Predicted generation speed."""
        return 1.0 / (self.base_seconds_per_token + self.delay)

    @property
    def hit_rates(self) -> dict[str, float]:
        """The expected fraction of all routed experts found in each tier (every layer routes k per token)."""
        return {tier: sum(lp.hit_rates[j] for lp in self.layers) / len(self.layers) for j, tier in enumerate(TIERS)}

    def encode(self) -> str:
        """The runtime's plan string: "<layer>:<hot>,<warm>,<sm>;..." (see the module's docstring)."""
        return ";".join(f"{lp.layer}:{lp.hot},{lp.warm},{lp.sm}" for lp in self.layers)

    def to_env(self) -> dict[str, str]:
        """ZIPMOE_PLAN for a bare llama.cpp program."""
        from ..runtime.config import RuntimeConfig

        return RuntimeConfig(plan=self.encode()).to_env()

    def to_dict(self) -> dict[str, Any]:
        return {
            "budget": self.budget, "bytes": self.nbytes, "read_bytes": self.read_bytes,
            "base_seconds_per_token": self.base_seconds_per_token,
            "delay_seconds_per_token": self.delay, "tokens_per_second": self.tokens_per_second,
            "hit_rates": self.hit_rates, "plan": self.encode(),
            "layers": [{"layer": lp.layer, "hot": lp.hot, "warm": lp.warm, "sm": lp.sm, "cold": lp.cold,
                        "bytes": lp.nbytes, "delay_seconds": lp.delay, "hit_rates": dict(zip(TIERS, lp.hit_rates))}
                       for lp in self.layers],
        }


def _plan_from_splits(model: CostModel, splits: Sequence[tuple[int, int, int]], budget: int) -> Plan:
    g = model.geometry
    layers = []
    for i, (design, (hot, warm, sm)) in enumerate(zip(model.designs, splits)):
        layers.append(LayerPlan(
            layer=g.layers[i], hot=hot, warm=warm, sm=sm, cold=g.n_expert - hot - warm - sm,
            nbytes=hot * g.hot_bytes[i] + warm * g.warm_bytes[i] + sm * g.sm_bytes[i],
            delay=design.expected_delay(tier_seconds(g, model.costs, i), hot, warm, sm),
            hit_rates=design.hit_rates(hot, warm, sm)))
    return Plan(tuple(layers), budget, model.costs.base_seconds_per_token)


_ENTRY = re.compile(r"(\d+):(\d+),(\d+),(\d+)")


def decode_plan(text: str) -> dict[int, tuple[int, int, int]]:
    """The slots (hot, warm, sm) per layer of a plan string; the reverse of Plan.encode."""
    slots: dict[int, tuple[int, int, int]] = {}
    for entry in text.split(";") if text.strip() else []:
        m = _ENTRY.fullmatch(entry.strip())
        if not m:
            raise ZipmoeError(f"plan entry {entry!r} is not <layer>:<hot>,<warm>,<sm>")
        layer, hot, warm, sm = map(int, m.groups())
        if layer in slots:
            raise ZipmoeError(f"plan lists layer {layer} twice")
        slots[layer] = (hot, warm, sm)
    return slots
