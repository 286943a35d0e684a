"""The limit model (pyzipmoe.plan.limit) against cases computed by hand."""

from __future__ import annotations

import numpy as np
import pytest

from pyzipmoe.plan import replay
from pyzipmoe.plan.limit import ExpertSizes, Rates, flat_steps, limit
from pyzipmoe.plan.trace import Routing

# one layer of 4 experts, top-1: experts 0, 1, 0, 1, 2, a token each
ORDER = [0, 1, 0, 1, 2]
RATES = Rates(read_seconds_per_expert=3.0, decode_core_seconds_per_expert=2.0, compute_seconds_per_token=1.0, cores=2)
SIZES = ExpertSizes(decoded_bytes=100, compressed_bytes=50)


def routing(order: list[list[int]], n_expert: int = 4, tokens: list[int] | None = None) -> Routing:
    routed = np.zeros((len(order), 1, n_expert), bool)
    for t, ids in enumerate(order):
        routed[t, 0, ids] = True
    k = max(len(ids) for ids in order)
    return Routing(routed=routed, layers=np.array([0], np.int32),
                   tokens=np.array(tokens or [1] * len(order), np.int32), k=k)


def test_decoded_layout_wins_where_it_holds_the_working_set() -> None:
    # 200 bytes: 2 decoded experts (Belady: misses at steps 0, 1, 4) or 4 compressed ones (the same misses).
    # decoded: a miss max(1 + 2/2, 3) = 3, a hit 1: 3 + 3 + 1 + 1 + 3 = 11 s. compressed: a miss 3, a hit
    # max(1 + 2/2, 0) = 2: 13 s. The limit is the decoded layout's 5 / 11 tokens/s.
    got = limit(routing([[e] for e in ORDER]), RATES, SIZES, cache_bytes=200)
    assert (got.layout, got.capacity, got.hits, got.routed) == ("decoded", 2, 2, 5)
    assert got.seconds == pytest.approx(11.0) and got.tokens_per_second == pytest.approx(5 / 11)


def test_compressed_layout_wins_where_decoded_experts_do_not_fit() -> None:
    # 100 bytes: 1 decoded expert misses every step (5 x 3 = 15 s); 2 compressed ones miss 3 times (13 s)
    got = limit(routing([[e] for e in ORDER]), RATES, SIZES, cache_bytes=100)
    assert (got.layout, got.capacity, got.hits) == ("compressed", 2, 2)
    assert got.tokens_per_second == pytest.approx(5 / 13)


def test_only_the_timed_steps_count_but_all_fill_the_cache() -> None:
    # steps 2.. of the 200-byte case: hit 1 + hit 1 + miss 3 = 5 s for 3 tokens
    got = limit(routing([[e] for e in ORDER]), RATES, SIZES, cache_bytes=200, timed_from=2)
    assert (got.tokens, got.hits, got.routed) == (3, 2, 3) and got.tokens_per_second == pytest.approx(3 / 5)


def test_reads_bound_a_step_when_they_outlast_the_cpu() -> None:
    # top-2 on 4 experts, 2 decoded fit: misses 2, 2, 0 (0,1 | 2,3 | 2,3); a batch of 2 tokens in the first step.
    # step 0: max(1 * 2 + 2 * 2 / 2, 2 * 3) = 6; step 1: max(1 + 2, 6) = 6; step 2: 1 -> 4 tokens in 13 s
    r = routing([[0, 1], [2, 3], [2, 3]], tokens=[2, 1, 1])
    got = limit(r, RATES, SIZES, cache_bytes=200)
    assert got.layout == "decoded" and got.seconds == pytest.approx(13.0) and got.tokens == 4


def test_one_cache_for_every_layer() -> None:
    routed = np.zeros((2, 2, 4), bool)
    routed[:, 0, 1] = routed[:, 1, 1] = True  # expert 1 of both layers, twice
    r = Routing(routed=routed, layers=np.array([0, 1], np.int32), tokens=np.array([1, 1], np.int32), k=1)
    assert [s.tolist() for s in flat_steps(r)] == [[1], [5], [1], [5]]
    assert limit(r, RATES, SIZES, cache_bytes=200).hits == 2  # both stay: the second token only computes
    assert replay.belady_step_hits(flat_steps(r), 1).tolist() == [0, 0, 0, 0]


def test_too_small_a_cache_and_bad_rates_are_refused() -> None:
    r = routing([[0, 1]])
    with pytest.raises(ValueError, match="fewer than a step's 2"):
        limit(r, RATES, SIZES, cache_bytes=99)
    with pytest.raises(ValueError, match="positive"):
        limit(r, Rates(1, 1, 0, 1), SIZES, cache_bytes=1000)
    with pytest.raises(ValueError, match="timed_from"):
        limit(r, RATES, SIZES, cache_bytes=1000, timed_from=1)


def test_rates_from_a_calibration() -> None:
    from types import SimpleNamespace

    from pyzipmoe.plan.limit import from_calibration

    cal = SimpleNamespace(base_seconds_per_token=0.02, expert_compressed_bytes=3_000_000, codec="huff",
                          expert_values=2_000_000, read_latency=1e-4, disk_bandwidth=1e9, t_decode=0.004, cores=8)
    rates, sizes = from_calibration(cal, cores=2)
    assert rates == Rates(read_seconds_per_expert=pytest.approx(3.1e-3), decode_core_seconds_per_expert=0.004,
                          compute_seconds_per_token=0.02, cores=2)
    assert sizes == ExpertSizes(decoded_bytes=4_000_000, compressed_bytes=3_000_000)
    assert from_calibration(cal, compute_seconds_per_token=0.5)[0].compute_seconds_per_token == 0.5
    raw = SimpleNamespace(**{**vars(cal), "codec": "raw", "base_seconds_per_token": None})
    assert from_calibration(raw, compute_seconds_per_token=1.0)[1].decoded_bytes == 3_000_000
    with pytest.raises(ValueError, match="compute per token"):
        from_calibration(raw)


def test_bench_budget_reports_the_limit_of_each_row(tmp_path) -> None:
    """bench_budget's row: the hand case above (200 bytes of cache, 5 tokens in 11 s) as llama-completion's eval
    speed of the generated steps after a prompt step, and zipmoe's measured tg as a share of it."""
    from helpers import load_tool

    from pyzipmoe.plan import trace

    bb = load_tool("bench/bench_budget.py")
    path = tmp_path / "r.npz"
    trace.save(path, routing([[e] for e in ORDER]))
    res = {"tg_threads": 2, "limit_inputs": {"uniform": {
        "routing_file": str(path), "timed_from": 1, "other_bytes": 1000,
        "rates": {"read_seconds_per_expert": 3.0, "decode_core_seconds_per_expert": 2.0, "cores": 2},
        "sizes": {"decoded_bytes": 100, "compressed_bytes": 50}}}}
    z, free = {"tps": 0.4, "zipmoe_budget_bytes": 1200}, {"tps": 1.0}  # compute: 1 s a token
    got = bb.row_limit(res, "uniform", z, free)
    # steps 1..4: miss 3 + hit 1 + hit 1 + miss 3 = 8 s for 4 tokens
    assert got["tps"] == pytest.approx(0.5) and got["share"] == pytest.approx(0.8) and got["layout"] == "decoded"
    res["tg_threads"] = None  # llama-simple: its speed is the generated tokens (5) over prompt and generation (11 s)
    assert bb.row_limit(res, "uniform", z, free)["tps"] == pytest.approx(5 / 11)
    assert bb.row_limit(res, "skewed", z, free) is None and bb.row_limit(res, "uniform", None, free) is None
