"""Routing sequences for replaying through the expert cache, and the hit counts no cache can beat.

A sequence is one MoE layer's steps in order, each the experts that step routed to (int32 ids, distinct): what
the layer's store is asked to materialise at once. tools/bench/bench_replay.py drives the native cache with
them; these functions make them and score them offline.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

Steps = Sequence[np.ndarray]


def steps_from_counts(counts: np.ndarray, k: int, seed: int) -> list[list[np.ndarray]]:
    """Per layer, the steps of prompts generated in order from per-prompt activation counts (n_prompts, n_layer,
    n_expert), as a trace holds them: prompt p generates round(its counts / k) tokens (the mean over its layers),
    each token routing in each layer to k distinct experts drawn without replacement in proportion to that prompt's
    counts there (experts it never used are never drawn; a layer of fewer than k used experts routes to all of
    them). Seeded: the same arguments give the same steps."""
    counts = np.asarray(counts)
    if counts.ndim != 3 or counts.shape[2] < k or k < 1:
        raise ValueError(f"counts must be (n_prompts, n_layer, n_expert >= k={k}), got shape {counts.shape}")
    rng = np.random.default_rng(seed)
    n_prompts, n_layer, n_expert = counts.shape
    out: list[list[np.ndarray]] = [[] for _ in range(n_layer)]
    for p, tokens in enumerate(prompt_tokens(counts, k)):
        for i in range(n_layer):
            row = counts[p, i].astype(np.float64)
            used = np.flatnonzero(row > 0)
            for _ in range(tokens):
                if len(used) <= k:
                    out[i].append(used.astype(np.int32))
                else:
                    out[i].append(np.sort(rng.choice(n_expert, k, replace=False, p=row / row.sum())).astype(np.int32))
    return out


def prompt_tokens(counts: np.ndarray, k: int) -> list[int]:
    """How many tokens steps_from_counts gives each prompt: round(its counts / k), the mean over its layers."""
    n_layer = counts.shape[1]
    return [int(round(counts[p].sum() / n_layer / k)) for p in range(counts.shape[0])]


def synthetic_steps(kind: str, n_layer: int, n_expert: int, k: int, n_steps: int, seed: int,
                    zipf: float = 1.0) -> list[list[np.ndarray]]:
    """Per layer, n_steps tokens of stationary routing: "uniform" (every expert equally likely) or "zipf" (expert
    of rank r with weight 1 / r**zipf, ranks a random permutation per layer, as the synthetic models' skewed
    routers)."""
    if kind not in ("uniform", "zipf"):
        raise ValueError(f"synthetic routing must be uniform or zipf, not {kind!r}")
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_layer):
        w = np.ones(n_expert) if kind == "uniform" else 1.0 / (1.0 + rng.permutation(n_expert)) ** zipf
        p = w / w.sum()
        out.append([np.sort(rng.choice(n_expert, k, replace=False, p=p)).astype(np.int32) for _ in range(n_steps)])
    return out


def _check_capacity(capacity: int, steps: Steps) -> None:
    widest = max((len(s) for s in steps), default=0)
    if capacity < widest:
        raise ValueError(f"capacity {capacity} is below a step's {widest} experts (every routed expert is resident)")


def belady_hits(steps: Steps, capacity: int) -> int:
    """The most hits any cache of `capacity` experts can have on `steps` (Belady's MIN, demand paging): a routed
    expert is a hit when resident; a miss enters, and when the cache is over capacity after a step the residents not
    routed in it whose next use is farthest (never first) leave. Counts one hit per routed expert per step."""
    return int(belady_step_hits(steps, capacity).sum())


def belady_step_hits(steps: Steps, capacity: int) -> np.ndarray:
    """belady_hits step by step: the hits of each step (int64 [len(steps)])."""
    _check_capacity(capacity, steps)
    never = len(steps)
    nxt: list[np.ndarray] = [np.empty(0, np.int64)] * len(steps)  # next use of each routed expert after its step
    seen: dict[int, int] = {}
    for t in range(len(steps) - 1, -1, -1):
        ids = [int(e) for e in steps[t]]
        nxt[t] = np.array([seen.get(e, never) for e in ids], np.int64)
        for e in ids:
            seen[e] = t
    resident: dict[int, int] = {}  # expert -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, expert), stale entries skipped
    hits = np.zeros(len(steps), np.int64)
    for t, ids in enumerate(steps):
        for e, n in zip((int(x) for x in ids), nxt[t].tolist()):
            hits[t] += e in resident
            resident[e] = n
            heapq.heappush(heap, (-n, e))
        current = {int(x) for x in ids}
        kept: list[tuple[int, int]] = []
        while len(resident) > capacity:
            neg, e = heapq.heappop(heap)
            if resident.get(e) != -neg:
                continue  # stale
            if e in current:
                kept.append((neg, e))
                continue
            del resident[e]
        for item in kept:
            heapq.heappush(heap, item)
    return hits


def frequency_oracle_hits(steps: Steps, capacity: int, segments: Sequence[int]) -> int:
    """The hits of a cache that knows how often each segment of `steps` (a prompt's tokens, in order: `segments`
    their lengths) routes to each expert, but not in which order: demand paging as belady_hits counts it, evicting
    after a step the residents not routed in it that the current segment routes to least (ties: the lowest id).
    Where routing is drawn independently step by step from a segment's distribution (steps_from_counts), this is
    the independent-reference model's optimal policy (A0) with the frequencies known exactly: what a policy that
    does not see the order can expect at best. Belady's MIN sees the order as well."""
    _check_capacity(capacity, steps)
    if sum(segments) != len(steps) or any(n < 0 for n in segments):
        raise ValueError(f"segments of {sum(segments)} steps do not cover the sequence's {len(steps)}")
    resident: set[int] = set()
    hits, start = 0, 0
    for n in segments:
        freq: dict[int, int] = {}
        for ids in steps[start:start + n]:
            for e in (int(x) for x in ids):
                freq[e] = freq.get(e, 0) + 1
        for ids in steps[start:start + n]:
            current = {int(x) for x in ids}
            hits += len(current & resident)
            resident |= current
            if len(resident) > capacity:
                victims = sorted(resident - current, key=lambda e: (freq.get(e, 0), e))
                resident -= set(victims[:len(resident) - capacity])
        start += n
    return hits


def lru_hits(steps: Steps, capacity: int) -> int:
    """Hits of an LRU cache of `capacity` experts on `steps` (the page cache's policy, approximately: what stock
    llama.cpp's mapped experts see under the same memory), counted as belady_hits counts them."""
    _check_capacity(capacity, steps)
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for ids in steps:
        for e in (int(x) for x in ids):
            if e in cache:
                hits += 1
                cache.move_to_end(e)
            else:
                cache[e] = None
        current = {int(x) for x in ids}
        for e in list(cache):
            if len(cache) <= capacity:
                break
            if e not in current:
                del cache[e]
    return hits


def routed_total(steps: Steps) -> int:
    return sum(len(s) for s in steps)


# ------------------------------------------------------------------------------------------ priors across prompts

PRIOR_MODES = ("none", "others", "earlier")


def prompt_priors(counts: np.ndarray, n_prompts: int, mode: str) -> np.ndarray | None:
    """The prior each of the first n_prompts prompts of a trace (counts: (n_prompts_all, n_layer, n_expert)) starts
    from, as counts of the same shape per prompt: "others", every other prompt's (leave-one-out: a calibration on the
    rest of the trace); "earlier", the prompts' before it (learned across runs: the first has none, all zeros);
    "none": None."""
    if mode not in PRIOR_MODES:
        raise ValueError(f"prior must be one of {', '.join(PRIOR_MODES)}, not {mode!r}")
    if mode == "none":
        return None
    counts = np.asarray(counts, dtype=np.int64)
    n = min(n_prompts, counts.shape[0])
    if mode == "others":
        return counts.sum(axis=0)[None] - counts[:n]
    before = np.cumsum(counts[:n], axis=0) - counts[:n]
    return before


def prior_distance(counts: np.ndarray, priors: np.ndarray) -> float:
    """The mean total variation distance between each prompt's routing in a layer and its prior's there (prompt-layer
    rows of (n_prompts, n_layer, n_expert), rows without routing or without a prior left out): 0 where a prompt
    routes as the prior says, 1 where they share no expert. What a prior can tell a cache about a prompt."""
    c = np.asarray(counts, dtype=np.float64)[:len(priors)]
    p = np.asarray(priors, dtype=np.float64)
    cs, ps = c.sum(axis=2, keepdims=True), p.sum(axis=2, keepdims=True)
    ok = (cs[..., 0] > 0) & (ps[..., 0] > 0)
    tv = 0.5 * np.abs(c / np.where(cs > 0, cs, 1) - p / np.where(ps > 0, ps, 1)).sum(axis=2)
    return float(tv[ok].mean()) if ok.any() else float("nan")


def prior_static_hits(steps: Steps, capacity: int, segments: Sequence[int], priors: np.ndarray) -> int:
    """The hits of a cache that holds, through each segment, the `capacity` experts its prior (priors[segment],
    counts per expert) ranks highest (ties: the lowest id), and nothing else: the prior's own forecast."""
    hits, start = 0, 0
    for seg, n in enumerate(segments):
        top = set(np.argsort(-np.asarray(priors[seg]), kind="stable")[:capacity].tolist())
        hits += sum(int(e) in top for ids in steps[start:start + n] for e in ids)
        start += n
    return hits


def _filled(steps: Steps, capacity: int, segments: Sequence[int], fill, hits_of) -> int:
    """Segment by segment from a cache filled with fill(segment's steps) (at most `capacity` experts): the hits of
    hits_of(steps, capacity, segments) with the fill as a first step of each segment, which finds an empty cache."""
    hits, start = 0, 0
    for n in segments:
        part = list(steps[start:start + n])
        first = np.asarray(fill(part), dtype=np.int32)
        hits += hits_of([first] + part, capacity, [n + 1])
        start += n
    return hits


def belady_fresh_hits(steps: Steps, capacity: int, segments: Sequence[int]) -> int:
    """belady_hits for a run per segment, each from a cache filled at its start as well as any fill can be: with the
    `capacity` experts the segment routes to soonest (what MIN keeps of any larger set)."""
    _check_capacity(capacity, steps)

    def soonest(part: list[np.ndarray]) -> list[int]:
        out: dict[int, None] = {}
        for ids in part:
            for e in (int(x) for x in ids):
                if len(out) < capacity:
                    out.setdefault(e)
        return list(out)

    return _filled(steps, capacity, segments, soonest, lambda s, c, _seg: belady_hits(s, c))


def frequency_oracle_fresh_hits(steps: Steps, capacity: int, segments: Sequence[int]) -> int:
    """frequency_oracle_hits for a run per segment, each from a cache filled at its start with the `capacity` experts
    the segment routes to most (ties: the lowest id), as a cache that knows its frequencies would fill it."""
    _check_capacity(capacity, steps)

    def most_used(part: list[np.ndarray]) -> list[int]:
        freq: dict[int, int] = {}
        for ids in part:
            for e in (int(x) for x in ids):
                freq[e] = freq.get(e, 0) + 1
        return sorted(freq, key=lambda e: (-freq[e], e))[:capacity]

    return _filled(steps, capacity, segments, most_used, frequency_oracle_hits)


def prior_aware_hits(steps: Steps, capacity: int, segments: Sequence[int], priors: np.ndarray) -> int:
    """The hits of a policy told where each segment begins and its prior (priors[segment], counts per expert), but
    not the segment's frequencies: demand paging as belady_hits counts it, evicting after a step the resident not
    routed in it with the fewest uses in the segment so far plus its prior's head start (as the store's: one use for
    an expert of the mean share, in proportion for the others; ties: the lowest id). What a prior and a prompt's own
    routing can tell a cache, with no count of earlier prompts in the way: the frequency oracle's lead over it is
    what the prompt's frequencies add."""
    _check_capacity(capacity, steps)
    resident: set[int] = set()
    hits, start = 0, 0
    for seg, n in enumerate(segments):
        p = np.asarray(priors[seg], dtype=np.float64)
        head = p * len(p) / p.sum() if p.sum() > 0 else np.zeros(len(p))
        uses: dict[int, int] = {}
        for ids in steps[start:start + n]:
            current = {int(x) for x in ids}
            hits += len(current & resident)
            resident |= current
            for e in current:
                uses[e] = uses.get(e, 0) + 1
            if len(resident) > capacity:
                victims = sorted(resident - current, key=lambda e: (uses.get(e, 0) + head[e], e))
                resident -= set(victims[:len(resident) - capacity])
        start += n
    return hits
