"""bench_ledger's table, from made-up runs (no model): each run's ledger per token, and N sequences' gain over the
one-sequence run of the same budget and repetition."""

from __future__ import annotations

from helpers import load_tool

bench = load_tool("bench/bench_ledger.py")


def run(budget: int | None, parallel: int, rep: int, tps: float, prompt: dict | None = None) -> dict:
    tokens = 8 * parallel
    stats = {"ledger_tokens": tokens, "ledger_compute_ns": tokens * 2_000_000, "ledger_read_wait_ns": tokens * 1_000_000,
             "misses": tokens * 3, "bytes_read": tokens * (2 << 20)}
    return {"budget": budget, "pct": None if budget is None else 40, "parallel": parallel, "rep": rep, "tps": tps,
            "stats": stats, "prompt": prompt}


def test_rows_gain_and_parts() -> None:
    prompt = {"tokens": 512, "tps": 200.0, "stats": {"ledger_tokens": 512, "ledger_decode_ns": 512 * 500_000}}
    runs = [run(100 << 20, 1, 0, 10.0, prompt), run(100 << 20, 4, 0, 12.0), run(100 << 20, 1, 1, 8.0),
            run(100 << 20, 4, 1, 12.0)]
    lines = bench.table(runs).splitlines()
    assert lines[0].split()[:3] == ["run", "tok/s", "np/1"]
    assert lines[1].startswith("40% 100 MiB pp512") and lines[1].split()[7] == "0.50"  # decode 0.5 ms a token
    one, four = lines[2].split(), lines[3].split()
    assert one[:5] == ["40%", "100", "MiB", "tg", "np1"] and one[7] == "-"
    assert four[7] == "1.20x" and lines[5].split()[7] == "1.50x"  # against its own repetition's single sequence
    # compute 2, read_wait 1 ms a token; total 3; 3 misses and 2 MiB a token
    assert four[8] == "2.00" and four[10] == "1.00" and four[-3:] == ["3.00", "3.00", "2.00"]
