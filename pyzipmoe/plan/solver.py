"""The tier planner: how many experts of each MoE layer to keep hot, warm or sign+mantissa-only under a memory
budget, from how often each expert is routed (the ZipMoE paper's planner: "Efficient On-Device MoE Serving via
Lossless Compression and Cache-Affinity Scheduling", ICML 2026).

Tiers, exclusive, with a number of slots per tier in each layer:

    hot   decoded BF16 resident                                  a routed hot expert costs nothing
    warm  compressed region resident (sm plane + exponent codes) one decode
    sm    sign+mantissa plane resident, exponent codes on disk    one decode + reading the codes
    cold  nothing resident                                        one decode + reading the whole region

Experts stored raw (a plain GGUF's, a zipmoe file's quantized ones: ModelGeometry.tiered) have no compressed copy:
their layers are planned hot and cold only, and a cold one costs its read, no decode (routing.tier_seconds).

The runtime's eviction keeps the most used experts in the highest tiers, so the model is by rank: within a layer,
experts sorted by routing frequency fill the hot slots, then the warm ones, then the sm ones; the rest are cold.

Routing (pyzipmoe.plan.routing): a token routes to exactly k = n_expert_used experts of each layer, by a
conditional Poisson design fitted to the observed frequencies, or by the recency model of the runtime's eviction.
Under the first, the numbers of routed experts in the tiers have an exact joint distribution, so a layer's expected
delay per generated token is exact:

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

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..errors import ZipmoeError
from .inputs import Costs, ModelGeometry, TIERS, uniform_counts, validate_counts
from .routing import (
    LayerDesign,
    MODELLED_POLICIES,
    RecencyDesign,
    TierSeconds,
    layer_design,
    pool_designs,
    recency_design,
    tier_seconds,
)


DEFAULT_BUDGET_STEPS = 2048


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
                sm_bytes: int, tiered: bool = True) -> LayerTable:
    """The Pareto frontier (bytes, delay) of a layer's splits; its first entry costs no bytes (no slots). Not
    `tiered` (experts stored raw): the splits with hot and cold experts only, the runtime keeping no other."""
    hot, warm, sm, delay = design.split_delays(seconds)
    if not tiered:
        only = (warm == 0) & (sm == 0)
        hot, warm, sm, delay = hot[only], warm[only], sm[only], delay[only]
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
    tables = tuple(layer_table(designs[i], tier_seconds(g, costs, i), g.hot_bytes[i], g.warm_bytes[i], g.sm_bytes[i],
                               g.has_tiers(i))
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

    The cost model's predictions fall within about 25% of measured speed (tools/bench/bench_planner.py), and decoded
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
        # one slot in every layer that has the tier (a layer stored raw has hot slots only)
        per_slot = sum(size for i, size in enumerate(sizes) if not slots or g.has_tiers(i))
        n = left if per_slot == 0 else min(left, int(share * budget) // per_slot)
        slots.append(n)
        left -= n
    hot, warm, sm = slots
    return _plan_from_splits(model, [(hot, warm, sm) if g.has_tiers(i) else (hot, 0, 0) for i in range(len(g.layers))],
                             budget)


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
