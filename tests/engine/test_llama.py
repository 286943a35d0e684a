"""llama.cpp with zipmoe: a zipmoe GGUF computes exactly what its BF16 source computes.

For tiny synthetic MoEs of two architectures, the logits of every prompt position and of a greedy
continuation must be bit-identical between the BF16 GGUF and its zipmoe GGUFs (huff and zstd, several chunks
per expert), through llama-cpp-python with 1 and 2 threads, mmap on and off, one token per batch and whole-prompt
batches; and the greedy outputs of llama-simple, llama-completion, llama-cli and llama-server must be identical.
Also: the zipmoe build changes nothing for plain GGUFs (compared with the stock build when there is one), the
"none" cache mode computes the same with more decoding, a damaged expert is an error (not a crash, not wrong
logits), a truncated file is refused, and a stock llama.cpp refuses a zipmoe GGUF.

Every model is loaded in a child process (a crash there fails one test instead of killing pytest). These tests
need zipmoe's llama.cpp build (build/bin/libllama.so and the programs) and llama-cpp-python; without them they
are skipped, except under CI (the CI environment variable is set), where they fail.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from importlib.util import find_spec
from itertools import product
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import assert_bit_identical, http_json, llama_bin_dir, stderr_tail, unavailable, worker_env

import pyzipmoe
from pyzipmoe.file.reader import open_zipmoe
from pyzipmoe.paths import stock_bin_dir

ARCHS = ("qwen3moe", "olmoe")
PROMPT = ("the expert model said hello to the world of water and time, and then the people of the world "
          "said hello to the expert")
N_GEN = 8  # greedy continuation, token by token
N_CTX = 128
# n_threads x use_mmap x (one token per batch, the whole prompt in one batch), plus a prompt split in ubatches
CONFIGS = [{"n_threads": t, "use_mmap": m, "n_batch": b, "n_ubatch": b}
           for t, m, b in product((1, 2), (True, False), (1, 64))]
CONFIGS.append({"n_threads": 2, "use_mmap": True, "n_batch": 64, "n_ubatch": 5})
TIMEOUT = 600  # seconds for any one child process (a few on an idle machine; CI machines are often busy)


# ----------------------------------------------------------------------------------- what the tests need


@pytest.fixture(scope="session")
def ours() -> Path:
    """zipmoe's build: the directory with libllama.so and the llama.cpp programs."""
    return llama_bin_dir()


def _program(bin_dir: Path, name: str) -> Path:
    path = bin_dir / name
    if not path.is_file():
        unavailable(f"{path} was not built")
    return path


@pytest.fixture(scope="session")
def stock() -> Path:
    """Stock llama.cpp: the same sdist built without zipmoe's patches (tools/dev/build_stock.sh, which .ci/run
    runs), for comparisons; `unavailable` when absent."""
    stock_bin = stock_bin_dir()
    if not (stock_bin / "libllama.so").is_file():
        unavailable(f"no stock llama.cpp build at {stock_bin} to compare with (`bash tools/dev/build_stock.sh` "
                    "builds it; or set ZIPMOE_STOCK_LLAMA_BIN)")
    return stock_bin




# ------------------------------------------------------------------------------ llama-cpp-python worker

WORKER = r"""
import json, sys
import numpy as np
job = json.loads(sys.argv[1])
from pyzipmoe.runtime.llama import Llama, zipmoe_stats_reset

def error(e):
    return {"type": type(e).__name__, "message": str(e), "mro": [c.__name__ for c in type(e).__mro__]}

out, arrays = {"runs": []}, {}
for i, run in enumerate(job["runs"]):
    res = {"config": run}
    out["runs"].append(res)
    cfg = dict(run["config"])
    threads = cfg.pop("n_threads")
    try:
        llm = Llama(job["model"], n_ctx=job["n_ctx"], n_threads=threads, n_threads_batch=threads, logits_all=True,
                    seed=0, verbose=False, zipmoe_cache=run.get("cache", "unbounded"), **{"prefill": False, **run.get("zipmoe", {})}, **cfg)
    except Exception as e:
        res["load_error"] = error(e)
        continue
    try:
        res["served"] = llm.zipmoe_served  # (a zipmoe GGUF, or a plain one under a budget)
        if llm.zipmoe_served:
            zipmoe_stats_reset()
        tokens = llm.tokenize(job["prompt"].encode())
        for _ in range(run.get("attempts", 1)):
            try:
                llm.reset()
                llm.eval(tokens)
                generated = []
                for _ in range(job["n_gen"]):
                    nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
                    generated.append(nxt)
                    llm.eval([nxt])
                arrays[f"run{i}"] = np.array(llm.scores[: llm.n_tokens], dtype=np.float32)
                res.update(prompt=[int(t) for t in tokens], generated=generated)
            except Exception as e:
                res.setdefault("errors", []).append(error(e))
        if llm.zipmoe_served:
            res["stats"] = llm.zipmoe_stats()
    finally:
        llm.close()
np.savez(job["out"], **arrays)
print(json.dumps(out))
"""


def run_worker(model: Path, lib_dir: Path, runs: list[dict[str, Any]], out: Path, prompt: str = PROMPT,
               env: dict[str, str] | None = None, n_gen: int = N_GEN) -> tuple[list[dict[str, Any]], dict[str, np.ndarray]]:
    """Loads `model` with libllama from lib_dir in a child process, once per run, evaluates PROMPT and N_GEN
    greedy tokens with logits_all; returns each run's report and logits (run{i}: float32 [positions, n_vocab]).

    A run is {"config": Llama arguments, "cache": zipmoe_cache (optional), "zipmoe": more zipmoe arguments such
    as memory_budget (optional; prefill is off unless it says so, so that the runs decode), "attempts": times to
    evaluate (optional)}; its report has prompt, generated,
    stats (zipmoe), or load_error / errors. env: more environment variables for the child."""
    job = {"model": str(model), "runs": runs, "prompt": prompt, "n_gen": n_gen, "n_ctx": N_CTX, "out": str(out)}
    done = subprocess.run([sys.executable, "-c", WORKER, json.dumps(job)], env={**worker_env(lib_dir), **(env or {})},
                          capture_output=True,
                          text=True, timeout=TIMEOUT, check=False)
    assert done.returncode == 0, \
        f"the worker died (exit status {done.returncode}) on {model}:\n{stderr_tail(done.stderr)}"
    reports = json.loads(done.stdout.strip().splitlines()[-1])["runs"]
    with np.load(out) as z:
        arrays = {k: z[k] for k in z.files}
    return reports, arrays


def _no_error(report: dict[str, Any]) -> None:
    assert "load_error" not in report and "errors" not in report, report


def _models(arch: str, tiny_models: dict[str, Path], zipmoe_models: dict[tuple[str, str], Path]) -> dict[str, Path]:
    return {"bf16": tiny_models[arch], **{name: zipmoe_models[arch, name] for name in ("huff", "zstd", "esc")}}


@pytest.fixture(scope="session")
def logits(ours: Path, tiny_models: dict[str, Path], zipmoe_models: dict[tuple[str, str], Path],
           tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], tuple[list[dict[str, Any]], dict]]:
    """logits(arch, variant) -> every CONFIGS run of that model on zipmoe's build (computed once).

    variant: bf16, huff, zstd or esc. The huff model also runs CONFIGS[0] once more with zipmoe_cache="none".
    """
    cache: dict[tuple[str, str], tuple[list[dict[str, Any]], dict]] = {}
    out_dir = tmp_path_factory.mktemp("logits")

    def get(arch: str, variant: str) -> tuple[list[dict[str, Any]], dict]:
        if (arch, variant) not in cache:
            runs = [{"config": c} for c in CONFIGS]
            if variant == "huff":
                runs.append({"config": CONFIGS[0], "cache": "none"})
            model = _models(arch, tiny_models, zipmoe_models)[variant]
            cache[arch, variant] = run_worker(model, ours, runs, out_dir / f"{arch}-{variant}.npz")
        return cache[arch, variant]

    return get


# ---------------------------------------------------------------------------------- bit-exact logits


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("variant", ["huff", "zstd", "esc"])
def test_zipmoe_logits_bit_identical_to_bf16(logits: Callable, arch: str, variant: str) -> None:
    ref_reports, ref = logits(arch, "bf16")
    reports, got = logits(arch, variant)
    n_tensors = 3 * 2  # up, gate, down in each of the tiny preset's 2 layers
    for i, cfg in enumerate(CONFIGS):
        _no_error(ref_reports[i])
        _no_error(reports[i])
        what = f"{arch} {variant} {cfg}"
        r = ref[f"run{i}"]
        n_prompt = len(ref_reports[i]["prompt"])
        assert n_prompt >= 16 and r.shape[0] == n_prompt + N_GEN and np.isfinite(r).all(), what
        assert np.ptp(r, axis=1).min() > 0 and not (r[0] == r[-1]).all(), f"{what}: degenerate logits"
        assert reports[i]["prompt"] == ref_reports[i]["prompt"]
        assert_bit_identical(got[f"run{i}"], r, what)
        assert reports[i]["generated"] == ref_reports[i]["generated"], what
        stats = reports[i]["stats"]  # the zipmoe path really ran
        assert stats["stores"] == n_tensors, (what, stats)
        # unbounded cache: each expert decoded once at most, and kept
        assert 0 < stats["experts_decoded"] <= n_tensors * 8, (what, stats)
        if "experts_resident" in stats:
            assert stats["experts_resident"] == stats["experts_decoded"], (what, stats)
        if "hot_bytes" in stats:
            assert stats["hot_bytes"] == stats["experts_decoded"] * 2048 * 2, (what, stats)
        assert stats["bytes_decoded"] == stats["experts_decoded"] * 2048 * 2, (what, stats)
        assert stats["chunks_decoded"] == stats["experts_decoded"] * 7, (what, stats)  # 2048 values / 300 per chunk
        assert stats["materialize_calls"] > 0 and stats["decode_ns"] > 0, (what, stats)


@pytest.mark.parametrize("arch", ARCHS)
def test_cache_none_same_logits_more_decoding(logits: Callable, arch: str) -> None:
    reports, got = logits(arch, "huff")
    unbounded, none = reports[0], reports[len(CONFIGS)]
    _no_error(none)
    assert none["config"]["cache"] == "none"
    assert_bit_identical(got[f"run{len(CONFIGS)}"], got["run0"], f"{arch}: cache none vs unbounded")
    assert none["generated"] == unbounded["generated"]
    assert none["stats"]["experts_decoded"] > unbounded["stats"]["experts_decoded"], (none["stats"], unbounded["stats"])
    if "experts_resident" in none["stats"]:
        assert none["stats"]["experts_resident"] < none["stats"]["experts_decoded"], none["stats"]


def _matching_runs(runs: list[dict[str, Any]], where: list[int], reports: list[dict[str, Any]], got: dict,
                   ref_reports: list[dict[str, Any]], ref: dict, label: str) -> list[tuple[dict[str, Any], str, dict]]:
    """Each run's logits and text held to the BF16 run of its config (where[k]); (run, label, stats) of each."""
    out = []
    for k, (run, i) in enumerate(zip(runs, where, strict=True)):
        what = f"{label} {run['zipmoe']} {CONFIGS[i]}"
        _no_error(reports[k])
        assert_bit_identical(got[f"run{k}"], ref[f"run{i}"], what)
        assert reports[k]["generated"] == ref_reports[i]["generated"], what
        out.append((run, what, reports[k]["stats"]))
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_every_budget_and_policy_gives_the_same_logits(logits: Callable, ours: Path, arch: str,
                                                       zipmoe_models: dict[tuple[str, str], Path], tmp_path: Path
                                                       ) -> None:
    """Budgets far below the experts' size force every tier and transition: decoded experts evicted and decoded
    again, compressed ones kept in RAM (hot_share < 1), sign+mantissa planes kept and codes read (sm_share), or read
    from the file again; prefill and decode, 1 and 2 threads, each eviction policy; and the planner's split. Logits
    stay bit-identical to the BF16 model's."""
    from pyzipmoe.runtime.budget import model_memory

    ref_reports, ref = logits(arch, "bf16")
    minimum = model_memory(zipmoe_models[arch, "huff"]).minimum  # what any budget must hold; the tiers get the rest
    picks = [i for i, c in enumerate(CONFIGS) if c["use_mmap"]]  # threads 1/2 x batch 1/64
    runs, where = [], []
    for policy in ("tlfu", "lru", "lfu", "fifo", "lfuda"):
        for extra, shares in ((16 << 10, {"hot_share": 1.0}), (100 << 10, {"hot_share": 0.3}),
                              (40 << 10, {"hot_share": 0.0}), (60 << 10, {"hot_share": 0.2, "sm_share": 0.5}),
                              (60 << 10, {"planner": True}), (None, {})):
            for i in picks:
                budget = {} if extra is None else {"memory_budget": str(minimum + extra)}
                runs.append({"config": CONFIGS[i], "cache": "none" if extra is None else "unbounded",
                             "zipmoe": {**budget, "cache_policy": policy, **shares}})
                where.append(i)
    for extra, shares in ((16 << 10, {"hot_share": 1.0}), (60 << 10, {"hot_share": 0.2, "sm_share": 0.5})):
        for i in picks:  # tiers filled at load, then the same transitions
            runs.append({"config": CONFIGS[i], "zipmoe": {"memory_budget": str(minimum + extra), "cache_policy": "lru",
                                                          "prefill": True, **shares}})
            where.append(i)
    reports, got = run_worker(zipmoe_models[arch, "huff"], ours, runs, tmp_path / "budgets.npz")
    hits = {"hits_warm": 0, "hits_sm": 0, "experts_streamed": 0}
    for run, what, stats in _matching_runs(runs, where, reports, got, ref_reports, ref, arch):
        assert stats["misses"] > 0 and stats["bytes_read"] > 0, (what, stats)
        if "memory_budget" in run["zipmoe"]:
            assert stats["evictions"] > 0, (what, stats)  # the budget held fewer experts than were used
        for name in hits:
            hits[name] += stats[name]
    assert hits["hits_warm"] > 0 and hits["hits_sm"] > 0, hits  # decoded from compressed experts / planes in RAM
    assert hits["experts_streamed"] > 0, hits  # generation's fused op decoded warm experts in its cache


@pytest.mark.parametrize("arch", ARCHS)
def test_escape_coded_experts_under_budgets_give_the_same_logits(logits: Callable, ours: Path, arch: str,
                                                                 zipmoe_models: dict[tuple[str, str], Path],
                                                                 tmp_path: Path) -> None:
    """The escape-coded model under budgets that force misses, warm hits and streamed warm experts, and under the
    runtime's default split where nearly every expert fits compressed: there, on a CPU whose SIMD decoder runs it,
    every expert is kept compressed (zipmoe_budget_default_hot_share), and the logits stay the BF16 model's."""
    from pyzipmoe.file import codec
    from pyzipmoe.runtime.budget import model_memory
    from pyzipmoe.runtime.cache_control import default_hot_share, store_sizes

    model = zipmoe_models[arch, "esc"]
    ref_reports, ref = logits(arch, "bf16")
    minimum = model_memory(model).minimum
    sizes = store_sizes(model)
    compressed = sum(c for _, _, c in sizes)
    near_all = int(0.95 * compressed)  # tiers holding 95% of the experts compressed, ~65% of them decoded
    assert default_hot_share(near_all, sizes, True) == 0.0 and default_hot_share(near_all, sizes, False) == 1.0
    picks = [i for i, c in enumerate(CONFIGS) if c["use_mmap"]]
    cases = [(near_all, {}), (near_all, {"hot_share": 1.0}), (40 << 10, {"hot_share": 0.0}),
             (16 << 10, {}), (60 << 10, {"hot_share": 0.2, "sm_share": 0.5})]
    runs, where = [], []
    for extra, shares in cases:
        for i in picks:
            runs.append({"config": CONFIGS[i], "zipmoe": {"memory_budget": str(minimum + extra), **shares}})
            where.append(i)
    reports, got = run_worker(model, ours, runs, tmp_path / "esc-budgets.npz")
    for run, what, stats in _matching_runs(runs, where, reports, got, ref_reports, ref, f"{arch} esc"):
        if run["zipmoe"] == {"memory_budget": str(minimum + near_all)} and codec.esc_simd_level() > 0:
            assert stats["hot_bytes"] == 0 and stats["hits_warm"] > 0, (what, stats)  # the default kept none decoded
        if run["zipmoe"].get("hot_share") == 1.0:
            assert stats["hits_warm"] == 0 and stats["hot_bytes"] > 0, (what, stats)


def test_per_expert_scales_follow_the_routed_experts_not_their_places(ours: Path, tmp_path: Path) -> None:
    """A model with per-expert output scales (ffn_*_exps.scale, which llama.cpp gathers by the router's ids): under
    a budget a decoded expert seldom lies at its own index, and each scale must still be its routed expert's."""
    from dataclasses import replace

    from conftest import SMALL_CHUNK
    from pyzipmoe.file import convert
    from pyzipmoe.runtime.budget import model_memory
    from pyzipmoe.synth import SynthConfig, write_config

    src = write_config(tmp_path / "scaled.gguf", replace(SynthConfig(), expert_scales=True)).path
    zipped = tmp_path / "scaled.zipmoe.gguf"
    convert.convert(src, zipped, codec="huff", chunk_n=SMALL_CHUNK, threads=2)
    budget = str(model_memory(zipped).minimum + (16 << 10))
    picks = [i for i, c in enumerate(CONFIGS) if c["use_mmap"]]  # threads 1/2 x batch 1/64
    ref_reports, ref = run_worker(src, ours, [{"config": CONFIGS[i]} for i in picks], tmp_path / "ref.npz")
    runs = [{"config": CONFIGS[i], "zipmoe": {"memory_budget": budget}} for i in picks]
    reports, got = run_worker(zipped, ours, runs, tmp_path / "zipmoe.npz")
    for k, i in enumerate(picks):
        _no_error(reports[k])
        assert_bit_identical(got[f"run{k}"], ref[f"run{k}"], f"scaled experts, {CONFIGS[i]}")
        assert reports[k]["generated"] == ref_reports[k]["generated"]
        assert reports[k]["stats"]["evictions"] > 0, reports[k]["stats"]  # experts moved between places


@pytest.mark.parametrize("env", [{"ZIPMOE_DIRECT_IO": "1"}, {"ZIPMOE_DIRECT_IO": "0"},
                                 {"ZIPMOE_READ_BUFFER": "4KiB"}, {"ZIPMOE_PREDICT": "1"},
                                 {"ZIPMOE_FUSED": "0", "ZIPMOE_PREDICT": "1"}])
def test_read_ahead_gives_the_same_logits(logits: Callable, ours: Path, env: dict[str, str],
                                          zipmoe_models: dict[tuple[str, str], Path], tmp_path: Path) -> None:
    """Under a budget the reader reads the next store's experts ahead (the same layer's routed ones in generation,
    all of the next layer's for a prompt) into its own buffers, around the page cache (O_DIRECT) or, with
    ZIPMOE_DIRECT_IO=0, through it; with read buffers smaller than the tiny model's reads (ZIPMOE_READ_BUFFER), a
    read-ahead waits for the other buffer to be given back, as a prompt's does on a real model. With ZIPMOE_PREDICT=1
    a generated token's layer also runs the next layer's router on its input, and that layer's first store reads
    the experts it guessed ahead (right or wrong). With ZIPMOE_FUSED=0 a generated token's matmul is ggml's
    mul_mat_id after the materialising node, not the op's own. The stores decode from those bytes with the same
    logits. The first store of a graph has nobody to read ahead for it, so the bytes read ahead are a part of
    bytes_read."""
    from pyzipmoe.runtime.budget import model_memory

    arch = ARCHS[0]
    ref_reports, ref = logits(arch, "bf16")
    minimum = model_memory(zipmoe_models[arch, "huff"]).minimum
    picks = (0, 4, 1, 5)  # 1 and 2 threads: one token a batch (generation), and the prompt in one batch
    runs = [{"config": CONFIGS[i], "zipmoe": {"memory_budget": str(minimum + (16 << 10)), "hot_share": 1.0}}
            for i in picks]
    reports, got = run_worker(zipmoe_models[arch, "huff"], ours, runs, tmp_path / "ahead.npz", env=env)
    guessed = sum(report["stats"]["bytes_read_guessed"] for report in reports)
    assert (guessed > 0) == ("ZIPMOE_PREDICT" in env), guessed
    for k, i in enumerate(picks):
        what = f"{arch} {env} {CONFIGS[i]}"
        _no_error(reports[k])
        assert_bit_identical(got[f"run{k}"], ref[f"run{i}"], what)
        assert reports[k]["generated"] == ref_reports[i]["generated"], what
        stats = reports[k]["stats"]
        assert stats["bytes_read_ahead"] < stats["bytes_read"], (what, stats)
    # (a read-ahead the next store overtakes is read by the store itself: on a loaded machine one run's may all be)
    assert sum(report["stats"]["bytes_read_ahead"] for report in reports) > 0, [r["stats"] for r in reports]


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_decodes_at_load_and_gives_the_same_logits(logits: Callable, ours: Path, arch: str,
                                                           zipmoe_models: dict[tuple[str, str], Path], tmp_path: Path
                                                           ) -> None:
    """Unbounded, every expert is decoded at load: the run itself decodes nothing, with the same logits."""
    ref_reports, ref = logits(arch, "bf16")
    runs = [{"config": CONFIGS[i], "zipmoe": {"prefill": True}} for i in (0, 1)]
    reports, got = run_worker(zipmoe_models[arch, "huff"], ours, runs, tmp_path / "prefill.npz")
    for k, run in enumerate(runs):
        what = f"{arch} prefill {run['config']}"
        _no_error(reports[k])
        assert_bit_identical(got[f"run{k}"], ref[f"run{k}"], what)
        stats = reports[k]["stats"]  # reset after the load
        assert stats["experts_decoded"] == 0 and stats["misses"] == 0 and stats["hits_hot"] > 0, (what, stats)
        assert stats["hot_bytes"] == 3 * 2 * 8 * 2048 * 2, (what, stats)  # every expert of the tiny preset


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tiers_kib, hot_experts, reads", [(80, 28, 40992), (90, 30, 46112)], ids=["80 KiB", "90 KiB"])
def test_the_decoded_experts_in_flight_count_once(logits: Callable, ours: Path, arch: str,
                                                  zipmoe_models: dict[tuple[str, str], Path], tmp_path: Path,
                                                  tiers_kib: int, hot_experts: int, reads: int) -> None:
    """The budget's allowance for the expert tensor in flight need not hold the experts the hot tier holds
    already, and a prompt that routes to every expert still peaks within the budget: the stores take turns with
    the allowance. The tiny preset has 6 expert tensors of 8 experts of 4 KiB (23-25 KB compressed). With 80 and
    90 KiB for the tiers a prompt's batch leaves half of them to its read buffers (40992 and 46112 bytes: each
    read's span of O_DIRECT blocks is most of what a 3 KiB region takes there), and keeps the rest decoded with
    what the allowance need not hold, 2 and 2.2 experts a store, whose fractions go on from store to store; the
    allowance is what a store that keeps only its whole experts decodes anew (with the fractional share's, one
    expert short, the peak went 2 KiB over once).
    Generated tokens route 2 experts a store, whose misses take their victims' places: the hot tier then holds
    all of it, the tiers and the 32 KiB of the largest tensor, 28 and 30 experts; the second attempt's prompt,
    after that, is back within the budget before its first store decodes beyond its share."""
    from pyzipmoe.runtime.budget import model_memory

    ref_reports, ref = logits(arch, "bf16")
    need = model_memory(zipmoe_models[arch, "huff"])
    assert need.in_flight_bytes == 8 * 2048 * 2 and need.expert_bytes == 6 * need.in_flight_bytes  # the tiny preset
    extra = (tiers_kib << 10) + 64  # (a little over: the runtime's shares are rounded down)
    runs = [{"config": CONFIGS[i], "attempts": 2, "zipmoe": {"memory_budget": str(need.minimum + extra),
                                                             "hot_share": 1.0, "prefill": True}}
            for i in (1, 5)]  # a prompt in one batch
    reports, got = run_worker(zipmoe_models[arch, "huff"], ours, runs, tmp_path / "credit.npz")
    for k, run in enumerate(runs):
        what = f"{arch} {run}"
        _no_error(reports[k])
        assert_bit_identical(got[f"run{k}"], ref[f"run{(1, 5)[k]}"], what)
        stats = reports[k]["stats"]
        assert stats["hot_bytes"] == hot_experts * 4096, (what, stats)
        assert stats["peak_resident_bytes"] <= extra + need.in_flight_bytes, (what, stats)
    # the prompt alone: its decoded experts leave the room of its read buffers
    reports, _ = run_worker(zipmoe_models[arch, "huff"], ours, runs[:1], tmp_path / "prompt.npz", n_gen=0)
    _no_error(reports[0])
    stats = reports[0]["stats"]
    assert 0 < stats["peak_hot_bytes"] <= extra + need.in_flight_bytes - reads, stats


@pytest.mark.parametrize("arch", ARCHS)
def test_generation_without_a_hot_tier_lends_the_allowance_in_flight_to_the_warm_tier(
        logits: Callable, ours: Path, arch: str, zipmoe_models: dict[tuple[str, str], Path], tmp_path: Path) -> None:
    """Every expert kept compressed (hot_share 0): a prompt in one batch decodes what it routes into the allowance for
    the expert tensor in flight, whose pages are kept for the next decodes. A generated token decodes only its misses,
    so in generation the pool keeps a token's pages and the warm tier takes the rest of the allowance
    (zipmoe_cache_begin_graph): more than the whole room the budget leaves the tiers. Logits stay the BF16 model's."""
    from pyzipmoe import synth
    from pyzipmoe.runtime.budget import model_memory

    _, ref = logits(arch, "bf16")
    model = zipmoe_models[arch, "huff"]
    need, tiers = model_memory(model), 40 << 10
    runs = [{"config": CONFIGS[5], "zipmoe": {"memory_budget": str(need.minimum + tiers), "hot_share": 0.0}}]
    reports, got = run_worker(model, ours, runs, tmp_path / "warm.npz")
    _no_error(reports[0])
    assert_bit_identical(got["run0"], ref["run5"], f"{arch} {runs[0]}")
    stats = reports[0]["stats"]
    config = synth.PRESETS["tiny"]
    token_pages = config.n_expert_used * max(c.source.nbytes // c.source.dims[2]
                                             for c in open_zipmoe(model).compressed)
    assert stats["hot_bytes"] <= token_pages and tiers < stats["warm_bytes"] <= tiers + need.in_flight_bytes - token_pages, stats
    assert stats["pool_bytes"] <= token_pages, stats  # (hot: the last store's misses, decoded in flight)
    assert stats["peak_resident_bytes"] + stats["pool_bytes"] <= tiers + need.in_flight_bytes, stats


@pytest.mark.parametrize("arch", ARCHS)
def test_a_plan_keeps_evicted_pages_within_the_allowance_in_flight(logits: Callable, ours: Path, arch: str,
                                                                zipmoe_models: dict[tuple[str, str], Path],
                                                                tmp_path: Path) -> None:
    """A plan leaves the allowance for the expert tensor in flight beside its slots, whatever the budget: experts
    evicted keep their pages there for the next decodes. (With a budget of the model's size the shares had credited the
    whole allowance to the hot tier, and a decode-on-every-use plan faulted in zeroed pages for every expert.)"""
    from pyzipmoe.runtime.budget import model_memory

    ref_reports, ref = logits(arch, "bf16")
    need = model_memory(zipmoe_models[arch, "huff"])
    budget = need.minimum + need.expert_bytes
    runs = [{"config": CONFIGS[1], "zipmoe": {"memory_budget": str(budget), "plan": "0:0,2,0;1:0,2,0"}}]
    reports, got = run_worker(zipmoe_models[arch, "huff"], ours, runs, tmp_path / "plan.npz")
    _no_error(reports[0])
    assert_bit_identical(got["run0"], ref["run1"], f"{arch} {runs[0]}")
    stats = reports[0]["stats"]
    assert stats["evictions"] > 0 and 0 < stats["pool_bytes"] <= need.in_flight_bytes, stats
    assert stats["peak_resident_bytes"] <= budget - need.other_bytes, stats


@pytest.fixture(scope="module")
def small_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The "small" synthetic preset (48 MiB of experts, compressed regions of ~170 KB: the tiny preset's 3 KiB ones
    take their O_DIRECT blocks more than their bytes), BF16 and zipmoe."""
    from pyzipmoe.file import convert
    from pyzipmoe import synth

    d = tmp_path_factory.mktemp("small")
    bf16, packed = d / "small.gguf", d / "small.zipmoe.gguf"
    synth.write_config(bf16, synth.PRESETS["small"])
    convert.convert(bf16, packed, threads=2)
    return bf16, packed


def test_a_planned_budget_holds_a_prompt_s_read_buffers(ours: Path, small_models: tuple[Path, Path],
                                                         tmp_path: Path) -> None:
    """A plan's slots leave a prompt's read buffers room in the budget, as the glue's shares do (planner.plan_tiers):
    a prompt in one batch routes to every expert, stages the compressed bytes of the decoding store's cold experts
    and reads the next store's ahead, and the tiers, the experts in flight and what the buffers grew by fit the
    budget less the weights that are not experts together. The plan is pyzipmoe.Llama's decoded-only split as its
    monitor applies it; the buffers keep 64 KiB each between uses, so that the prompt's reads show. Before
    plan_tiers the plan took all of the tiers and the buffers came on top."""
    from pyzipmoe.plan import solver as planner
    from pyzipmoe.runtime.budget import model_memory
    from pyzipmoe.runtime.controller import plan_model

    bf16, path = small_models
    need = model_memory(path)
    budget = need.minimum + need.expert_bytes // 2
    tiers = budget - need.minimum
    plan = planner.plan_tiers(plan_model(path, budget).model, tiers, (1.0, 0.0, 0.0))
    assert all(lp.cold for lp in plan.layers) and 0 < plan.read_bytes < tiers // 2, plan  # (not the room's cap)
    runs = [{"config": CONFIGS[1], "zipmoe": {"memory_budget": str(budget), "plan": plan.encode()}}]
    reports, got = run_worker(path, ours, runs, tmp_path / "reads.npz", n_gen=0, env={"ZIPMOE_READ_BUFFER": "64KiB"})
    _no_error(reports[0])
    _, ref = run_worker(bf16, ours, [{"config": CONFIGS[1]}], tmp_path / "ref.npz", n_gen=0)
    assert_bit_identical(got["run0"], ref["run0"], f"small {runs[0]}")
    stats = reports[0]["stats"]
    assert stats["staging_transient_bytes"] > 0, stats
    held = stats["peak_resident_bytes"] + stats["staging_transient_bytes"]
    assert held <= budget - need.other_bytes, (plan.read_bytes, {k: stats[k] for k in (
        "peak_resident_bytes", "staging_bytes", "staging_transient_bytes", "pool_bytes")})


def test_a_plan_that_takes_all_of_the_tiers_reads_a_prompt_through_rings(ours: Path, small_models: tuple[Path, Path],
                                                                          tmp_path: Path) -> None:
    """A ZIPMOE_PLAN whose slots take all of the budget's tiers (one a user wrote, or `zipmoe plan`'s without the
    room) leaves a prompt's read buffers what its slots leave (zipmoe_cache_rules_bytes): they read through rings of
    what they keep, and the tiers, the experts in flight and the buffers still fit the budget. Before, the buffers
    took a store's cold experts at once, beside the budget."""
    from pyzipmoe.runtime.budget import model_memory
    from pyzipmoe.runtime.controller import plan_model

    bf16, path = small_models
    need = model_memory(path)
    budget = need.minimum + need.expert_bytes // 2
    tiers = budget - need.minimum
    layers = plan_model(path, budget).plan.layers
    slot = max(lp.nbytes // lp.hot for lp in layers if lp.hot)  # one expert of a layer decoded: its tensors
    hot = tiers // (len(layers) * slot)
    plan = ";".join(f"{lp.layer}:{hot},0,0" for lp in layers)
    runs = [{"config": CONFIGS[1], "zipmoe": {"memory_budget": str(budget), "plan": plan}}]
    reports, got = run_worker(path, ours, runs, tmp_path / "rings.npz", n_gen=0, env={"ZIPMOE_READ_BUFFER": "64KiB"})
    _no_error(reports[0])
    _, ref = run_worker(bf16, ours, [{"config": CONFIGS[1]}], tmp_path / "ref.npz", n_gen=0)
    assert_bit_identical(got["run0"], ref["run0"], f"small {runs[0]}")
    stats = reports[0]["stats"]
    held = stats["peak_resident_bytes"] + stats["staging_transient_bytes"]
    assert held <= budget - need.other_bytes, (hot, tiers - hot * slot * len(layers), {k: stats[k] for k in (
        "peak_resident_bytes", "staging_bytes", "staging_transient_bytes", "pool_bytes")})


@pytest.mark.parametrize("arch", ARCHS)
def test_a_budget_below_the_minimum_is_refused_saying_the_minimum(arch: str, zipmoe_models: dict[tuple[str, str], Path],
                                                                 ours: Path, tmp_path: Path) -> None:
    """Python refuses it before loading, and bare libllama (the environment variable) refuses it at load."""
    from pyzipmoe.runtime.budget import model_memory

    path = zipmoe_models[arch, "huff"]
    need = model_memory(path)
    small = need.minimum - 1
    reports, _ = run_worker(path, ours, [{"config": CONFIGS[0], "zipmoe": {"memory_budget": str(small)}}],
                            tmp_path / "small.npz")
    assert "is below the minimum of" in reports[0]["load_error"]["message"], reports[0]
    simple = ours / "llama-simple"
    if simple.exists():
        env = {**os.environ, "ZIPMOE_MEMORY_BUDGET": str(small)}
        out = subprocess.run([str(simple), "-m", str(path), "-n", "1", "hi"], env=env, capture_output=True, text=True,
                             timeout=120, check=False)
        assert out.returncode != 0
        # (a byte short reads as the minimum rounded: both are said in bytes, zipmoe_budget_check)
        assert f"memory budget {small} ({small} bytes) is below the minimum of {need.minimum} bytes" in out.stderr, \
            out.stderr[-2000:]


RSS_CHILD = """
import json, re, sys
from pyzipmoe import Llama
job = json.loads(sys.argv[1])
def anon():
    return int(re.search(r"RssAnon:\\s+(\\d+) kB", open("/proc/self/status").read())[1]) << 10
llm = Llama(job["model"], n_ctx=512, n_threads=2, verbose=False, memory_budget=job["budget"], hot_share=0.0)
llm("once", max_tokens=16, temperature=0)
before, stats0 = anon(), llm.zipmoe_stats()
for i in range(4):
    llm(f"story {i}: the expert", max_tokens=48, temperature=0)
after, stats1 = anon(), llm.zipmoe_stats()
print(json.dumps({"before": before, "after": after, "misses": stats1["misses"] - stats0["misses"],
                  "warm": stats1["warm_bytes"]}))
"""


def test_compressed_tiers_give_back_what_they_evict(ours: Path, tmp_path: Path) -> None:
    """A warm tier that keeps evicting and admitting regions (a hundred KiB each) holds the process's anonymous
    memory where it was: what a tier gives up goes back to the system. Their blocks from malloc stayed in glibc's
    heaps and the process grew past its budget (~400 MB at 75% of the 2.8g model)."""
    from dataclasses import replace

    from pyzipmoe.file import convert
    from pyzipmoe import synth
    from pyzipmoe.runtime.budget import model_memory

    src, packed = tmp_path / "small.gguf", tmp_path / "small.zipmoe.gguf"
    synth.write_config(src, replace(synth.PRESETS["small"], n_layer=2))
    convert.convert(src, packed, threads=2)
    need = model_memory(packed)
    budget = need.minimum + need.expert_bytes // 3  # compressed, about half of the experts
    done = subprocess.run([sys.executable, "-c", RSS_CHILD, json.dumps({"model": str(packed), "budget": budget})],
                          env=worker_env(ours), capture_output=True, text=True, timeout=TIMEOUT, check=False)
    assert done.returncode == 0, stderr_tail(done.stderr)
    got = json.loads(done.stdout.strip().splitlines()[-1])
    from pyzipmoe._native import ffi, lib
    from pyzipmoe.runtime.cache_control import store_sizes

    sizes = store_sizes(packed)
    split = ffi.new("zipmoe_budget_split *")  # the warm tier the loader gives (beside a prompt's read room)
    assert lib.zipmoe_budget_split_tiers(ffi.new("zipmoe_store_size[]", [
        {"bf16_bytes": b, "n_expert": n, "compressed_bytes": c} for b, n, c in sizes]), len(sizes),
        budget - need.minimum, 0.0, 0.0, split) == 0
    assert got["misses"] > 200 and got["warm"] > split.warm * 9 // 10 > need.expert_bytes // 6, got  # full, churned
    assert got["after"] - got["before"] < 4 << 20, got  # 1.1 MiB here (the context's own), 5.4 from malloc


@pytest.mark.parametrize("tied", [False, True], ids=["own output", "tied output"])
def test_a_token_embedding_read_by_rows_is_charged_for_a_batch_of_rows(tied: bool, ours: Path, tmp_path: Path) -> None:
    """With an output matrix of its own, the mapped token_embd is read a row per token: the budget charges the pages
    of a batch of rows, not the table. Tied to the output it is read whole, and charged whole. Python and libllama
    agree to the byte: the minimum loads and generates what the BF16 model does, a byte less is refused."""
    import mmap
    from dataclasses import replace

    from pyzipmoe.file import convert
    from pyzipmoe import synth
    from pyzipmoe._native import lib
    from pyzipmoe.runtime.budget import model_memory
    from pyzipmoe.runtime.config import RUNTIME_ENV

    simple = _program(ours, "llama-simple")
    src, packed = tmp_path / "wide.gguf", tmp_path / "wide.zipmoe.gguf"
    synth.write_config(src, replace(synth.PRESETS["tiny"], n_vocab=16384, n_embd=1024, tied_output=tied))
    convert.convert(src, packed, threads=2)
    need, table = model_memory(packed), 16384 * 1024 * 2
    by_rows = not tied and mmap.PAGESIZE == 4096  # 2048 rows of 2 KiB on 2 pages each: 16 of 32 MiB
    if tied:
        assert (need.embd_bytes, need.embd_charged, need.embd_note) == (0, 0, "")
    else:
        assert need.embd_bytes == table and need.embd_charged == lib.zipmoe_budget_embd_charge(table, 2048, mmap.PAGESIZE)
        assert ("token_embd: the rows of a batch, 16.0 MiB of 32.0 MiB" in need.embd_note) == by_rows
    assert model_memory(packed, mapped=False).other_bytes == need.other_bytes - need.embd_charged + need.embd_bytes

    def generate(model: Path, budget: int | None) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k not in RUNTIME_ENV}
        if budget is not None:
            env["ZIPMOE_MEMORY_BUDGET"] = str(budget)
        return subprocess.run([str(simple), "-m", str(model), "-n", "6", "the expert"], env=env, capture_output=True,
                              text=True, timeout=TIMEOUT, check=False)

    reference, fits, short = generate(src, None), generate(packed, need.minimum), generate(packed, need.minimum - 1)
    assert reference.returncode == 0, reference.stderr[-2000:]
    assert fits.returncode == 0, fits.stderr[-2000:]
    assert fits.stdout == reference.stdout
    assert ("(token_embd: the rows of a batch" in fits.stderr) == by_rows, fits.stderr[-2000:]
    assert short.returncode != 0 and "is below the minimum of" in short.stderr, short.stderr[-2000:]


def assert_same_as_stock(ours: tuple[list[dict[str, Any]], dict], model: Path, stock: Path, out: Path,
                         what: str) -> None:
    """`ours` (every CONFIGS run of `model` in zipmoe's build) has the stock build's logits and tokens."""
    reports, got = ours
    stock_reports, stock_got = run_worker(model, stock, [{"config": c} for c in CONFIGS], out)
    for i, cfg in enumerate(CONFIGS):
        _no_error(stock_reports[i])
        assert_bit_identical(got[f"run{i}"], stock_got[f"run{i}"], f"{what} {cfg}: zipmoe build vs stock build")
        assert reports[i]["generated"] == stock_reports[i]["generated"]


@pytest.mark.parametrize("arch", ARCHS)
def test_plain_gguf_same_logits_as_stock_build(logits: Callable, stock: Path, arch: str, tiny_models: dict[str, Path],
                                               tmp_path: Path) -> None:
    assert_same_as_stock(logits(arch, "bf16"), tiny_models[arch], stock, tmp_path / "stock.npz", arch)


# ----------------------------------------------------------------- plain GGUFs of every type under a budget

TYPES = ("BF16", "F16", "Q8_0", "Q6_K", "Q4_K_M", "IQ4_XS")  # the BF16 model and llama-quantize's (typed_models)
MIB = 1 << 20


@pytest.fixture(scope="session")
def typed_logits(ours: Path, typed_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
                 ) -> Callable[[str], tuple[list[dict[str, Any]], dict]]:
    """typed_logits(qtype) -> every CONFIGS run of that plain GGUF without a budget (computed once): stock
    llama.cpp's code, nothing of zipmoe's runs for it."""
    cache: dict[str, tuple[list[dict[str, Any]], dict]] = {}
    out_dir = tmp_path_factory.mktemp("typed-logits")

    def get(qtype: str) -> tuple[list[dict[str, Any]], dict]:
        if qtype not in cache:
            cache[qtype] = run_worker(typed_models[qtype], ours, [{"config": c} for c in CONFIGS],
                                      out_dir / f"{qtype}.npz")
        return cache[qtype]

    return get


@pytest.mark.parametrize("qtype", TYPES)
def test_plain_gguf_of_every_type_same_logits_as_stock_build(typed_logits: Callable, stock: Path, qtype: str,
                                                              typed_models: dict[str, Path], tmp_path: Path) -> None:
    """Without a budget a plain GGUF of any type runs as in stock llama.cpp: the same logits, bit for bit, in every
    configuration (threads, mmap, batches)."""
    assert_same_as_stock(typed_logits(qtype), typed_models[qtype], stock, tmp_path / "stock.npz", qtype)


def _expert_tensors(model: Path) -> list[Any]:
    from pyzipmoe.file.gguf import read_gguf
    from pyzipmoe.file.metadata import EXPERT_NAME

    return [t for t in read_gguf(model).tensors if EXPERT_NAME.fullmatch(t.name)]


@pytest.mark.parametrize("qtype", TYPES)
def test_plain_gguf_of_every_type_under_tiny_budgets_gives_the_same_logits(typed_logits: Callable, ours: Path,
                                                                           typed_models: dict[str, Path], qtype: str,
                                                                           tmp_path: Path) -> None:
    """A plain GGUF (no conversion) of each type under budgets that keep a third of its experts, or about one a
    store: its experts are read from the file as stored, kept and evicted by each policy, with 1 and 2 threads, a
    token per batch and the whole prompt in one, mapped and not. Logits and text stay bit-identical to the same file
    without a budget, which runs stock llama.cpp's code; the budget holds (nothing kept beyond it, nothing kept
    compressed: a raw expert's copy would be the same bytes, so shares do not apply)."""
    from pyzipmoe.runtime.budget import model_memory

    model = typed_models[qtype]
    ref_reports, ref = typed_logits(qtype)
    for r in ref_reports:
        _no_error(r)
        assert r["served"] is False  # without a budget zipmoe serves nothing
    need = model_memory(model)
    tensors = _expert_tensors(model)
    expert = max(t.nbytes // t.dims[2] for t in tensors)
    n_experts = sum(t.dims[2] for t in tensors)
    picks = [i for i, c in enumerate(CONFIGS) if c["use_mmap"]]  # threads 1/2 x batch 1/64
    runs, where = [], []
    for policy in ("tlfu", "lru", "lfu", "fifo"):
        for i in picks:
            runs.append({"config": CONFIGS[i], "zipmoe": {"memory_budget": str(need.minimum + n_experts // 3 * expert),
                                                          "cache_policy": policy}})
            where.append(i)
    for i in (*picks, CONFIGS.index({**CONFIGS[0], "use_mmap": False})):
        runs.append({"config": CONFIGS[i], "zipmoe": {"memory_budget": str(need.minimum + 2 * expert)}})
        where.append(i)
    runs.append({"config": CONFIGS[0], "zipmoe": {"memory_budget": str(need.minimum + 8 * expert), "hot_share": 0.3,
                                                  "prefill": True}})
    where.append(0)
    reports, got = run_worker(model, ours, runs, tmp_path / "budgets.npz")
    for k, (run, what, stats) in enumerate(_matching_runs(runs, where, reports, got, ref_reports, ref, qtype)):
        assert reports[k]["served"] is True, what
        assert stats["stores"] == len(tensors), (what, stats)
        assert stats["misses"] > 0 and stats["bytes_read"] > 0, (what, stats)  # read from the file, as stored
        assert stats["warm_bytes"] == 0 and stats["hits_warm"] == 0 and stats["sm_bytes"] == 0, (what, stats)
        budget = int(run["zipmoe"]["memory_budget"])
        assert stats["peak_hot_bytes"] <= budget - need.other_bytes, (what, stats, need)
        if "prefill" not in run["zipmoe"]:
            assert stats["evictions"] > 0, (what, stats)  # the budget held fewer experts than were used


def test_a_mixed_type_gguf_is_budgeted_at_each_tensor_s_own_size(ours: Path, typed_models: dict[str, Path],
                                                                 tmp_path: Path) -> None:
    """Q4_K_M keeps some ffn_down_exps in Q6_K: pyzipmoe's accounting and the runtime's count each expert tensor at
    its own size. The smallest budget that works is the same for both (the runtime, given it bare through the
    environment, refuses a byte less, saying it; pyzipmoe refuses it before loading), and at it the model runs."""
    from pyzipmoe.runtime.budget import model_memory

    model = typed_models["Q4_K_M"]
    tensors = _expert_tensors(model)
    assert len({t.ggml_type for t in tensors}) > 1, [(t.name, t.ggml_type) for t in tensors]
    need = model_memory(model)
    assert need.in_flight_bytes == max(t.nbytes for t in tensors)
    assert need.expert_bytes == sum(t.nbytes for t in tensors)
    cases = [need.minimum - 1, need.minimum]
    reports = [run_worker(model, ours, [{"config": CONFIGS[0]}], tmp_path / f"min{k}.npz",
                          env={"ZIPMOE_MEMORY_BUDGET": str(b)})[0][0] for k, b in enumerate(cases)]
    assert f"is below the minimum of {need.minimum} bytes" in reports[0]["load_error"]["message"], (reports[0], need)
    _no_error(reports[1])
    refused, _ = run_worker(model, ours, [{"config": CONFIGS[0], "zipmoe": {"memory_budget": str(need.minimum - 1)}}],
                            tmp_path / "py.npz")
    assert refused[0]["load_error"]["type"] == "ZipmoeError"
    assert "is below the minimum of" in refused[0]["load_error"]["message"], refused[0]


ZIPMOE_TYPES = ("F16", "Q8_0", "Q6_K", "Q4_K_M", "IQ4_XS")  # converted from typed_models: F16 split, the rest raw


@pytest.mark.parametrize("qtype", ZIPMOE_TYPES)
def test_zipmoe_gguf_of_every_type_gives_the_source_s_logits(typed_logits: Callable, ours: Path,
                                                            typed_models: dict[str, Path], qtype: str,
                                                            tmp_path: Path) -> None:
    """A zipmoe GGUF (zipmoe.version 2) converted from a plain GGUF of each type: without a budget, and under budgets
    that keep a third of its experts or about one a store, with each policy, 1 and 2 threads, a token per batch and
    the whole prompt in one, its logits and text are bit-identical to the source file's without a budget (stock
    llama.cpp's code). Its experts are decoded from the file (F16 through the BF16 split, the others' checked raw
    chunks); a raw expert is kept only decoded (its compressed copy would be the same bytes)."""
    from pyzipmoe.file import convert
    from pyzipmoe.runtime.budget import model_memory

    src = typed_models[qtype]
    packed = tmp_path / f"{qtype}.zipmoe.gguf"
    convert.convert(src, packed, chunk_n=4096, threads=2)  # (several chunks an expert)
    assert open_zipmoe(packed).meta.version == 2
    ref_reports, ref = typed_logits(qtype)
    need = model_memory(packed)
    tensors = _expert_tensors(src)
    expert = max(t.nbytes // t.dims[2] for t in tensors)
    n_experts = sum(t.dims[2] for t in tensors)
    raw = qtype != "F16"
    runs: list[dict[str, Any]] = [{"config": c, "zipmoe": {}} for c in CONFIGS]
    where = list(range(len(CONFIGS)))
    picks = [i for i, c in enumerate(CONFIGS) if c["use_mmap"]]  # threads 1/2 x batch 1/64
    for policy in ("tlfu", "lru", "lfu", "fifo"):
        for i in picks:
            runs.append({"config": CONFIGS[i], "zipmoe": {"memory_budget": str(need.minimum + n_experts // 3 * expert),
                                                          "cache_policy": policy}})
            where.append(i)
    for i in picks:
        runs.append({"config": CONFIGS[i], "zipmoe": {"memory_budget": str(need.minimum + 2 * expert)}})
        where.append(i)
    reports, got = run_worker(packed, ours, runs, tmp_path / "zipmoe.npz")
    # decoded at load (prefill), and a generated token's next layer guessed and read ahead (ZIPMOE_PREDICT)
    more = [{"config": CONFIGS[0], "zipmoe": {"memory_budget": str(need.minimum + 8 * expert), "prefill": True}},
            *({"config": CONFIGS[i], "zipmoe": {"memory_budget": str(need.minimum + 2 * expert)}} for i in picks)]
    more_reports, more_got = run_worker(packed, ours, more, tmp_path / "more.npz", env={"ZIPMOE_PREDICT": "1"})
    for k, (run, i) in enumerate(zip(more, [0, *picks], strict=True)):
        _no_error(more_reports[k])
        assert_bit_identical(more_got[f"run{k}"], ref[f"run{i}"], f"{qtype} {run['zipmoe']} {CONFIGS[i]} predict")
        assert more_reports[k]["generated"] == ref_reports[i]["generated"]
    for k, (run, what, stats) in enumerate(_matching_runs(runs, where, reports, got, ref_reports, ref, qtype)):
        assert reports[k]["served"] is True, what
        assert stats["stores"] == len(tensors), (what, stats)
        assert stats["misses"] > 0 and stats["chunks_decoded"] > 0 and stats["bytes_read"] > 0, (what, stats)
        if raw:
            assert stats["warm_bytes"] == 0 and stats["hits_warm"] == 0 and stats["sm_bytes"] == 0, (what, stats)
        if "memory_budget" in run["zipmoe"]:
            assert stats["evictions"] > 0, (what, stats)  # the budget held fewer experts than were used
            assert stats["peak_hot_bytes"] <= int(run["zipmoe"]["memory_budget"]) - need.other_bytes, (what, stats)


def test_what_a_plain_gguf_cannot_do_under_a_budget_is_refused(ours: Path, typed_models: dict[str, Path],
                                                               tmp_path: Path) -> None:
    """Adaptation (re-planning while running) needs a zipmoe GGUF, and a trace is what the planner plans from:
    asked for with a plain one under a budget (adaptation; a trace with the planner off), they are refused with a
    message, never ignored. (The planner itself plans a plain GGUF: tests/system/test_plan_plain.py.)"""
    runs = [{"config": CONFIGS[0], "zipmoe": {"memory_budget": "64MiB", **extra}}
            for extra in ({"adapt": True}, {"trace": str(tmp_path / "counts.npz"), "planner": False})]
    reports, _ = run_worker(typed_models["Q8_0"], ours, runs, tmp_path / "refused.npz")
    for r, says in zip(reports, ("plain GGUF", "planner=False"), strict=True):
        assert r["load_error"]["type"] == "UnsupportedError" and says in r["load_error"]["message"], r


# ------------------------------------------------------------------------------ damaged and foreign files


def _damage_expert(path: Path, tensor: str, expert: int, flip_bit: Callable[[Path, int], None]) -> None:
    """Flips a bit in the exponent code of the expert's first chunk."""
    c = open_zipmoe(path).compressed_by_name[tensor]
    span = c.expert.span(expert)
    flip_bit(path, c.region_file_offset(expert) + span.exp_offset + 5)


@pytest.mark.parametrize("arch", ARCHS)
def test_damaged_expert_is_an_error_when_used(ours: Path, arch: str, zipmoe_models: dict[tuple[str, str], Path],
                                              copy_of: Callable[[Path], Path], flip_bit: Callable[[Path, int], None],
                                              tmp_path: Path) -> None:
    damaged = copy_of(zipmoe_models[arch, "huff"])
    tensor, expert = "blk.1.ffn_down_exps.weight", 3
    _damage_expert(damaged, tensor, expert, flip_bit)
    # the whole prompt in one batch routes to every expert of every layer; try twice: a damaged expert must
    # stay an error, never become a resident expert with wrong weights. Token by token (CONFIGS[4]) the op that
    # also computes the matmul meets it, on 2 threads, and must fail the same way.
    runs = [{"config": CONFIGS[1], "attempts": 2}, {"config": CONFIGS[1], "attempts": 2, "cache": "none"},
            {"config": CONFIGS[4], "attempts": 2}]
    reports, arrays = run_worker(damaged, ours, runs, tmp_path / "damaged.npz")
    assert not arrays, "logits came out of a model with a damaged expert"
    for report in reports:
        assert "load_error" not in report, f"a damaged expert must not stop the load: {report}"
        errors = report.get("errors", [])
        assert len(errors) == 2, report
        for e in errors:
            assert e["type"] == "ZipmoeDecodeError" and "RuntimeError" in e["mro"], e
            assert tensor.removesuffix(".weight") in e["message"] and f"expert {expert}" in e["message"], e
            assert "llama_decode returned" in e["message"], e
        assert report["stats"]["stores"] == 6


@pytest.mark.parametrize("arch", ARCHS)
def test_truncated_zipmoe_is_refused_at_load(ours: Path, arch: str, zipmoe_models: dict[tuple[str, str], Path],
                                             tmp_path: Path) -> None:
    src = zipmoe_models[arch, "huff"]
    last_data = [c.data for c in open_zipmoe(src).compressed][-1]
    truncated = tmp_path / "truncated.zipmoe.gguf"
    truncated.write_bytes(src.read_bytes()[: last_data.file_offset + last_data.nbytes // 2])
    reports, arrays = run_worker(truncated, ours, [{"config": CONFIGS[0]}], tmp_path / "t.npz")
    err = reports[0].get("load_error")
    assert err and "ValueError" in err["mro"] and not arrays, reports
    assert str(truncated) in err["message"] and "truncated" in err["message"], err
    done = subprocess.run([str(_program(ours, "llama-simple")), "-m", str(truncated), "-n", "4", "hello"],
                          env=worker_env(ours), capture_output=True, text=True, timeout=TIMEOUT, check=False)
    assert done.returncode == 1, (done.returncode, stderr_tail(done.stderr))  # an error exit, not a signal
    assert "unable to load model" in done.stderr, stderr_tail(done.stderr)


def test_stock_build_refuses_zipmoe_gguf(stock: Path, zipmoe_model: Path, tmp_path: Path) -> None:
    done = subprocess.run([str(stock / "llama-simple"), "-m", str(zipmoe_model), "-n", "4", "hello"],
                          env=worker_env(stock), capture_output=True, text=True, timeout=TIMEOUT, check=False)
    assert done.returncode == 1, (done.returncode, stderr_tail(done.stderr))
    # this llama.cpp says "check_tensor_dims: tensor '...' not found"; older ones said "missing tensor '...'"
    assert "tensor 'blk.0.ffn_" in done.stderr and ("not found" in done.stderr or "missing tensor" in done.stderr), \
        stderr_tail(done.stderr)
    if find_spec("llama_cpp") is None:
        return
    reports, _ = run_worker(zipmoe_model, stock, [{"config": CONFIGS[0]}], tmp_path / "s.npz")
    err = reports[0]["load_error"]
    assert err["type"] == "UnsupportedError" and "not built with zipmoe" in err["message"], err


GRAPH_LINES = re.compile(r"(graph\w*: nodes = .*|\w+ (?:model|compute) buffer size = .*)")


@pytest.mark.parametrize("qtype", ["BF16", "Q4_K_M"])
def test_plain_gguf_without_a_budget_builds_stock_s_graph(ours: Path, stock: Path, qtype: str,
                                                          typed_models: dict[str, Path]) -> None:
    """Without a budget a plain GGUF takes none of zipmoe's paths: llama.cpp reports the same graph (nodes,
    splits) and the same buffers (the model's, CPU_REPACK's, the compute buffers) in both builds."""
    def shape(bin_dir: Path) -> list[str]:
        env = worker_env(bin_dir)
        env.pop("ZIPMOE_MEMORY_BUDGET", None)
        done = _run([_program(bin_dir, "llama-simple"), "-m", typed_models[qtype], "-n", "2", PROMPT], env)
        return [m.group(1).strip() for m in GRAPH_LINES.finditer(done.stderr)]

    got = shape(ours)
    assert any("nodes = " in line for line in got), got
    assert got == shape(stock)


# --------------------------------------------------------------------------------- llama.cpp programs


def _run(argv: list[str | Path], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(a) for a in argv], env=env, capture_output=True, text=True, timeout=TIMEOUT,
                          errors="surrogateescape",
                          stdin=subprocess.DEVNULL, check=False)
    assert done.returncode == 0, f"{argv[0]} exited with {done.returncode}:\n{stderr_tail(done.stderr)}"
    return done


@pytest.mark.parametrize("arch", ARCHS)
def test_llama_simple_same_greedy_output(ours: Path, arch: str, tiny_models: dict[str, Path],
                                         zipmoe_models: dict[tuple[str, str], Path]) -> None:
    outputs = {v: _run([_program(ours, "llama-simple"), "-m", m, "-n", "24", PROMPT], worker_env(ours)).stdout
               for v, m in _models(arch, tiny_models, zipmoe_models).items()}
    assert len(outputs["bf16"]) > len(PROMPT) + 8, outputs
    assert outputs["huff"] == outputs["bf16"] and outputs["zstd"] == outputs["bf16"], outputs


@pytest.mark.parametrize("qtype", ["Q4_K_M", "BF16"])
def test_bare_llama_cpp_serves_a_plain_gguf_under_zipmoe_memory_budget(ours: Path, typed_models: dict[str, Path],
                                                                       qtype: str) -> None:
    """A bare llama.cpp program (llama-simple) takes the budget from ZIPMOE_MEMORY_BUDGET for a plain GGUF: its
    experts come from the cache, the greedy text is the same; without the variable nothing of zipmoe runs."""
    from pyzipmoe.runtime.budget import model_memory

    model = typed_models[qtype]
    env = worker_env(ours)
    env.pop("ZIPMOE_MEMORY_BUDGET", None)
    plain = _run([_program(ours, "llama-simple"), "-m", model, "-n", "24", PROMPT], env)
    budget = str(model_memory(model).minimum + (128 << 10))
    served = _run([_program(ours, "llama-simple"), "-m", model, "-n", "24", PROMPT],
                  {**env, "ZIPMOE_MEMORY_BUDGET": budget})
    assert "zipmoe: " not in plain.stderr, plain.stderr[-2000:]  # (the synthetic model's name has "zipmoe")
    assert "6 expert tensors are served from the cache as stored" in served.stderr, served.stderr[-2000:]
    assert len(plain.stdout) > len(PROMPT) + 8 and served.stdout == plain.stdout


def test_timing_times_the_models_greedy_text(ours: Path, zipmoe_model: Path, tmp_path: Path) -> None:
    """pyzipmoe.runtime.timing (engine calibration, tools/bench/bench_planner.py) generates the model's greedy
    text, the tokens the logits_all worker generates. It once took argmax of llama-cpp-python's `scores`, which
    stay zero without logits_all: token 0 forever, a text whose experts repeat, and costs and plans measured on
    it."""
    from pyzipmoe.runtime.timing import PROMPT as TIMING_PROMPT
    from pyzipmoe.runtime.timing import time_generation

    reports, _ = run_worker(zipmoe_model, ours, [{"config": {"n_threads": 1}}], tmp_path / "ref.npz",
                            prompt=TIMING_PROMPT.decode())
    _no_error(reports[0])
    timed = time_generation(zipmoe_model, warmup=2, gen=N_GEN - 2, threads=1)
    assert timed["tokens"] == reports[0]["generated"]
    assert len(set(timed["tokens"])) > 1, timed["tokens"]  # the tiny model's text is not one token repeated


def _chat_reply(stdout: str) -> str:
    """llama-cli -st --simple-io prints a banner, '> PROMPT', the reply, then '[ Prompt: ... t/s ]'."""
    start = stdout.index(f"> {PROMPT}\n") + len(PROMPT) + 3
    return stdout[start:stdout.index("\n[ Prompt:", start)]


@pytest.mark.parametrize("arch", ARCHS)
def test_llama_cli_same_greedy_output(ours: Path, arch: str, tiny_models: dict[str, Path],
                                      zipmoe_models: dict[tuple[str, str], Path]) -> None:
    replies = {}
    for v, m in _models(arch, tiny_models, zipmoe_models).items():
        done = _run([_program(ours, "llama-cli"), "-m", m, "-p", PROMPT, "-n", "16", "-st", "--simple-io", "--temp",
                     "0", "-t", "2", "-c", str(N_CTX)], worker_env(ours))
        replies[v] = _chat_reply(done.stdout)
    assert replies["bf16"].strip(), replies
    assert replies["huff"] == replies["bf16"] and replies["zstd"] == replies["bf16"], replies


def _completion(ours: Path, model: Path) -> tuple[str, bool]:
    """llama-completion's output, and whether it is complete: this llama.cpp never flushes its logger at exit
    (the program prints through it), so the tail of stdout can be lost; the perf report that comes last on
    stderr, through the same queue, shows that everything before it was written."""
    done = _run([_program(ours, "llama-completion"), "-m", model, "-p", PROMPT, "-n", "16", "-no-cnv", "--simple-io",
                 "--temp", "0", "-t", "2", "-c", str(N_CTX), "-s", "0"], worker_env(ours))
    return done.stdout, "total time" in done.stderr


@pytest.mark.parametrize("arch", ARCHS)
def test_llama_completion_same_greedy_output(ours: Path, arch: str, tiny_models: dict[str, Path],
                                             zipmoe_models: dict[tuple[str, str], Path]) -> None:
    """llama-completion prints through a logger that this llama.cpp neither flushes at exit nor keeps intact
    under load (seen: lost tails, a doubled character in the echoed prompt). Those glitches are random, a real
    difference is not: the same greedy text from every model in one round of complete runs passes; a
    difference that persists through 10 rounds fails."""
    models = _models(arch, tiny_models, zipmoe_models)
    seen: list[dict[str, str]] = []
    for _attempt in range(10):
        complete = {}
        for v, m in models.items():
            out, ok = _completion(ours, m)
            if ok:
                complete[v] = out
        if len(complete) == len(models):
            seen.append(complete)
            if complete["huff"] == complete["bf16"] == complete["zstd"]:
                assert len(complete["bf16"]) > len(PROMPT), complete
                return
    if not seen:
        pytest.xfail("llama-completion lost its output in 10 rounds (its logger is not flushed at exit in this "
                     "llama.cpp)")
    raise AssertionError(f"llama-completion's greedy text differed in all {len(seen)} complete rounds: {seen[-1]}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]




@pytest.fixture
def server(ours: Path, tmp_path: Path) -> Iterator[Callable[[Path], str]]:
    """server(model) -> base URL of `zipmoe serve model` (llama-server) on 127.0.0.1; always killed afterwards."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(model: Path) -> str:
        _program(ours, "llama-server")
        port = _free_port()
        log = tmp_path / f"server-{port}.log"  # a file, not a pipe nobody reads: a full pipe would stall the server
        with open(log, "wb") as err:
            proc = subprocess.Popen([sys.executable, "-m", "pyzipmoe", "serve", str(model), "--port", str(port), "-t",
                                     "2", "--", "-c", str(N_CTX), "-np", "1"], env=worker_env(ours),
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        procs.append(proc)
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"llama-server exited with {proc.returncode}: "
                                     f"{stderr_tail(log.read_text(errors='replace'))}")
            try:
                if http_json(url + "/health", timeout=2)[0] == 200:
                    return url
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.1)
        raise AssertionError("llama-server was not ready within 120 s")

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()  # zipmoe serve passes SIGTERM on to llama-server
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the session: zipmoe and llama-server
        except ProcessLookupError:
            pass
        proc.wait(10)


@pytest.mark.parametrize("arch", ARCHS)
def test_llama_server_same_greedy_output(server: Callable[[Path], str], arch: str, tiny_models: dict[str, Path],
                                         zipmoe_models: dict[tuple[str, str], Path]) -> None:
    results = {}
    for v, m in _models(arch, tiny_models, zipmoe_models).items():
        url = server(m)
        status, body = http_json(url + "/completion", {"prompt": PROMPT, "n_predict": 16, "temperature": 0, "seed": 0,
                                                       "n_probs": 4, "cache_prompt": False}, TIMEOUT)
        assert status == 200, (v, status, body)
        results[v] = (body["content"], body.get("tokens"), body["completion_probabilities"])
    assert results["bf16"][0], results["bf16"]
    assert results["huff"] == results["bf16"] and results["zstd"] == results["bf16"]


# ------------------------------------------------------------------------------------------ zipmoe CLI


def test_zipmoe_run_prompt_same_output(ours: Path, tiny_models: dict[str, Path],
                                       zipmoe_models: dict[tuple[str, str], Path]) -> None:
    outs = {}
    for v, m in _models("qwen3moe", tiny_models, zipmoe_models).items():
        done = _run([sys.executable, "-m", "pyzipmoe", "run", m, "-p", PROMPT, "-n", "12", "--temp", "0", "-t", "1",
                     "--stats"], worker_env(ours))
        outs[v] = done.stdout
        if v != "bf16":
            assert "[zipmoe: 6 expert tensors" in done.stderr, done.stderr
    assert outs["bf16"].strip() and outs["huff"] == outs["bf16"] == outs["zstd"], outs


def test_zipmoe_run_plain_gguf_under_a_budget_same_output(ours: Path, typed_models: dict[str, Path]) -> None:
    """`zipmoe run` on a plain GGUF takes --memory-budget: its experts come from the cache (the stats say so), the
    text is the same as without one, planned (--planner) or not; and `zipmoe plan` plans it: hot and cold experts
    only (they are stored raw)."""
    from pyzipmoe.runtime.budget import model_memory

    model = typed_models["Q4_K_M"]
    budget = str(model_memory(model).minimum + (256 << 10))
    outs = {}
    for label, extra in (("stock", []), ("budget", ["--memory-budget", budget]),
                         ("planner", ["--memory-budget", budget, "--planner"])):
        done = _run([sys.executable, "-m", "pyzipmoe", "run", model, "-p", PROMPT, "-n", "12", "--temp", "0", "-t", "1",
                     "--stats", *extra], worker_env(ours))
        outs[label] = done.stdout
        assert ("[zipmoe: 6 expert tensors" in done.stderr) == (label != "stock"), done.stderr
    assert outs["stock"].strip() and outs["budget"] == outs["stock"] == outs["planner"], outs
    plan = subprocess.run([sys.executable, "-m", "pyzipmoe", "plan", model, "--memory-budget", budget],
                          env=worker_env(ours), capture_output=True, text=True, timeout=TIMEOUT, check=False)
    assert plan.returncode == 0, plan.stderr
    line = next(x for x in plan.stdout.splitlines() if x.startswith("ZIPMOE_PLAN="))
    slots = [entry.split(":")[1].split(",") for entry in line.split("=", 1)[1].split(";")]
    assert len(slots) == 2 and all(warm == sm == "0" for _, warm, sm in slots), line


def test_zipmoe_bench_json(ours: Path, zipmoe_models: dict[tuple[str, str], Path], tiny_models: dict[str, Path]
                           ) -> None:
    _program(ours, "llama-bench")
    done = _run([sys.executable, "-m", "pyzipmoe", "bench", tiny_models["olmoe"], zipmoe_models["olmoe", "huff"],
                 "-p", "16", "-n", "4", "-r", "1", "-t", "1", "--json"], worker_env(ours))
    results = json.loads(done.stdout)["results"]
    assert [(r["model"], r["test"]) for r in results] == [
        (str(m), t) for m in (tiny_models["olmoe"], zipmoe_models["olmoe", "huff"]) for t in ("pp16", "tg4")]
    assert all(r["tokens_per_second"] > 0 for r in results), results


def test_zipmoe_run_missing_model_is_one_line(ours: Path, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "pyzipmoe", "run", str(tmp_path / "nope.gguf"), "-p", "x"],
                          env=worker_env(ours), capture_output=True, text=True, timeout=TIMEOUT, check=False)
    assert done.returncode == 2 and done.stderr.startswith("zipmoe: error: ") and done.stderr.count("\n") == 1, \
        done.stderr


def test_import_is_cheap_and_points_llama_cpp_at_our_build(ours: Path) -> None:
    code = ("import os, sys, pyzipmoe; print(os.environ.get('LLAMA_CPP_LIB_PATH')); "
            "print('llama_cpp' in sys.modules, 'pyzipmoe._native' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_CPP_LIB_PATH"}
    lines = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                           timeout=TIMEOUT, check=True).stdout.splitlines()
    assert Path(lines[0]) == pyzipmoe.llama_lib_dir() == ours
    assert lines[1] == "False False"
    env["LLAMA_CPP_LIB_PATH"] = "/somewhere/else"
    lines = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                           timeout=TIMEOUT, check=True).stdout.splitlines()
    assert lines[0] == "/somewhere/else"  # an explicit choice is kept


def test_unknown_cache_mode_is_refused(ours: Path, tiny_models: dict[str, Path], tmp_path: Path) -> None:
    reports, _ = run_worker(tiny_models["qwen3moe"], ours, [{"config": CONFIGS[0], "cache": "lru"}],
                            tmp_path / "c.npz")
    err = reports[0]["load_error"]
    assert err["type"] == "ValueError" and "zipmoe_cache" in err["message"], err



# ------------------------------------------------------------------------------------ stored model packages


def test_stored_model_runs_and_serves_chat_like_its_bf16_source(server: Callable[[Path], str], ours: Path,
                                                                 tiny_models: dict[str, Path], tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """zipmoe create from a BF16 GGUF, then run and serve it by name: the same greedy tokens as the BF16 file,
    through `zipmoe run -p` and llama-server's OpenAI-compatible /v1/chat/completions on loopback."""
    monkeypatch.setenv("ZIPMOE_MODELS", str(tmp_path / "models"))
    modelfile = tmp_path / "Modelfile"
    # no TEMPLATE: both sides then format the chat with llama-server's default, and must agree token for token
    modelfile.write_text(f"FROM {tiny_models['qwen3moe']}\nPARAMETER temperature 0\nPARAMETER seed 0\n")
    done = _run([sys.executable, "-m", "pyzipmoe", "create", "tinymoe", "-f", modelfile], worker_env(ours))
    assert done.returncode == 0, done.stderr

    runs = {m: _run([sys.executable, "-m", "pyzipmoe", "run", m, "-p", PROMPT, "-n", "12", "--temp", "0", "-t", "1"],
                    worker_env(ours)).stdout for m in ("tinymoe", str(tiny_models["qwen3moe"]))}
    assert runs["tinymoe"].strip() and runs["tinymoe"] == runs[str(tiny_models["qwen3moe"])], runs

    replies = {}
    for model in ("tinymoe", tiny_models["qwen3moe"]):
        url = server(model)
        status, body = http_json(url + "/v1/chat/completions",
                                 {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 12, "temperature": 0,
                                  "seed": 0}, TIMEOUT)
        assert status == 200, (model, status, body)
        replies[str(model)] = body["choices"][0]["message"]["content"]
    assert replies["tinymoe"] == replies[str(tiny_models["qwen3moe"])], replies
