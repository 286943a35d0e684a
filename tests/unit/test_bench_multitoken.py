"""bench_multitoken's ratios and text checks, from a made-up --json (no servers): each speculative configuration
against single-token generation at the same budget and repetition, its text against stock's in the same
configuration, and -np 4's four requests against its one."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

import pytest
from helpers import load_tool

bench = load_tool("bench/bench_multitoken.py")


def req(content: str, tps: float, n: int = 48, draft: tuple[int, int] = (0, 0)) -> dict:
    return {"content": content, "n": n, "ms": n / tps * 1000, "tps": tps, "draft_n": draft[0],
            "draft_accepted": draft[1]}


def report() -> dict:
    stock = {"single": {"repetitive": "r", "ordinary": "o"}, "ngram": {"repetitive": "r", "ordinary": "o"},
             "ngram1": {"repetitive": "r", "ordinary": "o-batched"}, "ngram1b": {"repetitive": "r", "ordinary": "o"}}
    runs = [
        {"config": "single", "status": "ok", "rep": 0, "budget_pct": 40, "limit_bytes": 1 << 30,
         "repetitive": req("r", 4.0), "ordinary": req("o", 5.0)},
        {"config": "ngram", "status": "ok", "rep": 0, "budget_pct": 40, "limit_bytes": 1 << 30,
         "repetitive": req("r", 6.0, draft=(16, 12)), "ordinary": req("o", 4.5)},
        {"config": "ngram1", "status": "ok", "rep": 0, "budget_pct": 40, "limit_bytes": 1 << 30,
         "repetitive": req("r", 2.0, draft=(20, 1)), "ordinary": req("o", 2.5, draft=(20, 0))},
        {"config": "ngram1b", "status": "ok", "rep": 0, "budget_pct": 40, "limit_bytes": 1 << 30,
         "repetitive": req("r", 3.9, draft=(6, 1)), "ordinary": req("o", 4.9, draft=(5, 0))},
        {"config": "np4", "status": "ok", "rep": 0, "budget_pct": 40, "limit_bytes": 1 << 30,
         "one": req("o", 5.0), "aggregate_tps": 12.5},
    ]
    return {"stock": stock, "preset": "small", "routing": "uniform", "model": "m", "bf16_bytes": 64 << 20,
            "overhead_bytes": 16 << 20, "gen": 48, "specs": bench.SPECS, "synthetic": True, "runs": runs}


def test_ratios_against_single_and_texts_against_stock_in_the_same_configuration():
    (row,) = bench.ratios(report())
    assert row["ngram:repetitive"] == pytest.approx(1.5) and row["ngram:repetitive_accepted"] == "12/16"
    assert row["ngram:ordinary"] == pytest.approx(0.9)
    assert row["ngram:repetitive_match"] and row["ngram:ordinary_match"]
    # stock's own batched text differs from its single-token text; zipmoe gave the single-token text: DIFF
    assert not row["ngram1:ordinary_match"] and row["ngram1:repetitive_match"]
    assert row["ngram1b:ordinary"] == pytest.approx(0.98) and row["ngram1b:ordinary_accepted"] == "0/5"
    assert row["np4"] == pytest.approx(2.5) and row["np4_match"]


def test_report_says_the_targets_and_writes_a_dated_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    path = tmp_path / "multitoken.json"
    path.write_text(json.dumps(report()))
    taken = datetime.datetime(2000, 1, 31, 12).timestamp()
    os.utime(path, (taken, taken))
    assert bench.main(["--report", str(path), "--results", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert "ngram/single repetitive at 40% >= 1.3: median 1.50x met" in printed
    assert "ngram/single ordinary >= 0.95: lowest median (40%) 0.90x NOT met" in printed
    assert "ngram1b/single ordinary (ngram1, --spec-backoff 16) >= 0.95: lowest median (40%) 0.98x met" in printed
    assert "np4/np1 aggregate at 40% >= 2.0: median 2.50x met" in printed
    assert "ordinary text with ngram1 is NOT its single-token text" in printed
    (out,) = (tmp_path / "out").iterdir()
    assert out.name == "2000-01-31-multitoken.md" and "SYNTHETIC" in out.read_text()


def test_a_target_at_every_budget_is_the_lowest_budget_s_median(capsys: pytest.CaptureFixture[str]):
    """Each repetition's ratio is one run against one run; "never below" holds each budget's median to the goal."""
    res = report()
    res["runs"] = []
    for budget, ratios in ((40, (0.80, 1.00, 1.10)), (75, (0.96, 0.97, 1.30))):
        for rep, r in enumerate(ratios):
            common = {"status": "ok", "rep": rep, "budget_pct": budget, "limit_bytes": 1 << 30}
            res["runs"] += [{"config": "single", **common, "repetitive": req("r", 4.0), "ordinary": req("o", 5.0)},
                            {"config": "ngram1b", **common, "repetitive": req("r", 4.0),
                             "ordinary": req("o", 5.0 * r, draft=(5, 0))}]
    bench.print_report(res)
    printed = capsys.readouterr().out
    assert "ngram1b/single ordinary (ngram1, --spec-backoff 16) >= 0.95: lowest median (75%) 0.97x met" in printed
