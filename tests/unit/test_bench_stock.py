"""bench_stock's table: medians per build and the median of the rounds' paired ratios, from made-up runs; and its
refusal to run without a build to compare."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import load_tool

bench = load_tool("bench/bench_stock.py")


def test_the_table_pairs_each_round_and_takes_medians():
    runs = {"Q8_0": {"stock": [{"pp": 100.0, "tg": 10.0}, {"pp": 50.0, "tg": 5.0}, {"pp": 80.0, "tg": 8.0}],
                     "zipmoe": [{"pp": 110.0, "tg": 9.0}, {"pp": 40.0, "tg": 5.0}, {"pp": 80.0, "tg": 9.0}]}}
    lines = bench.table(runs).splitlines()
    assert lines[0].split() == ["type", "budget", "stock", "pp", "zipmoe", "pp", "pp", "ratio", "stock", "tg", "zipmoe",
                                "tg", "tg", "ratio", "rounds"]
    # pp: medians 80 and 80; ratios 1.1, 0.8, 1.0 -> 1.0.  tg: medians 8 and 9; ratios 0.9, 1.0, 1.125 -> 1.0
    assert lines[1].split() == ["Q8_0", "none", "80.00", "80.00", "1.000", "8.00", "9.00", "1.000", "3"]


def test_each_budget_gets_its_row_against_the_same_stock_runs():
    stock = [{"pp": 100.0, "tg": 10.0}, {"pp": 200.0, "tg": 20.0}]
    runs = {"Q4_K_M": {"stock": stock, "zipmoe": stock,
                       "zipmoe 100%": [{"pp": 50.0, "tg": 10.0}, {"pp": 200.0, "tg": 10.0}]}}
    rows = [line.split() for line in bench.table(runs).splitlines()[1:]]
    assert [r[:2] for r in rows] == [["Q4_K_M", "none"], ["Q4_K_M", "100%"]]
    # 100%: pp ratios 0.5 and 1.0 -> median 0.75; tg ratios 1.0 and 0.5 -> 0.75
    assert rows[1][4] == "0.750" and rows[1][7] == "0.750"


def test_a_budget_run_gets_its_share_of_the_file_as_the_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x" * 1000)
    seen = []

    class Done:
        returncode = 0
        stdout = '[{"n_prompt": 8, "avg_ts": 1.0}, {"n_prompt": 0, "avg_ts": 2.0}]'
        stderr = ""

    def run(argv, env, **kw):
        seen.append(env.get("ZIPMOE_MEMORY_BUDGET"))
        return Done()

    monkeypatch.setattr(bench.subprocess, "run", run)
    args = bench.argparse.Namespace(pp=8, gen=4, reps=1, threads=1, timeout=10)
    assert bench.llama_bench(tmp_path, model, args, 150) == {"pp": 1.0, "tg": 2.0}
    assert bench.llama_bench(tmp_path, model, args) == {"pp": 1.0, "tg": 2.0}
    assert seen == ["1500", None]


@pytest.mark.parametrize("budgets", ["100,x", "0", "-5"])
def test_a_bad_budget_list_is_a_usage_error(budgets: str, capsys: pytest.CaptureFixture):
    with pytest.raises(SystemExit) as e:
        bench.main(["--budgets", budgets, "--no-results"])
    assert e.value.code == 2
    assert "--budgets" in capsys.readouterr().err


def test_a_missing_build_is_named_with_the_command_that_makes_it(tmp_path: Path, capsys: pytest.CaptureFixture):
    with pytest.raises(SystemExit) as e:
        bench.main(["--stock-bin", str(tmp_path), "--no-results"])
    assert e.value.code == 2
    assert "bash tools/dev/build_stock.sh" in capsys.readouterr().err
