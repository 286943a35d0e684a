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
    assert lines[0].split() == ["type", "stock", "pp", "zipmoe", "pp", "pp", "ratio", "stock", "tg", "zipmoe", "tg",
                                "tg", "ratio", "rounds"]
    # pp: medians 80 and 80; ratios 1.1, 0.8, 1.0 -> 1.0.  tg: medians 8 and 9; ratios 0.9, 1.0, 1.125 -> 1.0
    assert lines[1].split() == ["Q8_0", "80.00", "80.00", "1.000", "8.00", "9.00", "1.000", "3"]


def test_a_missing_build_is_named_with_the_command_that_makes_it(tmp_path: Path, capsys: pytest.CaptureFixture):
    with pytest.raises(SystemExit) as e:
        bench.main(["--stock-bin", str(tmp_path), "--no-results"])
    assert e.value.code == 2
    assert "bash tools/dev/build_stock.sh" in capsys.readouterr().err
