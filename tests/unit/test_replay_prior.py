"""The replay's priors across prompts (pyzipmoe.plan.replay): the priors a trace's prompts start from, what they tell
about a prompt, and Belady's and the frequency oracle's hits for a run per prompt, on cases counted by hand."""

from __future__ import annotations

import numpy as np
import pytest

from pyzipmoe.plan.replay import (belady_fresh_hits, belady_hits, frequency_oracle_fresh_hits, prior_distance,
                                  prior_static_hits, prompt_priors)


def seq(*steps: list[int]) -> list[np.ndarray]:
    return [np.array(s, np.int32) for s in steps]


COUNTS = np.array([[[1, 0]], [[0, 2]], [[3, 3]]])  # 3 prompts, 1 layer, 2 experts


def test_others_leaves_the_prompt_out_and_earlier_takes_the_prompts_before():
    assert prompt_priors(COUNTS, 3, "none") is None
    assert prompt_priors(COUNTS, 2, "others").tolist() == [[[3, 5]], [[4, 3]]]
    assert prompt_priors(COUNTS, 3, "earlier").tolist() == [[[0, 0]], [[1, 0]], [[1, 2]]]
    with pytest.raises(ValueError):
        prompt_priors(COUNTS, 3, "later")


def test_the_distance_is_0_for_a_prompt_routed_as_its_prior_and_1_for_one_sharing_no_expert():
    assert prior_distance(COUNTS[:1], np.array([[[2, 0]]])) == 0
    assert prior_distance(COUNTS[:1], np.array([[[0, 5]]])) == 1
    assert prior_distance(COUNTS[:2], np.array([[[0, 0]], [[1, 1]]])) == 0.5  # the first has no prior: left out


def test_a_cache_of_the_prior_s_top_experts_hits_what_they_route():
    steps = seq([0], [1], [0], [1], [1])
    assert prior_static_hits(steps, 1, [3, 2], np.array([[5, 1], [5, 1]])) == 2
    assert prior_static_hits(steps, 1, [3, 2], np.array([[5, 1], [1, 5]])) == 4


def test_a_run_per_prompt_starts_the_oracles_from_their_best_fill():
    steps = seq([0], [1], [0], [2])
    assert belady_hits(steps, 2) == 1  # m m h m
    assert belady_fresh_hits(steps, 2, [2, 2]) == 4  # filled {0, 1}, then {0, 2}
    assert belady_fresh_hits(seq([0], [1], [2], [0]), 2, [4]) == 3  # {0, 1}: 2 evicts 1, 0 hits
    assert frequency_oracle_fresh_hits(seq([1], [0], [0]), 1, [3]) == 1  # filled {0}: 1 misses and evicts it
    assert frequency_oracle_fresh_hits(seq([0], [0], [1]), 1, [3]) == 2



def test_the_prior_aware_policy_counts_the_prompt_s_uses_over_its_prior_and_forgets_earlier_prompts():
    from pyzipmoe.plan.replay import prior_aware_hits

    # capacity 2: 0 1 0 2 1. At 2, 0 (2 uses) outranks 1 (1 use) without a prior: 1 leaves and misses after; a
    # prior that makes 1 worth 2.5 uses (10 of 12) keeps it: one hit more
    steps = seq([0], [1], [0], [2], [1])
    assert prior_aware_hits(steps, 2, [5], np.array([[1, 1, 1]])) == 1
    assert prior_aware_hits(steps, 2, [5], np.array([[1, 10, 1]])) == 2
    # a new prompt counts from nothing: 0's three uses in the first are forgotten, the tie at 2 goes against 0
    steps = seq([0], [0], [0], [1], [2], [1])
    assert prior_aware_hits(steps, 2, [4, 2], np.array([[1, 1, 1], [1, 1, 1]])) == 3
    assert prior_aware_hits(steps, 2, [6], np.array([[1, 1, 1]])) == 2  # one prompt: 1 leaves, and misses
