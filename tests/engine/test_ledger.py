"""The time ledger (ggml_zipmoe/include/zipmoe-ledger.h): the computing thread's time per token, in parts measured
each on their own, adds up to the time per token the caller measures, and each part is where the work is."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import llama_bin_dir, unavailable, worker_env

from pyzipmoe.runtime import ledger
from pyzipmoe.runtime.timing import time_generation

GEN = 32


@pytest.fixture(scope="module")
def model(small_models: tuple[Path, Path]) -> Path:
    llama_bin_dir()  # (skips, or fails under CI, without zipmoe's build)
    return small_models[1]


def timed(model: Path, budget: str | None) -> tuple[dict, float]:
    """The runtime's counters over GEN greedy tokens, and the seconds per token the caller measured."""
    got = time_generation(model, llama={} if budget is None else {"memory_budget": budget}, warmup=6, gen=GEN,
                          threads=2)
    return got["stats"], got["seconds"] / GEN


@pytest.mark.parametrize("budget", [None, "30MiB"])  # every expert kept; about half of them (reads, decodes)
def test_the_parts_add_up_to_the_time_per_token(model: Path, budget: str | None) -> None:
    stats, measured = timed(model, budget)
    assert stats["ledger_tokens"] == GEN and stats["ledger_graphs"] == GEN  # one graph a token, each counted once
    parts = ledger.per_token(stats)
    assert all(v >= 0 for v in parts.values())
    assert parts["total"] == pytest.approx(measured, rel=0.05)
    assert stats["ledger_wall_ns"] == sum(stats[k] for _, k, _ in ledger.PARTS if k != "ledger_between_ns")
    if budget is None:  # warm and unbounded: nothing is read or decoded while timing
        assert stats["misses"] == 0 and parts["decode"] == 0 and parts["read_wait"] == 0
        assert parts["compute"] > 0.8 * parts["total"]
    else:
        assert stats["misses"] > 0 and parts["decode"] > 0 and parts["read_wait"] > 0
        # the decoding thread's share of the decoding is at most the decoding every thread did
        assert parts["decode"] * GEN * 1e9 <= stats["decode_ns"]


def test_parallel_steps_and_a_timed_prompt_add_up_too(model: Path) -> None:
    """Steps of four sequences' tokens (llama-server -np 4's) and a prompt's micro-batches: the ledger counts every
    token of them, and its parts add up to the time the caller measured."""
    got = time_generation(model, llama={"memory_budget": "30MiB"}, warmup=4, gen=GEN // 2, threads=2, prompt=96,
                          parallel=4)
    stats, prompt = got["stats"], got["prompt"]
    assert stats["ledger_tokens"] == 4 * GEN // 2 and stats["ledger_graphs"] == GEN // 2  # a graph a step
    assert got["tps"] == pytest.approx(4 * GEN // 2 / got["seconds"])
    assert len(got["tokens"]) == 4 + GEN // 2
    assert ledger.per_token(stats)["total"] * 4 == pytest.approx(got["seconds"] / (GEN // 2), rel=0.05)
    assert prompt["stats"]["ledger_tokens"] == 96 and prompt["stats"]["ledger_graphs"] == 1
    assert ledger.per_token(prompt["stats"])["total"] == pytest.approx(prompt["seconds"] / 96, rel=0.05)
    with pytest.raises(ValueError, match="parallel sequences"):
        time_generation(model, parallel=4, record=model.with_suffix(".npz"))


def test_table_rows_sum_and_empty() -> None:
    stats = {"ledger_tokens": 2, "ledger_compute_ns": 6_000_000, "ledger_decode_ns": 2_000_000,
             "ledger_read_wait_ns": 1_000_000, "ledger_thread_wait_ns": 500_000, "ledger_other_ns": 300_000,
             "ledger_between_ns": 200_000}
    parts = ledger.per_token(stats)
    assert parts["compute"] == pytest.approx(3e-3) and parts["total"] == pytest.approx(5e-3)
    rows = ledger.table_rows(stats)
    assert rows[0][1:] == ("3.000", "60.0%") and rows[-1] == ("total", "5.000", "100.0%")
    assert ledger.per_token({})["total"] == 0 and ledger.table_rows({})[-1] == ("total", "0.000", "-")


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pyzipmoe", "bench", *args], env=worker_env(llama_bin_dir()),
                          capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL, check=False)


def test_bench_prints_the_ledger_and_the_share_of_the_limit(model: Path) -> None:
    if not (llama_bin_dir() / "llama-bench").exists():
        unavailable("llama-bench is not built")
    done = bench(str(model), "--memory-budget", "30MiB", "--ledger", "--limit", "-p", "0", "-n", "8", "-r", "1",
                 "-t", "2", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    timed = json.loads(done.stdout)["timed"][str(model)]
    assert timed["stats"]["ledger_tokens"] == 8 and timed["stats"]["misses"] > 0
    lim = timed["limit"]
    assert lim["tokens"] == 8 and lim["routed"] == 8 * 4 * 4  # 4 MoE layers, top-4
    assert lim["hits"] < lim["routed"] and timed["share_of_limit"] == pytest.approx(
        timed["tokens_per_second"] / lim["tokens_per_second"])
    assert timed["cache_bytes"] < 30 << 20
    done = bench(str(model), "--ledger", "-p", "32", "-n", "4", "-r", "1", "-t", "2")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "(no budget: no limit)" in done.stdout and "\ntotal " in done.stdout and "read_wait" in done.stdout
    assert "its timed prompt (32 random tokens, after one untimed)" in done.stdout
    assert done.stdout.count("\ntotal ") == 2  # the generation's ledger and the prompt's


def test_limit_needs_a_budget(model: Path) -> None:
    done = bench(str(model), "--limit", "-p", "0", "-n", "4")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == "zipmoe: error: --limit is the best speed of a cache of the budget's size: give " \
                                  "--memory-budget"


@pytest.mark.parametrize("flags, says", [(["--parallel", "4"], "--parallel is the timed generation of --ledger"),
                                         (["--ledger", "--parallel", "9"], "--parallel 9: at most 8 sequences")])
def test_parallel_needs_the_ledger_and_a_prompt_each(model: Path, flags: list[str], says: str) -> None:
    done = bench(str(model), *flags, "-p", "0", "-n", "4")
    assert done.returncode == 2 and done.stdout == "" and says in done.stderr
