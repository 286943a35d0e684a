"""Models of which experts a token routes to, which tiers they are found in, and what a layer's token waits for them.

The frequency model: a token routes to exactly k = n_expert_used experts of each layer. The planner uses the
maximum-entropy design that routes expert i with its observed probability pi_i: conditional Poisson sampling
(independent Bernoulli(p_i), conditioned on exactly k successes), p fitted to pi by the fixed point of Chen,
Dempster & Liu (1994). Under it the numbers of routed experts in the tiers have an exact joint distribution (a
product of the tiers' Poisson-binomial pmfs, conditioned on the total k).

The recency model: where each routed expert stood in the runtime's eviction order (LRU or LFU ranks) before its
token, from the runtime's routing log: the tiers' hits exactly, for a run that routes as it has so far.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ZipmoeError
from .inputs import Costs, ModelGeometry, PlanInputError


CP_TOLERANCE = 1e-12  # largest error of a fitted inclusion probability
CP_MAX_ITERATIONS = 10_000
_CAP = 1 - 1e-12  # an inclusion probability this close to 1 is 1 (rounding must not leave 0.9999999999999998)


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
    tier (decoding on every use; a warm expert gives up its codes for the sm tier): tests/native/test_store.py checks
    the runtime's hits against this model token by token, for both policies. With both hot and warm slots it is not:
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
    """The costs of MoE layer i (its index in geometry.layers). A layer stored raw decodes nothing: a routed expert
    that is not hot costs its read (decode_share 0)."""
    def read(nbytes: int, measured: float | None, measured_bytes: int) -> float:
        if measured is not None:  # measured through the runtime on the first MoE layer: scaled by size
            return measured * nbytes / max(1, measured_bytes)
        return nbytes / costs.disk_bandwidth + costs.read_latency

    return TierSeconds(decode=costs.t_decode / costs.cores * geometry.decode_share(i),
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
