"""Routing sequences for the cache replay and the bounds it reports (pyzipmoe.plan.replay): Belady's optimum and
LRU on sequences whose hits are counted by hand."""

from __future__ import annotations

import numpy as np
import pytest

from pyzipmoe.plan.replay import (belady_hits, frequency_oracle_hits, lru_hits, prompt_tokens, routed_total,
                                  steps_from_counts, synthetic_steps)


def seq(*steps: list[int]) -> list[np.ndarray]:
    return [np.array(s, np.int32) for s in steps]


def test_belady_and_lru_on_a_sequence_counted_by_hand():
    # capacity 2: 0 1 0 2 1 0
    #   LRU:    m m h m(evicts 1) m(evicts 0) m(evicts 2)            -> 1 hit
    #   Belady: m m h m(evicts 0: next use at 5, 1's at 4) h m        -> 2 hits
    s = seq([0], [1], [0], [2], [1], [0])
    assert lru_hits(s, 2) == 1
    assert belady_hits(s, 2) == 2
    assert routed_total(s) == 6


def test_belady_never_evicts_an_expert_of_the_step_and_evicts_the_never_used_first():
    # capacity 3, steps of two: {0,1} {2,3} evict one of 0/1: 1 is used again at step 3, 0 never -> 0 goes;
    # {1,2} hits both; {1,3} hits both
    s = seq([0, 1], [2, 3], [1, 2], [1, 3])
    assert belady_hits(s, 3) == 4
    assert belady_hits(s, 4) == 4  # all fit: every reuse hits
    # capacity 2: {0,1} {2} evicts 1 (never used again), not 0 (used next); {0} hits. LRU evicts 0 (older): a miss
    s = seq([0, 1], [2], [0])
    assert belady_hits(s, 2) == 1 and lru_hits(s, 2) == 0


@pytest.mark.parametrize("capacity", [4, 6, 10])
def test_belady_bounds_lru_on_random_routing(capacity):
    for seed in range(5):
        steps = synthetic_steps("zipf", 1, 16, 4, 300, seed)[0]
        b, lru = belady_hits(steps, capacity), lru_hits(steps, capacity)
        assert lru <= b <= routed_total(steps)
        # more room never loses hits
        assert belady_hits(steps, capacity + 1) >= b


def test_a_capacity_below_a_step_is_refused():
    with pytest.raises(ValueError, match="capacity 1 is below a step's 2 experts"):
        belady_hits(seq([0, 1]), 1)
    with pytest.raises(ValueError, match="capacity"):
        lru_hits(seq([0, 1]), 1)


def test_steps_from_counts_draw_each_prompts_experts_seeded():
    counts = np.zeros((3, 2, 8), np.int32)
    counts[0, :, [1, 2, 3]] = 4  # prompt 0: 12 activations a layer, k=2: 6 tokens from experts 1..3
    counts[1, :, [5, 6]] = 2  # prompt 1: 2 tokens, only two experts used: both every token
    counts[2, :, :] = 1  # prompt 2: 4 tokens from all
    a = steps_from_counts(counts, 2, seed=7)
    again = steps_from_counts(counts, 2, seed=7)
    assert all(np.array_equal(x, y) for la, lb in zip(a, again) for x, y in zip(la, lb))
    assert len(a) == 2 and all(len(layer) == 6 + 2 + 4 for layer in a)
    for layer in a:
        assert all(len(s) == 2 and len(set(s.tolist())) == 2 for s in layer)
        assert all(set(s.tolist()) <= {1, 2, 3} for s in layer[:6])
        assert all(s.tolist() == [5, 6] for s in layer[6:8])
    other = steps_from_counts(counts, 2, seed=8)
    assert any(not np.array_equal(x, y) for x, y in zip(a[0], other[0]))


def test_steps_from_counts_refuse_a_bad_shape():
    with pytest.raises(ValueError, match="n_expert >= k"):
        steps_from_counts(np.zeros((2, 3, 2)), 4, seed=0)
    with pytest.raises(ValueError, match="uniform or zipf"):
        synthetic_steps("normal", 1, 8, 2, 4, 0)


def test_the_frequency_oracle_on_sequences_counted_by_hand():
    # capacity 1, prompts of 4 and 2 steps: 0 1 0 0 | 1 1
    #   prompt 1 (0 used 3 times, 1 once): m m(evicts 0: 1 is routed) m(evicts 1) h     -> 1 hit
    #   prompt 2: m(evicts 0) h                                                        -> 1 hit
    s = seq([0], [1], [0], [0], [1], [1])
    assert frequency_oracle_hits(s, 1, [4, 2]) == 2
    # capacity 2, prompts of 3 and 3: 0 1 2 | 2 1 2
    #   prompt 1 (each once): m m m(evicts 0, the lowest id of the least used) -> 0 hits, holds 1 2
    #   prompt 2 (2 twice, 1 once): h h h                                       -> 3 hits
    s = seq([0], [1], [2], [2], [1], [2])
    assert frequency_oracle_hits(s, 2, [3, 3]) == 3
    # it keeps the prompt's most used expert where LRU keeps the last: capacity 2, 0 1 0 2 1 0 (0 three times)
    #   oracle: m m h m(evicts 1) m(evicts 2) h -> 2 hits;  LRU: m m h m(evicts 1) m(evicts 0) m -> 1 hit
    s = seq([0], [1], [0], [2], [1], [0])
    assert frequency_oracle_hits(s, 2, [6]) == 2 and lru_hits(s, 2) == 1 and belady_hits(s, 2) == 2
    with pytest.raises(ValueError, match="do not cover"):
        frequency_oracle_hits(s, 2, [3, 4])


@pytest.mark.parametrize("capacity", [4, 8, 12])
def test_belady_bounds_the_frequency_oracle(capacity):
    counts = np.random.default_rng(3).integers(0, 20, size=(6, 2, 16))
    per_layer = steps_from_counts(counts, 4, seed=1)
    segments = prompt_tokens(counts, 4)
    for steps in per_layer:
        assert sum(segments) == len(steps)
        assert frequency_oracle_hits(steps, capacity, segments) <= belady_hits(steps, capacity)
