"""`zipmoe plan` and `zipmoe calibrate` on models whose experts are not (all) compressed BF16: plain GGUFs of the
types people run (llama-quantize's, of SYNTHETIC weights: tests/conftest.py typed_models), no conversion, and zipmoe
files converted from them (F16 through the split codec, quantized experts stored raw). Each expert tensor counts at
its own size (Q4_K_M keeps some ffn_down_exps in Q6_K), raw experts are planned hot or cold only (a cold one is read,
never decoded), and the runtime runs the plans it is given bit-exactly, its slots applied to raw stores too."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES

import helpers
from pyzipmoe.cli import main as zipmoe_main
from pyzipmoe.file import gguf as format
from pyzipmoe.file.metadata import EXPERT_NAME
from pyzipmoe.plan import inputs
from pyzipmoe.plan import solver as planner

KINDS = ("Q4_K_M", "Q8_0", "F16", "F16.zipmoe", "Q4_K_M.zipmoe")  # plain GGUFs, and two conversions
RAW = {"Q4_K_M": True, "Q8_0": True, "F16": True, "F16.zipmoe": False, "Q4_K_M.zipmoe": True}
FAST = {"read_bytes": 64 << 10, "min_seconds": 0.005, "engine": False}


@pytest.fixture(scope="module")
def models(typed_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The plain GGUFs and two zipmoe conversions (read-only)."""
    from pyzipmoe.file import convert

    root = tmp_path_factory.mktemp("plan-plain")
    out = {k: typed_models[k] for k in ("Q4_K_M", "Q8_0", "F16")}
    for kind in ("F16", "Q4_K_M"):
        out[f"{kind}.zipmoe"] = root / f"{kind}.zipmoe.gguf"
        convert.convert(typed_models[kind], out[f"{kind}.zipmoe"], threads=2)
    return out


@pytest.fixture
def no_calibration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


def own_sizes(path: Path) -> dict[int, list[tuple[str, int]]]:
    """(type name, bytes of one expert) of each expert tensor per layer, from gguf-py's block sizes (not zipmoe's)."""
    layers: dict[int, list[tuple[str, int]]] = {}
    for t in format.read_gguf(path).tensors:
        if EXPERT_NAME.fullmatch(t.name):
            qtype = GGMLQuantizationType(t.ggml_type)
            blck, size = GGML_QUANT_SIZES[qtype]
            layers.setdefault(int(t.name.split(".")[1]), []).append((qtype.name, t.dims[0] // blck * size * t.dims[1]))
    return layers


def tier_budget(model: Path, tiers: int) -> int:
    from pyzipmoe.runtime.budget import model_memory

    return model_memory(model).minimum + tiers


def plan_json(capsys: pytest.CaptureFixture[str], model: Path, budget: int, *extra: str) -> dict[str, Any]:
    code = zipmoe_main(["plan", str(model), "--memory-budget", str(budget), "--json", *extra])
    out, err = capsys.readouterr()
    assert code == 0 and err == "", err
    return json.loads(out)


# ------------------------------------------------------------------------------------------ geometry


def test_mixed_types_are_accounted_at_their_own_size(models: dict[str, Path]):
    """Q4_K_M's expert tensors are Q4_K and Q6_K: 256-value rows of 144 and 210 bytes, 256 rows an expert (the
    test models' shape). The planner's decoded expert of a layer is the sum of its tensors' own sizes, and as stored
    (what a cold expert reads) the same bytes, plain or converted; the F16 conversion alone has compressed tiers."""
    sizes = own_sizes(models["Q4_K_M"])
    types = {name for layer in sizes.values() for name, _ in layer}
    assert types == {"Q4_K", "Q6_K"}, sizes  # mixed in one file
    assert {size for layer in sizes.values() for _, size in layer} == {256 * 144, 256 * 210}
    want = tuple(sum(size for _, size in sizes[i]) for i in sorted(sizes))
    assert len(set(want)) > 1  # the layers differ: each counts its own Q6_K tensors
    for kind in ("Q4_K_M", "Q4_K_M.zipmoe"):
        g = inputs.geometry_from_gguf(models[kind])
        assert g.hot_bytes == g.warm_bytes == want and g.sm_bytes == (0,) * len(want), kind
        assert g.tiered == (False,) * len(want), kind
    values = 3 * 256 * 256  # gate, up, down
    plain, packed = (inputs.geometry_from_gguf(models[k]) for k in ("F16", "F16.zipmoe"))
    assert plain.hot_bytes == packed.hot_bytes == (2 * values,) * 2
    assert plain.tiered == (False, False) and plain.sm_bytes == (0, 0)
    assert packed.tiered == (True, True) and packed.sm_bytes == (values,) * 2
    assert all(values < w < 2 * values for w in packed.warm_bytes)  # compressed


def test_a_plan_of_mixed_types_buys_each_layer_s_slots_at_its_size(models: dict[str, Path], no_calibration: Path):
    """Uniform routing (2 of 8 experts a token), the conservative costs (0.5 GB/s + 0.1 ms a read, no decode): a hot
    slot saves a quarter of a cold read, which takes longer the larger the layer's expert. Room for one expert of
    either layer keeps the larger one; for one of each, one of each; for two of the smaller but not one of each, two
    of the smaller (two quarter reads beat one). (`slack` covers the budget's rounding into units.)"""
    model = models["Q4_K_M"]
    g = inputs.geometry_from_gguf(model)
    small, large = sorted(range(2), key=lambda i: g.hot_bytes[i])
    assert g.hot_bytes[large] < 2 * g.hot_bytes[small] < sum(g.hot_bytes)
    costs = inputs.default_costs(g)
    model_ = planner.cost_model(g, costs)
    slack = 1024
    for budget, want in ((g.hot_bytes[large], {large: 1}), (sum(g.hot_bytes), {small: 1, large: 1}),
                         (2 * g.hot_bytes[small], {small: 2})):
        plan = planner.plan_for_budget(model_, budget + slack)
        assert [lp.hot for lp in plan.layers] == [want.get(i, 0) for i in range(2)], (budget, plan)
        assert plan.nbytes == sum(lp.hot * size for lp, size in zip(plan.layers, g.hot_bytes))
        for lp, size in zip(plan.layers, g.hot_bytes):
            read = size / costs.disk_bandwidth + costs.read_latency
            assert lp.delay == pytest.approx((g.n_expert - lp.hot) / g.n_expert * g.n_expert_used * read)


def test_a_layer_mixing_split_and_raw_experts_is_planned_hot_and_cold(tmp_path: Path, no_calibration: Path):
    """A zipmoe file whose layer 1 keeps BF16, Q8_0 and F16 experts (gguf-py's writer, SYNTHETIC weights): the
    runtime keeps no compressed copy of its Q8_0 experts, so the layer is planned hot and cold, and decoding one of
    its experts costs its BF16 and F16 values' share (sm_bytes); layer 0, all BF16, keeps every tier. Calibration
    measures layer 0's tiers."""
    from gguf import GGUFWriter
    from gguf.quants import quantize

    from pyzipmoe.file import convert
    from pyzipmoe.plan import routing
    from pyzipmoe.runtime.measure import calibrate

    rng = np.random.default_rng(5)
    ne0, ne1, n = 256, 8, 4
    w = GGUFWriter(tmp_path / "mixed.gguf", "qwen3moe")
    w.add_block_count(2)
    w.add_expert_count(n)
    w.add_expert_used_count(2)
    w.add_tensor("token_embd.weight", rng.standard_normal((16, ne0)).astype(np.float32))
    types = {0: ("BF16", "BF16", "BF16"), 1: ("BF16", "Q8_0", "F16")}
    for block, kinds in types.items():
        for role, kind in zip(("up", "gate", "down"), kinds):
            weights = rng.normal(0, 0.02, (n, ne1, ne0)).astype(np.float32)
            if kind == "BF16":
                data, raw = (weights.view(np.uint32) >> 16).astype(np.uint16), GGMLQuantizationType.BF16
            elif kind == "F16":
                data, raw = weights.astype(np.float16), None
            else:
                data, raw = quantize(weights, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0
            w.add_tensor(f"blk.{block}.ffn_{role}_exps.weight", data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    packed = tmp_path / "mixed.zipmoe.gguf"
    convert.convert(tmp_path / "mixed.gguf", packed, threads=2)
    g = inputs.geometry_from_gguf(packed)
    values, q8 = ne0 * ne1, ne0 // 32 * 34 * ne1
    assert g.tiered == (True, False) and g.sm_bytes == (3 * values, 2 * values)
    assert g.hot_bytes == (6 * values, 4 * values + q8)
    costs = inputs.Costs(cores=2, t_decode=3e-3, disk_bandwidth=1e6, read_latency=1e-4, base_seconds_per_token=0.01)
    # t_decode / cores for layer 0, two thirds of it for layer 1 (2 of its 3 tensors decode)
    assert routing.tier_seconds(g, costs, 0).decode == pytest.approx(1.5e-3)
    assert routing.tier_seconds(g, costs, 1).decode == pytest.approx(1e-3)
    model = planner.cost_model(g, costs)
    for budget in range(0, g.all_hot_bytes, 997):
        lp = planner.plan_for_budget(model, budget).layers[1]
        assert (lp.warm, lp.sm) == (0, 0), (budget, lp)
    assert any(planner.plan_for_budget(model, b).layers[0].warm for b in range(0, g.all_hot_bytes, 997))
    cal = calibrate(packed, **FAST)
    assert cal.layer == 0 and cal.t_decode > 0 and cal.t_read_sm > 0 and cal.codec == "huff"


# ------------------------------------------------------------------------------------------- plan


@pytest.mark.parametrize("kind", KINDS)
def test_plan_prints_a_plan_for_every_kind(kind: str, models: dict[str, Path], capsys: pytest.CaptureFixture[str],
                                           no_calibration: Path):
    model = models[kind]
    g = inputs.geometry_from_gguf(model)
    budget = tier_budget(model, g.all_hot_bytes // 2)
    data = plan_json(capsys, model, budget)
    assert data["memory"]["budget"] == budget and data["bytes"] <= data["budget"]
    assert data["geometry"]["tiered"] == [not RAW[kind]] * 2
    assert data["geometry"]["hot_bytes"] == list(g.hot_bytes)
    assert data["env"] == {"ZIPMOE_PLAN": data["plan"]}
    for layer, hot_bytes in zip(data["layers"], g.hot_bytes):
        assert layer["hot"] + layer["warm"] + layer["sm"] + layer["cold"] == g.n_expert
        if RAW[kind]:
            assert layer["warm"] == layer["sm"] == 0 and layer["bytes"] == layer["hot"] * hot_bytes, layer
    assert data["hit_rates"]["hot"] > 0
    code = zipmoe_main(["plan", str(model), "--memory-budget", str(budget)])
    out, _ = capsys.readouterr()
    assert code == 0 and f"ZIPMOE_PLAN={data['plan']}" in out
    assert ("stored raw: hot or cold only" in out) == RAW[kind], out


def test_a_plain_gguf_without_experts_is_refused(non_moe_gguf: Path, capsys: pytest.CaptureFixture[str]):
    code = zipmoe_main(["plan", str(non_moe_gguf), "--memory-budget", "1MiB"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and "expert_count is missing" in err and err.count("\n") == 1, err


# -------------------------------------------------------------------------------------- calibrate


def test_calibrating_raw_experts_measures_reads_and_no_decode(models: dict[str, Path], no_calibration: Path,
                                                              capsys: pytest.CaptureFixture[str]):
    """Through the runtime's stores (quick): a plain GGUF's experts, and a quantized zipmoe file's, cost a read;
    nothing is decoded, so there is no decode speed and no sm tier. The plan then takes the calibration's costs."""
    from pyzipmoe.plan.calibration import Calibration
    from pyzipmoe.runtime.measure import calibrate

    for kind in ("Q4_K_M.zipmoe", "Q4_K_M"):  # (the plain one's is planned with below)
        cal = calibrate(models[kind], **FAST)
        assert (cal.codec, cal.chunk_size, cal.t_decode, cal.t_read_sm) == ("raw", 0, 0.0, None), cal
        assert cal.t_read_cold > 0 and cal.disk_bandwidth > 0 and cal.decode_values_per_second == {}
        assert cal.t_decode_fresh is None and cal.merge_seconds_per_value is None and cal.plain == (kind == "Q4_K_M")
        assert cal.expert_compressed_bytes == sum(size for _, size in own_sizes(models["Q4_K_M"])[0])
        assert Calibration.from_dict(cal.to_dict()) == cal  # what the cache keeps reads back
        assert calibrate(models[kind], **FAST).from_cache
    g = inputs.geometry_from_gguf(models["Q4_K_M"])
    data = plan_json(capsys, models["Q4_K_M"], tier_budget(models["Q4_K_M"], g.all_hot_bytes // 2))
    assert data["costs_source"].startswith("calibration") and data["costs"]["t_decode"] == 0
    assert data["costs"]["t_read_cold"] == cal.t_read_cold
    code = zipmoe_main(["calibrate", str(models["Q4_K_M"])])
    out, _ = capsys.readouterr()
    assert code == 0 and "a plain GGUF, experts served as stored" in out and "never decoded" in out
    assert "t_read_sm" not in out and "values/s" not in out


def test_calibrating_f16_experts_decodes_them(models: dict[str, Path], no_calibration: Path):
    """F16 experts decode through the split codec, as BF16 ones: the file's codec and the others on the same
    expert re-encoded as F16, and the tiers' costs."""
    from pyzipmoe.runtime.measure import calibrate

    cal = calibrate(models["F16.zipmoe"], **FAST)
    assert cal.t_decode > 0 and cal.t_read_sm > 0 and cal.t_read_cold > 0 and not cal.plain
    assert set(cal.decode_values_per_second) == {"huff", "zstd", "esc"} and cal.codec in cal.decode_values_per_second
    assert cal.t_decode_fresh > 0 and cal.merge_seconds_per_value > 0 and cal.expert_values == 3 * 256 * 256


def test_the_engine_calibrates_a_plain_gguf(models: dict[str, Path], no_calibration: Path, llama_lib_dir: Path):
    """Three generations through the cache (all experts hot, k and half of them): the base and a cold read."""
    from pyzipmoe.runtime.measure import calibrate

    cal = calibrate(models["Q8_0"], **{**FAST, "engine": True})
    assert cal.tier_source == "engine" and cal.plain and cal.t_decode == 0 and cal.t_read_sm is None, cal
    assert cal.base_seconds_per_token > 0 and cal.t_read_cold > 0 and cal.t_layer is not None


# --------------------------------------------------------------------------------- runs with a plan

PROMPT = "The quick brown fox jumps over the lazy dog because"
N_GEN = 8

WORKER = r"""
import json, sys
import numpy as np
from pyzipmoe.runtime.llama import Llama, zipmoe_stats_reset
job = json.loads(sys.argv[1])
reports, arrays = [], {}
for i, extra in enumerate(job["runs"]):
    llm = Llama(job["model"], n_ctx=128, n_threads=2, n_threads_batch=2, n_batch=1, n_ubatch=1, logits_all=True,
                seed=0, verbose=False, prefill=False, **extra)
    if llm.zipmoe_served:
        zipmoe_stats_reset()
    tokens = llm.tokenize(job["prompt"].encode())
    llm.eval(tokens)
    generated = []
    for _ in range(job["n_gen"]):
        generated.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([generated[-1]])
    arrays[f"run{i}"] = np.array(llm.scores[: llm.n_tokens], dtype=np.float32)
    reports.append({"generated": generated, "served": llm.zipmoe_served,
                    "stats": llm.zipmoe_stats() if llm.zipmoe_served else None})
    llm.close()
np.savez(job["out"], **arrays)
print(json.dumps(reports))
"""


def run_all(model: Path, lib_dir: Path, runs: list[dict[str, Any]], out: Path, env: dict[str, str]
            ) -> tuple[list[dict[str, Any]], dict[str, np.ndarray]]:
    """Each run's report and logits, one child process for all of them (a token per batch)."""
    job = {"model": str(model), "runs": runs, "prompt": PROMPT, "n_gen": N_GEN, "out": str(out)}
    done = subprocess.run([sys.executable, "-c", WORKER, json.dumps(job)], env={**helpers.worker_env(lib_dir), **env},
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, helpers.stderr_tail(done.stderr)
    with np.load(out) as z:
        return json.loads(done.stdout.strip().splitlines()[-1]), {k: z[k] for k in z.files}


@pytest.mark.parametrize("kind", ("Q4_K_M", "Q8_0", "F16.zipmoe"))
def test_a_run_with_the_plan_gives_the_same_logits(kind: str, models: dict[str, Path], llama_lib_dir: Path,
                                                   tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   no_calibration: Path):
    """The plan `zipmoe plan` prints for a budget that keeps a third of the experts, the planner's own in
    pyzipmoe.Llama(planner=True) (and from a trace, for a plain GGUF), and plans that keep every expert of one layer
    and none of the other, or none at all: logits and tokens bit-identical to the same file without a budget. The
    stats show that the runtime applies the slots to every store, raw ones included (no slots: nothing hot; every
    slot: nothing evicted), and the budget holds. For F16 (compressed) also the planner's best split for a slow
    disk, which keeps experts warm and sm (without the margin by which a run prefers decoded experts:
    solver.runtime_plan)."""
    model = models[kind]
    g = inputs.geometry_from_gguf(model)
    budget = tier_budget(model, g.all_hot_bytes // 3)
    planned = plan_json(capsys, model, budget)
    n = g.n_expert
    whole = tier_budget(model, g.all_hot_bytes + (1 << 20))
    runs = [{},
            {"memory_budget": budget, "plan": planned["plan"]},
            {"memory_budget": budget, "planner": True},
            {"memory_budget": whole, "plan": "0:0,0,0;1:0,0,0"},
            {"memory_budget": whole, "plan": f"0:{n},0,0;1:0,0,0"},
            {"memory_budget": whole, "plan": f"0:{n},0,0;1:{n},0,0"}]
    if RAW[kind]:  # a plain GGUF given a trace plans from it (the planner on by default then)
        counts = np.zeros((1, g.n_layer, n), np.int64)
        counts[0, :, :3] = [60, 30, 10]
        np.savez(tmp_path / "trace.npz", counts=counts)
        runs.append({"memory_budget": budget, "trace": str(tmp_path / "trace.npz")})
    else:
        slow = inputs.Costs(cores=2, t_decode=1e-5, disk_bandwidth=5e6, read_latency=1e-4, base_seconds_per_token=0.01)
        tiered = planner.plan_for_budget(planner.cost_model(g, slow), g.all_hot_bytes // 3)
        assert any(lp.warm for lp in tiered.layers) and any(lp.sm for lp in tiered.layers), tiered.encode()
        runs.append({"memory_budget": tier_budget(model, 2 * tiered.nbytes), "plan": tiered.encode()})
    env = {"XDG_CACHE_HOME": str(no_calibration)}
    reports, logits = run_all(model, llama_lib_dir, runs, tmp_path / "runs.npz", env)
    ref = reports[0]
    assert ref["served"] is kind.endswith(".zipmoe") and ref["generated"], ref  # (a plain one: stock code)
    from pyzipmoe.runtime.budget import model_memory

    other = model_memory(model).other_bytes
    for k, (run, report) in enumerate(zip(runs, reports)):
        what = f"{kind} {run}"
        helpers.assert_bit_identical(logits[f"run{k}"], logits["run0"], what)
        assert report["generated"] == ref["generated"], what
        if k == 0:
            continue
        stats = report["stats"]
        assert report["served"] and stats["misses"] > 0, (what, stats)
        assert stats["peak_hot_bytes"] <= run["memory_budget"] - other, (what, stats)
        if RAW[kind]:
            assert stats["hits_warm"] == stats["hits_sm"] == stats["warm_bytes"] == stats["sm_bytes"] == 0, stats
    none, one_layer, every = (reports[k]["stats"] for k in (3, 4, 5))
    assert none["hits_hot"] == 0 and none["misses"] > one_layer["misses"] > every["misses"], (none, one_layer, every)
    assert every["evictions"] == 0 and every["misses"] <= 3 * len(g.layers) * n, every  # each expert read once
    if not RAW[kind]:
        assert reports[6]["stats"]["hits_warm"] > 0 and reports[6]["stats"]["hits_sm"] > 0, reports[6]["stats"]

