"""The limit model: the best tokens/s any expert cache of a given size could reach on a run's own routing, with this
machine's rates. Pure (no I/O): the routing, the rates and the sizes come in as values.

The cache is as good as any can be: Belady's MIN over the whole run (every layer's experts in one cache, evicting
the resident whose next use is farthest; replay.belady_step_hits), so its misses are the fewest possible. Each
miss reads the expert's compressed bytes from the file and decodes them; reads overlap compute completely, and
decoding is spread over every core. A step (a generated token, or a prompt's batch) then takes

    max(compute_seconds_per_token * tokens + decoded * decode_core_seconds_per_expert / cores,
        misses * read_seconds_per_expert)

where `decoded` is what the step decodes. Two layouts of the same bytes are scored and the faster one is the
limit: every cached expert kept decoded (capacity cache_bytes // decoded_bytes; only misses decode), or every one
kept compressed (capacity cache_bytes // compressed_bytes, more of them; every routed expert decodes). Mixes of the
two, which the runtime's tiers allow, lie between them in what they hold but are not searched: the limit is an
upper bound for one-layout caches and a target, not a proof about every mix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .replay import belady_step_hits
from .trace import Routing


@dataclass(frozen=True)
class Rates:
    """This machine's rates for one model."""

    read_seconds_per_expert: float  # one routed expert's compressed bytes (every expert tensor of its layer), cold
    decode_core_seconds_per_expert: float  # decoding it into BF16 on one core (0: stored raw, only read)
    compute_seconds_per_token: float  # a generated token with every expert resident (the warm, unbounded speed)
    cores: int  # the cores decoding may use (the run's threads)


@dataclass(frozen=True)
class ExpertSizes:
    """One routed expert of a layer, over its layer's expert tensors."""

    decoded_bytes: int
    compressed_bytes: int


@dataclass(frozen=True)
class Limit:
    tokens_per_second: float
    seconds: float  # for the timed steps' tokens
    tokens: int
    layout: str  # "decoded" or "compressed": the faster layout
    capacity: int  # experts that layout's cache holds
    hits: int  # Belady's hits over the timed steps
    routed: int  # routed experts over the timed steps


def flat_steps(routing: Routing) -> list[np.ndarray]:
    """The run as one cache sees it: per step, each layer's routed experts in layer order, an expert of layer l
    numbered l * n_expert + e; one entry per (step, layer)."""
    n = routing.n_expert
    return [np.flatnonzero(routing.routed[t, layer]).astype(np.int64) + layer * n
            for t in range(routing.n_steps) for layer in range(routing.n_layer)]


def _layout(routing: Routing, rates: Rates, capacity: int, *, decode_all: bool, timed_from: int) -> Limit:
    steps = flat_steps(routing)
    hits = belady_step_hits(steps, capacity).reshape(routing.n_steps, routing.n_layer).sum(axis=1)
    routed = routing.routed.sum(axis=(1, 2)).astype(np.int64)
    misses = routed - hits
    decoded = routed if decode_all else misses
    tokens = routing.tokens.astype(np.int64)
    cpu = rates.compute_seconds_per_token * tokens + decoded * rates.decode_core_seconds_per_expert / rates.cores
    seconds = np.maximum(cpu, misses * rates.read_seconds_per_expert)[timed_from:]
    total, n_tokens = float(seconds.sum()), int(tokens[timed_from:].sum())
    return Limit(tokens_per_second=n_tokens / total if total > 0 else float("inf"), seconds=total, tokens=n_tokens,
                 layout="compressed" if decode_all else "decoded", capacity=capacity,
                 hits=int(hits[timed_from:].sum()), routed=int(routed[timed_from:].sum()))


def limit(routing: Routing, rates: Rates, sizes: ExpertSizes, cache_bytes: int, *, timed_from: int = 0) -> Limit:
    """The best tokens/s of a cache of `cache_bytes` over the steps of `routing` from `timed_from` on (the steps
    before it, a prompt and a warm-up, fill the cache but are not timed). ValueError where neither layout holds a
    step's routed experts, or for rates that are not positive."""
    if rates.cores < 1 or rates.compute_seconds_per_token <= 0 or rates.read_seconds_per_expert < 0 or \
            rates.decode_core_seconds_per_expert < 0 or min(sizes.decoded_bytes, sizes.compressed_bytes) <= 0:
        raise ValueError(f"limit: rates and sizes must be positive ({rates}, {sizes})")
    if not 0 <= timed_from < routing.n_steps:
        raise ValueError(f"limit: timed_from {timed_from} is not a step of the {routing.n_steps} recorded")
    widest = int(routing.routed.sum(axis=2).max(initial=0))
    candidates = []
    for per_expert, decode_all in ((sizes.decoded_bytes, False), (sizes.compressed_bytes, True)):
        capacity = cache_bytes // per_expert
        if capacity >= widest:
            candidates.append(_layout(routing, rates, int(capacity), decode_all=decode_all, timed_from=timed_from))
    if not candidates:
        raise ValueError(f"limit: a cache of {cache_bytes} bytes holds fewer than a step's {widest} routed experts")
    return max(candidates, key=lambda c: c.tokens_per_second)


def from_calibration(cal: Any, *, compute_seconds_per_token: float | None = None,
                     cores: int | None = None) -> tuple[Rates, ExpertSizes]:
    """Rates and sizes from a calibration of the model (pyzipmoe.plan.calibration.Calibration): a cold read of an
    expert's regions (its bytes at the measured bandwidth, plus one read's latency), the runtime's core-seconds to
    decode one expert, the compute per token (given, else the calibration's base_seconds_per_token) and the cores
    (given: the run's threads, else the calibration's). BF16 experts decode to 2 bytes a value; raw ones are read as
    they are stored. ValueError without a compute per token."""
    compute = compute_seconds_per_token if compute_seconds_per_token is not None else cal.base_seconds_per_token
    if compute is None:
        raise ValueError("limit: no compute per token (the calibration has no base_seconds_per_token: give it)")
    compressed = int(cal.expert_compressed_bytes)
    decoded = compressed if cal.codec == "raw" else 2 * int(cal.expert_values)
    rates = Rates(read_seconds_per_expert=cal.read_latency + compressed / cal.disk_bandwidth,
                  decode_core_seconds_per_expert=float(cal.t_decode), compute_seconds_per_token=float(compute),
                  cores=int(cores or cal.cores))
    return rates, ExpertSizes(decoded_bytes=decoded, compressed_bytes=compressed)
