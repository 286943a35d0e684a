"""The tier planner (pyzipmoe/plan/); `zipmoe plan` on a real file is tests/system/test_plan_command.py.

The planner's numbers are checked against brute force: enumeration of every routed set for small layers (the
conditional Poisson design, the tier-count distribution, the expected delay), every slot allocation for a tiny
two-layer model (the dynamic programme), and sampling (the delay, independently of the enumeration).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from pyzipmoe.plan import inputs
from pyzipmoe.plan import routing as plan_routing
from pyzipmoe.plan import solver as planner
from pyzipmoe.errors import ZipmoeError
from pyzipmoe.plan.inputs import Costs, ModelGeometry, PlanInputError
from pyzipmoe.plan.routing import TierSeconds
from pyzipmoe.runtime.config import RuntimeConfig

# reads and decoding both matter in the max; a layer that reads at all pays `layer` once
SECONDS = TierSeconds(decode=0.3, read_sm=0.7, read_cold=1.1, layer=0.25, layer_sm=0.1)


def skewed(rng: np.random.Generator, n: int) -> np.ndarray:
    """Zipf-like frequencies, shuffled, sometimes with an expert never used."""
    f = rng.permutation(1.0 / np.arange(1, n + 1) ** rng.uniform(0.3, 2.5))
    if rng.random() < 0.3:
        f[rng.integers(n)] = 0
    return f


def splits(n: int):
    return [(h, w, s) for h in range(n + 1) for w in range(n + 1 - h) for s in range(n + 1 - h - w)]


# ------------------------------------------------------------------------------ brute force


def routed_sets(p: np.ndarray, k: int) -> list[tuple[tuple[int, ...], float]]:
    """Every set of k experts with its probability under independent Bernoulli(p) conditioned on k successes."""
    sets = list(itertools.combinations(range(p.size), k))
    weights = np.array([np.prod(np.where(np.isin(np.arange(p.size), s), p, 1 - p)) for s in sets])
    return list(zip(sets, weights / weights.sum()))


def brute_inclusion(p: np.ndarray, k: int) -> np.ndarray:
    pi = np.zeros(p.size)
    for s, w in routed_sets(p, k):
        pi[list(s)] += w
    return pi


def brute_tier_counts(p: np.ndarray, k: int, hot: int, warm: int, sm: int) -> np.ndarray:
    tier = np.repeat([0, 1, 2, 3], [hot, warm, sm, p.size - hot - warm - sm])
    joint = np.zeros((k + 1,) * 4)
    for s, w in routed_sets(p, k):
        joint[tuple(np.bincount(tier[list(s)], minlength=4))] += w
    return joint


def brute_delay(p: np.ndarray, k: int, hot: int, warm: int, sm: int, t: TierSeconds) -> float:
    joint = brute_tier_counts(p, k, hot, warm, sm)
    return sum(w * (max((b + c + d) * t.decode, c * t.read_sm + d * t.read_cold) + (t.layer_sm if c else t.layer if d else 0))
               for (a, b, c, d), w in np.ndenumerate(joint) if w)


# --------------------------------------------------------------------------- the routing design


def test_cp_fit_reaches_the_targets_on_random_layers():
    rng = np.random.default_rng(1)
    for _ in range(25):
        n = int(rng.integers(3, 65))
        k = int(rng.integers(1, min(8, n - 1) + 1))
        design = plan_routing.layer_design(skewed(rng, n), k)
        assert design.inclusion.sum() == pytest.approx(k, abs=1e-12)
        assert ((design.bernoulli >= 0) & (design.bernoulli <= 1)).all()
        np.testing.assert_allclose(plan_routing.cp_inclusion(design.bernoulli, k), design.inclusion, rtol=0, atol=1e-9)
        assert (np.diff(design.inclusion) <= 1e-15).all()  # rank order: most used first


def test_cp_fit_says_when_it_does_not_converge():
    with pytest.raises(ZipmoeError, match="did not converge"):
        plan_routing.conditional_poisson(np.array([0.9, 0.6, 0.3, 0.2]), 2, max_iter=2)


def test_inclusion_targets_cap_at_one_and_keep_k():
    pi = plan_routing.inclusion_targets(np.array([100.0, 1, 1, 1, 1, 0]), 3)
    assert pi[0] == 1 and pi[5] == 0 and pi.sum() == pytest.approx(3)
    np.testing.assert_allclose(pi[1:5], 0.5)
    # fewer experts ever used than routed per token: the rest is spread evenly over the unused ones
    np.testing.assert_allclose(plan_routing.inclusion_targets(np.array([5.0, 0, 0]), 2), [1, 0.5, 0.5])


@pytest.mark.parametrize("n,k", [(n, k) for n in (2, 4, 6, 8) for k in (1, 2, 3) if k < n])
def test_planner_is_exact_against_enumeration(n: int, k: int):
    rng = np.random.default_rng(100 * n + k)
    design = plan_routing.layer_design(skewed(rng, n), k)
    p = design.bernoulli
    enumerated = brute_inclusion(p, k)
    np.testing.assert_allclose(plan_routing.cp_inclusion(p, k), enumerated, rtol=0, atol=1e-12)
    np.testing.assert_allclose(enumerated, design.inclusion, rtol=0, atol=1e-9)
    table_hot, table_warm, table_sm, table_delay = plan_routing.split_delays(design, SECONDS)
    table = {(int(h), int(w), int(s)): d for h, w, s, d in zip(table_hot, table_warm, table_sm, table_delay)}
    assert len(table) == len(splits(n))
    for hot, warm, sm in splits(n):
        joint = plan_routing.tier_count_distribution(design, hot, warm, sm)
        np.testing.assert_allclose(joint, brute_tier_counts(p, k, hot, warm, sm), rtol=0, atol=1e-12)
        expected = brute_delay(p, k, hot, warm, sm, SECONDS)
        assert plan_routing.expected_delay(design, SECONDS, hot, warm, sm) == pytest.approx(expected, rel=1e-12, abs=1e-15)
        assert table[hot, warm, sm] == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_delay_matches_sampling():
    rng = np.random.default_rng(7)
    n, k, (hot, warm, sm) = 16, 4, (3, 4, 5)
    design = plan_routing.layer_design(skewed(rng, n), k)
    draws = rng.random((400_000, n)) < design.bernoulli  # conditional Poisson by rejection: keep draws of k
    routed = draws[draws.sum(axis=1) == k]
    assert len(routed) > 20_000
    tier = np.repeat([0, 1, 2, 3], [hot, warm, sm, n - hot - warm - sm])
    counts = np.stack([routed[:, tier == t].sum(axis=1) for t in range(4)], axis=1)
    delays = np.maximum(counts[:, 1:].sum(axis=1) * SECONDS.decode,
                        counts[:, 2] * SECONDS.read_sm + counts[:, 3] * SECONDS.read_cold) + \
        np.where(counts[:, 2] > 0, SECONDS.layer_sm, np.where(counts[:, 3] > 0, SECONDS.layer, 0))
    standard_error = delays.std() / np.sqrt(len(delays))
    assert abs(delays.mean() - plan_routing.expected_delay(design, SECONDS, hot, warm, sm)) < 5 * standard_error
    np.testing.assert_allclose(routed.mean(axis=0), design.inclusion, atol=0.01)


# ------------------------------------------------------------------------------------ edge cases


def test_one_routed_expert():
    f = np.array([4.0, 3, 2, 1])
    design = plan_routing.layer_design(f, 1)
    np.testing.assert_allclose(design.inclusion, [0.4, 0.3, 0.2, 0.1])
    np.testing.assert_allclose(brute_inclusion(design.bernoulli, 1), design.inclusion, atol=1e-12)
    # with k = 1 the routed expert is in exactly one tier: the hit rates are the delay's weights
    rates = plan_routing.hit_rates(design, 1, 1, 1)
    expected = rates[1] * SECONDS.decode + rates[2] * max(SECONDS.decode, SECONDS.read_sm) + \
        rates[3] * max(SECONDS.decode, SECONDS.read_cold) + rates[2] * SECONDS.layer_sm + rates[3] * SECONDS.layer
    assert plan_routing.expected_delay(design, SECONDS, 1, 1, 1) == pytest.approx(expected, rel=1e-12)


def test_equally_likely_experts():
    design = plan_routing.layer_design(np.ones(6), 2)
    np.testing.assert_allclose(design.inclusion, 2 / 6)
    np.testing.assert_allclose(design.bernoulli, design.bernoulli[0])
    np.testing.assert_array_equal(design.order, np.arange(6))  # ties ranked by id


def test_an_expert_always_chosen():
    design = plan_routing.layer_design(np.array([1000.0, 1, 1, 1, 1]), 2)
    assert design.inclusion[0] == 1 and design.bernoulli[0] == 1
    np.testing.assert_allclose(brute_inclusion(design.bernoulli, 2), design.inclusion, atol=1e-12)
    joint = plan_routing.tier_count_distribution(design, 1, 0, 0)
    assert joint[0].sum() == 0 and joint[1].sum() == pytest.approx(1)  # it is hot and always routed


def test_a_never_used_expert_gets_no_slot():
    geometry = ModelGeometry.uniform(1, 4, 2, hot_bytes=4, warm_bytes=3, sm_bytes=2)
    counts = np.array([[5, 0, 3, 2]])
    model = planner.cost_model(geometry, costs(), counts)
    assert model.designs[0].order[-1] == 1 and model.designs[0].bernoulli[-1] == 0
    plan = planner.plan_for_budget(model, 12)  # enough for the three used experts, hot
    assert (plan.layers[0].hot, plan.layers[0].warm, plan.layers[0].sm) == (3, 0, 0)
    assert plan.delay == 0 and plan.hit_rates["cold"] == 0


def test_a_layer_never_used_counts_as_uniform():
    counts = inputs.validate_counts(np.array([[0, 0, 0], [1, 2, 3]]), 2, 3)
    np.testing.assert_array_equal(counts[0], [1, 1, 1])


def costs(**overrides: float) -> Costs:
    values = {"cores": 2, "t_decode": 1e-3, "disk_bandwidth": 1e3, "read_latency": 1e-4,
              "base_seconds_per_token": 0.01, **overrides}
    return Costs(**values)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ the recency design


def local_routing(rng: np.random.Generator, tokens: int, n: int, k: int, stay: float = 0.7) -> np.ndarray:
    """Routing with locality: each token keeps each of the last token's experts with probability `stay`."""
    out = np.zeros((tokens, n), bool)
    last = rng.choice(n, k, replace=False)
    for t in range(tokens):
        keep = [e for e in last if rng.random() < stay]
        fresh = rng.choice(np.setdiff1d(np.arange(n), keep), k - len(keep), replace=False)
        last = np.array(keep + list(fresh), int)
        out[t, last] = True
    return out


def brute_lru_ranks(routing: np.ndarray) -> np.ndarray:
    """An explicit LRU list: most recent first, a token's experts in descending id (the runtime evicts the lower id
    of a tie first)."""
    tokens, n = routing.shape
    order: list[int] = []
    ranks = np.full((tokens, n), -1)
    for t in range(tokens):
        used = [int(e) for e in np.flatnonzero(routing[t])]
        for e in used:
            ranks[t, e] = order.index(e) if e in order else n
        order = sorted(used, reverse=True) + [e for e in order if e not in used]
    return ranks


def test_lru_ranks_match_an_explicit_lru_list():
    rng = np.random.default_rng(3)
    for n, k in ((5, 1), (8, 2), (12, 4)):
        routing = local_routing(rng, 60, n, k, stay=0.5)
        assert (plan_routing.lru_ranks(routing) == brute_lru_ranks(routing)).all()


def explicit_lfu_hits(routing: np.ndarray, initial_uses: np.ndarray) -> np.ndarray:
    """[tokens, n + 1]: the hits of a token-weighted LFU cache of every size c, each simulated on its own as the
    runtime keeps a tier: after a token routing to R, R and the c - |R| previous residents with the most uses (the
    lower id of a tie goes first); with c < |R|, the c of R with the most uses."""
    tokens, n = routing.shape
    uses = initial_uses.copy()
    caches: list[set[int]] = [set() for _ in range(n + 1)]
    hits = np.zeros((tokens, n + 1), int)
    for t in range(tokens):
        routed = {int(e) for e in np.flatnonzero(routing[t])}
        hits[t] = [len(routed & cache) for cache in caches]
        for e in routed:
            uses[e] += 1
        rank = lambda e: (uses[e], e)  # noqa: E731
        for c in range(n + 1):
            keep = sorted(caches[c] - routed, key=rank, reverse=True)[: max(c - len(routed), 0)]
            caches[c] = set(sorted(routed, key=rank, reverse=True)[:c]) | set(keep)
    return hits


def test_lfu_ranks_match_lfu_caches_of_every_size():
    """One order gives every cache size's hits (the stack property), prompt batches and prior uses included."""
    rng = np.random.default_rng(13)
    for trial in range(200):
        n = int(rng.integers(2, 9))
        routing = local_routing(rng, int(rng.integers(1, 40)), n, min(2, n), stay=0.6)
        for t in np.flatnonzero(rng.random(len(routing)) < 0.1):  # a prompt batch routes to any number
            routing[t] = rng.random(n) < 0.6
        initial = rng.integers(0, 4, n) if trial % 2 else np.zeros(n, int)
        ranks = plan_routing.lfu_ranks(routing, initial if trial % 2 else None)
        hits = explicit_lfu_hits(routing, initial)
        for c in range(n + 1):
            assert (((ranks >= 0) & (ranks < c)).sum(axis=1) == hits[:, c]).all(), (trial, c)
    with pytest.raises(PlanInputError):
        plan_routing.lfu_ranks(routing, np.zeros(n + 1))


def test_the_recency_design_follows_the_policy():
    """LFU keeps an often-used expert that LRU lets go: expert 0 routed by every other token."""
    routing = np.zeros((40, 6), bool)
    for t in range(40):
        routing[t, [0, 1 + t % 5] if t % 2 == 0 else [1 + t % 5, 1 + (t + 1) % 5]] = True
    lru = plan_routing.recency_design(routing, 2, history=8, policy="lru")
    lfu = plan_routing.recency_design(routing, 2, history=8, policy="tlfu")
    assert lfu.hit_rates(3, 0, 0)[0] > lru.hit_rates(3, 0, 0)[0] + 0.2
    with pytest.raises(PlanInputError, match="fifo"):
        plan_routing.recency_design(routing, 2, policy="fifo")


def test_recency_split_delays_match_each_split():
    rng = np.random.default_rng(4)
    design = plan_routing.recency_design(local_routing(rng, 80, 7, 2), 2)
    assert design is not None and design.ranks.shape == (60, 2)
    hot, warm, sm, delay = design.split_delays(SECONDS)
    assert sorted(zip(hot, warm, sm)) == sorted(x for x in splits(7) if x[0] == 0 or x[1] == 0)
    for h, w, s, d in zip(hot, warm, sm, delay):
        assert d == pytest.approx(design.expected_delay(SECONDS, int(h), int(w), int(s)))
        counts = design.tier_counts(int(h), int(w), int(s))
        assert (counts.sum(axis=1) == 2).all()
    assert sum(design.hit_rates(7, 0, 0)) == pytest.approx(1)
    assert design.expected_delay(SECONDS, 0, 0, 0) == pytest.approx(2 * SECONDS.read_cold + SECONDS.layer)
    assert design.expected_delay(SECONDS, 7, 0, 0) <= design.expected_delay(SECONDS, 6, 0, 0)  # unseen: cold


def test_recency_design_needs_enough_generated_tokens():
    rng = np.random.default_rng(5)
    assert plan_routing.recency_design(local_routing(rng, 20, 8, 2), 2) is None  # 15 scored < RECENCY_MIN_TOKENS
    with_prompt = local_routing(rng, 40, 8, 2)
    with_prompt[0] = True  # a prompt's batch: it places the experts, it is not scored
    design = plan_routing.recency_design(with_prompt, 2, history=0)
    assert design is not None and design.ranks.shape == (39, 2)
    assert (plan_routing.lru_ranks(with_prompt)[1][with_prompt[1]] < 8).all()  # seen in the prompt: not cold
    with pytest.raises(PlanInputError):
        plan_routing.recency_design(np.zeros(8, bool), 2)


def test_recency_sees_what_frequencies_miss():
    """Every expert equally frequent overall, but a token mostly reuses the last token's experts: one hot slot
    per routed expert serves most of the routing, which the frequency design cannot know."""
    rng = np.random.default_rng(6)
    n, k = 16, 2
    routing = local_routing(rng, 400, n, k, stay=0.9)
    geometry = ModelGeometry.uniform(1, n, k, hot_bytes=100, warm_bytes=60, sm_bytes=50)
    by_frequency = planner.cost_model(geometry, costs(), routing.sum(axis=0, keepdims=True))
    by_recency = planner.cost_model(geometry, costs(), routing={0: routing})
    assert by_recency.recency and not by_frequency.recency
    frequency_hot = by_frequency.designs[0].hit_rates(k, 0, 0)[0]
    recency_hot = by_recency.designs[0].hit_rates(k, 0, 0)[0]
    assert frequency_hot < 0.3 and recency_hot > 0.85
    plan = planner.plan_for_budget(by_recency, 2 * 100)  # two hot slots, or three warm
    assert plan.hit_rates["cold"] < 0.15
    assert plan.delay < planner.plan_for_budget(by_frequency, 2 * 100).delay / 3


def test_a_plan_spends_what_the_routing_log_leaves():
    """A log shows only the experts its tokens used; the budget it does not need still buys hot slots."""
    rng = np.random.default_rng(8)
    routing = np.zeros((64, 16), bool)
    routing[:, :4] = local_routing(rng, 64, 4, 2)  # four experts of sixteen seen
    geometry = ModelGeometry.uniform(1, 16, 2, hot_bytes=100, warm_bytes=60, sm_bytes=50)
    plan = planner.plan_for_budget(planner.cost_model(geometry, costs(), routing={0: routing}), 10 * 100 + 30)
    assert plan.layers[0].hot == 10 and plan.nbytes <= 1030


def test_weighted_recency_means():
    """Weights of one change nothing; whole weights count a token that many times (0: not at all)."""
    rng = np.random.default_rng(9)
    design = plan_routing.recency_design(local_routing(rng, 80, 7, 2), 2)
    assert design is not None and design.weights is None
    ones = plan_routing.RecencyDesign(design.k, design.n_expert, design.ranks, weights=np.ones(60))
    for x, y in zip(ones.split_delays(SECONDS), design.split_delays(SECONDS)):
        assert np.array_equal(x, y)
    for h, w, s in ((0, 0, 0), (2, 0, 3), (0, 4, 1), (7, 0, 0)):
        assert ones.expected_delay(SECONDS, h, w, s) == design.expected_delay(SECONDS, h, w, s)
        assert ones.hit_rates(h, w, s) == design.hit_rates(h, w, s)
    counts = rng.integers(0, 4, 60)
    weighted = plan_routing.RecencyDesign(design.k, design.n_expert, design.ranks, weights=counts)
    repeated = plan_routing.RecencyDesign(design.k, design.n_expert, np.repeat(design.ranks, counts, axis=0))
    assert weighted.tokens == repeated.tokens == counts.sum()
    for x, y in zip(weighted.split_delays(SECONDS), repeated.split_delays(SECONDS)):
        assert x == pytest.approx(y, rel=1e-12, abs=1e-15)
    for h, w, s, d in zip(*weighted.split_delays(SECONDS)):
        assert d == pytest.approx(weighted.expected_delay(SECONDS, int(h), int(w), int(s)))
        assert d == pytest.approx(repeated.expected_delay(SECONDS, int(h), int(w), int(s)))
        assert weighted.hit_rates(int(h), int(w), int(s)) == pytest.approx(repeated.hit_rates(int(h), int(w), int(s)))
    assert plan_routing.miss_fractions(weighted) == pytest.approx(plan_routing.miss_fractions(repeated))
    for bad in (np.ones(59), np.zeros(60), -np.ones(60), np.full(60, np.nan)):
        with pytest.raises(ZipmoeError, match="weights"):
            plan_routing.RecencyDesign(design.k, design.n_expert, design.ranks, weights=bad)


def routed_from(rng: np.random.Generator, tokens: int, popularity: np.ndarray, k: int) -> np.ndarray:
    """Routing without locality: each token draws k distinct experts with these relative popularities."""
    out = np.zeros((tokens, popularity.size), bool)
    for t in range(tokens):
        out[t, rng.choice(popularity.size, k, replace=False, p=popularity / popularity.sum())] = True
    return out


def fast_disk_costs() -> Costs:
    """Decoding the bottleneck, reads cheap: a layer's delay is its misses times the decode."""
    return costs(t_decode=2e-3, disk_bandwidth=1e5, read_latency=1e-5)


def test_layers_that_route_alike_are_pooled():
    """Short logs of layers with one routing distribution differ by sampling noise only: each layer's design is
    mostly the pool, and the plan stops fitting the noise. Over seeds: the own weight of uniform layers is below
    0.2 in 55 of 60; unpooled, the skewed layers' plans gave one layer 3 to 11 more hot slots than another (40 of
    40 seeds more than 2), pooled 1 more (57 of 60, the others 4 or 5)."""
    rng = np.random.default_rng(11)
    n_layer, n, k, tokens = 8, 32, 4, 42  # 32 scored tokens a layer (the first quarter is history)
    uniform = [plan_routing.recency_design(routed_from(rng, tokens, np.ones(n), k), k) for _ in range(n_layer)]
    assert all(d is not None and d.tokens == 32 for d in uniform)
    n0 = plan_routing.pooling_strength(uniform)  # type: ignore[arg-type]
    assert 32 / (32 + n0) < 0.2
    pooled = plan_routing.pool_designs(uniform)  # type: ignore[arg-type]
    # each layer keeps its own weight's share of its distance from the pool: here all of them, so one spread
    own_hits = np.array([d.hit_rates(16, 0, 0)[0] for d in uniform])  # type: ignore[union-attr]
    pooled_hits = np.array([d.hit_rates(16, 0, 0)[0] for d in pooled])
    assert np.ptp(pooled_hits) <= 32 / (32 + n0) * np.ptp(own_hits) + 1e-12 and np.ptp(own_hits) > 0.05

    # With uniform routing every split of the hot slots between layers is as good as any other (misses fall
    # linearly with hot slots), so how a plan splits them tells nothing; with a skewed distribution, the same
    # in every layer (experts relabelled), the equal split is the best one.
    rng = np.random.default_rng(21)
    zipf = 1 / np.arange(1, n + 1) ** 2.0
    routing = {b: routed_from(rng, tokens, rng.permutation(zipf), k) for b in range(n_layer)}
    geometry = ModelGeometry.uniform(n_layer, n, k, hot_bytes=100, warm_bytes=60, sm_bytes=50)
    model = planner.cost_model(geometry, fast_disk_costs(), routing=routing)
    assert model.recency
    hot = [lp.hot for lp in planner.plan_for_budget(model, int(0.78 * geometry.all_hot_bytes)).layers]
    assert max(hot) - min(hot) <= 2, hot


def test_layers_that_differ_keep_their_own_designs():
    """Long logs of layers that route differently (half from 6 experts, half from all 32): pooling leaves each
    layer its own design, and the plan gives the concentrated layers fewer hot slots (fully pooled, it would
    treat all layers alike)."""
    rng = np.random.default_rng(12)
    n_layer, n, k, tokens = 8, 32, 4, 533  # 400 scored tokens a layer
    popularity = [np.ones(n) if b % 2 == 0 else np.isin(np.arange(n), rng.choice(n, 6, replace=False)) * 1.0
                  for b in range(n_layer)]
    routing = {b: routed_from(rng, tokens, popularity[b], k) for b in range(n_layer)}
    designs = [plan_routing.recency_design(routing[b], k) for b in range(n_layer)]
    n0 = plan_routing.pooling_strength(designs)  # type: ignore[arg-type]
    assert 400 / (400 + n0) > 0.8
    geometry = ModelGeometry.uniform(n_layer, n, k, hot_bytes=100, warm_bytes=60, sm_bytes=50)
    model = planner.cost_model(geometry, fast_disk_costs(), routing=routing)
    hot = [lp.hot for lp in planner.plan_for_budget(model, geometry.all_hot_bytes // 2).layers]
    assert max(hot[1::2]) < min(hot[0::2]), hot


def test_a_single_layer_is_not_pooled():
    rng = np.random.default_rng(13)
    routing = local_routing(rng, 64, 8, 2)
    design = plan_routing.recency_design(routing, 2)
    assert design is not None
    assert plan_routing.pooling_strength([design]) == 0
    assert plan_routing.pool_designs([design])[0] is design
    geometry = ModelGeometry.uniform(1, 8, 2, hot_bytes=100, warm_bytes=60, sm_bytes=50)
    model = planner.cost_model(geometry, costs(), routing={0: routing})
    assert model.designs[0].weights is None and np.array_equal(model.designs[0].ranks, design.ranks)
    # a layer without a routing log keeps its frequency design; a lone recency design is not pooled with it
    geometry = ModelGeometry.uniform(2, 8, 2, hot_bytes=100, warm_bytes=60, sm_bytes=50)
    model = planner.cost_model(geometry, costs(), routing={1: routing})
    assert isinstance(model.designs[0], plan_routing.LayerDesign)
    assert model.designs[1].weights is None and np.array_equal(model.designs[1].ranks, design.ranks)


@pytest.fixture(scope="module")
def small_model() -> planner.CostModel:
    geometry = ModelGeometry.uniform(3, 8, 2, hot_bytes=40, warm_bytes=27, sm_bytes=20)
    rng = np.random.default_rng(3)
    return planner.cost_model(geometry, costs(), rng.integers(0, 50, (3, 8)) ** 2)


def test_budgets_from_nothing_to_everything(small_model: planner.CostModel):
    nothing = planner.plan_for_budget(small_model, 0)
    assert all((lp.hot, lp.warm, lp.sm, lp.cold) == (0, 0, 0, 8) for lp in nothing.layers)
    assert nothing.hit_rates["cold"] == pytest.approx(1) and nothing.nbytes == 0
    everything = planner.plan_for_budget(small_model, small_model.geometry.all_hot_bytes)
    assert all((lp.hot, lp.cold) == (8, 0) for lp in everything.layers)
    assert everything.delay == 0 and everything.hit_rates["hot"] == pytest.approx(1)
    assert everything.tokens_per_second == pytest.approx(1 / small_model.costs.base_seconds_per_token)
    previous = nothing
    for budget in range(0, small_model.geometry.all_hot_bytes + 1, 37):
        between = planner.plan_for_budget(small_model, budget)
        assert between.nbytes <= budget
        assert everything.delay <= between.delay <= previous.delay + 1e-15  # more memory never hurts
        previous = between
    assert 0 < previous.delay < nothing.delay


def test_coarse_budget_steps_stay_within_the_budget(small_model: planner.CostModel):
    for budget in (55, 333, 700):
        plan = planner.plan_for_budget(small_model, budget, steps=7)
        assert plan.nbytes <= budget
        assert plan.delay >= planner.plan_for_budget(small_model, budget).delay - 1e-15


def test_dynamic_programme_matches_every_allocation():
    geometry = ModelGeometry(n_layer=3, n_expert=4, n_expert_used=2, layers=(0, 2), hot_bytes=(4, 5),
                             warm_bytes=(3, 3), sm_bytes=(2, 2))
    counts = np.array([[9, 1, 4, 2], [0, 0, 0, 0], [1, 1, 6, 3]])  # block 1 is dense: its row is never read
    model = planner.cost_model(geometry, costs(disk_bandwidth=40.0, read_latency=0.002), counts)
    seconds = [plan_routing.tier_seconds(geometry, model.costs, i) for i in range(2)]
    layer_options = [[(h * geometry.hot_bytes[i] + w * geometry.warm_bytes[i] + s * geometry.sm_bytes[i],
                       plan_routing.expected_delay(model.designs[i], seconds[i], h, w, s)) for h, w, s in splits(4)]
                     for i in range(2)]
    for budget in range(geometry.all_hot_bytes + 1):
        best = min(d0 + d1 for (b0, d0), (b1, d1) in itertools.product(*layer_options) if b0 + b1 <= budget)
        plan = planner.plan_for_budget(model, budget)
        assert plan.nbytes <= budget
        assert plan.delay == pytest.approx(best, rel=1e-9, abs=1e-15), budget
    assert [lp.layer for lp in plan.layers] == [0, 2]


def test_fixed_split_plan(small_model: planner.CostModel):
    budget = 600
    fixed = planner.fixed_split_plan(small_model, budget, 0.5, 0.3, 0.2)
    per_layer = {(lp.hot, lp.warm, lp.sm) for lp in fixed.layers}
    assert per_layer == {(600 // 2 // 120, int(0.3 * 600) // 81, int(0.2 * 600) // 60)}  # the same slots everywhere
    assert fixed.nbytes <= budget
    assert planner.plan_for_budget(small_model, budget).delay <= fixed.delay
    all_hot = planner.fixed_split_plan(small_model, 10**6, 1, 0, 0)
    assert all(lp.hot == 8 for lp in all_hot.layers) and all_hot.delay == 0
    with pytest.raises(ZipmoeError, match="shares"):
        planner.fixed_split_plan(small_model, budget, 0.8, 0.3, 0)


def test_a_prompt_reads_what_the_largest_tensor_keeps_out_of_ram_into_two_buffers():
    """prompt_read_bytes: a cold expert's region and an sm expert's codes, of the largest expert tensor (the share
    of its layer), each in its span of O_DIRECT blocks, twice: the staging buffer of the store that decodes and
    the read-ahead of the next."""
    g = ModelGeometry(n_layer=2, n_expert=8, n_expert_used=2, layers=(0, 1), hot_bytes=(60, 60),
                      warm_bytes=(40, 40), sm_bytes=(30, 30), tensor_shares=(0.5, 1 / 3))
    assert g.read_sm_bytes(0) == 10
    # layer 0: 4 cold, 2 sm -> (4 * 40 + 2 * 10) / 2 = 90, and each of the 6 reads up to two O_DIRECT blocks more;
    # layer 1: 1 cold -> 40 / 3 + 2 blocks
    block = planner.DIRECT_ALIGN
    assert planner.prompt_read_bytes(g, [(2, 0, 2), (7, 0, 0)]) == 2 * (90 + 6 * 2 * block)
    assert planner.prompt_read_bytes(g, [(8, 0, 0), (4, 4, 0)]) == 0  # everything in RAM: nothing read
    with pytest.raises(ZipmoeError, match="tensor_shares"):
        ModelGeometry(n_layer=1, n_expert=2, n_expert_used=1, layers=(0,), hot_bytes=(4,), warm_bytes=(3,),
                      sm_bytes=(2,), tensor_shares=(0.0,))


@pytest.mark.parametrize("split", [None, (1.0, 0.0, 0.0), (0.5, 0.3, 0.2)], ids=["planner", "decoded", "mixed"])
def test_a_run_s_plan_leaves_room_for_a_prompt_s_reads(small_model: planner.CostModel,
                                                       split: tuple[float, float, float] | None):
    """plan_tiers: the slots and a prompt's read buffers fit the tiers' bytes together (at most half of them for
    the buffers, as the glue caps them), the plan being the one made for what the buffers leave; a budget that
    holds every expert decoded reads nothing and keeps them all."""
    g = small_model.geometry
    rooms = []
    for tiers in range(0, g.all_hot_bytes + 1, 29):
        plan = planner.plan_tiers(small_model, tiers, split)
        reads = planner.prompt_read_bytes(g, [(lp.hot, lp.warm, lp.sm) for lp in plan.layers])
        assert min(tiers // 2, reads) <= plan.read_bytes <= tiers // 2, tiers  # the room holds its reads
        assert plan.nbytes + plan.read_bytes <= tiers and plan.budget == tiers - plan.read_bytes, tiers
        same = planner.runtime_plan(small_model, plan.budget) if split is None \
            else planner.fixed_split_plan(small_model, plan.budget, *split)
        assert same.encode() == plan.encode(), tiers
        rooms.append(plan.read_bytes)
    assert max(rooms) > 0
    everything = planner.plan_tiers(small_model, g.all_hot_bytes, split)
    if split != (0.5, 0.3, 0.2):  # (a mixed split keeps sm experts, whose codes a prompt reads)
        assert everything.read_bytes == 0 and all(lp.hot == g.n_expert for lp in everything.layers)


def test_plan_string_and_environment(small_model: planner.CostModel):
    plan = planner.plan_for_budget(small_model, 300)
    text = plan.encode()
    assert RuntimeConfig(plan=text).to_env() == {"ZIPMOE_PLAN": text}  # what a bare llama.cpp program reads
    assert planner.decode_plan(text) == {lp.layer: (lp.hot, lp.warm, lp.sm) for lp in plan.layers}
    assert planner.decode_plan("0:12,4,0;1:10,6,2") == {0: (12, 4, 0), 1: (10, 6, 2)}
    for bad in ("0:1,2", "0:1,2,3;0:1,1,1", "x:1,2,3"):
        with pytest.raises(ZipmoeError):
            planner.decode_plan(bad)
    data = plan.to_dict()
    assert data["plan"] == text and json.loads(json.dumps(data)) == data
    assert sum(data["hit_rates"].values()) == pytest.approx(1)


# ------------------------------------------------------------------------------------------ inputs


def test_trace_files(tmp_path: Path):
    counts = np.zeros((3, 2, 4), np.int64)
    counts[:, 0] = [[5, 1, 0, 2], [1, 1, 0, 0], [0, 0, 0, 1]]
    np.savez(tmp_path / "t.npz", counts=counts)
    np.save(tmp_path / "t.npy", counts)
    for name in ("t.npz", "t.npy"):
        got = inputs.counts_from_trace(tmp_path / name, 2, 4)
        np.testing.assert_array_equal(got, [[6, 2, 0, 3], [1, 1, 1, 1]])  # layer 1 never used: uniform


@pytest.mark.parametrize("content,message", [
    (b"not numpy at all", "not a readable numpy file"),
    (b"", "not a readable numpy file"),
    (b"PK\x03\x04 a damaged zip", "not a readable numpy file"),
    ("wrong key", "no key 'counts'"),
    (np.zeros((2, 4), np.int64) + 1, "dimension"),
    (np.ones((1, 3, 4), np.int64), r"shape \(1, 3, 4\)"),
    (-np.ones((1, 2, 4), np.int64), "negative"),
    (np.zeros((1, 2, 4), np.int64), "every count is zero"),
    (np.ones((1, 2, 4)) / 2, "integers"),
])
def test_bad_traces(tmp_path: Path, content, message: str):
    path = tmp_path / "trace.npz"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, str):
        np.savez(path, activations=np.ones((1, 2, 4), np.int64))
    else:
        np.savez(path, counts=content)
    with pytest.raises(PlanInputError, match=message) as e:
        inputs.counts_from_trace(path, 2, 4)
    assert "\n" not in str(e.value) and e.value.exit_code == 2


def test_missing_trace(tmp_path: Path):
    with pytest.raises(PlanInputError, match="expected an .npz"):
        inputs.counts_from_trace(tmp_path / "nope.npz", 2, 4)


def test_costs_validation(tmp_path: Path):
    defaults = costs()
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"cores": 8, "disk_bandwidth": 2e9}))
    loaded = inputs.costs_from_file(path, defaults=defaults)
    assert (loaded.cores, loaded.disk_bandwidth, loaded.t_decode) == (8, 2e9, defaults.t_decode)
    for text, message in (('{"cores": 0}', "cores"), ('{"t_decde": 1}', "unknown key"), ("[1]", "JSON object"),
                          ("{", "not JSON"), ('{"disk_bandwidth": -5}', "disk_bandwidth")):
        path.write_text(text)
        with pytest.raises(PlanInputError, match=message):
            inputs.costs_from_file(path, defaults=defaults)
    calibration = {"t_decode": 2e-3, "base_seconds_per_token": 0.5, "codec": "huff"}  # extra keys are skipped
    assert inputs.costs_from_dict(calibration, defaults=defaults, label="c", strict=False).t_decode == 2e-3


def test_a_run_takes_a_plan_only_for_a_clear_saving(small_model: planner.CostModel):
    """runtime_plan keeps decoded experts only unless the plan saves more than PLAN_MARGIN of their wait."""
    g = small_model.geometry
    found = {True: False, False: False}
    for budget in range(0, g.all_hot_bytes + 1, 10):
        best = planner.plan_for_budget(small_model, budget)
        decoded = planner.fixed_split_plan(small_model, budget, 1.0, 0.0, 0.0)
        taken = planner.runtime_plan(small_model, budget)
        clear = best.delay < (1 - planner.PLAN_MARGIN) * decoded.delay
        assert taken.encode() == (best if clear else decoded).encode(), budget
        assert taken.nbytes <= budget
        found[clear] = True
    assert all(found.values()), found  # both cases occur in this sweep
    assert planner.runtime_plan(small_model, 100, margin=0.0).encode() == planner.plan_for_budget(small_model, 100).encode()


# ------------------------------------------------------------------------------ experts stored raw


def raw_geometry(tiered: tuple[bool, bool] = (False, False)) -> ModelGeometry:
    """Two layers of 4 experts, 1 routed: layer 1's experts larger (a Q4_K_M file's Q6_K ffn_down_exps), stored as
    they are (a cold one reads its decoded bytes); sm_bytes only where a layer is stored through the split codec."""
    sm = tuple(150 if t else 0 for t in tiered)
    warm = tuple(200 if t else h for t, h in zip(tiered, (300, 420)))
    return ModelGeometry(n_layer=2, n_expert=4, n_expert_used=1, layers=(0, 1), hot_bytes=(300, 420),
                         warm_bytes=warm, sm_bytes=sm, tiered=tiered)


RAW_COSTS = Costs(cores=2, t_decode=1.0, disk_bandwidth=1e6, read_latency=1e-3, base_seconds_per_token=0.01)


def test_a_raw_expert_costs_its_read_and_no_decode():
    g = raw_geometry()
    for i, size in enumerate((300, 420)):
        s = plan_routing.tier_seconds(g, RAW_COSTS, i)
        assert s.decode == 0 and s.read_cold == pytest.approx(size / 1e6 + 1e-3)
    assert inputs.default_costs(g, cores=2).t_decode == 0  # nothing to decode
    mixed = raw_geometry((True, False))
    assert plan_routing.tier_seconds(mixed, RAW_COSTS, 0).decode == pytest.approx(0.5)  # t_decode / cores
    assert plan_routing.tier_seconds(mixed, RAW_COSTS, 1).decode == 0
    with pytest.raises(ZipmoeError, match="tiered"):
        ModelGeometry(2, 4, 1, (0, 1), (300, 420), (300, 420), (0, 0), tiered=(False,))


@pytest.mark.parametrize("budget,hot", [(720, (1, 1)), (719, (2, 0)), (599, (0, 1)), (299, (0, 0)),
                                        (4 * 720, (4, 4))])
def test_layers_stored_raw_are_planned_hot_and_cold_at_their_own_sizes(budget: int, hot: tuple[int, int]):
    """Hand-checked: with uniform routing a hot slot saves a quarter of a cold read, 1.3 ms in layer 0 (300 bytes),
    1.42 ms in layer 1 (420 bytes): 599 bytes buy layer 1's slot (0.355 ms) over layer 0's (0.325 ms), 719 two of
    layer 0 (one each takes 720). A plan never keeps a raw expert warm or sm, and its bytes are each layer's hot
    slots at that layer's size."""
    model = planner.cost_model(raw_geometry(), RAW_COSTS)
    plan = planner.plan_for_budget(model, budget)
    assert tuple(lp.hot for lp in plan.layers) == hot
    reads = (300 / 1e6 + 1e-3, 420 / 1e6 + 1e-3)
    for lp, size, read in zip(plan.layers, (300, 420), reads):
        assert (lp.warm, lp.sm, lp.cold) == (0, 0, 4 - lp.hot) and lp.nbytes == lp.hot * size
        assert lp.delay == pytest.approx((4 - lp.hot) / 4 * read)
        assert lp.hit_rates[1] == lp.hit_rates[2] == 0
    assert plan.nbytes <= budget


def test_only_layers_with_compressed_tiers_get_warm_or_sm_slots():
    model = planner.cost_model(raw_geometry((True, False)), RAW_COSTS)
    fixed = planner.fixed_split_plan(model, 2000, 0.2, 0.5, 0.3)
    assert fixed.layers[0].warm > 0 and (fixed.layers[1].warm, fixed.layers[1].sm) == (0, 0)
    for budget in range(0, 2000, 50):
        raw_layer = planner.plan_for_budget(model, budget).layers[1]
        assert (raw_layer.warm, raw_layer.sm) == (0, 0)
    table = model.tables[1]
    assert not table.warm.any() and not table.sm.any()
