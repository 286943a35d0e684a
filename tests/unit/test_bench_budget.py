"""bench_budget's logic that needs no cgroup: the ratio against the faster stock (--stock-no-repack), stock that was
OOM-killed, the targets of a plain or a converted model, --synth and --overhead auto's arithmetic. Its cgroup
plumbing is exercised by tests/system/test_cgroup.py."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
from helpers import load_tool

bench = load_tool("bench/bench_budget.py")
MIB = 1 << 20


def run(budget: float | None, engine: str, test: str, status: str = "ok", tps: float | None = None) -> dict:
    return {"routing": "uniform", "budget_pct": budget, "engine": engine, "test": test, "status": status,
            "tps": tps if status == "ok" else None, "text": "same", "peak_bytes": 1 << 26, "wall_s": 1.0,
            "tokens": 16, "disk_read_bytes": 1 << 24}


def report(runs: list[dict], budgets: list[float], **extra: Any) -> dict:
    res = {"synthetic": True, "preset": "1g+n_layer16", "codec": "auto", "type": "Q4_K_M", "converted": False,
           "budgets_pct": budgets, "models": {"uniform": {"bf16": "m.gguf", "bf16_bytes": 500 * MIB,
                                                          "zipmoe": "m.gguf", "zipmoe_bytes": 500 * MIB}},
           "gen_tokens": 16, "pp_tokens": 512, "pp_reps": 2, "prompt": "p", "threads_llama_bench": 2, "tg_threads": 2,
           "repeat": 1, "overhead_bytes": {"tg": 70 * MIB, "pp": 130 * MIB}, "timeout_s": 120, "zipmoe_env": {},
           "read_rate_bytes": None, "tests": ["tg", "pp"], "variant": None, "engines": ["stock", "zipmoe", "stock-nr"],
           "runs": runs, **extra}
    bench.summarize(res)
    return res


def target(res: dict, name: str) -> dict:
    return next(t for t in res["targets"]["uniform"] if t["target"].startswith(name))


def test_the_ratio_is_against_the_faster_stock_that_ran():
    runs = [run(None, "stock", "tg", tps=100), run(None, "zipmoe", "tg", tps=100), run(None, "stock-nr", "tg", tps=50),
            run(40, "stock", "tg", "oom"), run(40, "zipmoe", "tg", tps=6), run(40, "stock-nr", "tg", tps=1.5),
            run(60, "stock", "tg", tps=2), run(60, "zipmoe", "tg", tps=8), run(60, "stock-nr", "tg", tps=4)]
    res = report(runs, [40, 60])
    rows = {r["budget_pct"]: r for r in res["rows"]["uniform"]}
    assert rows[None]["tg_ratio"] == 1.0 and rows[None]["tg_stock_best"] == "stock"
    assert rows[40]["tg_ratio"] == 4.0 and rows[40]["tg_stock_best"] == "stock-nr" and not rows[40]["tg_stock_oom"]
    assert rows[60]["tg_ratio"] == 2.0 and rows[60]["tg_stock_best"] == "stock-nr"
    assert target(res, ">= 4x at ~40%")["met"] is True
    assert target(res, ">= 2.5x at ~60%")["met"] is False  # 2x against stock-nr's 4, not 4x against stock's 2


def test_where_every_stock_was_oom_killed_zipmoe_meets_the_target_without_a_ratio(capsys: pytest.CaptureFixture[str]):
    runs = [run(40, "stock", "tg", "oom"), run(40, "zipmoe", "tg", tps=6), run(40, "stock-nr", "tg", "oom"),
            run(60, "stock", "tg", "oom"), run(60, "zipmoe", "tg", "too-small"), run(60, "stock-nr", "tg", "oom")]
    res = report(runs, [40, 60])
    t40, t60 = target(res, ">= 4x at ~40%"), target(res, ">= 2.5x at ~60%")
    assert (t40["met"], t40["ratio"], t40.get("stock_oom")) == (True, None, True)
    assert t60["met"] is None  # zipmoe did not run either: nothing measured
    assert target(res, "never slower (tg")["met"] is None
    bench.print_report(res)
    out = capsys.readouterr().out
    assert "stock OOM" in out and "zipmoe ran, stock was OOM-killed at 40%" in out
    assert "stock-nr tg" in out and "stock-nr pp" in out


def test_a_converted_model_of_another_type_gets_the_converted_targets():
    runs = [run(75, "stock", "tg", tps=1), run(75, "zipmoe", "tg", tps=5)]
    plain = [t["target"] for t in report(runs, [75])["targets"]["uniform"]]
    conv = [t["target"] for t in report(runs, [75], converted=True, type="F16")["targets"]["uniform"]]
    assert ">= 1.5x at ~75%" in plain and ">= 5x at ~75%" not in plain
    assert ">= 5x at ~75%" in conv and ">= 1.5x at ~75%" not in conv
    assert bench.converted({"type": "BF16"}) and not bench.converted({"type": "Q8_0"})


def test_a_report_without_stock_nr_or_measured_overhead_still_prints(capsys: pytest.CaptureFixture[str]):
    """JSON written before --stock-no-repack and --overhead auto: an int overhead and no engines list."""
    runs = [run(75, "stock", "tg", tps=1), run(75, "zipmoe", "tg", tps=5)]
    res = report(runs, [75], overhead_bytes=128 * MIB, engines=None)
    del res["engines"], res["converted"]
    bench.print_report(res)
    out = capsys.readouterr().out
    assert "overhead = 128 MiB" in out and "stock-nr" not in out and "5.00x" in out


def test_synth_overrides_name_the_model_and_are_checked():
    assert bench._synth_pair("n_layer=16") == ("n_layer", 16)
    assert bench._synth_pair("n-vocab=4096") == ("n_vocab", 4096)
    for bad in ("n_layer", "routing=skewed", "n_layer=x", "n_layer=0", "nope=3"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench._synth_pair(bad)
    assert bench.model_tag("1g", [("n_vocab", 4096), ("n_layer", 16)]) == "1g+n_layer16+n_vocab4096"
    assert bench.model_tag("2.8g") == "2.8g"
    assert bench._overhead("auto") is None and bench._overhead("64MiB") == 64 * MIB


def test_pp_without_repack_says_so_to_llama_bench():
    argv = bench.pp_argv(Path("llama-bench"), "m.gguf", 512, 2, 2, repack=False)
    assert argv[-2:] == ["--repack", "0"] and "--repack" not in bench.pp_argv(Path("b"), "m", 512, 2, 2)
    assert bench.engines_of(True, False) == ("stock", "zipmoe", "stock-nr")
    assert bench.engines_of(False, True) == ("stock", "zipmoe", "stock", "variant")


def test_measured_overhead_is_the_resident_set_above_the_budget_at_the_minimum(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path):
    calls: list[tuple[str, int | None]] = []

    def fake(argv, env, parent, limit, timeout, stem, drop_cache=True, throttle=None):
        budget = int(env["ZIPMOE_MEMORY_BUDGET"])
        calls.append((env["ZIPMOE_MEMORY_BUDGET"], limit))
        if budget < 44 * MIB:
            return {"status": "too-small", "min_budget": "44MiB", "message": "needs at least 44 MiB", "log": "x"}
        return {"status": "ok", "maxrss_bytes": budget + 57 * MIB, "peak_bytes": budget + 300 * MIB, "log": "y"}

    monkeypatch.setattr(bench, "run_limited", fake)
    got = bench.measure_overhead(["p"], {}, tmp_path, 10, tmp_path / "o")
    assert got["min_budget_bytes"] == 44 * MIB and got["budget_bytes"] == 44 * MIB + bench.CALIBRATION_SLACK
    assert got["overhead_bytes"] == 57 * MIB + bench.OVERHEAD_MARGIN  # not the cgroup's peak: its page cache
    assert [limit for _, limit in calls] == [None, None]  # both without a limit

    monkeypatch.setattr(bench, "run_limited", lambda *a, **k: {"status": "ok", "maxrss_bytes": 1, "log": "z"})
    with pytest.raises(bench.BenchError, match="was not refused"):
        bench.measure_overhead(["p"], {}, tmp_path, 10, tmp_path / "o")


def test_a_stock_that_timed_out_bounds_the_ratio_by_whole_runs(capsys: pytest.CaptureFixture[str]):
    """stock took longer than the timeout (120 s), zipmoe's whole run 20 s: zipmoe is > 6x faster on whole runs."""
    z = {**run(40, "zipmoe", "tg", tps=6), "wall_s": 20.0}
    runs = [run(40, "stock", "tg", "oom"), z, run(40, "stock-nr", "tg", "timeout"),
            run(60, "stock", "tg", "timeout"), {**run(60, "zipmoe", "tg", tps=6), "wall_s": 60.0},
            run(60, "stock-nr", "tg", "timeout")]
    res = report(runs, [40, 60])
    rows = {r["budget_pct"]: r for r in res["rows"]["uniform"]}
    assert rows[40]["tg_ratio"] is None and rows[40]["tg_timeout_bound"] == 6.0 and not rows[40]["tg_stock_oom"]
    t40, t60 = target(res, ">= 4x at ~40%"), target(res, ">= 2.5x at ~60%")
    assert (t40["met"], t40["ratio"], t40.get("timeout_bound")) == (True, 6.0, True)
    assert (t60["met"], t60["ratio"]) == (False, 2.0)  # 120 / 60: the bound does not reach 2.5x
    never = target(res, "never slower (tg")
    assert (never["met"], never["ratio"], never["bounded"]) == (True, 2.0, True)
    bench.print_report(res)
    out = capsys.readouterr().out
    assert ">6.00x (t/o)" in out and "whole-run bound" in out


def test_zipmoe_is_matched_with_stock_as_it_is_and_also_judged_against_it(capsys: pytest.CaptureFixture[str]):
    """--no-repack computes Q4_K with other kernels: stock-nr's text may differ from stock's, zipmoe's must not."""
    runs = [run(None, "stock", "tg", tps=100), run(None, "zipmoe", "tg", tps=100),
            {**run(None, "stock-nr", "tg", tps=50), "text": "other"},
            run(40, "stock", "tg", "oom"), run(40, "zipmoe", "tg", tps=6), {**run(40, "stock-nr", "tg", tps=2),
                                                                            "text": "other"}]
    res = report(runs, [40])
    rows = {r["budget_pct"]: r for r in res["rows"]["uniform"]}
    assert rows[40]["match"] is True and rows[40]["stock_nr_same_text"] is False
    assert target(res, ">= 4x at ~40%")["met"] is False  # 3x against stock-nr
    alone = next(t for t in res["targets_stock"]["uniform"] if t["target"] == ">= 4x at ~40%")
    assert (alone["met"], alone.get("stock_oom")) == (True, True)  # stock as it is could not run
    bench.print_report(res)
    out = capsys.readouterr().out
    assert "stock-nr generated other text than stock" in out and "against stock as it is" in out


def test_the_overhead_is_the_larger_of_the_programs_and_is_printed_so(capsys: pytest.CaptureFixture[str]):
    measured = {t: {"min_budget_bytes": 70 * MIB, "budget_bytes": 86 * MIB, "maxrss_bytes": (86 + o) * MIB,
                    "peak_bytes": 400 * MIB, "margin_bytes": 8 * MIB, "overhead_bytes": (o + 8) * MIB}
                for t, o in (("tg", 12), ("pp", 83))}
    assert bench.overhead_of(measured) == 91 * MIB
    runs = [run(75, "stock", "tg", tps=1), {**run(75, "zipmoe", "tg", tps=5), "zipmoe_budget_bytes": 300 * MIB}]
    res = report(runs, [75], overhead_bytes=91 * MIB, overhead_measured=measured)
    bench.print_report(res)
    out = capsys.readouterr().out
    assert "overhead 91 MiB, measured before the runs, the larger of: tg 20 MiB (resident 98 MiB" in out


@pytest.mark.parametrize("argv,words", [(["--stock-no-repack"], "needs --tg-threads"),
                                        (["--convert"], "--convert is for --type other than BF16"),
                                        (["--synth", "n_layer=0"], "must be at least 1")])
def test_options_that_cannot_work_are_refused(argv: list[str], words: str, capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as e:
        bench.main(["--no-results", *argv])
    assert e.value.code == 2 and words in capsys.readouterr().err


def test_stock_runs_on_a_stock_build_only_where_one_has_every_program(tmp_path, capsys):
    for name in ("llama-simple", "llama-bench"):
        (tmp_path / name).write_text("#!/bin/sh\n")
        (tmp_path / name).chmod(0o755)
    assert bench.stock_programs(tmp_path) is None  # no llama-completion: not a whole build
    assert bench.stock_programs(None) is None
    (tmp_path / "llama-completion").write_text("#!/bin/sh\n")
    (tmp_path / "llama-completion").chmod(0o755)
    assert bench.stock_programs(tmp_path) == tmp_path.resolve()
    runs = [run(None, "stock", "tg", tps=10.0), run(None, "zipmoe", "tg", tps=10.0)]
    for build, says in (("stock", "without zipmoe's patches"), ("same", "same build")):
        bench.print_report(report(runs, [], engines=["stock", "zipmoe"], stock_build=build))
        assert says in capsys.readouterr().out.splitlines()[0]
