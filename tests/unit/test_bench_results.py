"""The benchmarks' dated result files (tools/bench/results.py, bench/results/README.md), and bench_budget's
--report writing one; bench_codec's is tested with a --quick run in tests/native/test_bench_codec.py."""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

import pytest
from helpers import REPO, load_tool

results = load_tool("bench/results.py")

DAY = datetime.date(2000, 1, 31)


def options(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    results.add_arguments(p)
    return p.parse_args(argv)


def test_defaults_are_bench_results():
    args = options()
    assert args.results == REPO / "bench" / "results" and args.label is None and not args.no_results


def test_a_file_per_run_named_by_day_benchmark_and_label(tmp_path: Path):
    args = options("--results", str(tmp_path), "--label", "read room/on")
    first = results.write(args, "budget", "a | table\n", weights=results.SYNTHETIC, day=DAY, argv=["x.py", "--y"])
    assert first == tmp_path / "2000-01-31-budget-read-room-on.md"
    text = first.read_text()
    assert text.startswith("# budget (read room/on), 2000-01-31\n")
    assert "- command: `" in text and "x.py --y`" in text
    assert f"- machine: {results.cpu_model()}, {os.cpu_count()} cores" in text
    assert "- weights: SYNTHETIC weights\n" in text
    assert "```text\na | table\n```\n" in text
    # a second run the same day never overwrites the first
    second = results.write(args, "budget", "another\n", weights="trained", day=DAY, argv=["x.py"])
    assert second == tmp_path / "2000-01-31-budget-read-room-on-2.md"
    assert first.read_text() == text


def test_no_label_and_json_and_notes(tmp_path: Path):
    args = options("--results", str(tmp_path / "new"))
    path = results.write(args, "e2e", "t", weights="w", json_path="stdout", notes=["one note"], day=DAY, argv=["e"])
    assert path.name == "2000-01-31-e2e.md"
    text = path.read_text()
    assert "- JSON: stdout\n- one note\n" in text


def test_no_results_writes_nothing(tmp_path: Path):
    args = options("--results", str(tmp_path / "r"), "--no-results")
    assert results.write(args, "planner", "t", weights="w") is None
    assert not (tmp_path / "r").exists()


def test_tee_prints_and_keeps(capsys: pytest.CaptureFixture[str]):
    with results.Tee() as tee:
        print("row 1")
        print("row 2", flush=True)
    assert tee.text == "row 1\nrow 2\n"
    assert capsys.readouterr().out == "row 1\nrow 2\n"
    assert results.printed(print, "quiet") == "quiet\n"
    assert capsys.readouterr().out == ""


def test_synthetic_gguf(tiny_model: Path, non_moe_gguf: Path, not_gguf: Path):
    assert results.synthetic_gguf(tiny_model) is True  # pyzipmoe.synth names its models so
    assert results.synthetic_gguf(non_moe_gguf) is False
    assert results.synthetic_gguf(not_gguf) is None


def budget_report() -> dict:
    """What bench_budget --json writes, cut down to one routing, one budget and the tg test."""
    runs = [{"routing": "uniform", "budget_pct": pct, "engine": engine, "test": "tg", "status": "ok", "tps": tps,
             "text": "same", "peak_bytes": 1 << 26, "wall_s": 1.0, "limit_bytes": None if pct is None else 48 << 20}
            for pct, engine, tps in ((None, "stock", 10.0), (None, "zipmoe", 9.5), (75, "stock", 1.0),
                                     (75, "zipmoe", 6.0))]
    return {"synthetic": True, "preset": "small", "codec": "huff", "budgets_pct": [75],
            "models": {"uniform": {"bf16": "s.gguf", "bf16_bytes": 64 << 20, "zipmoe": "s.zipmoe.gguf",
                                   "zipmoe_bytes": 43 << 20}},
            "gen_tokens": 8, "pp_tokens": 64, "pp_reps": 1, "prompt": "Once upon a time", "threads_llama_bench": 2,
            "tg_threads": None, "repeat": 1, "overhead_bytes": 16 << 20, "timeout_s": 600, "zipmoe_env": {},
            "read_rate_bytes": None, "tests": ["tg"], "variant": None, "cpus": 2, "runs": runs}


def test_budget_report_writes_a_file_dated_when_its_json_was_written(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]):
    report = tmp_path / "budget.json"
    report.write_text(json.dumps(budget_report()))
    taken = datetime.datetime(2000, 1, 31, 12).timestamp()
    os.utime(report, (taken, taken))
    bench = load_tool("bench/bench_budget.py")
    assert bench.main(["--report", str(report), "--results", str(tmp_path / "out"), "--label", "smoke"]) == 0
    printed = capsys.readouterr().out
    (path,) = (tmp_path / "out").iterdir()
    assert path.name == "2000-01-31-budget-smoke.md"
    text = path.read_text()
    assert "bench_budget.py --report" in text and f"- JSON: {report}" in text
    assert "- weights: SYNTHETIC weights (tools/dev/make_synth.py, preset small)" in text
    assert "printed by --report" in text
    assert printed.strip() in text and "6.00x" in text
    bench.main(["--report", str(report), "--no-results"])
    assert len(list((tmp_path / "out").iterdir())) == 1


def test_e2e_stamps_its_models_with_files_that_exist():
    """bench_e2e remakes its cached models when the code that writes them changes: each file it hashes must exist."""
    e2e = load_tool("bench/bench_e2e.py")
    for name in e2e.SYNTH_SOURCES + e2e.CONVERT_SOURCES:
        assert (REPO / "pyzipmoe" / name).is_file(), name
